"""Which device an NN rank trains on: a GPU of its own where the host has one per rank, else the CPU; and a
clear error, before anything connects, for a GPU index the host does not have. CUDA's presence and count
are patched: the rule is a function of them and the environment alone."""

from __future__ import annotations

import pytest
import torch
from persia_nats.services.nn_worker.ctx import EmbeddingCtx

from persia.env import get_device_id


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return visible


@pytest.mark.parametrize("n_gpus, local_rank, local_world_size, expected", [
    (0, 0, None, None),   # no CUDA: the CPU
    (1, 0, None, 0),      # one rank, started by hand (no LOCAL_WORLD_SIZE), one GPU
    (2, 1, "2", 1),       # a GPU per rank: the rank's own
    (8, 3, "4", 3),
    (1, 0, "2", None),    # two ranks, one GPU: NCCL refuses two ranks on one GPU, so both on the CPU
    (1, 1, "2", None),
])
def test_a_rank_gets_its_own_gpu_or_the_cpu(gpus, monkeypatch, n_gpus, local_rank, local_world_size, expected):
    gpus(n_gpus)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    assert get_device_id() == expected


@pytest.mark.parametrize("device_id", [1, 5, -1])
def test_a_gpu_the_host_does_not_have_is_refused_by_name(gpus, device_id):
    gpus(1)
    with pytest.raises(ValueError, match=rf"device_id={device_id}, but 1 CUDA device\(s\) are visible"):
        EmbeddingCtx(device_id=device_id)


def test_a_device_id_without_cuda_trains_on_the_cpu(gpus):
    gpus(0)
    assert EmbeddingCtx(device_id=0).device == torch.device("cpu")


def test_ranks_without_a_gpu_each_say_so(gpus, monkeypatch, caplog):
    gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with caplog.at_level("WARNING", logger="persia.env"):
        assert get_device_id() is None
    assert "2 NN ranks on this host and 1 GPU(s): every rank trains on the CPU" in caplog.text
