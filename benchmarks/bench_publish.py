"""CPU and page faults of publishing batch-sized messages with nats-py, with and without the allocator
settings every role starts with (``persia_nats.common.malloc``), against a plain socket send.

    .venv/bin/python benchmarks/bench_publish.py [--sizes 200000,1500000,6000000] [--messages 200] [--json]

Each contender runs in its own process (the allocator's settings are per process): it publishes
``--messages`` messages of each size to a subscriber in another process through a real nats-server,
flushing after each, and reports its own CPU (user + system) and minor page faults per message. The
reference is ``socket.sendall`` of the same bytes to a reader thread over loopback: the kernel's share
of moving them, which no client can avoid. Ratios are against it, measured in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _usage() -> tuple[float, int]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_minflt


def _per_message(before: tuple[float, int], n: int) -> dict:
    cpu, faults = _usage()
    return {"cpu_ms": (cpu - before[0]) * 1e3 / n, "faults": (faults - before[1]) / n}


async def _subscribe(url: str, n: int) -> None:
    import nats

    nc = await nats.connect(url)
    got, done = 0, asyncio.Event()

    async def count(_msg: object) -> None:
        nonlocal got
        got += 1
        if got == n:
            done.set()

    await nc.subscribe("bench.publish", cb=count)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.wait_for(done.wait(), 300)
    await nc.close()


async def _publish(url: str, n: int, size: int) -> dict:
    import nats

    nc = await nats.connect(url)
    data = os.urandom(size)
    for _ in range(5):  # warm up: the first messages grow the heap whatever the settings
        await nc.publish("bench.publish", data)
        await nc.flush()
    before = _usage()
    for _ in range(n):
        await nc.publish("bench.publish", data)
        await nc.flush()
    out = _per_message(before, n)
    await nc.close()
    return out


def _socket_send(n: int, size: int) -> dict:
    server = socket.create_server(("127.0.0.1", 0))

    def drain() -> None:
        conn, _ = server.accept()
        buf = bytearray(4 << 20)
        while conn.recv_into(buf):
            pass

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    sock = socket.create_connection(server.getsockname())
    data = os.urandom(size)
    for _ in range(5):
        sock.sendall(data)
    started = time.thread_time()
    _, faults = _usage()
    for _ in range(n):
        sock.sendall(data)
    # the reader thread's CPU is the receiving end's: count the sending thread's alone
    out = {"cpu_ms": (time.thread_time() - started) * 1e3 / n, "faults": (_usage()[1] - faults) / n}
    sock.close()
    return out


def _child(argv: list[str]) -> None:
    role, url, n, size = argv[0], argv[1], int(argv[2]), int(argv[3])
    if role == "subscribe":
        asyncio.run(_subscribe(url, n))
        return
    if role == "socket":
        print(json.dumps(_socket_send(n, size)))
        return
    if role == "tuned":
        from persia_nats.common.malloc import tune_malloc

        if not tune_malloc():
            raise SystemExit("the allocator settings did not take (not glibc, or PERSIA_MALLOC/GLIBC_TUNABLES)")
    print(json.dumps(asyncio.run(_publish(url, n, size))))


def _run(role: str, url: str, n: int, size: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PERSIA_MALLOC", "GLIBC_TUNABLES")}
    sub = None
    if role != "socket":
        sub = subprocess.Popen([sys.executable, __file__, "--child", "subscribe", url, str(n + 5), "0"],
                               stdout=subprocess.PIPE, text=True, env=env)
        assert sub.stdout is not None and sub.stdout.readline().strip() == "ready"
    out = subprocess.run([sys.executable, __file__, "--child", role, url, str(n), str(size)], env=env,
                         capture_output=True, text=True, timeout=300)
    if sub is not None:
        sub.wait(60)
    if out.returncode != 0:
        raise RuntimeError(f"{role} failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.splitlines()[-1])


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _child(sys.argv[2:])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="200000,1500000,6000000", help="message sizes in bytes")
    parser.add_argument("--messages", type=int, default=200)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    from tests.natsserver import start_nats_server

    server = start_nats_server()
    rows = []
    try:
        for size in (int(x) for x in args.sizes.split(",")):
            row = {"size": size}
            for role in ("socket", "default", "tuned"):
                row[role] = _run(role, server.url, args.messages, size)
            rows.append(row)
    finally:
        server.stop()
    print(f"{'bytes':>9} {'socket ms':>10} {'nats-py ms':>11} {'faults':>7} {'x socket':>9} "
          f"{'tuned ms':>9} {'faults':>7} {'x socket':>9}")
    for r in rows:
        s, d, t = r["socket"]["cpu_ms"], r["default"], r["tuned"]
        print(f"{r['size']:>9} {s:>10.3f} {d['cpu_ms']:>11.3f} {d['faults']:>7.0f} {d['cpu_ms'] / s:>9.2f} "
              f"{t['cpu_ms']:>9.3f} {t['faults']:>7.0f} {t['cpu_ms'] / s:>9.2f}")
    if args.json:
        print(json.dumps({"rows": rows}))


if __name__ == "__main__":
    main()
