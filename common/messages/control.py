"""Messages every role shares: the empty request (``info``, ``status``), ``{ok: true}``, and status replies."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from persia_nats.common.errors import BadRequest
from persia_nats.common.messages.base import Message, always_sent, get_field

__all__ = ["Empty", "Ok", "StatusReply", "InfoReply"]


@dataclass(frozen=True, slots=True)
class Empty(Message):
    """A request with nothing but the envelope (``{"v": 1}``): ``*.info``, ``status``, ``nn.checkpoint``."""

    def body(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> Empty:
        return cls()


@dataclass(frozen=True, slots=True)
class Ok(Message):
    """The reply of a request that has nothing to report but its success."""

    kind = "reply"

    ok: bool = always_sent(True)

    def body(self) -> dict[str, Any]:
        return {"ok": self.ok}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> Ok:
        return cls(get_field(obj, "ok", bool, ""))


@dataclass(frozen=True, slots=True)
class StatusReply(Message):
    """One instance's answer to ``status`` (and its ``$SRV.STATS`` data): who it is and its figures."""

    subject = "status"
    kind = "reply"

    role: str
    replica: int
    instance: str
    stats: Mapping[str, Any] = always_sent(factory=dict)

    def body(self) -> dict[str, Any]:
        return {"role": self.role, "replica": self.replica, "instance": self.instance, "stats": dict(self.stats)}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> StatusReply:
        stats = get_field(obj, "stats", Mapping, "")
        if not all(isinstance(k, str) for k in stats):
            raise BadRequest("stats: expected a map with str keys")
        return cls(get_field(obj, "role", str, ""), get_field(obj, "replica", int, ""),
                   get_field(obj, "instance", str, ""), stats)


@dataclass(frozen=True, slots=True)
class InfoReply(Message):
    """A role's figures as a flat map (``ew.<worker>.info``, ``serve.info``): open-ended by design, since
    each release adds counters; readers take the keys they know."""

    kind = "reply"

    figures: Mapping[str, Any] = field(default_factory=dict)

    def body(self) -> dict[str, Any]:
        return {k: v for k, v in self.figures.items() if k != "v"}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> InfoReply:
        return cls({k: v for k, v in obj.items() if k != "v"})
