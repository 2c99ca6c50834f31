"""NN worker subjects: ``nn.<rank>.end``, ``nn.info``, ``nn.rendezvous``, ``nn.checkpoint``, and the
``trained`` notices. (``nn.<rank>.batch`` is in :mod:`persia_nats.common.messages.batches`.)"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from persia_nats.common.errors import BadRequest
from persia_nats.common.messages.base import Message, always_sent, get_field, is_int, opt_field

__all__ = ["NNEnd", "NNInfoReply", "RendezvousRequest", "RendezvousReply", "NNCheckpointReply", "TrainedNotice"]


@dataclass(frozen=True, slots=True)
class NNEnd(Message):
    """End of stream from one data loader for one rank: it sent ``batches`` batches there.

    ``final``: from a loader of the ingestion stream, every batch of the stream is trained (the other
    fields are then not sent).
    """

    subject = "nn.<rank>.end"

    # required unless final: the defaults only serve NNEnd(final=True)
    loader_index: int = always_sent(0)
    loader_size: int = always_sent(1)
    batches: int = always_sent(0)
    final: bool = False

    def body(self) -> dict[str, Any]:
        if self.final:
            return {"final": True}
        return {"loader_index": self.loader_index, "loader_size": self.loader_size, "batches": self.batches}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> NNEnd:
        final = obj.get("final", False)
        if not isinstance(final, bool):
            raise BadRequest("end: final must be a bool")
        if final:
            return cls(final=True)
        index, size, batches = obj.get("loader_index"), obj.get("loader_size"), obj.get("batches")
        if not (is_int(index) and is_int(size) and is_int(batches)) or not 0 <= index < size or batches < 0:
            raise BadRequest("end: loader_index, loader_size and batches must be ints with 0 <= index < size")
        return cls(index, size, batches)


@dataclass(frozen=True, slots=True)
class NNInfoReply(Message):
    subject = "nn.info"
    kind = "reply"

    world_size: int
    rank: int
    #: its dense process group is up (the rendezvous done; a single rank has none to wait for)
    ready: bool = always_sent(True)

    def body(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "rank": self.rank, "ready": self.ready}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> NNInfoReply:
        world_size = get_field(obj, "world_size", int, "")
        if world_size < 1:
            raise BadRequest(f"world_size: expected >= 1, got {world_size}")
        return cls(world_size, get_field(obj, "rank", int, ""), get_field(obj, "ready", bool, ""))


@dataclass(frozen=True, slots=True)
class RendezvousRequest(Message):
    """NN rank > 0 -> rank 0: where is the dense all-reduce's TCP store?"""

    subject = "nn.rendezvous"

    rank: int

    def body(self) -> dict[str, Any]:
        return {"rank": self.rank}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> RendezvousRequest:
        return cls(get_field(obj, "rank", int, ""))


@dataclass(frozen=True, slots=True)
class RendezvousReply(Message):
    subject = "nn.rendezvous"
    kind = "reply"

    addr: str
    port: int
    world_size: int

    def body(self) -> dict[str, Any]:
        return {"addr": self.addr, "port": self.port, "world_size": self.world_size}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> RendezvousReply:
        return cls(get_field(obj, "addr", str, ""), get_field(obj, "port", int, ""),
                   get_field(obj, "world_size", int, ""))


@dataclass(frozen=True, slots=True)
class NNCheckpointReply(Message):
    """The directory of the sealed checkpoint."""

    subject = "nn.checkpoint"
    kind = "reply"

    checkpoint: str

    def body(self) -> dict[str, Any]:
        return {"checkpoint": self.checkpoint}

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> NNCheckpointReply:
        return cls(get_field(obj, "checkpoint", str, ""))


@dataclass(frozen=True, slots=True)
class TrainedNotice(Message):
    """A stream batch was trained (or given back: ``trained`` false; ``dead``: why it was dead-lettered)."""

    subject = "trained"

    seq: int
    batch_id: int
    rank: int
    delivered: int
    trained: bool
    dead: str | None = None

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"seq": self.seq, "batch_id": self.batch_id, "rank": self.rank,
                               "delivered": self.delivered, "trained": self.trained}
        if self.dead is not None:
            out["dead"] = self.dead
        return out

    @classmethod
    def from_wire(cls, obj: Mapping[str, Any]) -> TrainedNotice:
        return cls(get_field(obj, "seq", int, ""), get_field(obj, "batch_id", int, ""), get_field(obj, "rank", int, ""),
                   get_field(obj, "delivered", int, ""), get_field(obj, "trained", bool, ""),
                   opt_field(obj, "dead", str, ""))
