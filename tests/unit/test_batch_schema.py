"""The job's batch schema (persia_nats.common.batch.BatchSchema): every slot, and dense features and labels by name."""

from __future__ import annotations

import numpy as np
import pytest
from persia_nats.common.batch import BatchSchema
from persia_nats.common.config import global_config_from_dict
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import NamedArray


def arr(name, shape=(4, 5), dtype=np.float32):
    return NamedArray(name, np.zeros(shape, dtype))


DENSE = [arr("continuous"), arr("extra", (4, 2))]
LABELS = [arr("y", (4, 1))]


def test_a_trained_batch_fixes_the_schema_and_later_ones_must_match():
    schema = BatchSchema()
    assert schema.admit(DENSE, LABELS, True) == (tuple(DENSE), tuple(LABELS))
    assert schema.confirm(DENSE, LABELS) and schema.fixed
    with pytest.raises(BadRequest, match=r"non_id\(continuous\): <f4 \[4\] .* has <f4 \[5\]"):
        schema.admit([arr("continuous", (4, 4)), DENSE[1]], LABELS, True)
    with pytest.raises(BadRequest, match=r"non_id\(extra\): <f8 \[2\].*<f4 \[2\]"):
        schema.admit([DENSE[0], arr("extra", (4, 2), np.float64)], LABELS, True)
    with pytest.raises(BadRequest, match=r"labels\(y\): <f4 \[2\]"):
        schema.admit(DENSE, [arr("y", (4, 2))], True)
    with pytest.raises(BadRequest, match=r"non_id\(extra\): missing"):
        schema.admit(DENSE[:1], LABELS, True)
    with pytest.raises(BadRequest, match=r"non_id\(other\): not in the job's schema"):
        schema.admit([*DENSE, arr("other")], LABELS, True)
    with pytest.raises(BadRequest, match=r"non_id\(extra\): given twice"):
        schema.admit([*DENSE, DENSE[1]], LABELS, True)


def test_a_refused_first_batch_fixes_nothing():
    schema = BatchSchema()
    with pytest.raises(BadRequest, match="given twice"):
        schema.admit([DENSE[0], DENSE[0]], LABELS, True)
    assert schema.non_id is None and schema.labels is None


def test_admitting_fixes_nothing_so_a_poisoned_first_batch_cannot_decide_the_schema():
    """A batch of another width admitted first (the model then fails on it) leaves the real ones admitted."""
    schema = BatchSchema()
    poisoned = [arr("continuous", (4, 4))]
    schema.admit(poisoned, LABELS, True)
    assert not schema.fixed
    schema.admit(DENSE, LABELS, True)  # the model's shape, after all
    schema.confirm(DENSE, LABELS)  # it trained
    assert not schema.confirm(poisoned, LABELS)  # a later trained batch changes nothing
    with pytest.raises(BadRequest, match=r"non_id\(continuous\): <f4 \[4\] .* has <f4 \[5\]"):
        schema.admit(poisoned, LABELS, True)
    assert "continuous <f4 [5]" in schema.describe() and "y <f4 [1]" in schema.describe()


def test_any_order_comes_back_in_the_schemas_order():
    schema = BatchSchema()
    schema.confirm(DENSE, LABELS)
    reversed_in = [DENSE[1], DENSE[0]]
    non_id, _ = schema.admit(reversed_in, LABELS, True)
    assert [a.name for a in non_id] == ["continuous", "extra"]


def test_evaluation_batches_may_leave_labels_out_but_fix_nothing():
    schema = BatchSchema()
    assert schema.admit(DENSE, [], False) == (tuple(DENSE), ())
    assert schema.non_id is None  # only a trained batch fixes the schema
    schema.confirm(DENSE, LABELS)
    assert schema.admit(DENSE, [], False) == (tuple(DENSE), ())
    with pytest.raises(BadRequest, match=r"labels\(y\): missing"):
        schema.admit(DENSE, [], True)


def test_every_configured_slot_is_required_and_no_other():
    schema = BatchSchema(("a", "b", "c"))
    schema.check_slots(["c", "a", "b"])
    with pytest.raises(BadRequest, match=r"features: slot 'b' is missing"):
        schema.check_slots(["a", "c"])
    with pytest.raises(BadRequest, match=r"features: unknown slot 'd' \(configured: a, b, c\)"):
        schema.check_slots(["a", "b", "c", "d"])
    BatchSchema().check_slots(["anything"])  # no slots known: the embedding worker names unknown ones


def test_a_declared_schema_is_required_from_the_first_batch_in_its_order():
    cfg = global_config_from_dict({"data_loader_config": {
        "non_id_features": {"extra": {"dtype": "float32", "shape": [2]}, "continuous": {"dtype": "<f4", "shape": [5]}},
        "labels": {"y": {"dtype": "float32", "shape": [1]}}}})
    schema = BatchSchema.from_config(None, cfg.data_loader_config)
    non_id, _ = schema.admit(DENSE, LABELS, True)
    assert [a.name for a in non_id] == ["extra", "continuous"]
    with pytest.raises(BadRequest, match=r"labels\(y\): <i8 \[1\]"):
        schema.admit(DENSE, [arr("y", (4, 1), np.int64)], True)
