"""Serving: requests/s and p50/p99 latency of ``persia-launcher serve`` over NATS, against the same model in-process.

    .venv/bin/python benchmarks/bench_serving.py [--batch-sizes 1,256] [--concurrency 1,4,16]
        [--seconds 3] [--ids-per-slot 100000] [--json]

Checkpoint: fabricated, shaped like the adult-income job (``examples/adult-income/config``: eight
slots of width 8) with ``--ids-per-slot`` rows per slot (800,000 rows by default) and Adagrad
state, written by the PS's own ``dump_store`` as one replica, plus the example's ``DNN(dense_dim=5)``
with random weights, sealed by ``finalize``. Requests: single-id slots, ids uniform over each
slot's rows, five float32 dense features; 64 distinct pre-encoded batches per batch size, sent in
turn.

Served: nats-server and one ``persia-launcher serve`` process; the client (nats-py, in this
process) keeps ``concurrency`` requests outstanding for ``--seconds`` after a warm-up and times each
request-reply. Server and reference run torch with ``--torch-threads`` (1) intra-op threads.

Reference, in the same run: :func:`persia_nats.services.serving.snapshot.predict` called in this process on
the same (already decoded) batches, one at a time, from the same checkpoint; ``x in-proc`` is served
requests/s over the reference's. ``handler req/s`` is the service's whole handler without NATS
(msgpack decode and validation, predict, reply encoding), one request at a time. Client,
nats-server and server share this machine's cores. Prints one table; with --json, one JSON line
last.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
import tempfile
import time
import uuid
from pathlib import Path

import msgpack
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
ADULT = ROOT / "examples" / "adult-income"

from persia_nats.common import checkpoint as ck  # noqa: E402
from persia_nats.common.config import EmbeddingConfig, load_embedding_config  # noqa: E402
from persia_nats.common.messages import IdFeature  # noqa: E402
from persia_nats.common.optim_config import AdagradConfig  # noqa: E402
from persia_nats.core.plan import make_plan  # noqa: E402
from persia_nats.core.store import EmbeddingStore  # noqa: E402
from persia_nats.core.store_checkpoint import dump_store  # noqa: E402
from persia_nats.services.serving.model import model_factory  # noqa: E402
from persia_nats.services.serving.snapshot import load_snapshot, predict  # noqa: E402

from tests.natsserver import start_nats_server  # noqa: E402
from tests.procs import Job, job_env  # noqa: E402

MODEL = f"{ADULT / 'model.py'}:DNN"
MODEL_KWARGS = {"dense_dim": 5}
DENSE_DIM = 5
DISTINCT_BATCHES = 64


def fabricate_checkpoint(root: Path, ecfg: EmbeddingConfig, ids_per_slot: int, seed: int = 0) -> Path:
    """A final checkpoint with ``ids_per_slot`` rows (ids 0..n-1) in every slot, and a random DNN."""
    import torch

    store = EmbeddingStore(10 * ids_per_slot * len(ecfg.slot_names), AdagradConfig())
    ids = np.arange(ids_per_slot, dtype=np.uint64)
    feats = [IdFeature(name, ids, np.ones(ids_per_slot, np.int32)) for name in ecfg.slot_names]
    for dim, signs in make_plan(feats, ecfg).distinct.items():
        store.lookup(signs, dim, train=True)  # rows start uniform in the init range, seeded by id
    partial = ck.partial_dir(root, ck.next_number(root))
    partial.mkdir(parents=True)
    files = dict(dump_store(store, partial, 0, 1))
    torch.manual_seed(seed)
    model = model_factory(MODEL, MODEL_KWARGS)()
    (partial / "dense").mkdir()
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    files["dense/model.pt"] = ck.write_bytes_atomic(partial / "dense" / "model.pt", buf.getvalue())
    files["state.json"] = ck.write_bytes_atomic(partial / "state.json", json.dumps({"step": 0}).encode())
    return ck.finalize(partial, files, extra={"step": 0, "ps_replicas": 1})


def _arr(a: np.ndarray) -> dict:
    a = np.ascontiguousarray(a)
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


def make_requests(ecfg: EmbeddingConfig, batch_size: int, ids_per_slot: int, seed: int) -> list[dict]:
    """Distinct ``serve.predict`` maps of ``batch_size`` samples (plain msgpack-able dicts)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(DISTINCT_BATCHES):
        features = [{"name": name, "values": _arr(rng.integers(0, ids_per_slot, batch_size).astype(np.uint64)),
                     "lengths": _arr(np.ones(batch_size, np.int32))} for name in ecfg.slot_names]
        dense = rng.standard_normal((batch_size, DENSE_DIM)).astype(np.float32)
        out.append({"v": 1, "features": features, "non_id": [{"name": "continuous", "data": _arr(dense)}]})
    return out


def _percentiles(lat: list[float]) -> tuple[float, float]:
    a = np.asarray(lat) * 1e3
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


async def measure_served(url: str, subject: str, payloads: list[bytes], concurrency: int, seconds: float) -> dict:
    import nats

    nc = await nats.connect(url, max_reconnect_attempts=0)
    lat: list[float] = []
    errors = 0
    try:
        async def client(k: int, until: float, record: bool) -> None:
            nonlocal errors
            i = k
            while time.perf_counter() < until:
                t0 = time.perf_counter()
                msg = await nc.request(subject, payloads[i % len(payloads)], timeout=30)
                if msg.headers and "Nats-Service-Error-Code" in msg.headers:
                    errors += 1
                else:
                    msgpack.unpackb(msg.data, raw=False)
                if record:
                    lat.append(time.perf_counter() - t0)
                i += concurrency

        warm = time.perf_counter() + min(1.0, seconds / 3)
        await asyncio.gather(*(client(k, warm, False) for k in range(concurrency)))
        start = time.perf_counter()
        await asyncio.gather(*(client(k, start + seconds, True) for k in range(concurrency)))
        elapsed = time.perf_counter() - start
    finally:
        await nc.close()
    p50, p99 = _percentiles(lat)
    return {"requests": len(lat), "req_s": len(lat) / elapsed, "p50_ms": p50, "p99_ms": p99, "errors": errors}


def _timed(call, items: list, seconds: float) -> list[float]:  # noqa: ANN001
    for item in items[:8]:
        call(item)
    lat = []
    i = 0
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        item = items[i % len(items)]
        t0 = time.perf_counter()
        call(item)
        lat.append(time.perf_counter() - t0)
        i += 1
    return lat


def measure_inprocess(snap, ecfg: EmbeddingConfig, requests: list[dict], seconds: float) -> dict:
    """predict() on decoded batches (the reference), and the whole handler minus NATS (decode, predict, encode)."""
    from persia_nats.common.codec import pack, unpack_message
    from persia_nats.common.messages import PredictReply, PredictRequest

    payloads = [msgpack.packb(r, use_bin_type=True) for r in requests]
    decoded = []
    for payload in payloads:
        req = PredictRequest.from_wire(unpack_message(payload))
        decoded.append((req.features, [a.data for a in req.non_id]))
    lat = _timed(lambda d: predict(snap, ecfg, *d), decoded, seconds)

    def handler(payload: bytes) -> bytes:
        req = PredictRequest.from_wire(unpack_message(payload))
        out = predict(snap, ecfg, req.features, [a.data for a in req.non_id])
        return pack(PredictReply(out, snap.name).to_wire())  # as the server's handler answers

    handler_lat = _timed(handler, payloads, seconds / 2)
    p50, p99 = _percentiles(lat)
    return {"requests": len(lat), "req_s": len(lat) / sum(lat), "p50_ms": p50, "p99_ms": p99,
            "handler_req_s": len(handler_lat) / sum(handler_lat)}


async def wait_serving(url: str, subject: str, deadline: float) -> dict:
    import nats

    nc = await nats.connect(url)
    try:
        end = time.monotonic() + deadline
        while True:
            try:
                msg = await nc.request(subject, msgpack.packb({"v": 1}), timeout=2)
                info = msgpack.unpackb(msg.data, raw=False)
                if info.get("checkpoint"):
                    return info
            except Exception:
                pass
            if time.monotonic() > end:
                raise RuntimeError(f"the server did not come up within {deadline}s")
            await asyncio.sleep(0.2)
    finally:
        await nc.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-sizes", default="1,256")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--ids-per-slot", type=int, default=100_000)
    parser.add_argument("--torch-threads", type=int, default=1, help="for the server and the reference")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    levels = [int(x) for x in args.concurrency.split(",")]
    import torch

    torch.set_num_threads(args.torch_threads)
    ecfg = load_embedding_config(ADULT / "config" / "embedding_config.yml")
    job_name = f"serve{uuid.uuid4().hex[:8]}"
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        t0 = time.perf_counter()
        ckpt = fabricate_checkpoint(tmp_path / "ckpt", ecfg, args.ids_per_slot)
        fabricate_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        snap = load_snapshot(ckpt, model_factory(MODEL, MODEL_KWARGS))
        load_s = time.perf_counter() - t0
        server = start_nats_server()
        job = Job(job_env(server.url, job_name, LOG_LEVEL="warning", PERSIA_CHECKPOINT_DIR=str(tmp_path / "ckpt")),
                  tmp_path)
        try:
            job.start("serve", "serve", "--model", MODEL, "--model-kwargs", json.dumps(MODEL_KWARGS),
                      "--reload-interval", "0", "--torch-threads", str(args.torch_threads))
            prefix = f"persia.{job_name}.serve"
            info = asyncio.run(wait_serving(server.url, f"{prefix}.info", 120))
            for bs in batch_sizes:
                requests = make_requests(ecfg, bs, args.ids_per_slot, seed=bs)
                payloads = [msgpack.packb(r, use_bin_type=True) for r in requests]
                ref = measure_inprocess(snap, ecfg, requests, args.seconds)
                for c in levels:
                    served = asyncio.run(measure_served(server.url, f"{prefix}.predict", payloads, c, args.seconds))
                    if served["errors"]:
                        raise RuntimeError(f"{served['errors']} error replies at batch {bs}, concurrency {c}")
                    rows.append({"batch": bs, "concurrency": c, **{k: served[k] for k in ("req_s", "p50_ms", "p99_ms")},
                                 "samples_s": served["req_s"] * bs, "inproc_req_s": ref["req_s"],
                                 "inproc_p50_ms": ref["p50_ms"], "inproc_p99_ms": ref["p99_ms"],
                                 "handler_req_s": ref["handler_req_s"],
                                 "ratio": served["req_s"] / ref["req_s"]})
        except BaseException:
            sys.stderr.write(job.dump_logs() if job.procs else "")
            raise
        finally:
            job.stop_all()
            server.stop()
    print(f"checkpoint: {snap.rows:,} rows (8 slots x {args.ids_per_slot:,}, dim 8) + DNN(dense_dim=5); "
          f"fabricated in {fabricate_s:.1f}s, loaded in {load_s:.2f}s; served: {info['checkpoint']}")
    header = ["batch", "concurrency", "req/s", "samples/s", "p50 ms", "p99 ms", "in-proc req/s", "in-proc p50 ms",
              "in-proc p99 ms", "handler req/s", "x in-proc"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        cells = [str(r["batch"]), str(r["concurrency"]), f"{r['req_s']:,.0f}", f"{r['samples_s']:,.0f}",
                 f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}", f"{r['inproc_req_s']:,.0f}", f"{r['inproc_p50_ms']:.3f}",
                 f"{r['inproc_p99_ms']:.3f}", f"{r['handler_req_s']:,.0f}", f"{r['ratio']:.2f}"]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        print(json.dumps({"rows": snap.rows, "load_s": load_s, "results": rows}))


if __name__ == "__main__":
    main()
