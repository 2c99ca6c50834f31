"""What every wire message shares: the envelope, the base class and the field readers.

A message is a frozen dataclass whose :meth:`Message.body` is the map it sends without ``v``;
:meth:`Message.to_wire` wraps it with :func:`envelope`, the one place the version is written. The
version is checked in one place too, on decode (:func:`persia_nats.common.codec.unpack_message`), so
``from_wire`` gets a map whose ``v`` is already known good.

The readers below name the field that is wrong in the :class:`BadRequest` they raise; ``where``
is the path of the map being read (``"groups[2]"``), so a nested error reads ``groups[2].ids: ...``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import field
from typing import Any, ClassVar, Self, TypeGuard

from persia_nats.common.codec import WIRE_VERSION
from persia_nats.common.errors import BadRequest

#: PERSIA's limit: one batch holds at most this many samples.
MAX_BATCH_SIZE = 65535
MAX_NAME_LEN = 256
TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


def envelope(body: Mapping[str, Any]) -> dict[str, Any]:
    """The map a message body travels as: ``v`` first, then the body's fields."""
    return {"v": WIRE_VERSION, **body}


class Message:
    """Base of every request and reply body: ``to_wire`` adds the envelope to :meth:`body`.

    ``from_wire`` takes the decoded map (``v`` already checked) and raises :class:`BadRequest`
    naming the first field that is wrong; unknown fields are ignored, so a newer peer may add some.
    """

    __slots__ = ()

    #: where the message goes (a heading of docs/protocol.md), and ``kind``: the request or the reply
    subject: ClassVar[str] = ""
    kind: ClassVar[str] = "request"

    def body(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_wire(self) -> dict[str, Any]:
        return envelope(self.body())

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> Self:
        raise NotImplementedError


def always_sent(default: Any = None, factory: Any = None) -> Any:
    """A field every sender includes, though its type gives it a default for constructors: decoders
    require it, and docs/protocol.md lists it as required."""
    if factory is not None:
        return field(default_factory=factory, metadata={"always_sent": True})
    return field(default=default, metadata={"always_sent": True})


def is_int(value: Any) -> TypeGuard[int]:
    """An msgpack integer: bool is an int in Python, never on this wire."""
    return isinstance(value, int) and not isinstance(value, bool)


def names(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join(t.__name__ for t in ts)


def get_field(obj: Mapping[str, Any], key: str, types: type | tuple[type, ...], where: str) -> Any:
    """A required field of one of ``types``; bool is not an int here (msgpack keeps them apart)."""
    if key not in obj:
        raise BadRequest(f"{where}: missing field {key!r}")
    return _typed(obj[key], key, types, where)


def opt_field(obj: Mapping[str, Any], key: str, types: type | tuple[type, ...], where: str,
              default: Any = None) -> Any:
    """An optional field: ``default`` when absent or nil, else one of ``types``."""
    value = obj.get(key)
    if value is None:
        return default
    return _typed(value, key, types, where)


def _typed(value: Any, key: str, types: type | tuple[type, ...], where: str) -> Any:
    label = f"{where}.{key}" if where else key
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise BadRequest(f"{label}: expected {names(types)}, got bool")
    if not isinstance(value, types):
        raise BadRequest(f"{label}: expected {names(types)}, got {type(value).__name__}")
    return value


def map_at(obj: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise BadRequest(f"{where}: expected a map, got {type(obj).__name__}")
    return obj


def list_field(obj: Mapping[str, Any], key: str, where: str = "") -> list[Any]:
    value = obj.get(key)
    if not isinstance(value, list):
        label = f"{where}.{key}" if where else key
        raise BadRequest(f"{label}: expected a list, got {type(value).__name__}")
    return value


def name_field(obj: Mapping[str, Any], where: str) -> str:
    name: str = get_field(obj, "name", str, where)
    if not name or len(name) > MAX_NAME_LEN:
        raise BadRequest(f"{where}.name: must be 1..{MAX_NAME_LEN} characters")
    return name


def check_batch_size(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BATCH_SIZE:
        raise BadRequest(f"{where}: batch_size must be an int in 0..{MAX_BATCH_SIZE}, got {value!r}")
    return value
