"""Sync mode trains the embedding rows that one process with torch's optimizer trains.

The same batches (a single-id slot with a popular head and a multi-hot slot) go once through a real
job in sync mode (a PS and an embedding worker over a real nats-server, the NN worker's TrainCtx, and
float32 on the wire both ways) and once through one process: a ``torch.nn.EmbeddingBag`` per slot,
the same dense model and ``torch.optim.<Name>`` on the embedding. The rows must agree to float32
rounding, and they must have moved far more than that, so the comparison can fail; with
``persia_order=True`` they must not agree.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch
from persia_nats.common.config import embedding_config_from_dict, global_config_from_dict
from persia_nats.common.env import Env
from persia_nats.common.optim_config import EmbeddingHyperparams
from persia_nats.core.store import EmbeddingTable

from persia.ctx import TrainCtx
from persia.data import DataLoader, IterableDataset
from persia.embedding.data import IDTypeFeature, IDTypeFeatureWithSingleID, Label, PersiaBatch
from persia.embedding.optim import SGD, Adagrad
from tests.integration.helpers import running_job

DIM, BATCH, STEPS = 4, 16, 12
SLOTS = {"u": {"dim": DIM}, "i": {"dim": DIM}}
HYPER = EmbeddingHyperparams(init_lower=-0.5, init_upper=0.5, weight_bound=0.0)  # torch does not clip


def _batches(seed: int = 0, most: int = 3) -> list[tuple[np.ndarray, list[np.ndarray], np.ndarray]]:
    """(u ids, i id lists, labels) per batch: u Zipf-like over 12 ids, i 1 to ``most`` ids of 20 per sample."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        u = np.minimum(rng.zipf(1.5, BATCH), 12).astype(np.uint64)
        items = [rng.choice(20, rng.integers(1, most + 1), replace=False).astype(np.uint64) + 1 for _ in range(BATCH)]
        out.append((u, items, (rng.random(BATCH) < 0.5).astype(np.float32)))
    return out


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.out = torch.nn.Linear(2 * DIM, 1)

    def forward(self, non_id: list[torch.Tensor], emb: list[torch.Tensor]) -> torch.Tensor:
        return torch.sigmoid(self.out(torch.cat([e.float() for e in emb], dim=1)))


def _keys(ecfg, slot: str, ids: np.ndarray) -> np.ndarray:
    return ids | np.uint64(ecfg.prefix_of(slot))


def _one_process(ecfg, optimizer: str, batches) -> dict[int, np.ndarray]:
    """The reference: one EmbeddingBag per slot over every key, started at the PS's initial rows."""
    keys = {s: _keys(ecfg, s, np.arange(1, 21, dtype=np.uint64)) for s in SLOTS}
    init = EmbeddingTable(DIM, capacity=100, hyper=HYPER)
    bags = {s: torch.nn.EmbeddingBag(20, DIM, mode="sum") for s in SLOTS}
    for s, bag in bags.items():
        bag.weight.data = torch.from_numpy(init.lookup(keys[s], train=True).copy())
    params = [b.weight for b in bags.values()]
    opt = torch.optim.SGD(params, lr=0.3) if optimizer == "sgd" \
        else torch.optim.Adagrad(params, lr=0.3, initial_accumulator_value=0.1, eps=1e-10)
    model = _Model()
    dense = torch.optim.SGD(model.parameters(), lr=0.1)
    for u, items, labels in batches:
        emb_u = bags["u"](torch.from_numpy(u.astype(np.int64) - 1).view(-1, 1))
        flat = torch.from_numpy(np.concatenate(items).astype(np.int64) - 1)
        offsets = torch.from_numpy(np.cumsum([0] + [len(x) for x in items[:-1]]))
        loss = torch.nn.functional.binary_cross_entropy(model([], [emb_u, bags["i"](flat, offsets)]),
                                                        torch.from_numpy(labels).view(-1, 1))
        opt.zero_grad()
        dense.zero_grad()
        loss.backward()
        opt.step()
        dense.step()
    return {int(k): bags[s].weight.detach().numpy()[j] for s in SLOTS for j, k in enumerate(keys[s])}


class _Batches(IterableDataset):
    def __init__(self, batches) -> None:
        super().__init__(buffer_size=4)
        self.batches = batches

    def __iter__(self):
        for u, items, labels in self.batches:
            yield PersiaBatch([IDTypeFeatureWithSingleID("u", u), IDTypeFeature("i", items)],
                              labels=[Label(labels.reshape(-1, 1), name="y")])


def _train_in_sync_mode(url: str, job: str, optimizer: str, batches, gather: str = "auto") -> None:
    gcfg = global_config_from_dict({"common_config": {"job_name": job},
                                    "embedding_worker_config": {"wire_dtype": "float32"},
                                    "nn_worker_config": {"sync_mode": "sync", "request_timeout_sec": 10,
                                                         "embedding_gather": gather}})
    model = _Model()
    emb_opt = SGD(lr=0.3) if optimizer == "sgd" else Adagrad(
        lr=0.3, initial_accumulator_value=0.1, eps=1e-10, persia_order=optimizer == "adagrad-persia-order")
    with TrainCtx(model=model, embedding_optimizer=emb_opt, dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  embedding_config=HYPER, env=Env(nats_url=url, rank=0, world_size=1), global_config=gcfg) as ctx:
        for batch in DataLoader(_Batches(batches)):
            output, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
        ctx.wait_for_gradients()


@pytest.mark.parametrize(("optimizer", "most", "gather"), [
    ("adagrad", 3, "auto"), ("sgd", 3, "auto"), ("adagrad-persia-order", 3, "auto"), ("adagrad", 1, "host"),
    ("adagrad", 1, "device"), ("sgd", 1, "device")])
async def test_sync_mode_trains_the_rows_one_torch_process_trains(nats_server, job_name, optimizer, most, gather):
    """``most`` 1: every slot holds one id a sample, so the width comes to the NN worker gathered (its rows
    once each) and its gradients go back per row, summed by the NN worker's I/O thread (``host``) or by
    autograd from a gather in the model's graph (``device``, here the CPU)."""
    ecfg = embedding_config_from_dict({"feature_index_prefix_bit": 8, "slots_config": SLOTS})
    batches = _batches(most=most)
    async with running_job(nats_server.url, job_name, replicas=1, embedding={
            "feature_index_prefix_bit": 8, "slots_config": SLOTS}, wire_dtype="float32") as (_, pss, ew):
        await asyncio.to_thread(_train_in_sync_mode, nats_server.url, job_name, optimizer, batches, gather)
        assert ew.counters["looked_up_gathered"] == (STEPS if most == 1 else 0)
        want = _one_process(ecfg, optimizer, batches)
        seen = np.unique(np.concatenate([_keys(ecfg, "u", u) for u, _, _ in batches]
                                        + [_keys(ecfg, "i", np.concatenate(items)) for _, items, _ in batches]))
        held, rows, _ = pss[0].store.read(seen, DIM)
        keys = seen
    assert held.all(), "every id the batches hold is stored"
    expected = np.stack([want[int(k)] for k in keys])
    start = EmbeddingTable(DIM, capacity=100, hyper=HYPER).lookup(keys, train=True)
    assert np.abs(expected - start).max() > 0.01  # the rows moved: agreement below is not the initial values
    close = np.isclose(rows, expected, rtol=1e-4, atol=2e-6)
    if optimizer == "adagrad-persia-order":
        assert not close.all()  # PERSIA's order is another update, and this comparison sees it
    else:
        np.testing.assert_allclose(rows, expected, rtol=1e-4, atol=2e-6)
