"""PersiaBatch and the jagged id form, validated as PERSIA documents (minus its defects)."""

import numpy as np
import pytest
from persia_nats.common.batch import IDTypeFeature, IDTypeFeatureWithSingleID, Label, NonIDTypeFeature, PersiaBatch
from persia_nats.common.codec import pack, unpack
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import IdFeature, IngestRequest, NNBatch, id_features_from_wire


def u64(*x):
    return np.array(x, dtype=np.uint64)


def test_id_type_feature_is_stored_jagged_with_empty_samples():
    f = IDTypeFeature("user", [u64(1000, 1001), u64(1000), u64(), u64(1000, 1001, 1024)])
    assert f.batch_size == 4
    assert f.jagged.values.tolist() == [1000, 1001, 1000, 1000, 1001, 1024]
    assert f.jagged.lengths.tolist() == [2, 1, 0, 3]
    assert f.jagged.lengths.dtype == np.int32


def test_every_sample_is_checked_for_uint64():
    # PERSIA's per-element check was a generator that never ran; this one does
    with pytest.raises(TypeError, match="sample 2 must be a 1-D np.uint64"):
        IDTypeFeature("user", [u64(1), u64(2), np.array([3], np.int64)])
    with pytest.raises(TypeError, match="sample 0"):
        IDTypeFeature("user", [[1, 2]])
    with pytest.raises(TypeError, match="1-D np.uint64"):
        IDTypeFeatureWithSingleID("user", np.array([1, 2], np.int64))


def test_single_id_feature_and_from_jagged():
    f = IDTypeFeatureWithSingleID("item", u64(5, 6, 7))
    assert f.jagged.lengths.tolist() == [1, 1, 1]
    g = IDTypeFeature.from_jagged("item", u64(1, 2, 3), np.array([2, 0, 1]))
    assert g.batch_size == 3
    with pytest.raises(ValueError, match="sum to len"):
        IDTypeFeature.from_jagged("item", u64(1, 2, 3), np.array([2, 0, 2]))


def test_ndarray_features_accept_documented_dtypes_and_refuse_others():
    for dtype in (np.bool_, np.int8, np.int64, np.uint8, np.float16, np.float32, np.float64):
        NonIDTypeFeature(np.zeros((2, 3), dtype))
    with pytest.raises(TypeError, match="not supported"):
        NonIDTypeFeature(np.zeros(2, np.complex64))
    with pytest.raises(ValueError, match="at least one dimension"):
        Label(np.array(1.0, np.float32))
    assert NonIDTypeFeature(np.zeros(2)).name == "non_id_type_feature_anonymous"
    assert Label(np.zeros(2)).name == "label_anonymous"


def test_persia_batch_validation():
    ids = [IDTypeFeatureWithSingleID("a", u64(1, 2))]
    lab = [Label(np.zeros((2, 1), np.float32))]
    with pytest.raises(RuntimeError, match="requires_grad=True needs at least one Label"):
        PersiaBatch(ids)
    PersiaBatch(ids, requires_grad=False)
    with pytest.raises(ValueError, match="batch size mismatch"):
        PersiaBatch(ids, [NonIDTypeFeature(np.zeros((3, 1)))], lab)
    with pytest.raises(ValueError, match="at least one id type feature"):
        PersiaBatch([], labels=lab)
    with pytest.raises(ValueError, match="duplicate"):
        PersiaBatch(ids * 2, labels=lab)
    big = [IDTypeFeatureWithSingleID("a", np.zeros(65536, np.uint64))]
    with pytest.raises(ValueError, match="exceeds the maximum 65535"):
        PersiaBatch(big, requires_grad=False)
    with pytest.raises(TypeError, match="meta"):
        PersiaBatch(ids, labels=lab, meta="text")


def test_batch_becomes_wire_messages_and_back():
    b = PersiaBatch([IDTypeFeature("a", [u64(1, 2), u64()])], [NonIDTypeFeature(np.ones((2, 3), np.float32), "d")],
                    [Label(np.array([[1.0], [0.0]], np.float32), "y")], meta=b"m")
    req = IngestRequest.from_wire(unpack(pack(b.ingest_request().to_wire())))
    assert req.features[0].values.tolist() == [1, 2] and req.features[0].lengths.tolist() == [2, 0]
    from persia_nats.common.messages import BatchRef

    msg = NNBatch(7, 2, BatchRef("w", 3), b.non_id_wire(), b.labels_wire(), True, b.meta)
    back = NNBatch.from_wire(unpack(pack(msg.to_wire())))
    assert back.batch_id == 7 and back.ref == BatchRef("w", 3) and back.meta == b"m"
    assert back.labels[0].data.tolist() == [[1.0], [0.0]]


def wire_feature(name, values, lengths):
    return IdFeature(name, np.asarray(values, np.uint64), np.asarray(lengths, np.int32)).to_wire()


@pytest.mark.parametrize("features, needle", [
    ([], "non-empty list"),
    ([wire_feature("a", [1], [1]), wire_feature("a", [1], [1])], "duplicate feature names"),
    ([wire_feature("a", [1], [1]), wire_feature("b", [1, 2], [1, 1])], "disagree on batch size"),
    ([wire_feature("a", [1, 2], [1])], "lengths sum to 1 but there are 2 values"),
    ([{"name": "", "values": None, "lengths": None}], "name"),
    ([{"name": 3}], "expected str"),
])
def test_jagged_features_from_the_wire_are_validated(features, needle):
    with pytest.raises(BadRequest, match=needle):
        id_features_from_wire(unpack(pack(features)))


def test_nn_batch_needs_labels_when_training_and_matching_batch_dims():
    base = {"v": 1, "batch_id": 1, "batch_size": 2, "ref": {"worker": "w", "ref": 1}}
    with pytest.raises(BadRequest, match="needs at least one label"):
        NNBatch.from_wire(base)
    bad = dict(base, labels=[{"name": "y", "data": np.zeros(3, np.float32)}])
    with pytest.raises(BadRequest, match="batch dimension 3 != batch_size 2"):
        NNBatch.from_wire(unpack(pack(bad)))
    with pytest.raises(BadRequest, match="batch_size"):
        NNBatch.from_wire(dict(base, batch_size=70000))


def test_batch_refs_with_a_bad_worker_id_are_bad_requests():
    from persia_nats.common.messages import BatchRef

    with pytest.raises(BadRequest, match="worker id"):
        BatchRef.from_wire({"worker": "a.b*", "ref": 1})
    assert BatchRef.from_wire({"worker": "0-abc", "ref": 1}) == BatchRef("0-abc", 1)
