"""Ask a running inference server (``persia-launcher serve``) for predictions on adult.test, from a plain
NATS client, and print their test AUC.

Only nats-py, msgpack and numpy are used (plus the example's ``adult_data`` loader for the rows and its
``metrics`` for the AUC), so this file is what a client in any language has to do; the wire format is
in ``docs/protocol.md`` (section Serving). Against a local server (docs/operations.md, "Serving")::

    .venv/bin/python examples/clients/predict_adult.py

On a secured NATS the client connects as ``predict-client`` (``PERSIA_NATS_USER`` and
``PERSIA_NATS_PASSWORD``, from ``deploy/credentials/predict-client.env``), which may ask for
predictions and nothing else. Prints one JSON line: ``samples``, ``test_auc``, ``checkpoint`` (the
checkpoint that answered; more than one name when the server swapped checkpoints meanwhile).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import msgpack
import nats
import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "adult-income"))
from adult_data import CATEGORICAL, batches, load_split  # noqa: E402
from metrics import auc  # noqa: E402


def arr(a: np.ndarray) -> dict:
    """An array on the wire: {dtype, shape, data} with the raw little-endian bytes."""
    a = np.ascontiguousarray(a, dtype=np.asarray(a).dtype.newbyteorder("<"))
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


async def predict(nc: nats.NATS, subject: str, ids: np.ndarray, dense: np.ndarray, timeout: float) -> dict:
    """One batch: the id features in jagged form (one id per sample here) and the dense features."""
    n = ids.shape[0]
    body = {"v": 1,
            "features": [{"name": name, "values": arr(ids[:, j].astype(np.uint64)),
                          "lengths": arr(np.ones(n, np.int32))} for j, name in enumerate(CATEGORICAL)],
            "non_id": [{"name": "continuous", "data": arr(dense.astype(np.float32))}]}
    payload, tries = msgpack.packb(body, use_bin_type=True), 0
    while True:
        msg = await nc.request(subject, payload, timeout=timeout)
        headers = msg.headers or {}
        code = headers.get("Nats-Service-Error-Code")
        if code is None:
            return msgpack.unpackb(msg.data, raw=False)
        tries += 1
        # 503: the server has no checkpoint loaded yet, or is busy; any other code will not change
        if code != "503" or tries == 100:
            raise RuntimeError(f"{subject}: {code} {headers.get('Nats-Service-Error', '')}")
        await asyncio.sleep(0.1)


async def run(url: str, job: str, batch_size: int, concurrency: int, timeout: float) -> dict:
    user, password = os.environ.get("PERSIA_NATS_USER"), os.environ.get("PERSIA_NATS_PASSWORD")
    # under deploy/nats-auth.conf a user reads replies only on its own inbox prefix, _INBOX.<user>
    nc = await nats.connect(servers=url.split(","), **({"user": user, "password": password,
                                                        "inbox_prefix": f"_INBOX.{user}"} if user else {}))
    subject = f"persia.{job}.serve.predict"
    split = load_split("test")
    limit = asyncio.Semaphore(concurrency)

    async def one(ids: np.ndarray, dense: np.ndarray) -> dict:
        async with limit:
            return await predict(nc, subject, ids, dense, timeout)

    try:
        replies = await asyncio.gather(*(one(ids, dense) for ids, dense, _ in batches(split, batch_size)))
    finally:
        await nc.drain()
    scores = np.concatenate([np.frombuffer(r["predictions"]["data"], np.dtype(r["predictions"]["dtype"]))
                             for r in replies])
    return {"samples": int(scores.shape[0]), "test_auc": auc(split.labels.ravel(), scores),
            "checkpoint": sorted({r["checkpoint"] for r in replies})}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nats-url", default=os.environ.get("PERSIA_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--job", default=os.environ.get("PERSIA_JOB_NAME", "adult"), help="common_config.job_name")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=8, help="requests in flight at once")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for one reply")
    a = p.parse_args()
    print(json.dumps(asyncio.run(run(a.nats_url, a.job, a.batch_size, a.concurrency, a.timeout))))


if __name__ == "__main__":
    main()
