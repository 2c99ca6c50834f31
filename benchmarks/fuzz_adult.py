"""The adult job's test AUC, trained clean and then under the hostile-input campaign; print one table.

    .venv/bin/python benchmarks/fuzz_adult.py [--json]

Every role runs as its own process over a real nats-server (as ``tests/e2e``). The attacked run gets,
while it starts and trains: 1,000 one-sample ingests nobody looks up (they fill the embedding
worker's buffer), a ``configure`` of SGD lr 1e6 on each PS once the job has configured it, training
lookups at 200 widths nobody configured, zero-size arrays of shape ``[0, 2**62]`` on ``ps.<i>.update``
and ``nn.0.batch``, and 1-byte chunk parts declaring 1 GiB. The job must still train every sample, to
the clean run's AUC.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats  # noqa: E402
import numpy as np  # noqa: E402
from persia_nats.common.chunking import part_headers  # noqa: E402
from persia_nats.common.codec import WIRE_VERSION, array_to_wire  # noqa: E402
from persia_nats.common.errors import NoResponders, RemoteError, RequestTimeout  # noqa: E402
from persia_nats.common.messages import IdFeature, IngestRequest  # noqa: E402
from persia_nats.common.optim_config import SGDConfig, to_wire  # noqa: E402
from persia_nats.common.rpc import request  # noqa: E402
from persia_nats.common.subjects import Subjects  # noqa: E402

from tests.fuzzing import OVERFLOW  # noqa: E402
from tests.natsserver import start_nats_server  # noqa: E402
from tests.procs import ADULT, Job, job_env  # noqa: E402

PS = 2


async def _answer(nc: nats.aio.client.Client, subject: str, msg: dict | bytes, codes: dict[str, int]) -> None:
    """Send until someone answers (the roles are still starting), and count the answer's code."""
    for _ in range(600):
        try:
            await request(nc, subject, msg, 10)
            code = "200"
        except NoResponders:
            await asyncio.sleep(0.2)
            continue
        except RemoteError as exc:
            code = str(exc.code)
        except RequestTimeout:
            code = "timeout"
        codes[code] = codes.get(code, 0) + 1
        return
    codes["no responders"] = codes.get("no responders", 0) + 1


async def _configured(nc: nats.aio.client.Client, s: Subjects) -> None:
    """Until every PS has the job's optimizer (the NN worker's TrainCtx sent it)."""
    while True:
        try:
            infos = [await request(nc, s.ps(i, "info"), {"v": WIRE_VERSION}, 2) for i in range(PS)]
            if all(i.get("configured") for i in infos):
                return
        except (RemoteError, RequestTimeout, NoResponders):
            pass
        await asyncio.sleep(0.2)


async def attack(url: str, job: str) -> dict[str, dict[str, int]]:
    s = Subjects(job)
    nc = await nats.connect(url)
    out: dict[str, dict[str, int]] = {k: {} for k in ("orphans", "configure", "widths", "overflow", "chunks")}
    one = IngestRequest((IdFeature("workclass", np.array([7], np.uint64), np.ones(1, np.int32)),)).to_wire()
    for _ in range(1000):
        await _answer(nc, s.ew_ingest(), one, out["orphans"])
    await _configured(nc, s)
    for i in range(PS):
        await _answer(nc, s.ps(i, "configure"), {"v": WIRE_VERSION, "optimizer": to_wire(SGDConfig(lr=1e6))},
                      out["configure"])
        for dim in range(1, 201):
            await _answer(nc, s.ps(i, "lookup"), {"v": WIRE_VERSION, "train": True, "groups": [
                {"dim": dim, "ids": array_to_wire(np.arange(1, 1025, dtype=np.uint64))}]}, out["widths"])
        await _answer(nc, s.ps(i, "update"), {"v": WIRE_VERSION, "update_id": f"forged.{i}", "groups": [
            {"ids": array_to_wire(np.array([1], np.uint64)), "grads": OVERFLOW}]}, out["overflow"])
        for k in range(4):
            await nc.publish(s.ps(i, "lookup"), b"\0", headers=part_headers(f"liar{i}.{k}", 1, 2, 1 << 30))
            await _answer(nc, s.ps(i, "lookup"), b"", out["chunks"])  # a plain request closes nothing: 400
    await _answer(nc, s.nn_batch(0), {"v": WIRE_VERSION, "batch_id": 1, "batch_size": 0,
                                      "ref": {"worker": "x", "ref": 1},
                                      "labels": [{"name": "y", "data": OVERFLOW}]}, out["overflow"])
    await nc.close()
    return out


def run(url: str, attacked: bool, logdir: Path) -> dict:
    job_name = f"fz{uuid.uuid4().hex[:8]}"
    job = Job(job_env(url, job_name), logdir)
    started = time.perf_counter()
    try:
        job.start_roles(ADULT / "train.py", ADULT / "data_loader.py", ps=PS)
        codes = asyncio.run(attack(url, job_name)) if attacked else {}
        assert job.wait("nn", timeout=600) == 0, job.dump_logs()
        result = job.json_result("nn")
    finally:
        job.stop_all()
    return {"auc": result["test_auc"], "train_samples": result["train_samples"], "steps": result["steps"],
            "wall_s": time.perf_counter() - started, "answers": codes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    server = start_nats_server()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            clean = run(server.url, False, Path(tmp))
        with tempfile.TemporaryDirectory() as tmp:
            hostile = run(server.url, True, Path(tmp))
    finally:
        server.stop()
    print(f"{'run':<10}{'test AUC':>10}{'samples':>9}{'steps':>7}{'wall s':>8}  answers to the forged requests")
    for name, r in (("clean", clean), ("attacked", hostile)):
        print(f"{name:<10}{r['auc']:>10.4f}{r['train_samples']:>9}{r['steps']:>7}{r['wall_s']:>8.1f}  {r['answers']}")
    if args.json:
        print(json.dumps({"clean": clean, "attacked": hostile}))
    ok = hostile["train_samples"] == clean["train_samples"] and abs(hostile["auc"] - clean["auc"]) < 0.005
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
