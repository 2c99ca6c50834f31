"""A periodic checkpoint is written while training goes on: rank 0 cuts it at a step (every gradient applied,
the replicas asked to dump, the dense part in memory) and finishes it in the background, one at a time, and
an explicit checkpoint waits for the one being written. Over a real nats-server, with a PS replica whose
table is large enough, and its dump paced slowly enough, that writing it outlasts several training steps."""

from __future__ import annotations

import asyncio
import json

import numpy as np
import torch
from persia_nats.common import checkpoint as ck
from persia_nats.common.config import global_config_from_dict
from persia_nats.common.env import Env
from persia_nats.core.store_checkpoint import DumpPace

from persia.ctx import TrainCtx
from persia.data import DataLoader
from persia.embedding.optim import SGD
from tests.integration.helpers import running_job
from tests.integration.test_sync_equals_one_process import DIM, HYPER, SLOTS, _Batches, _Model

STEPS = 60
#: rows put in the replica's table before training: with the slow pace below, its dump takes seconds
FILLER_ROWS = 100_000


def _batches(seed: int = 1) -> list[tuple[np.ndarray, list[np.ndarray], np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [(rng.integers(1, 13, 16).astype(np.uint64),
             [rng.choice(20, 2, replace=False).astype(np.uint64) + 1 for _ in range(16)],
             (rng.random(16) < 0.5).astype(np.float32)) for _ in range(STEPS)]


def _train(url: str, job: str, root: str) -> dict:
    gcfg = global_config_from_dict({"common_config": {"job_name": job, "checkpointing_config": {"keep": 10}},
                                    "nn_worker_config": {"request_timeout_sec": 10}})
    model = _Model()
    seen = {"steps_while_writing": 0, "cut_steps": []}
    with TrainCtx(model=model, embedding_optimizer=SGD(lr=0.1), embedding_config=HYPER,
                  dense_optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                  env=Env(nats_url=url, rank=0, world_size=1), global_config=gcfg, checkpoint_dir=root,
                  checkpoint_every_sec=0.001) as ctx:
        for batch in DataLoader(_Batches(_batches())):
            writing = ctx.checkpointer.busy()
            output, labels = ctx.forward(batch)
            ctx.backward(torch.nn.functional.binary_cross_entropy(output, labels[0]))
            seen["steps_while_writing"] += writing
            if ctx.checkpointer.busy() and not writing:
                seen["cut_steps"].append(ctx.steps)
        explicit = ctx.dump_checkpoint(root)  # after the periodic one being written, not beside it
        seen.update(summary=ctx.checkpoint_summary(), explicit=explicit, steps=ctx.steps)
    return seen


async def test_a_periodic_checkpoint_is_written_while_training_goes_on(nats_server, job_name, tmp_path):
    root = tmp_path / "ckpt"
    async with running_job(nats_server.url, job_name, replicas=1, checkpoint_dir=str(root), embedding={
            "feature_index_prefix_bit": 8, "slots_config": SLOTS}) as (_, (ps,), _ew):
        ps.store.lookup(np.arange(1 << 20, (1 << 20) + FILLER_ROWS, dtype=np.uint64), DIM, True)
        ps.dump_pace = DumpPace(scan_slots=1 << 10, step_bytes=1 << 12, loop_share=0.1)
        seen = await asyncio.to_thread(_train, nats_server.url, job_name, str(root))
    summary = seen["summary"]
    print(f"\nbackground checkpoints: cut at steps {seen['cut_steps']}, {seen['steps_while_writing']} of "
          f"{seen['steps']} steps trained while one was being written, summary {summary}")
    assert summary["failed"] == 0, summary
    assert seen["steps_while_writing"] > 0, seen  # training did not wait for the dump
    assert seen["cut_steps"] and summary["taken"] == len(seen["cut_steps"]) + 1, seen
    written = ck.list_checkpoints(root)  # newest first
    assert str(written[0]) == seen["explicit"] and len(written) == summary["taken"], (written, seen)
    steps = [json.loads((p / "state.json").read_text())["step"] for p in reversed(written)]
    # each periodic checkpoint holds the step it was cut at, whatever training did while it was written
    assert steps == [*seen["cut_steps"], seen["steps"]], (steps, seen)
    for path in written:
        manifest = ck.read_manifest(path)
        assert any(name.startswith("ps") or "shard" in name for name in manifest["files"]), manifest["files"]
        assert manifest["step"] in steps
