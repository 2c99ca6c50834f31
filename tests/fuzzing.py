"""Hostile payloads for every subject: random bytes, random msgpack values, and mutated valid messages.

Shared by ``tests/integration/test_fuzz.py`` (a few thousand payloads) and ``benchmarks/fuzz.py``
(10,000 per subject). A subject passes when every payload gets an answer (a reply or an error
reply with a 4xx/503 code: never a 500, never silence) and no refused payload changes any state.
"""

from __future__ import annotations

import asyncio
import copy
import os
import random
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import nats
import numpy as np
from persia_nats.common.chunking import part_headers
from persia_nats.common.codec import WIRE_VERSION, array_to_wire, pack
from persia_nats.common.errors import RemoteError, RequestTimeout
from persia_nats.common.messages import (
    MAX_BATCH_SIZE,
    BatchBounds,
    BatchRef,
    GradRequest,
    IdFeature,
    IngestRequest,
    NamedArray,
    NNBatch,
    SlotGradient,
)
from persia_nats.common.optim_config import SGDConfig, to_wire
from persia_nats.common.rpc import decode_reply, request
from persia_nats.common.subjects import Subjects

ACCEPTED_ERRORS = {400, 404, 409, 413, 503}


def _feature(name: str, rows: list[list[int]]) -> IdFeature:
    return IdFeature(name, np.array([x for r in rows for x in r], np.uint64), np.array([len(r) for r in rows],
                                                                                        np.int32))


def valid_messages(worker: str, ref: int) -> dict[str, dict[str, Any]]:
    """One well-formed message per subject kind, the seeds of mutation."""
    feats = (_feature("a", [[1, 2], [3]]), _feature("r", [[7], []]))
    labels = (NamedArray("y", np.zeros((2, 1), np.float32)),)
    return {
        "ingest": IngestRequest(feats).to_wire(),
        "lookup_direct": {"v": WIRE_VERSION, "features": [f.to_wire() for f in feats]},
        "lookup": {"v": WIRE_VERSION, "ref": ref, "train": True},
        "grad": GradRequest(ref, (SlotGradient("a", np.ones((2, 4), np.float16)),)).to_wire(),
        "ps_lookup": {"v": WIRE_VERSION, "train": True,
                      "groups": [{"dim": 4, "ids": array_to_wire(np.array([1, 2], np.uint64))}]},
        "ps_update": {"v": WIRE_VERSION, "update_id": "f.1", "groups": [
            {"ids": array_to_wire(np.array([1], np.uint64)), "grads": array_to_wire(np.ones((1, 4), np.float32))}]},
        "ps_configure": {"v": WIRE_VERSION, "optimizer": to_wire(SGDConfig(lr=0.1))},
        "info": {"v": WIRE_VERSION},
        "nn_batch": NNBatch(1, 2, BatchRef(worker, ref), labels=labels).to_wire(),
        "nn_end": {"v": WIRE_VERSION, "loader_index": 0, "loader_size": 1, "batches": 1000},
        # the fuzzed job has no checkpoint root: both must refuse everything and touch no file
        "ps_checkpoint": {"v": WIRE_VERSION, "action": "dump", "dir": "/tmp/persia-fuzz/ckpt-00000001.partial"},
        "nn_checkpoint": {"v": WIRE_VERSION},
    }


_SCALARS: list[Callable[[random.Random], Any]] = [
    lambda r: None, lambda r: r.choice([True, False]), lambda r: r.randint(-2**63, 2**64 - 1),
    lambda r: r.randint(-3, 3), lambda r: r.random() * 10 ** r.randint(-40, 40), lambda r: float("nan"),
    lambda r: float("inf"), lambda r: "".join(chr(r.randint(0, 0x2FF)) for _ in range(r.randint(0, 12))),
    lambda r: r.randbytes(r.randint(0, 40)), lambda r: [], lambda r: {},
    lambda r: {"dtype": r.choice(["<f4", "<u8", "<i4", "<f2", "|b1", "x"]),
               "shape": [r.randint(-1, 5) for _ in range(r.randint(0, 3))], "data": r.randbytes(r.randint(0, 48))},
]


def random_value(r: random.Random, depth: int = 0) -> Any:
    kind = r.random()
    if depth < 3 and kind < 0.15:
        return [random_value(r, depth + 1) for _ in range(r.randint(0, 4))]
    if depth < 3 and kind < 0.3:
        return {r.choice(["v", "ref", "features", "groups", "name", "x", "train"]): random_value(r, depth + 1)
                for _ in range(r.randint(0, 4))}
    return r.choice(_SCALARS)(r)


def _mutate_obj(obj: Any, r: random.Random) -> Any:
    """Replace, drop or retype one node somewhere inside a decoded message."""
    if isinstance(obj, dict) and obj:
        key = r.choice(list(obj))
        choice = r.random()
        if choice < 0.2:
            del obj[key]
        elif choice < 0.6:
            obj[key] = random_value(r)
        else:
            obj[key] = _mutate_obj(obj[key], r)
        return obj
    if isinstance(obj, list) and obj:
        i = r.randrange(len(obj))
        if r.random() < 0.3:
            obj.pop(i)
        elif r.random() < 0.3:
            obj.append(copy.deepcopy(obj[i]))
        else:
            obj[i] = _mutate_obj(obj[i], r)
        return obj
    if isinstance(obj, bytes) and obj and r.random() < 0.5:
        b = bytearray(obj)
        b[r.randrange(len(b))] ^= 1 << r.randrange(8)
        return bytes(b)
    return random_value(r)


def payloads(seed_msg: dict[str, Any], n: int, seed: int) -> list[bytes]:
    """``n`` hostile payloads: a third raw bytes, a third random msgpack, a third mutations of ``seed_msg``."""
    r = random.Random(seed)
    base = msgpack.unpackb(pack(seed_msg), raw=False)
    out = []
    for i in range(n):
        mode = i % 3
        if mode == 0:
            raw = bytearray(pack(seed_msg))
            for _ in range(r.randint(1, 4)):
                op = r.random()
                if op < 0.4 and raw:
                    raw[r.randrange(len(raw))] = r.randrange(256)
                elif op < 0.7:
                    raw = raw[: r.randint(0, len(raw))]
                else:
                    raw += r.randbytes(r.randint(1, 16))
            out.append(bytes(raw))
        elif mode == 1:
            value = random_value(r)
            if isinstance(value, dict) and r.random() < 0.7:
                value["v"] = WIRE_VERSION
            out.append(msgpack.packb(value, use_bin_type=True))
        else:
            out.append(msgpack.packb(_mutate_obj(copy.deepcopy(base), r), use_bin_type=True))
    return out


@dataclass
class FuzzReport:
    sent: Counter[str] = field(default_factory=Counter)
    accepted: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)


async def fuzz_subject(nc: nats.aio.client.Client, subject: str, kind: str, blobs: list[bytes],
                       snapshot: Callable[[], Any], report: FuzzReport, timeout: float = 5.0) -> None:
    """Send every blob; check each is answered, and that refusals leave ``snapshot()`` unchanged."""
    for blob in blobs:
        before = snapshot()
        report.sent[kind] += 1
        try:
            await request(nc, subject, blob, timeout)
            report.accepted[kind] += 1
        except RemoteError as exc:
            report.refused[kind] += 1
            if exc.code not in ACCEPTED_ERRORS:
                report.failures.append(f"{kind}: {exc.code} {exc.description[:200]} for {blob[:80]!r}")
            elif snapshot() != before:
                report.failures.append(f"{kind}: refused ({exc.code}) but state changed for {blob[:80]!r}")
        except RequestTimeout:
            report.failures.append(f"{kind}: no answer for {blob[:80]!r}")
        await asyncio.sleep(0)


def subjects_for(s: Subjects, worker: str) -> dict[str, str]:
    return {"ingest": s.ew_ingest(), "lookup_direct": s.ew_lookup_direct(), "lookup": s.ew_lookup(worker),
            "grad": s.ew_grad(worker), "ps_lookup": s.ps(0, "lookup"), "ps_update": s.ps(0, "update"),
            "ps_configure": s.ps(0, "configure"), "info": s.ps(0, "info"), "nn_batch": s.nn_batch(0),
            "nn_end": s.nn_end(0), "ps_checkpoint": s.ps(0, "checkpoint"), "nn_checkpoint": s.nn_checkpoint()}


# -- the hostile-input campaign's findings (issue 23): each must be a 4xx/503 and change nothing --

#: a zero-size array whose other dimension overflows numpy's index type
OVERFLOW = {"dtype": "<f4", "shape": [0, 2**62], "data": b""}
#: checkpoint directories the job never writes
FOREIGN_CHECKPOINTS = ("ckpt-999999999999999999.partial", "~/x", "a/b/c", "a/b/ckpt-00000002.partial",
                       "ckpt-\u0663.partial", "ckpt-99999999.partial")


def _overflowing(msg: dict[str, Any], *path: Any) -> bytes:
    out = copy.deepcopy(msgpack.unpackb(pack(msg), raw=False))
    node = out
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = OVERFLOW
    return msgpack.packb(out, use_bin_type=True)


def hostile_payloads(worker: str, ref: int, dims: tuple[int, ...]) -> dict[str, list[bytes]]:
    """Per subject kind, the payloads that once got a 500, a crash or unbounded memory."""
    seeds = valid_messages(worker, ref)
    out: dict[str, list[bytes]] = {kind: [msgpack.packb({**msg, "v": v}, use_bin_type=True) for v in (True, 1.0)]
                                   for kind, msg in seeds.items()}
    out["nn_batch"].append(_overflowing(seeds["nn_batch"], "labels", 0, "data"))
    out["grad"].append(_overflowing(seeds["grad"], "grads", 0, "grad"))
    tiny = GradRequest(ref, (SlotGradient("a", np.ones((3, 4), np.float16)),), 1e-320).to_wire()
    out["grad"].append(pack(tiny))
    # a fresh update id: a repeat of one already applied is answered as such before its groups are read
    out["ps_update"].append(_overflowing({**seeds["ps_update"], "update_id": "hostile.1"}, "groups", 0, "grads"))
    out["ps_configure"].append(pack({"v": WIRE_VERSION, "optimizer": to_wire(SGDConfig(lr=1e6))}))
    out["ps_configure"].append(pack({"v": WIRE_VERSION, "dims": [4, 4096]}))
    out["ps_lookup"] += [pack({"v": WIRE_VERSION, "train": True, "groups": [
        {"dim": dim, "ids": array_to_wire(np.arange(1, 1025, dtype=np.uint64))}]}) for dim in range(1, 201)
        if dim not in dims]
    # 640 KB of ids read at the widest width: more rows than the PS's reply limit, refused before any is read
    out["ps_lookup"].append(pack({"v": WIRE_VERSION, "train": False, "groups": [
        {"dim": max(dims), "ids": array_to_wire(np.arange(1, 80_001, dtype=np.uint64))}]}))
    out["ps_checkpoint"] += [pack({"v": WIRE_VERSION, "action": "dump", "dir": d}) for d in FOREIGN_CHECKPOINTS]
    # 8 MB of ids a batch, 56 MB buffered with its plan: a few fill any byte bound below 512 MiB
    for k in range(12):
        values = np.random.default_rng(k).integers(1, 2**40, 1 << 20, dtype=np.uint64)
        lengths = np.full(1024, 1024, np.int32)
        empty = IdFeature("r", np.array([], np.uint64), np.zeros(1024, np.int32))
        out["ingest"].append(pack(IngestRequest((IdFeature("a", values, lengths), empty)).to_wire()))
    return out


async def hostile_chunks(nc: nats.aio.client.Client, subject: str, report: FuzzReport, n: int = 8) -> None:
    """1-byte first parts declaring 1 GiB each, every sequence then closed by a last part that cannot fit."""
    for k in range(n):
        report.sent["chunks"] += 1
        chunk_id = f"liar{k}"
        await nc.publish(subject, b"\0", headers=part_headers(chunk_id, 1, 2, 1 << 30))
        try:
            decode_reply(await nc.request(subject, b"\0", 5, headers=part_headers(chunk_id, 2, 2, 1 << 30)))
            report.accepted["chunks"] += 1
            report.failures.append(f"chunks: a 2-byte message declaring 1 GiB was accepted on {subject}")
        except RemoteError as exc:
            report.refused["chunks"] += 1
            if exc.code not in ACCEPTED_ERRORS:
                report.failures.append(f"chunks: {exc.code} {exc.description[:200]}")
        except TimeoutError:
            report.failures.append(f"chunks: no answer on {subject}")


#: the byte bounds the campaign runs under (lowered from the defaults so that a few messages reach them)
HOSTILE_EW_BUFFER_BYTES = 128 << 20
HOSTILE_PS_REPLY_BYTES = 1 << 20


def _scratch_root() -> Path:
    return Path(os.path.realpath(tempfile.mkdtemp(prefix="persia-fuzz-ckpt-")))


def _remove_counting(root: Path) -> int:
    """Remove ``root``; return how many entries it held."""
    n = sum(1 for _ in root.rglob("*"))
    shutil.rmtree(root, ignore_errors=True)
    return n


async def fuzz_hostile(nc: nats.aio.client.Client, s: Subjects, pss: list[Any], ew: Any, rt: Any,
                       snapshot: Callable[[], Any], report: FuzzReport) -> dict[str, int]:
    """Send :func:`hostile_payloads` and :func:`hostile_chunks` to a job's roles (one process); return the
    bounded structures' bytes and the process's RSS growth, with the bounds they were held to."""
    from tests.rss import rss_bytes

    ew.ids.capacity, ew.ids.max_bytes = 1000, HOSTILE_EW_BUFFER_BYTES
    # the batch bounds (data_loader_config.max_batch_*) would refuse the 1M-id batches before they are buffered
    # (tests/integration/test_outsider_bounds.py holds them): lifted here so the buffer's byte bound is what stops them
    ew.bounds = BatchBounds(1 << 30, MAX_BATCH_SIZE, 1 << 21)
    root = _scratch_root()
    for ps in pss:
        ps.max_reply_bytes = HOSTILE_PS_REPLY_BYTES
        ps.checkpoint_root = root  # so the names themselves are judged, not the missing root
    dims = tuple(sorted({sl.dim for sl in ew.ecfg.slots_config.values()}))
    ref = (await request(nc, s.ew_ingest(), valid_messages(ew.worker_id, 0)["ingest"], 5))["ref"]
    payloads_by_kind = hostile_payloads(ew.worker_id, ref, dims)
    subjects = subjects_for(s, ew.worker_id)
    rss_before = rss_bytes(os.getpid()) or 0
    for kind, blobs in payloads_by_kind.items():
        await fuzz_subject(nc, subjects[kind], f"hostile_{kind}", blobs, snapshot, report, timeout=30)
    await hostile_chunks(nc, subjects["ps_lookup"], report)
    wide = {"v": WIRE_VERSION, "version": 1, "groups": [{"ids": array_to_wire(np.arange(1, 11, dtype=np.uint64)),
                                                         "rows": array_to_wire(np.ones((10, 10**6), np.float32))}]}
    await nc.publish(s.hot_rows(0), pack(wide))  # 40 MB of rows 10^6 wide, to a job without hot rows
    await nc.flush()
    for kind in payloads_by_kind:
        if kind != "ingest" and report.accepted[f"hostile_{kind}"]:
            report.failures.append(f"hostile_{kind}: {report.accepted[f'hostile_{kind}']} accepted")
    figures = {"ew_buffer_bytes": ew.ids.nbytes + ew.pending.nbytes, "ew_buffer_bound": 2 * HOSTILE_EW_BUFFER_BYTES,
               "ps_tables_outside_dims": sum(len(set(ps.store.tables) - set(dims)) for ps in pss),
               "ps_chunk_bytes_held": sum(ps.rpc._assembler.reserved_bytes for ps in pss),
               "nn_hot_row_bytes": rt.hot.mirror.nbytes, "rss_growth": (rss_bytes(os.getpid()) or 0) - rss_before,
               "checkpoint_dirs_made": _remove_counting(root)}
    for ps in pss:
        ps.checkpoint_root = None
    if figures["ew_buffer_bytes"] > figures["ew_buffer_bound"] or figures["ps_tables_outside_dims"] \
            or figures["ps_chunk_bytes_held"] > 64 or figures["nn_hot_row_bytes"] or figures["checkpoint_dirs_made"]:
        report.failures.append(f"memory beyond its bounds: {figures}")
    return figures
