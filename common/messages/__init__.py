"""Wire messages: one frozen dataclass per request and reply body, with ``to_wire()`` / ``from_wire()``.

``from_wire`` validates untrusted maps and raises :class:`~persia_nats.common.errors.BadRequest` naming the
field; it ignores unknown fields (the open-world rule NATS uses) so a newer peer can add fields
without breaking an older one. Every map carries ``v`` (see :data:`persia_nats.common.codec.WIRE_VERSION`),
written by :func:`~persia_nats.common.messages.base.envelope` and checked on decode.

One module per group of subjects (docs/protocol.md): :mod:`.batches` (``ew.ingest``, ``nn.<rank>.batch``,
the stream's batches), :mod:`.worker` (``ew.<worker>.*``), :mod:`.ps` (``ps.<i>.*``), :mod:`.hot`
(``hot.*``), :mod:`.nn` (``nn.*``, ``trained``), :mod:`.serving` (``serve.*``) and :mod:`.control`
(what every role answers). The names are re-exported here.
"""

from persia_nats.common.messages.base import MAX_BATCH_SIZE, MAX_NAME_LEN, Message, envelope
from persia_nats.common.messages.batches import (
    ACK_PREFIX,
    BatchBounds,
    BatchRef,
    IdFeature,
    IngestReply,
    IngestRequest,
    NamedArray,
    NNBatch,
    StreamAck,
    StreamBatch,
    StreamEnd,
    check_sequence_of,
    id_features_from_wire,
    named_list_from_wire,
)
from persia_nats.common.messages.control import Empty, InfoReply, Ok, StatusReply
from persia_nats.common.messages.hot import HotGrads, HotGradsGroup, HotRows, HotRowsGroup
from persia_nats.common.messages.nn import (
    NNCheckpointReply,
    NNEnd,
    NNInfoReply,
    RendezvousReply,
    RendezvousRequest,
    TrainedNotice,
)
from persia_nats.common.messages.ps import (
    PsCheckpoint,
    PsCheckpointReply,
    PsConfigure,
    PsInfoReply,
    PsLookup,
    PsLookupGroup,
    PsLookupReply,
    PsUpdate,
    PsUpdateGroup,
    PsUpdateReply,
)
from persia_nats.common.messages.serving import PredictReply, PredictRequest
from persia_nats.common.messages.worker import (
    EwLookup,
    EwLookupReply,
    GatheredSlots,
    GradReply,
    GradRequest,
    HotGroup,
    HotPart,
    LookupDirectReply,
    RowGradient,
    SlotEmbedding,
    SlotGradient,
    embeddings_from_wire,
    slot_order,
)

__all__ = [
    "MAX_BATCH_SIZE", "MAX_NAME_LEN", "Message", "envelope",
    "ACK_PREFIX", "BatchRef", "IdFeature", "IngestReply", "IngestRequest", "NamedArray", "NNBatch", "StreamAck",
    "StreamBatch", "StreamEnd", "BatchBounds", "check_sequence_of", "id_features_from_wire", "named_list_from_wire",
    "Empty", "InfoReply", "Ok", "StatusReply",
    "HotGrads", "HotGradsGroup", "HotRows", "HotRowsGroup",
    "NNCheckpointReply", "NNEnd", "NNInfoReply", "RendezvousReply", "RendezvousRequest", "TrainedNotice",
    "PsCheckpoint", "PsCheckpointReply", "PsConfigure", "PsInfoReply", "PsLookup", "PsLookupGroup", "PsLookupReply",
    "PsUpdate", "PsUpdateGroup", "PsUpdateReply",
    "PredictReply", "PredictRequest",
    "EwLookup", "EwLookupReply", "GatheredSlots", "GradReply", "GradRequest", "HotGroup", "HotPart",
    "LookupDirectReply", "RowGradient", "SlotEmbedding", "SlotGradient", "embeddings_from_wire",
    "slot_order",
]
