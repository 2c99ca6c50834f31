"""Every NATS subject and queue group the system uses, built in one place.

All subjects live under ``persia.<job>.``, so several jobs can share one NATS cluster and tests
isolate themselves with a unique job name. No other module writes a subject literal.

=====================================  ==============================  =========================
subject                                 requester -> responder          queue group
=====================================  ==============================  =========================
persia.<job>.ew.ingest                  data loader -> any worker       ``ew``
persia.<job>.ew.lookup_direct           NN worker (eval) -> any worker  ``ew``
persia.<job>.ew.<worker>.lookup         NN worker -> the buffering one  (none)
persia.<job>.ew.<worker>.grad           NN worker -> the buffering one  (none)
persia.<job>.ew.<worker>.info           anyone -> that worker           (none)
persia.<job>.ew.replica.<i>.info        anyone -> worker(s) of index i  (none)
persia.<job>.ps.<i>.lookup|update|      embedding worker / NN worker    (none)
  configure|info|checkpoint               -> PS replica i
persia.<job>.nn.<rank>.batch|end        data loader -> NN rank          (none)
persia.<job>.nn.info                    data loader -> NN ranks         (none)
persia.<job>.nn.checkpoint              operator -> NN rank 0           (none)
persia.<job>.nn.rendezvous              NN rank > 0 -> NN rank 0        (none)
persia.<job>.status                     anyone -> every instance        (none; many replies)
persia.<job>.serve.predict|info         any client -> any server        ``serve``
persia.<job>.srv.<instance>.status      anyone -> that instance         ``q`` (nats.micro's)
persia.<job>.hot.rows.<i>               PS replica i -> NN ranks        (none; published rows)
persia.<job>.hot.grads.<rank>           NN rank -> the other NN ranks   (none; announced gradients)
persia.<job>.batches                    any client -> JetStream stream  (stream ``PERSIA_<job>``)
persia.<job>.stream_end                 operator -> JetStream stream    (stream ``PERSIA_<job>``)
persia.<job>.dead                       data loader -> dead letters     (stream ``PERSIA_<job>_DEAD``)
persia.<job>.trained                    NN worker -> anyone listening   (none; notices)
=====================================  ==============================  =========================
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")

EMBEDDING_WORKER_QUEUE = "ew"
SERVE_QUEUE = "serve"

#: every reply goes to a subject under this prefix: nats-py's (and every NATS client's) default inbox
INBOX_ROOT = "_INBOX"


def inbox_prefix(user: str | None) -> str:
    """The inbox prefix of a connection made as NATS user ``user``: ``_INBOX.<user>``.

    Under deploy/nats-auth.conf each user may subscribe only to its own ``_INBOX.<user>.>``, so no
    outside user reads another's replies, and a responder may publish only to its callers' inboxes
    (no ``allow_responses``), so no reply can be aimed at ``$JS.API.>`` or a job subject. A user
    name that is not a subject token (or none: token, nkey or no auth) keeps the default ``_INBOX``.
    """
    if user is None or not _TOKEN.match(user):
        return INBOX_ROOT
    return f"{INBOX_ROOT}.{user}"


def is_inbox(subject: str | None) -> bool:
    """Whether ``subject`` is a reply inbox (``_INBOX.<...>``), the only place a responder answers."""
    return subject is not None and subject.startswith(INBOX_ROOT + ".")


def _check_token(kind: str, value: str) -> str:
    if not _TOKEN.match(value):
        raise ValueError(f"{kind} {value!r} is not a valid subject token (letters, digits, '_' and '-')")
    return value


@dataclass(frozen=True, slots=True)
class Subjects:
    """Subject builder for one job."""

    job: str

    def __post_init__(self) -> None:
        _check_token("job name", self.job)

    @property
    def prefix(self) -> str:
        return f"persia.{self.job}"

    # embedding workers
    def ew_ingest(self) -> str:
        return f"{self.prefix}.ew.ingest"

    def ew_lookup_direct(self) -> str:
        return f"{self.prefix}.ew.lookup_direct"

    def ew_lookup(self, worker: str) -> str:
        return f"{self.prefix}.ew.{_check_token('worker id', worker)}.lookup"

    def ew_grad(self, worker: str) -> str:
        return f"{self.prefix}.ew.{_check_token('worker id', worker)}.grad"

    def ew_info(self, worker: str) -> str:
        return f"{self.prefix}.ew.{_check_token('worker id', worker)}.info"

    def ew_replica_info(self, replica: int) -> str:
        return f"{self.prefix}.ew.replica.{int(replica)}.info"

    # embedding parameter servers
    def ps(self, replica: int, verb: str) -> str:
        if verb not in ("lookup", "update", "configure", "info", "checkpoint"):
            raise ValueError(f"unknown PS verb {verb!r}")
        return f"{self.prefix}.ps.{int(replica)}.{verb}"

    # hot rows (embedding_worker_config.hot_row_min_count): publishes, not requests
    def hot_rows(self, replica: int) -> str:
        """Where PS replica ``replica`` publishes the rows an update marked for publishing."""
        return f"{self.prefix}.hot.rows.{int(replica)}"

    def hot_grads(self, rank: int) -> str:
        """Where NN rank ``rank`` publishes its gradients of a batch's hot rows, before sending them."""
        return f"{self.prefix}.hot.grads.{int(rank)}"

    def hot(self) -> str:
        """Every hot-row message: rows published by PS replicas and gradients announced by NN ranks."""
        return f"{self.prefix}.hot.>"

    def hot_rows_all(self) -> str:
        """The rows every PS replica publishes."""
        return f"{self.prefix}.hot.rows.*"

    # NN workers
    def nn_batch(self, rank: int) -> str:
        return f"{self.prefix}.nn.{int(rank)}.batch"

    def nn_end(self, rank: int) -> str:
        return f"{self.prefix}.nn.{int(rank)}.end"

    def nn_info(self) -> str:
        return f"{self.prefix}.nn.info"

    def nn_checkpoint(self) -> str:
        """Ask NN rank 0 for a checkpoint at the next step boundary."""
        return f"{self.prefix}.nn.checkpoint"

    def status(self) -> str:
        return f"{self.prefix}.status"

    def nn_rendezvous(self) -> str:
        return f"{self.prefix}.nn.rendezvous"

    # inference service (persia_nats.services.serving), queue group SERVE_QUEUE
    def serve_predict(self) -> str:
        return f"{self.prefix}.serve.predict"

    def serve_info(self) -> str:
        return f"{self.prefix}.serve.info"

    # discovery (persia_nats.common.discovery): the one nats.micro endpoint of each registered instance
    def srv_status(self, instance: str) -> str:
        return f"{self.prefix}.srv.{_check_token('instance', instance)}.status"

    # the durable ingestion path (JetStream)
    def batches(self) -> str:
        """Where any client publishes training batches; captured by the stream :attr:`stream`."""
        return f"{self.prefix}.batches"

    def stream_end(self) -> str:
        """The end marker of the job's stream (captured by :attr:`stream` after the batches it ends): a
        subject of its own, so that the operator alone may end a stream (deploy/nats-auth.conf grants it to
        ``admin`` only), not whoever may publish batches."""
        return f"{self.prefix}.stream_end"

    def dead(self) -> str:
        """Refused stream batches, with the reason in a header; captured by :attr:`dead_stream`."""
        return f"{self.prefix}.dead"

    def trained(self) -> str:
        """A notice per stream batch once trained (or given back): for audits and progress."""
        return f"{self.prefix}.trained"

    @property
    def stream(self) -> str:
        # stream names may not hold '.', and a job name is already a subject token
        return f"PERSIA_{self.job}"

    @property
    def dead_stream(self) -> str:
        return f"PERSIA_{self.job}_DEAD"

    @property
    def stream_consumer(self) -> str:
        """The durable consumer every data loader of the job pulls from."""
        return "loaders"
