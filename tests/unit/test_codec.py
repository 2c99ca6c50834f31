import msgpack
import numpy as np
import pytest
from persia_nats.common.codec import (
    WIRE_VERSION,
    all_finite,
    array_from_wire,
    array_to_wire,
    pack,
    unpack,
    unpack_message,
)
from persia_nats.common.errors import BadRequest, PayloadTooLarge


@pytest.mark.parametrize("dtype", ["<f2", "<f4", "<f8", "<u8", "<i8", "<i4", "|u1", "|b1"])
def test_array_round_trip_keeps_dtype_shape_and_values(dtype):
    a = (np.arange(24) % 7).astype(dtype).reshape(2, 3, 4)
    b = array_from_wire(unpack(pack(array_to_wire(a))), "x")
    assert b.dtype == a.dtype and b.shape == a.shape
    np.testing.assert_array_equal(a, b)


def test_decoded_arrays_are_read_only_views():
    b = array_from_wire(unpack(pack(array_to_wire(np.arange(3, dtype=np.int64)))), "x")
    assert not b.flags.writeable
    with pytest.raises(ValueError):
        b[0] = 1


def test_big_endian_is_sent_little_endian():
    a = np.arange(4, dtype=">i4")
    wire = array_to_wire(a)
    assert wire["dtype"] == "<i4"
    np.testing.assert_array_equal(array_from_wire(unpack(pack(wire)), "x"), [0, 1, 2, 3])


def test_non_contiguous_and_empty_arrays():
    a = np.arange(12, dtype=np.float32).reshape(3, 4)[:, ::2]
    np.testing.assert_array_equal(array_from_wire(unpack(pack(a)), "x"), a)
    e = array_from_wire(unpack(pack(np.empty((0, 8), np.float32))), "x")
    assert e.shape == (0, 8)


def test_arrays_are_raw_bytes_not_lists():
    a = np.arange(1000, dtype=np.float32)
    assert len(pack(a)) < 4000 + 64


@pytest.mark.parametrize("bad, needle", [
    ({"dtype": "<f4", "shape": [3], "data": b"\0" * 11}, "needs 12 bytes"),
    ({"dtype": "object", "shape": [1], "data": b"x"}, "unsupported dtype"),
    ({"dtype": ">f4", "shape": [1], "data": b"\0" * 4}, "unsupported dtype"),
    ({"dtype": "<f4", "shape": [-1], "data": b""}, "shape"),
    ({"dtype": "<f4", "shape": "3", "data": b""}, "shape"),
    ({"dtype": "<f4", "shape": [True], "data": b"\0" * 4}, "shape"),
    ({"dtype": "<f4", "shape": [1], "data": "text"}, "binary"),
    ({"dtype": "<f4", "shape": [0, 2**62], "data": b""}, "more than a message can hold"),
    ({"dtype": "<u8", "shape": [2**40, 0], "data": b""}, "more than a message can hold"),
    ({"dtype": "|u1", "shape": [0, 2**20, 2**20], "data": b""}, "more than a message can hold"),
    ({"shape": [1], "data": b""}, "lacks 'dtype'"),
    ([1, 2, 3], "array map"),
])
def test_malformed_array_maps_raise_bad_request_naming_the_field(bad, needle):
    with pytest.raises(BadRequest, match=needle) as info:
        array_from_wire(bad, "features[0].values")
    assert "features[0].values" in str(info.value)


def test_empty_arrays_with_sane_dimensions_still_decode():
    assert array_from_wire(array_to_wire(np.empty((0, 1 << 20), np.float32)), "x").shape == (0, 1 << 20)


def test_dtype_and_ndim_constraints():
    wire = unpack(pack(np.zeros(3, np.int64)))
    with pytest.raises(BadRequest, match="dtype must be <u8"):
        array_from_wire(wire, "ids", dtype="<u8")
    with pytest.raises(BadRequest, match="expected 2 dimensions"):
        array_from_wire(wire, "ids", ndim=2)


def test_size_limit_checked_before_decoding():
    with pytest.raises(PayloadTooLarge):
        unpack(b"\x90" * 101, max_bytes=100)


@pytest.mark.parametrize("data", [b"", b"\xc1", b"\x92\x01", b"\xdd\xff\xff\xff\xff", b"\x81\x01\x02"])
def test_garbage_is_bad_request(data):
    with pytest.raises(BadRequest):
        unpack(data)


def test_a_claimed_huge_container_does_not_allocate():
    # an array header claiming 2^32-1 items in a 5-byte message
    with pytest.raises(BadRequest):
        unpack(b"\xdd\xff\xff\xff\xff")


def test_messages_need_a_map_with_a_known_version():
    assert unpack_message(pack({"v": WIRE_VERSION, "x": 1}))["x"] == 1
    with pytest.raises(BadRequest, match="version"):
        unpack_message(pack({"v": 99}))
    for lookalike in (True, 1.0):  # equal to 1 in Python, but not the integer the wire defines
        with pytest.raises(BadRequest, match="version"):
            unpack_message(pack({"v": lookalike}))
    with pytest.raises(BadRequest, match="must be a map"):
        unpack_message(pack([1]))
    with pytest.raises(BadRequest):
        unpack_message(msgpack.packb({1: 2}))  # non-str keys are refused (strict_map_key)


def test_all_finite_reads_every_float16_bit_pattern_as_numpy_does():
    every = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = every[np.isfinite(every)]
    assert all_finite(finite) and all_finite(finite[::7]) and all_finite(np.zeros((0, 16), np.float16))
    bad = every[~np.isfinite(every)]
    assert bad.size == 2048  # an all-ones exponent: Inf and every NaN, of both signs
    for value in bad:  # each one alone among finite values, in a 2-D array as gradients come
        assert not all_finite(np.concatenate([finite[:50], [value], finite[50:63]]).reshape(8, 8))
    for dtype in (np.float32, np.float64):
        assert all_finite(finite.astype(dtype)) and not all_finite(np.array([1.0, np.nan], dtype))
