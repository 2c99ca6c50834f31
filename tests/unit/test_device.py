"""Which device an NN rank trains on: a GPU of its own where the host has one per rank, else the CPU or, with
``PERSIA_SHARE_GPUS=1``, a GPU shared round robin; which backend the job all-reduces with; and a clear error,
before anything connects, for a GPU index the host does not have. CUDA's presence and count are patched: the
rule is a function of them and the environment alone. Two ranks on one real GPU over gloo are run by
``tests/integration/test_dense_sync.py`` where there is a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from persia_nats.common.errors import ConfigError
from persia_nats.services.nn_worker.ctx import EmbeddingCtx
from persia_nats.services.nn_worker.dense_sync import backend_for, device_for_rank

from persia.distributed import get_default_distributed_option
from persia.env import get_device_id


@pytest.fixture
def gpus(monkeypatch: pytest.MonkeyPatch):
    def visible(n: int) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)

    return visible


@pytest.mark.parametrize("n_gpus, local_rank, local_world_size, share, expected", [
    (0, 0, None, "", None),   # no CUDA: the CPU
    (1, 0, None, "", 0),      # one rank, started by hand (no LOCAL_WORLD_SIZE), one GPU
    (2, 1, "2", "", 1),       # a GPU per rank: the rank's own
    (8, 3, "4", "", 3),
    (1, 0, "2", "", None),    # two ranks, one GPU: NCCL refuses two ranks on one GPU, so both on the CPU
    (1, 1, "2", "0", None),
    (1, 0, "2", "1", 0),      # ... unless the job shares GPUs: both on GPU 0
    (1, 1, "2", "1", 0),
    (2, 3, "4", "1", 1),      # four ranks, two GPUs: round robin
    (2, 2, "4", "1", 0),
    (2, 1, "2", "1", 1),      # a GPU per rank anyway: the rank's own
    (0, 1, "2", "1", None),   # no CUDA: nothing to share
])
def test_a_rank_gets_its_own_gpu_a_shared_one_or_the_cpu(gpus, monkeypatch, n_gpus, local_rank, local_world_size,
                                                         share, expected):
    gpus(n_gpus)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("PERSIA_SHARE_GPUS", share)
    if local_world_size is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world_size)
    assert get_device_id() == expected


def test_the_rule_alone():
    assert [device_for_rank(r, 4, 2, True) for r in range(4)] == [0, 1, 0, 1]
    assert [device_for_rank(r, 4, 2, False) for r in range(4)] == [None] * 4
    assert [device_for_rank(r, 2, 4, False) for r in range(2)] == [0, 1]
    assert device_for_rank(0, 1, 0, True) is None


def test_ranks_sharing_gpus_all_reduce_with_gloo_every_one_of_them(monkeypatch):
    cuda = torch.device("cuda", 0)
    assert backend_for(torch.device("cpu")) == backend_for(torch.device("cpu"), True) == "gloo"
    assert backend_for(cuda, True) == "gloo"  # a rank with a GPU to itself too: one backend a job
    assert backend_for(cuda) == ("nccl" if dist.is_nccl_available() else "gloo")
    monkeypatch.setenv("PERSIA_SHARE_GPUS", "1")
    assert get_default_distributed_option(0).backend == "gloo"
    monkeypatch.setenv("PERSIA_SHARE_GPUS", "0")
    assert get_default_distributed_option(0).backend == "nccl"
    assert get_default_distributed_option(None).backend == "gloo"


def test_a_malformed_share_setting_is_refused_by_name(gpus, monkeypatch):
    gpus(1)
    monkeypatch.setenv("PERSIA_SHARE_GPUS", "yes")
    with pytest.raises(ConfigError, match=r"PERSIA_SHARE_GPUS='yes': expected 1 \(on\) or 0 \(off\)"):
        get_device_id()


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
    monkeypatch.delenv("PERSIA_SHARE_GPUS", raising=False)
    with caplog.at_level("WARNING", logger="persia.env"):
        assert get_device_id() is None
    assert ("2 NN ranks on this host and 1 GPU(s): every rank trains on the CPU (PERSIA_SHARE_GPUS=1 shares the "
            "GPUs)") in caplog.text


def test_ranks_sharing_a_gpu_each_say_which(gpus, monkeypatch, caplog):
    gpus(1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("PERSIA_SHARE_GPUS", "1")
    with caplog.at_level("INFO", logger="persia.env"):
        assert get_device_id() == 0
    assert "2 NN ranks share 1 GPU(s): rank 1 trains on GPU 0, all-reducing with gloo" in caplog.text
