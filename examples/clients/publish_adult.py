"""Publish the adult-income training split into a running job from a plain NATS client.

Only nats-py, msgpack and numpy are used (plus the example's ``adult_data`` loader for the rows), so
this file is what a client in any language has to do; the wire format is in ``docs/protocol.md``.

Start a job without its data loader, then run this script::

    honcho start nats ps0 ps1 embedding_worker nn_worker      # in one shell
    .venv/bin/python examples/clients/publish_adult.py          # in another

For every batch it asks an embedding worker to buffer the id features (``ew.ingest``), sends the
dense features, labels and the returned ref to NN rank ``batch_id % world_size``
(``nn.<rank>.batch``), and at the end tells every rank how many batches it sent (``nn.<rank>.end``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys

import msgpack
import nats
import numpy as np
from nats.errors import NoRespondersError

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "adult-income"))
from adult_data import CATEGORICAL, batches, load_split  # noqa: E402


def arr(a: np.ndarray) -> dict:
    """An array on the wire: {dtype, shape, data} with the raw little-endian bytes."""
    a = np.ascontiguousarray(a, dtype=np.asarray(a).dtype.newbyteorder("<"))
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": a.tobytes()}


class ServiceError(Exception):
    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{code}: {text}")
        self.code = code


async def call(nc, subject: str, body: dict, timeout: float = 30.0, patience: float = 600.0) -> dict:
    """One request/reply. 503 (busy) and "no responders" are retried with backoff; other errors raise."""
    payload = msgpack.packb(body, use_bin_type=True)
    delay, waited = 0.002, 0.0
    while True:
        try:
            msg = await nc.request(subject, payload, timeout=timeout)
        except NoRespondersError:
            code, text = 503, f"no responders on {subject}"
        else:
            headers = msg.headers or {}
            if "Nats-Service-Error-Code" not in headers:
                return msgpack.unpackb(msg.data, raw=False, strict_map_key=False)
            code, text = int(headers["Nats-Service-Error-Code"]), headers.get("Nats-Service-Error", "")
            if code != 503:
                raise ServiceError(code, text)  # 400/404/409/413: resending the same bytes cannot help
        if waited > patience:
            raise ServiceError(code, text)
        await asyncio.sleep(delay)
        waited += delay
        delay = min(delay * 2, 0.1)


async def publish(url: str, job: str, batch_size: int, seed: int, loader_index: int, loader_size: int) -> None:
    nc = await nats.connect(url)
    prefix = f"persia.{job}"
    world_size = (await call(nc, f"{prefix}.nn.info", {"v": 1}))["world_size"]
    sent = [0] * world_size
    counter = 0
    for i, (ids, dense, labels) in enumerate(batches(load_split("train"), batch_size, shuffle_seed=seed)):
        if i % loader_size != loader_index:
            continue
        n = labels.shape[0]
        # 1. the id features go to any embedding worker (queue group "ew"), which answers {worker, ref}
        features = [{"name": name, "values": arr(ids[:, j].astype(np.uint64)), "lengths": arr(np.ones(n, np.int32))}
                    for j, name in enumerate(CATEGORICAL)]
        ref = await call(nc, f"{prefix}.ew.ingest", {"v": 1, "features": features, "requires_grad": True})
        # 2. dense features, labels and the ref go to NN rank batch_id % world_size
        batch_id = counter * loader_size + loader_index
        counter += 1
        rank = batch_id % world_size
        await call(nc, f"{prefix}.nn.{rank}.batch", {
            "v": 1, "batch_id": batch_id, "batch_size": n,
            "ref": {"worker": ref["worker"], "ref": ref["ref"]},
            "non_id": [{"name": "continuous", "data": arr(dense)}],
            "labels": [{"name": "income", "data": arr(labels)}],
            "requires_grad": True,
        })
        sent[rank] += 1
    # end of stream: every rank learns how many batches this loader sent it
    for rank in range(world_size):
        await call(nc, f"{prefix}.nn.{rank}.end",
                   {"v": 1, "loader_index": loader_index, "loader_size": loader_size, "batches": sent[rank]})
    print(f"published {sum(sent)} batches to {world_size} NN rank(s): {sent}", flush=True)
    await nc.drain()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nats-url", default=os.environ.get("PERSIA_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--job", default=os.environ.get("PERSIA_JOB_NAME", "adult"), help="common_config.job_name")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="shuffle seed (the example's data loader uses 0)")
    p.add_argument("--loader-index", type=int, default=0)
    p.add_argument("--loader-size", type=int, default=1)
    a = p.parse_args()
    asyncio.run(publish(a.nats_url, a.job, a.batch_size, a.seed, a.loader_index, a.loader_size))


if __name__ == "__main__":
    main()
