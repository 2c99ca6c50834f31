"""Fuzz every subject with 10,000 hostile payloads each against a real nats-server; print one table.

    .venv/bin/python benchmarks/fuzz.py [--per-subject 10000] [--json]

A payload passes when it is answered (a reply, or an error reply with code 400/404/409/413/503)
and, when refused, left every role's state unchanged. "crashes" counts 500s, timeouts and state
changes from refused payloads; the goal is 0. Then the hostile-input campaign's findings
(``tests.fuzzing.hostile_payloads``, rows ``hostile_*`` and ``chunks``): each must be refused, except
ingests up to the embedding worker's byte bound, and every bounded structure must stay within its bound.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import nats  # noqa: E402
from persia_nats.common.codec import WIRE_VERSION  # noqa: E402
from persia_nats.common.optim_config import SGDConfig, to_wire  # noqa: E402
from persia_nats.common.rpc import request  # noqa: E402
from persia_nats.common.subjects import Subjects  # noqa: E402
from persia_nats.services.nn_worker.runtime import NNRuntime  # noqa: E402

from tests.fuzzing import (  # noqa: E402
    FuzzReport,
    fuzz_hostile,
    fuzz_subject,
    payloads,
    subjects_for,
    valid_messages,
)
from tests.integration.helpers import running_job  # noqa: E402
from tests.integration.test_fuzz import state  # noqa: E402
from tests.natsserver import start_nats_server  # noqa: E402


async def run(per_subject: int) -> tuple[FuzzReport, dict[str, int], float]:
    server = start_nats_server()
    job = f"fuzz{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    try:
        async with running_job(server.url, job, replicas=1) as (client, pss, ew):
            s = Subjects(job)
            await request(client, s.ps(0, "configure"), {"v": WIRE_VERSION, "optimizer": to_wire(SGDConfig(lr=0.1))},
                          5)
            nc = await nats.connect(server.url)
            rt = NNRuntime.build(nc, s, rank=0, world_size=1, timeout=5, incoming_limit=10 * per_subject)
            await rt.start()
            ref = (await request(client, s.ew_ingest(), valid_messages(ew.worker_id, 0)["ingest"], 5))["ref"]
            seeds = valid_messages(ew.worker_id, ref)
            report = FuzzReport()
            for i, (kind, subject) in enumerate(subjects_for(s, ew.worker_id).items()):
                await fuzz_subject(client, subject, kind, payloads(seeds[kind], per_subject, seed=1000 + i),
                                   lambda: state(pss, ew, rt), report)
            ew.ids.clear()
            figures = await fuzz_hostile(client, s, pss, ew, rt, lambda: state(pss, ew, rt), report)
            await rt.close()
    finally:
        server.stop()
    return report, figures, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-subject", type=int, default=10_000)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    report, figures, wall = asyncio.run(run(args.per_subject))
    crashes = {k: sum(1 for f in report.failures if f.startswith(k + ":")) for k in report.sent}
    print(f"{'subject':<22}{'payloads':>10}{'accepted':>10}{'refused':>10}{'crashes':>9}")
    for k in report.sent:
        print(f"{k:<22}{report.sent[k]:>10}{report.accepted[k]:>10}{report.refused[k]:>10}{crashes[k]:>9}")
    print("bounded memory after the hostile cases: "
          + ", ".join(f"{k}={v / 2**20:.1f} MiB" if "bytes" in k or "bound" in k or "rss" in k else f"{k}={v}"
                      for k, v in figures.items()))
    print(f"total {sum(report.sent.values())} payloads in {wall:.1f}s, {len(report.failures)} crashes")
    for f in report.failures[:20]:
        print("  ", f)
    if args.json:
        print(json.dumps({"payloads": dict(report.sent), "crashes": crashes, "memory": figures, "wall_s": wall}))
    sys.exit(1 if report.failures else 0)


if __name__ == "__main__":
    main()
