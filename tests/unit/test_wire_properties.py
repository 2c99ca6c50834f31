"""Property-based fuzzing (hypothesis) of every decoder that reads untrusted maps.

Whatever arrives, a decoder either returns a message or raises BadRequest / PayloadTooLarge (which
the RPC layer turns into a 400 / 413 reply): never another exception, which would be a 500 and a
bug. The maps are random msgpack values, and valid messages with one field replaced by a random
value, which reach much deeper into the validation than random maps alone.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from persia_nats.common.codec import WIRE_VERSION, unpack_message
from persia_nats.common.errors import BadRequest, PayloadTooLarge
from persia_nats.common.messages import (
    BatchRef,
    GradRequest,
    IngestRequest,
    NamedArray,
    NNBatch,
    SlotGradient,
    StreamAck,
    StreamBatch,
)

from tests.fuzzing import _feature

EXAMPLES = 1500
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))

arrays = st.fixed_dictionaries({
    "dtype": st.sampled_from(["<f4", "<f2", "<f8", "<u8", "<i4", "<i8", "|b1", "|u1", "<c8", "x", ""]),
    # zeros next to huge dimensions: a zero-size array whose shape overflows numpy's index type
    "shape": st.lists(st.integers(-2, 6) | st.sampled_from([0, 2**31, 2**62, 2**64 - 1]), max_size=9),
    "data": st.binary(max_size=96),
})
scalars = (st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats(allow_nan=True)
           | st.text(max_size=12) | st.binary(max_size=24))
values = st.recursive(scalars | arrays, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)

ACK = "$JS.ACK.PERSIA_j.loaders.1.7.7.1700000000000000000.0"
LABELS = (NamedArray("y", np.zeros((2, 1), np.float32)),)
FEATURES = (_feature("a", [[1, 2], [3]]), _feature("r", [[7], []]))
SEEDS = {
    "stream_batch": (StreamBatch.from_wire, StreamBatch(FEATURES, (NamedArray("x", np.ones((2, 3), np.float32)),),
                                                        LABELS).to_wire()),
    "nn_batch": (NNBatch.from_wire, NNBatch(5, 2, BatchRef("w-1", 3), labels=LABELS,
                                            ack=StreamAck(ACK, 5, 1, 60.0)).to_wire()),
    "ingest": (IngestRequest.from_wire, IngestRequest(FEATURES).to_wire()),
    # a single-id slot (no lengths on the wire) beside a jagged one, and a wait
    "ingest_single": (IngestRequest.from_wire, IngestRequest((_feature("s", [[4], [5]]), FEATURES[1]),
                                                             wait=15.0).to_wire()),
    "grad": (GradRequest.from_wire, GradRequest(3, (SlotGradient("a", np.ones((2, 4), np.float16)),)).to_wire()),
    "ack": (StreamAck.from_wire, StreamAck(ACK, 5, 2, 30.0).to_wire()),
}


def _decode(kind: str, obj: object) -> None:
    decode = SEEDS[kind][0]
    try:
        msg = unpack_message(msgpack.packb(obj, use_bin_type=True))
        decode(msg)
    except (BadRequest, PayloadTooLarge):
        pass


def _replace(seed: object, path: list[int | str], value: object) -> object:
    """A copy of ``seed`` with the value at the first reachable step of ``path`` replaced."""
    if isinstance(seed, dict) and seed:
        keys = sorted(seed)
        key = keys[path[0] % len(keys)] if isinstance(path[0], int) else path[0]
        out = dict(seed)
        out[key] = _replace(seed.get(key), path[1:], value) if len(path) > 1 else value
        return out
    if isinstance(seed, list) and seed:
        i = path[0] % len(seed) if isinstance(path[0], int) else 0
        out = list(seed)
        out[i] = _replace(seed[i], path[1:], value) if len(path) > 1 else value
        return out
    return value


@SETTINGS
@given(kind=st.sampled_from(sorted(SEEDS)), obj=values)
def test_random_maps_are_refused_cleanly(kind, obj):
    _decode(kind, {"v": WIRE_VERSION, **obj} if isinstance(obj, dict) else obj)


@SETTINGS
@given(kind=st.sampled_from(sorted(SEEDS)), path=st.lists(st.integers(0, 8) | st.text(max_size=6), min_size=1,
                                                          max_size=5), value=values)
def test_valid_messages_with_one_field_replaced_are_refused_cleanly(kind, path, value):
    seed = SEEDS[kind][1]
    mutated = _replace(seed, path, value)
    if isinstance(mutated, dict):
        mutated.setdefault("v", WIRE_VERSION)
    _decode(kind, mutated)


def test_the_seeds_themselves_decode():
    for decode, seed in SEEDS.values():
        decode(unpack_message(msgpack.packb({"v": WIRE_VERSION, **seed}, use_bin_type=True)))


@pytest.mark.parametrize("loss_scale", [1e-320, 0.0, 1e-39, 1e39, float("inf"), float("nan"), -1.0, True])
def test_a_loss_scale_outside_float32s_normal_range_is_refused(loss_scale):
    with pytest.raises(BadRequest, match="loss_scale"):
        GradRequest.from_wire(unpack_message(msgpack.packb({**SEEDS["grad"][1], "loss_scale": loss_scale},
                                                           use_bin_type=True)))


def test_zero_size_arrays_with_overflowing_shapes_are_refused_by_every_decoder():
    empty = {"dtype": "<f4", "shape": [0, 2**62], "data": b""}
    for kind, path in [("stream_batch", ["non_id", 0, "data"]), ("nn_batch", ["labels", 0, "data"]),
                       ("grad", ["grads", 0, "grad"])]:
        bad = _replace(SEEDS[kind][1], path, empty)
        with pytest.raises(BadRequest, match="more than a message can hold"):
            SEEDS[kind][0](unpack_message(msgpack.packb({"v": WIRE_VERSION, **bad}, use_bin_type=True)))
