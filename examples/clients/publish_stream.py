"""Publish the adult-income training split onto a job's durable ingestion stream.

Only ``nats-py`` and ``msgpack`` (and the standard library): this file is the template for a client
in any language. Each batch is one msgpack map on ``persia.<job>.batches`` (see
``docs/protocol.md``, "Durable ingestion"); JetStream stores it until the job has trained it, so
the publisher needs nothing running but NATS and the stream, and a crash of any role after the
publish loses nothing. The last message, ``{"v": 1, "end": true}`` on ``persia.<job>.stream_end``, ends
the job's stream. Under deploy/nats-auth.conf only ``admin`` may publish there: publish the batches as
``publisher`` with ``--no-end``, then end the stream as ``admin`` with ``--limit 0``.

Each publish carries a ``Nats-Msg-Id`` header (``<run id>-<batch number>``): a publish whose ack was
lost (a timeout) is sent again, and the stream drops the second copy within its duplicate window (two
minutes by default), so no batch is trained twice. Each run's id is 128 random bits, so no other client
can guess an id and claim it first; a duplicate on a first send (the stream already held the id) stops
the run with DuplicateIdError instead of losing the batch in silence. ``--run-id`` resumes a run: a
publisher restarted with the same id and seed resends nothing the stream already holds (within the
window) and says how many it held.

    persia-launcher data-loader --from-stream        # the job side (see docs/operations.md)
    python examples/clients/publish_stream.py --job adult

The features are encoded as the adult example does (``examples/adult-income/adult_data.py``): per
categorical column an id from the train split's sorted vocabulary (0 = missing or unseen), the five
continuous columns standardised with the train mean and standard deviation.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import secrets
import struct
import sys
from pathlib import Path

import msgpack
import nats
from nats.errors import NoRespondersError, TimeoutError
from nats.js.errors import APIError, NoStreamResponseError

COLUMNS = ("age", "workclass", "fnlwgt", "education", "education_num", "marital_status", "occupation",
           "relationship", "race", "gender", "capital_gain", "capital_loss", "hours_per_week", "native_country",
           "income")
CATEGORICAL = ("workclass", "education", "marital_status", "occupation", "relationship", "race", "gender",
               "native_country")
CONTINUOUS = ("age", "education_num", "capital_gain", "capital_loss", "hours_per_week")


def array(fmt: str, dtype: str, values: list, shape: list[int]) -> dict:
    """An array on the wire: {dtype, shape, data} with the raw little-endian bytes."""
    return {"dtype": dtype, "shape": shape, "data": struct.pack(f"<{len(values)}{fmt}", *values)}


def read_rows(path: Path) -> list[list[str]]:
    rows = []
    for line in path.read_text(encoding="ascii").splitlines():
        if line and not line.startswith("|"):
            rows.append(line.split(", "))
    return rows


def encode(rows: list[list[str]], vocab: dict, mean: list[float], std: list[float]) -> list[tuple]:
    col = {name: i for i, name in enumerate(COLUMNS)}
    out = []
    for r in rows:
        ids = [vocab[name].get(r[col[name]], 0) for name in CATEGORICAL]
        dense = [(float(r[col[name]]) - m) / s for name, m, s in zip(CONTINUOUS, mean, std, strict=True)]
        out.append((ids, dense, 1.0 if r[col["income"]].rstrip(".") == ">50K" else 0.0))
    return out


def train_encoding(rows: list[list[str]]) -> tuple[dict, list[float], list[float]]:
    col = {name: i for i, name in enumerate(COLUMNS)}
    vocab = {name: {v: i + 1 for i, v in enumerate(sorted({r[col[name]] for r in rows} - {"?"}))}
             for name in CATEGORICAL}
    mean, std = [], []
    for name in CONTINUOUS:
        xs = [float(r[col[name]]) for r in rows]
        m = sum(xs) / len(xs)
        s = math.sqrt(sum((x - m) ** 2 for x in xs) / len(xs))
        mean.append(m)
        std.append(s if s > 0 else 1.0)
    return vocab, mean, std


def batch_message(samples: list[tuple]) -> dict:
    """One batch: 8 single-id slots, one dense feature (n, 5) and one label (n, 1)."""
    n = len(samples)
    features = [{"name": name,
                 "values": array("Q", "<u8", [s[0][j] for s in samples], [n]),
                 "lengths": array("i", "<i4", [1] * n, [n])}
                for j, name in enumerate(CATEGORICAL)]
    dense = [x for s in samples for x in s[1]]
    return {"v": 1, "features": features,
            "non_id": [{"name": "continuous", "data": array("f", "<f4", dense, [n, len(CONTINUOUS)])}],
            "labels": [{"name": "income", "data": array("f", "<f4", [s[2] for s in samples], [n, 1])}],
            "requires_grad": True}


class DuplicateIdError(RuntimeError):
    """The stream dropped a batch as a duplicate of a message this run never sent."""


async def publish_with_retry(js, subject: str, payload: bytes, msg_id: str | None = None,
                             patience: float = 600.0, resuming: bool = False) -> int:
    """Publish and wait for the stream's ack; a full stream (or none yet) is waited out, not skipped.

    ``msg_id`` makes a resend after a lost ack harmless: the stream keeps the first copy only. A
    duplicate on a first send means the stream held the id already: expected when ``resuming`` a run
    (returns -1: already there), else another client took the id, and DuplicateIdError says so.
    """
    delay, waited, sent = 0.05, 0.0, False
    while True:
        try:
            headers = {"Nats-Msg-Id": msg_id} if msg_id else None
            ack = await js.publish(subject, payload, timeout=10, headers=headers)
            if ack.duplicate and not sent and resuming:
                return -1
            if ack.duplicate and not sent:
                # the stream already held this id, and not from a resend of ours: another client published
                # under it first, and the stream dropped this batch as its copy
                raise DuplicateIdError(f"the stream already holds a message with Nats-Msg-Id {msg_id!r} (sequence "
                                       f"{ack.seq}) that this run did not send: the batch was dropped as a duplicate."
                                       " Another publisher uses the same ids; publish with a fresh --run-id")
            return ack.seq
        except TimeoutError:
            sent = True  # it may have been stored: a duplicate on the resend is then our own first copy
            if waited > patience:
                raise RuntimeError(f"the stream did not take the batch within {patience:g}s") from None
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 1.0)
        except (NoRespondersError, NoStreamResponseError, APIError) as exc:
            # no stream yet (the job creates it when its data loader starts), or the stream is full
            if waited > patience:
                raise RuntimeError(f"the stream did not take the batch within {patience:g}s: {exc}") from exc
            await asyncio.sleep(delay)
            waited += delay
            delay = min(delay * 2, 1.0)


async def publish(url: str, job: str, data_dir: Path, batch_size: int, seed: int, limit: int | None,
                  end: bool, run_id: str, resuming: bool = False) -> None:
    rows = read_rows(data_dir / "adult.data")
    samples = encode(rows, *train_encoding(rows))
    random.Random(seed).shuffle(samples)
    if limit is not None:
        samples = samples[: limit * batch_size]
    user, password = os.environ.get("PERSIA_NATS_USER"), os.environ.get("PERSIA_NATS_PASSWORD")
    # under deploy/nats-auth.conf a user reads replies (here JetStream's acks) only on _INBOX.<user>.>
    nc = await nats.connect(url, **({"user": user, "password": password, "inbox_prefix": f"_INBOX.{user}"}
                                    if user else {}))
    js = nc.jetstream()
    subject = f"persia.{job}.batches"
    print(f"run {run_id} (to resume it: --run-id {run_id})", flush=True)
    count = held = 0
    for start in range(0, len(samples), batch_size):
        seq = await publish_with_retry(js, subject, msgpack.packb(batch_message(samples[start:start + batch_size]),
                                                                  use_bin_type=True), f"{run_id}-{count}",
                                       resuming=resuming)
        held += seq == -1
        count += 1
    if end:
        # the stream's end has a subject of its own, which the secure deployment lets only the operator use
        await publish_with_retry(js, f"persia.{job}.stream_end", msgpack.packb({"v": 1, "end": True},
                                                                               use_bin_type=True),
                                 f"{run_id}-end", resuming=resuming)
    print(f"published {count - held} batches ({len(samples)} samples in all) to {subject}"
          + (f", {held} the stream held already from run {run_id}" if resuming else "")
          + (" and the end marker" if end else ""), flush=True)
    await nc.drain()


def main() -> None:
    here = Path(__file__).resolve().parent
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nats-url", default=os.environ.get("PERSIA_NATS_URL", "nats://127.0.0.1:4222"))
    p.add_argument("--job", default=os.environ.get("PERSIA_JOB_NAME", "adult"), help="common_config.job_name")
    p.add_argument("--data-dir", type=Path, default=here.parent / "adult-income" / "data")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0, help="shuffle seed")
    p.add_argument("--limit", type=int, default=None, help="publish at most this many batches")
    p.add_argument("--no-end", action="store_true", help="leave the stream open (no end marker)")
    p.add_argument("--run-id", default=None,
                   help="resume this run: the batches the stream already holds under its ids are not sent again "
                        "(default: a fresh, random run id)")
    a = p.parse_args()
    if not (a.data_dir / "adult.data").is_file():
        sys.exit(f"{a.data_dir / 'adult.data'} not found (--data-dir)")
    # 128 random bits: ids another client can neither guess nor claim first (the stream keeps the first
    # message under an id for its duplicate window and drops later ones)
    run_id = a.run_id or secrets.token_hex(16)
    asyncio.run(publish(a.nats_url, a.job, a.data_dir, a.batch_size, a.seed, a.limit, not a.no_end, run_id,
                        resuming=a.run_id is not None))


if __name__ == "__main__":
    main()
