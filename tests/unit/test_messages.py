"""The typed messages: the bytes they send are the maps the project sent before (clients in other
languages depend on them), they decode back to themselves, and a bad field is named."""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from persia_nats.common import messages as m
from persia_nats.common.codec import array_to_wire, pack, unpack, unpack_message
from persia_nats.common.errors import BadRequest
from persia_nats.common.optim_config import AdagradConfig, EmbeddingHyperparams, hyperparams_to_wire, to_wire

ROOT = Path(__file__).resolve().parents[2]
U64 = np.array([3, 17], np.uint64)
ROWS = np.arange(8, dtype=np.float32).reshape(2, 4)


def wire(obj: Any) -> Any:
    """What a peer decodes: packed and unpacked, so arrays compare as their dtype, shape and bytes."""
    return unpack(pack(obj))


# each message next to the map the project built by hand for it before the types existed
GOLDEN = [
    (m.PsLookup((m.PsLookupGroup(4, U64),), train=True),
     {"v": 1, "train": True, "groups": [{"dim": 4, "ids": array_to_wire(U64)}]}),
    (m.PsLookupReply((ROWS,), 42), {"v": 1, "groups": [array_to_wire(ROWS)], "version": 42}),
    (m.PsUpdate((m.PsUpdateGroup(U64, ROWS, np.array([1], np.int64)),), "w.1.ab", batch="w.1"),
     {"v": 1, "update_id": "w.1.ab", "groups": [{"ids": array_to_wire(U64), "grads": array_to_wire(ROWS),
                                                 "publish": array_to_wire(np.array([1], np.int64))}],
      "batch": "w.1"}),
    (m.PsUpdate((m.PsUpdateGroup(U64, ROWS),)),
     {"v": 1, "update_id": None, "groups": [{"ids": array_to_wire(U64), "grads": array_to_wire(ROWS)}]}),
    # scaled float16 gradients never travel as "grads": a replica that knows no scale refuses them
    (m.PsUpdate((m.PsUpdateGroup(U64, ROWS.astype(np.float16), scale=2.0 ** 20),)),
     {"v": 1, "update_id": None, "groups": [{"ids": array_to_wire(U64),
                                             "scaled_grads": array_to_wire(ROWS.astype(np.float16)),
                                             "scale": 2.0 ** 20}]}),
    (m.PsLookup((m.PsLookupGroup(4, U64, half=True),)),
     {"v": 1, "train": False, "groups": [{"dim": 4, "ids": array_to_wire(U64), "half": True}]}),
    (m.PsLookupReply((ROWS.astype(np.float16),), 42),
     {"v": 1, "groups": [array_to_wire(ROWS.astype(np.float16))], "version": 42}),
    (m.PsUpdateReply(3), {"v": 1, "missing": 3}),
    (m.PsUpdateReply(0, duplicate=True), {"v": 1, "missing": 0, "duplicate": True}),
    (m.PsConfigure(dims=(4, 8)), {"v": 1, "dims": [4, 8]}),
    (m.PsConfigure(AdagradConfig(lr=0.1), EmbeddingHyperparams()),
     {"v": 1, "optimizer": to_wire(AdagradConfig(lr=0.1)), "hyper": hyperparams_to_wire(EmbeddingHyperparams())}),
    (m.PsCheckpoint("dump", "/r/ckpt-00000001.partial"),
     {"v": 1, "action": "dump", "dir": "/r/ckpt-00000001.partial"}),
    (m.PsCheckpointReply(5, files={"a": {"size": 1, "sha256": "0" * 64}}),
     {"v": 1, "rows": 5, "files": {"a": {"size": 1, "sha256": "0" * 64}}}),
    (m.PsCheckpointReply(5, checkpoint="ckpt-00000001"), {"v": 1, "rows": 5, "checkpoint": "ckpt-00000001"}),
    (m.PsInfoReply(0, 2, True, {"rows": 1}, "ckpt-00000001"),
     {"v": 1, "replica_index": 0, "replica_size": 2, "configured": True, "loaded_checkpoint": "ckpt-00000001",
      "stats": {"rows": 1}, "ready": True, "waiting_for": ""}),
    (m.PsInfoReply(1, 2, False, {}, "", False, "the load of checkpoint ckpt-00000001"),
     {"v": 1, "replica_index": 1, "replica_size": 2, "configured": False, "loaded_checkpoint": "",
      "stats": {}, "ready": False, "waiting_for": "the load of checkpoint ckpt-00000001"}),
    (m.IngestReply("w-1", 7), {"v": 1, "worker": "w-1", "ref": 7}),
    (m.EwLookup(7, train=False, hot=False), {"v": 1, "ref": 7, "train": False, "hot": False}),
    (m.EwLookupReply(7, (m.SlotEmbedding("a", ROWS.astype(np.float16)),)),
     {"v": 1, "ref": 7, "embeddings": [{"name": "a", "emb": array_to_wire(ROWS.astype(np.float16))}]}),
    (m.LookupDirectReply((m.SlotEmbedding("a", ROWS),)),
     {"v": 1, "embeddings": [{"name": "a", "emb": array_to_wire(ROWS)}]}),
    (m.GradReply(7, ("b",), 2), {"v": 1, "ref": 7, "skipped": ["b"], "missing": 2}),
    (m.HotRows(1, 99, "w.7", (m.HotRowsGroup(U64, ROWS, ROWS[:, :1], np.array([5], np.uint64)),)),
     {"v": 1, "replica": 1, "version": 99, "update_id": "w.7", "groups": [
         {"ids": array_to_wire(U64), "rows": array_to_wire(ROWS), "state": array_to_wire(ROWS[:, :1]),
          "gone": array_to_wire(np.array([5], np.uint64))}]}),
    (m.HotGrads("w.7", 1, 3, (m.HotGradsGroup(4, U64, ROWS),)),
     {"v": 1, "update_id": "w.7", "rank": 1, "seq": 3, "groups": [
         {"dim": 4, "ids": array_to_wire(U64), "grads": array_to_wire(ROWS)}]}),
    (m.NNEnd(0, 2, 255), {"v": 1, "loader_index": 0, "loader_size": 2, "batches": 255}),
    (m.NNEnd(final=True), {"v": 1, "final": True}),
    (m.NNInfoReply(2, 1), {"v": 1, "world_size": 2, "rank": 1, "ready": True}),
    (m.NNInfoReply(2, 0, False), {"v": 1, "world_size": 2, "rank": 0, "ready": False}),
    (m.RendezvousRequest(1), {"v": 1, "rank": 1}),
    (m.RendezvousReply("10.0.0.1", 29500, 2), {"v": 1, "addr": "10.0.0.1", "port": 29500, "world_size": 2}),
    (m.NNCheckpointReply("/c/ckpt-00000002"), {"v": 1, "checkpoint": "/c/ckpt-00000002"}),
    (m.TrainedNotice(4, 9, 0, 1, True), {"v": 1, "seq": 4, "batch_id": 9, "rank": 0, "delivered": 1, "trained": True}),
    (m.Empty(), {"v": 1}),
    (m.Ok(), {"v": 1, "ok": True}),
    (m.StatusReply("nn-worker", 0, "nn-0", {"batches": 3}),
     {"v": 1, "role": "nn-worker", "replica": 0, "instance": "nn-0", "stats": {"batches": 3}}),
    (m.PredictReply(ROWS, "ckpt-00000003"),
     {"v": 1, "predictions": array_to_wire(ROWS), "checkpoint": "ckpt-00000003"}),
    (m.StreamEnd(), {"v": 1, "end": True}),
]


@pytest.mark.parametrize(("msg", "before"), GOLDEN, ids=[f"{type(g[0]).__name__}-{i}" for i, g in enumerate(GOLDEN)])
def test_the_wire_is_the_map_sent_before_and_decodes_back(msg, before):
    sent = msg.to_wire()
    assert wire(sent) == wire(before)
    assert next(iter(sent)) == "v" and type(sent["v"]) is int
    back = type(msg).from_wire(unpack_message(pack(sent)))
    assert wire(back.to_wire()) == wire(before)


@pytest.mark.parametrize(("cls", "obj", "missing"), [
    (m.PsInfoReply, {"v": 1, "replica_index": 0, "replica_size": 1, "configured": True, "stats": {},
                     "loaded_checkpoint": "", "waiting_for": ""}, "ready"),
    (m.NNInfoReply, {"v": 1, "world_size": 2, "rank": 1}, "ready"),
    (m.PsLookupReply, {"v": 1, "groups": []}, "version"),
    (m.PsUpdateReply, {"v": 1}, "missing"),
    (m.GradReply, {"v": 1, "ref": 3, "skipped": []}, "missing"),
    (m.Ok, {"v": 1}, "ok"),
])
def test_a_reply_without_a_field_every_sender_includes_is_refused(cls, obj, missing):
    # a reply without ready would read as ready, one without version as older than every copy: refused, named
    with pytest.raises(BadRequest, match=f"missing field {missing!r}"):
        cls.from_wire(obj)


def test_every_message_type_is_in_the_golden_table_or_the_older_tests():
    # the batch messages predate this table and have their own tests (test_batch, test_wire_properties)
    older = {m.IngestRequest, m.NNBatch, m.StreamBatch, m.GradRequest, m.PredictRequest, m.InfoReply}
    types = {t for t in vars(m).values() if isinstance(t, type) and issubclass(t, m.Message) and t is not m.Message}
    assert types - older - {type(g[0]) for g in GOLDEN} == set()


@pytest.mark.parametrize(("cls", "obj", "field"), [
    (m.PsLookup, {"train": "yes", "groups": []}, "train"),
    (m.PsLookup, {"groups": "all"}, "groups"),
    (m.PsLookup, {"groups": [{"dim": 0, "ids": array_to_wire(U64)}]}, "groups[0].dim"),
    (m.PsLookup, {"groups": [{"dim": 4, "ids": array_to_wire(U64.astype(np.int64))}]}, "groups[0].ids"),
    (m.PsUpdate, {"update_id": 5, "groups": []}, "update_id"),
    (m.PsUpdate, {"batch": "x" * 300, "groups": []}, "batch"),
    (m.PsUpdate, {"groups": [{"ids": array_to_wire(U64), "grads": array_to_wire(ROWS[:1])}]}, "groups[0]"),
    (m.PsUpdate, {"groups": [{"ids": array_to_wire(U64), "grads": array_to_wire(ROWS * np.nan)}]},
     "groups[0].grads"),
    # float16 as the embedding worker sends them, read by their bits: an Inf, a NaN
    *[(m.PsUpdate, {"groups": [{"ids": array_to_wire(U64), "scaled_grads": array_to_wire(bad), "scale": 4.0}]},
       "groups[0].scaled_grads: non-finite") for bad in (np.where(ROWS == 5, np.inf, ROWS).astype(np.float16),
                                                         np.where(ROWS == 2, np.nan, ROWS).astype(np.float16))],
    (m.PsUpdate, {"groups": [{"ids": array_to_wire(U64), "grads": array_to_wire(ROWS),
                              "publish": array_to_wire(np.array([2], np.int64))}]}, "groups[0].publish"),
    (m.PsLookup, {"groups": [{"dim": 4, "ids": array_to_wire(U64), "half": 1}]}, "groups[0].half"),
    *[(m.PsUpdate, {"groups": [{"ids": array_to_wire(U64), "scaled_grads": array_to_wire(ROWS), "scale": scale}]},
       "groups[0].scale") for scale in (3.0, 0.0, -2.0, float("nan"), 2.0 ** 101, True, "2")],
    (m.PsUpdate, {"groups": [{"ids": array_to_wire(U64), "scaled_grads": array_to_wire(ROWS)}]}, "scale"),
    (m.PsUpdate, {"groups": [{"ids": array_to_wire(U64), "scaled_grads": array_to_wire(ROWS), "scale": 2.0,
                              "grads": array_to_wire(ROWS)}]}, "both grads and scaled_grads"),
    (m.PsConfigure, {"optimizer": {"type": "sgdx", "lr": 1}}, "sgdx"),
    (m.PsConfigure, {"dims": [0]}, "dims"),
    (m.PsCheckpoint, {"action": "wipe", "dir": "x"}, "action"),
    (m.PsCheckpoint, {"action": "load", "dir": ""}, "dir"),
    (m.EwLookup, {"ref": "7"}, "ref"),
    (m.EwLookup, {"ref": 7, "train": 1}, "train"),
    (m.EwLookup, {"ref": 7, "hot": "no"}, "hot"),
    (m.NNEnd, {"final": "yes"}, "final"),
    (m.NNEnd, {"loader_index": 2, "loader_size": 2, "batches": 1}, "loader_index"),
    (m.NNEnd, {"loader_index": 0, "loader_size": True, "batches": 1}, "loader_size"),
    (m.RendezvousRequest, {}, "rank"),
    (m.HotRows, {"version": "3", "groups": []}, "version"),
    (m.HotGrads, {"update_id": "x", "rank": 1, "seq": 1, "groups": [{"dim": 3, "ids": None}]}, "groups[0]"),
    (m.StreamEnd, {"end": 1}, "end"),
])
def test_a_bad_field_is_refused_by_name(cls, obj, field):
    with pytest.raises(BadRequest, match=field.replace("[", r"\[").replace("]", r"\]")):
        cls.from_wire(wire(obj))


@pytest.mark.parametrize("version", [True, 1.0, 2, None, "1"])
def test_only_the_integer_version_is_accepted(version):
    with pytest.raises(BadRequest, match="version"):
        unpack_message(pack({**m.Empty().to_wire(), "v": version}))


def test_messages_are_frozen_dataclasses():
    for t in vars(m).values():
        if isinstance(t, type) and issubclass(t, m.Message) and t is not m.Message:
            assert dataclasses.is_dataclass(t) and t.__dataclass_params__.frozen, t.__name__


def _rpc_adds(path: Path) -> list[ast.Call]:
    """``x.rpc.add(...)`` and ``rpc.add(...)`` (an owner handed the service's RPC server)."""
    tree = ast.parse(path.read_text(), str(path))
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr == "add" and (isinstance(n.func.value, ast.Attribute) and n.func.value.attr == "rpc"
                                          or isinstance(n.func.value, ast.Name) and n.func.value.id == "rpc")]


def test_every_served_subject_decodes_into_a_message_type():
    """Handlers get typed requests: no handler of a role is handed a raw map to parse by hand."""
    raw, found = [], 0
    for folder in ("common", "services", "persia"):
        for path in (ROOT / folder).rglob("*.py"):
            for call in _rpc_adds(path):
                found += 1
                request = next((k.value for k in call.keywords if k.arg == "request"), None)
                if not isinstance(request, ast.Name) or request.id == "None":
                    raw.append(f"{path.relative_to(ROOT)}:{call.lineno}")
    assert found >= 20 and not raw, raw


# -- slots with one id per sample travel without lengths -----------------------------------------------

def _feature(name: str, values: list[int], lengths: list[int]) -> m.IdFeature:
    return m.IdFeature(name, np.asarray(values, np.uint64), np.asarray(lengths, np.int32))


def test_a_single_id_slot_leaves_lengths_out_and_decodes_to_the_same_batch():
    single, jagged = _feature("a", [5, 6, 7], [1, 1, 1]), _feature("b", [5, 6, 7], [2, 0, 1])
    sent = m.IngestRequest((single, jagged)).to_wire()
    assert "lengths" not in sent["features"][0] and "lengths" in sent["features"][1]
    back = m.IngestRequest.from_wire(unpack_message(pack(sent)))
    assert back.batch_size == 3
    assert back.features[0].lengths.tolist() == [1, 1, 1] and back.features[0].lengths.dtype == np.int32
    assert back.features[0].single and not back.features[1].single
    assert back.features[1].lengths.tolist() == [2, 0, 1]
    # the decoded form is read-only like every decoded array: nobody can change another batch's lengths
    assert not back.features[0].lengths.flags.writeable


def test_single_id_slots_are_what_the_persia_api_sends():
    from persia_nats.common.batch import IDTypeFeature, IDTypeFeatureWithSingleID, Label, PersiaBatch

    ids = np.arange(4, dtype=np.uint64)
    batch = PersiaBatch([IDTypeFeatureWithSingleID("a", ids), IDTypeFeature("b", [ids[i:i + 1] for i in range(4)]),
                         IDTypeFeature("c", [ids[:2], ids[:0], ids[:1], ids[:1]])],
                        labels=[Label(np.zeros(4, np.float32))])
    features = batch.ingest_request().to_wire()["features"]
    assert ["lengths" in f for f in features] == [False, False, True]
    # the bytes saved are exactly the int32 lengths of the two single-id slots
    with_lengths = [{**f.to_wire(), "lengths": array_to_wire(f.lengths)} for f in batch.ingest_request().features]
    assert len(pack(with_lengths)) - len(pack(features)) >= 2 * (4 * 4)


@pytest.mark.parametrize(("features", "needle"), [
    # the single-id slot with one value too few is the one named, whichever slot comes first
    ([{"name": "a", "values": array_to_wire(np.arange(3, dtype=np.uint64))},
      _feature("b", [1, 2, 3, 4], [1, 1, 1, 1]).to_wire() | {"lengths": array_to_wire(np.ones(4, np.int32))}],
     r"features\[0\]\(a\): 3 values \(one id per sample: no lengths\), but the batch size is 4"),
    ([_feature("b", [1, 2], [2, 0, 0, 0]).to_wire(),
      {"name": "a", "values": array_to_wire(np.arange(5, dtype=np.uint64))}],
     r"features\[1\]\(a\): 5 values .* batch size is 4"),
    # no slot has lengths: most slots set the batch size, the odd one is named
    ([{"name": n, "values": array_to_wire(np.arange(k, dtype=np.uint64))} for n, k in (("a", 4), ("b", 3), ("c", 4))],
     r"features\[1\]\(b\): 3 values .* batch size is 4"),
    # a nil lengths is the single-id form too, and a missing or wrong values still says so
    ([{"name": "a", "lengths": None}], r"features\[0\]\(a\)\.values"),
    ([{"name": "a", "values": array_to_wire(np.arange(2, dtype=np.int64))}], r"features\[0\]\(a\)\.values: dtype"),
    ([{"name": "a", "values": array_to_wire(np.arange(2, dtype=np.uint64)), "lengths": "ones"}],
     r"features\[0\]\(a\)\.lengths"),
])
def test_a_single_id_slot_is_checked_as_strictly(features, needle):
    with pytest.raises(BadRequest, match=needle):
        m.IngestRequest.from_wire(unpack_message(pack({"v": 1, "features": features})))


def test_a_single_id_batch_above_the_batch_limit_is_refused_before_its_lengths_are_made():
    from persia_nats.common.messages import batches

    big = {"name": "a", "values": array_to_wire(np.zeros(m.MAX_BATCH_SIZE + 1, np.uint64))}
    batches.single_lengths.cache_clear()
    with pytest.raises(BadRequest, match=r"features\[0\]\(a\): 65536 values without lengths .* \(65535\)"):
        m.IngestRequest.from_wire(unpack_message(pack({"v": 1, "features": [big]})))
    # nothing the size of a hostile message was made (or kept in the cache)
    assert batches.single_lengths.cache_info().misses == 0
