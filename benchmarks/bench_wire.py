"""Bytes on the wire per sample, and messages per batch, for each hop of the flow, against the minimum.

    .venv/bin/python benchmarks/bench_wire.py [--batch-size 4096] [--ps-replicas 2] [--json]

Two views of the same synthetic Criteo-like batches (26 slots, dim 16, Zipf ids):

1. per hop, the exact size of every message the roles send, encoded with the project's own message
   builders (request and reply), divided by the batch size;
2. per role, what the nats-server counted on each client connection (``/connz``) during a real run of
   the pipeline, divided by the samples trained.

The minimum is what any design must move: each distinct id once to the PS side, the pooled
float16 embeddings to the NN worker, and their float16 gradients back. (Single-id slots travel to the NN
worker as their distinct rows, once each, and their gradients per row, which is less than that minimum's
two legs on Zipf ids; the minimum is kept as it was, so figures stay comparable over time.)
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks" / "e2e"))

import numpy as np  # noqa: E402
from bench_setup import DIM, SLOTS, make_batches  # noqa: E402
from persia_nats.common.codec import pack  # noqa: E402
from persia_nats.common.config import load_embedding_config  # noqa: E402
from persia_nats.common.messages import (  # noqa: E402
    BatchRef,
    EwLookup,
    EwLookupReply,
    GatheredSlots,
    GradReply,
    GradRequest,
    IdFeature,
    IngestReply,
    IngestRequest,
    Message,
    NamedArray,
    NNBatch,
    Ok,
    PsLookup,
    PsLookupGroup,
    PsLookupReply,
    PsUpdate,
    PsUpdateGroup,
    PsUpdateReply,
    RowGradient,
)
from persia_nats.core.plan import gather_index, make_plan  # noqa: E402
from persia_nats.core.sharding import split_by_shard  # noqa: E402

from tests.natsserver import start_nats_server  # noqa: E402
from tests.procs import Job, job_env  # noqa: E402

HERE = ROOT / "benchmarks" / "e2e"
EMBEDDING_CONFIG = ROOT / "examples" / "synthetic" / "config" / "embedding_config.yml"


def size(msg: Message) -> int:
    return len(pack(msg.to_wire()))


def per_hop(batch_size: int, replicas: int) -> tuple[list[tuple[str, int, int]], int]:
    """[(hop, messages, bytes)] for one batch, and the minimum bytes for it."""
    ids, dense, labels = make_batches(1, batch_size)[0]
    # single-id slots, as the loader builds them: their lengths do not travel
    feats = tuple(IdFeature(s, np.ascontiguousarray(ids[:, i]), np.ones(batch_size, np.int32))
                  for i, s in enumerate(SLOTS))
    cfg = load_embedding_config(str(EMBEDDING_CONFIG))
    plan = make_plan(feats, cfg)
    distinct = plan.distinct[DIM]
    rows = np.zeros((distinct.shape[0], DIM), np.float32)
    ref = BatchRef("0-0123abcd", 2**40)
    shards = split_by_shard(distinct, replicas)
    version = 1_700_000_000_000_000_000  # a PS version: the clock in nanoseconds
    # one id per sample in every slot: the worker asks for float16 rows (docs/protocol.md, ps.<i>.lookup)
    ps_lookup_req = sum(size(PsLookup((PsLookupGroup(DIM, distinct[pos], half=True),), train=True))
                        for _, pos in shards)
    ps_lookup_rep = sum(size(PsLookupReply((rows[pos].astype(np.float16),), version)) for _, pos in shards)
    # float16 row gradients, scaled by a power of two (docs/protocol.md, ps.<i>.update)
    ps_update_req = sum(size(PsUpdate((PsUpdateGroup(distinct[pos], rows[pos].astype(np.float16), scale=2.0 ** 20),),
                                      "0-0123abcd.1099511627776")) for _, pos in shards)
    small_reply = size(PsUpdateReply(0))
    # every slot holds one id a sample: the NN worker asks for them gathered (docs/protocol.md, ew.<worker>.lookup)
    gathered = (GatheredSlots(DIM, rows.astype(np.float16), tuple(s.name for s in plan.slots),
                              np.arange(len(plan.slots), dtype=np.int32), gather_index(plan, DIM)),)
    wait = 30.0  # what a data loader with the default 60 s timeout of bench_e2e's config lets a full receiver hold
    hops = [
        ("1 loader -> EW ingest", 2, size(IngestRequest(feats, wait=wait)) + size(IngestReply(ref.worker, ref.ref))),
        ("2 loader -> NN batch", 2, size(NNBatch(0, batch_size, ref, (NamedArray("dense", dense),),
                                                 (NamedArray("label", labels),), wait=wait)) + size(Ok())),
        ("3 NN -> EW lookup", 2, size(EwLookup(ref.ref, train=True, gather=True))
         + size(EwLookupReply(ref.ref, (), None, gathered))),
        ("4 EW -> PS lookup", 2 * len(shards), ps_lookup_req + ps_lookup_rep),
        ("6 NN -> EW gradients", 2, size(GradRequest(ref.ref, (), rows=(
            RowGradient(DIM, rows.astype(np.float16), 2.0 ** 20),))) + size(GradReply(ref.ref, (), 0))),
        ("7 EW -> PS update", 2 * len(shards), ps_update_req + small_reply * len(shards)),
    ]
    minimum = distinct.shape[0] * 8 + 2 * batch_size * len(SLOTS) * DIM * 2
    return hops, minimum


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measured(batch_size: int, batches: int, replicas: int) -> tuple[dict[str, dict[str, int]], int]:
    """Bytes and messages each role's connection sent and received during a real run."""
    mport = free_port()
    server = start_nats_server(extra_conf=f"http: 127.0.0.1:{mport}")
    env = {"BENCH_BATCH_SIZE": str(batch_size), "BENCH_BATCHES": str(batches), "BENCH_WARMUP": "0",
           "PERSIA_GLOBAL_CONFIG": str(HERE / "global_config.yml"), "PERSIA_EMBEDDING_CONFIG": str(EMBEDDING_CONFIG),
           "LOG_LEVEL": "warning"}
    counts: dict[str, dict[str, int]] = {}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            job = Job(job_env(server.url, f"w{uuid.uuid4().hex[:10]}", **env), Path(tmp))
            try:
                job.start_roles(HERE / "nn.py", HERE / "loader.py", ps=replicas, loader_args=("--stay-alive",))
                if job.wait("nn", timeout=900) != 0:
                    raise RuntimeError(job.dump_logs())
                time.sleep(0.5)
                with urllib.request.urlopen(f"http://127.0.0.1:{mport}/connz?limit=1024&state=all") as r:
                    conns = json.load(r)["connections"]
            finally:
                job.stop_all()
    finally:
        server.stop()
    for c in conns:
        role = c.get("name", "?").rsplit("-", 1)[0]
        agg = counts.setdefault(role, {"sent_bytes": 0, "received_bytes": 0, "sent_msgs": 0, "received_msgs": 0})
        # connz counts from the server's side: what it received from the client is what the client sent
        agg["sent_bytes"] += c["in_bytes"]
        agg["received_bytes"] += c["out_bytes"]
        agg["sent_msgs"] += c["in_msgs"]
        agg["received_msgs"] += c["out_msgs"]
    return counts, batch_size * batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--ps-replicas", type=int, default=2)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    bs = args.batch_size
    hops, minimum = per_hop(bs, args.ps_replicas)
    total = sum(b for _, _, b in hops)
    print(f"per hop, batch {bs}, {args.ps_replicas} PS replicas (request + reply, encoded by the project's builders)")
    print(f"{'hop':<24}{'msgs/batch':>11}{'bytes/sample':>14}")
    for name, msgs, b in hops:
        print(f"{name:<24}{msgs:>11}{b / bs:>14.1f}")
    print(f"{'total':<24}{sum(m for _, m, _ in hops):>11}{total / bs:>14.1f}")
    print(f"{'minimum':<24}{'':>11}{minimum / bs:>14.1f}   ratio {total / minimum:.2f}x")
    counts, samples = measured(bs, args.batches, args.ps_replicas)
    print(f"\nmeasured by nats-server over {samples} samples ({args.batches} batches)")
    print(f"{'role':<22}{'sent B/sample':>14}{'recv B/sample':>14}{'msgs/batch':>11}")
    for role, c in sorted(counts.items()):
        print(f"{role:<22}{c['sent_bytes'] / samples:>14.1f}{c['received_bytes'] / samples:>14.1f}"
              f"{(c['sent_msgs'] + c['received_msgs']) / args.batches:>11.1f}")
    wire = sum(c["sent_bytes"] for c in counts.values())
    print(f"all clients sent {wire / samples:.1f} B/sample: {wire / (minimum / bs * samples):.2f}x the minimum")
    if args.json:
        print(json.dumps({"batch_size": bs, "per_hop_bytes_per_sample": {n: b / bs for n, _, b in hops},
                          "messages_per_batch": {n: m for n, m, _ in hops}, "minimum_bytes_per_sample": minimum / bs,
                          "ratio_to_minimum": total / minimum, "measured": counts, "measured_samples": samples,
                          "measured_ratio_to_minimum": wire / (minimum / bs * samples)}))


if __name__ == "__main__":
    main()
