"""Durable ingestion: training batches from any NATS client, through a JetStream stream.

A client publishes each batch as one msgpack map (:class:`~persia_nats.common.messages.StreamBatch`) on
``persia.<job>.batches``. The stream ``PERSIA_<job>`` keeps it on disk until it is trained: data
loaders pull from one shared durable consumer, forward each batch through the usual two steps
(embedding worker, then NN rank), and hand the NN worker the message's ack subject. The NN worker
acknowledges only once the batch's gradients are applied, so a crash anywhere on the way means the
stream delivers the batch again after ``ack_wait``: redelivery, never loss.

- A malformed batch, or one that does not fit the job's schema (:class:`~persia_nats.common.batch.BatchSchema`:
  every configured slot, and the dense features and labels ``data_loader_config`` declares), is refused with
  its reason, counted, copied to ``persia.<job>.dead`` (kept by the stream ``PERSIA_<job>_DEAD``,
  :mod:`persia_nats.common.dead`) and terminated before any other role sees it: it is never retried.
- Where the configuration leaves the dense features and labels open, the loader checks none: no batch
  it sees may fix them (the first one published could be wrong). The NN ranks fix them from the first
  batch that trains and refuse what differs from then on, which the loader dead-letters the same way.
- A batch over ``data_loader_config.max_batch_bytes``, ``max_batch_samples`` or ``max_batch_distinct_ids``
  goes the same way, before any role holds it (the stream also refuses a publish over ``max_batch_bytes``).
  The dead-letter stream is bounded in messages, bytes and age, and keeps a large batch's reason without
  its bytes (:mod:`persia_nats.common.dead`).
- A batch delivered ``max_deliveries`` times without being trained goes the same way.
- ``{"v": 1, "end": true}`` on ``persia.<job>.stream_end`` ends the job's stream: once every batch
  published before it is trained, the NN ranks are told to finish. The end is the operator's: the secure
  deployment lets only ``admin`` publish there, and a marker on the batches subject (which any publisher may
  send) is dead-lettered unless ``data_loader_config.end_marker_from`` is ``batches``. Batches still in the
  stream when it ends (published after the marker) are logged and counted (``left_at_end``); the job's
  account reports them as ``left``.
- Backpressure: the consumer lets at most ``max_ack_pending`` batches be in flight (delivered, not yet
  trained), and the stream refuses new publishes beyond ``max_msgs``/``max_bytes`` (discard "new"),
  so a publisher faster than training fills a bounded disk queue and then waits.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import api
from nats.js.errors import APIError, NotFoundError, ServiceUnavailableError
from persia_nats.common.acks import AckKeeper, nak_delay
from persia_nats.common.batch import BatchSchema
from persia_nats.common.codec import unpack_message
from persia_nats.common.config import DataLoaderConfig
from persia_nats.common.dead import DEAD_HEADER_ROOM, DEAD_MAX_MSGS, DEAD_MAX_PAYLOAD_BYTES, dead_letter
from persia_nats.common.errors import BadRequest, ConfigError, PeersMissing, PersiaError
from persia_nats.common.logs import figures
from persia_nats.common.messages import BatchBounds, NNEnd, StreamAck, StreamBatch, StreamEnd
from persia_nats.common.rpc import request_with_retry
from persia_nats.common.subjects import Subjects
from persia_nats.services.data_loader.sender import BatchSender
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_delay, wait_random_exponential

log = logging.getLogger(__name__)


#: messages pulled per request
FETCH = 8
#: seconds batches being forwarded get to finish after SIGTERM before they are given back to the stream
DRAIN_TIMEOUT_S = 10.0
#: seconds between lines of the loader's counters
STATS_LOG_INTERVAL_S = 30.0
#: seconds between progress lines while the end marker waits for earlier batches
END_LOG_INTERVAL_S = 10.0
#: seconds a loader waits for JetStream to answer: a new cluster elects its meta leader first, which
#: takes a few seconds (tens on a loaded host), and a node restarting catches up before it serves
JETSTREAM_WAIT_S = 60.0
#: stream replicas in a NATS cluster when ``stream_replicas`` is 0: a quorum survives one node down
CLUSTER_REPLICAS = 3


def stream_replicas(setting: int, server_info: dict[str, Any]) -> int:
    """The replicas to create the streams with: ``setting``, or for 0 (auto) 3 when the server
    announces a cluster (its INFO names one), else 1."""
    if setting:
        return setting
    return CLUSTER_REPLICAS if server_info.get("cluster") else 1


async def ensure_streams(nc: NATS, subjects: Subjects, settings: DataLoaderConfig = DataLoaderConfig(),
                         wait_s: float = JETSTREAM_WAIT_S) -> None:
    """Create the batches stream, the dead-letter stream and the consumer unless they exist.

    The first loader to start creates them with its ``data_loader_config``; later ones use them as they are.
    While JetStream answers "temporarily unavailable" (or not at all), as a cluster does until it has
    elected a leader, this waits up to ``wait_s`` seconds.

    Raises:
        PeersMissing: JetStream did not answer within ``wait_s`` seconds.
    """
    def log_first(state: RetryCallState) -> None:  # one line while waiting, not one per try
        if state.attempt_number == 1 and state.outcome is not None:
            log.info("JetStream not ready yet (%s); waiting up to %gs", state.outcome.exception(), wait_s)

    # jittered like the NATS connect (persia_nats.common.service.connect): loaders started together spread out
    attempts = AsyncRetrying(stop=stop_after_delay(wait_s), wait=wait_random_exponential(multiplier=0.2, max=2.0),
                             retry=retry_if_exception_type((ServiceUnavailableError, NatsTimeout)),
                             before_sleep=log_first, reraise=True)
    try:
        async for attempt in attempts:
            with attempt:
                await _ensure_streams(nc, subjects, settings)
    except (ServiceUnavailableError, NatsTimeout) as exc:
        raise PeersMissing(f"JetStream did not answer within {wait_s:g}s ({exc}): every nats-server of the "
                           "job needs JetStream on (-js), and a cluster a majority of its nodes up") from None


async def _ensure_streams(nc: NATS, subjects: Subjects, settings: DataLoaderConfig) -> None:
    js = nc.jetstream()
    # nats-py keeps the server's INFO only in a private attribute; an older client without it gets 1 replica
    replicas = stream_replicas(settings.stream_replicas, getattr(nc, "_server_info", None) or {})
    wanted = [
        api.StreamConfig(name=subjects.stream, subjects=[subjects.batches(), subjects.stream_end()],
                         retention=api.RetentionPolicy.WORK_QUEUE,
                         storage=api.StorageType.FILE, discard=api.DiscardPolicy.NEW,
                         max_msgs=settings.stream_max_msgs, max_bytes=settings.stream_max_bytes,
                         max_msg_size=settings.max_batch_bytes,  # JetStream refuses the publisher a larger batch
                         num_replicas=replicas, description="PERSIA training batches, kept until trained"),
        api.StreamConfig(name=subjects.dead_stream, subjects=[subjects.dead()], retention=api.RetentionPolicy.LIMITS,
                         storage=api.StorageType.FILE, discard=api.DiscardPolicy.OLD, num_replicas=replicas,
                         max_msgs=DEAD_MAX_MSGS, max_bytes=settings.dead_max_bytes,
                         max_age=settings.dead_max_age_sec,
                         # the NN ranks dead-letter a batch whose step failed with the default cut
                         max_msg_size=max(settings.dead_max_payload_bytes, DEAD_MAX_PAYLOAD_BYTES) + DEAD_HEADER_ROOM,
                         description="PERSIA batches refused, with the reason"),
    ]
    for cfg in wanted:
        try:
            info = await js.stream_info(cfg.name)
        except NotFoundError:
            await _add_stream(js, cfg)
            continue
        _warn_unbounded(info.config, cfg)
        if cfg.name == subjects.stream and subjects.stream_end() not in (info.config.subjects or []):
            log.warning("stream %s was made without the end markers' subject (by hand, say): it captures %s only, so "
                        "%s ends nothing%s; recreate the stream (when empty) to end it the new way", cfg.name,
                        info.config.subjects, subjects.stream_end(), "" if settings.end_marker_from == "batches" else
                        ", and with data_loader_config.end_marker_from: stream_end nothing can end it")
    try:
        consumer = await js.consumer_info(subjects.stream, subjects.stream_consumer)
        if consumer.config.filter_subject == subjects.batches():
            log.warning("consumer %s of %s takes %s only (made by hand, say): end markers on %s are never "
                        "delivered; delete it (nothing is lost: the stream keeps the batches) to take them",
                        subjects.stream_consumer, subjects.stream, subjects.batches(), subjects.stream_end())
    except NotFoundError:
        # no filter: the stream captures the batches and the end markers, in the order they were published
        await js.add_consumer(subjects.stream, api.ConsumerConfig(
            durable_name=subjects.stream_consumer, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=settings.ack_wait_sec,
            max_ack_pending=settings.max_ack_pending, deliver_policy=api.DeliverPolicy.ALL))
        log.info("created consumer %s on stream %s", subjects.stream_consumer, subjects.stream)


async def _add_stream(js: Any, cfg: api.StreamConfig) -> None:
    try:
        await js.add_stream(cfg)
    except ServiceUnavailableError:
        raise  # not yet a leader to ask: ensure_streams waits and asks again
    except APIError as exc:
        if cfg.num_replicas == 1:
            raise
        raise ConfigError(f"data_loader_config.stream_replicas: the NATS cluster cannot hold stream {cfg.name} with "
                          f"{cfg.num_replicas} replicas ({exc.description}); start that many JetStream servers "
                          "or set stream_replicas lower") from exc
    log.info("created stream %s on %s with %d replica(s)", cfg.name, cfg.subjects, cfg.num_replicas)


#: the bounds a stream made by hand may lack
_BOUNDS = ("max_msgs", "max_bytes", "max_age", "max_msg_size")


def _warn_unbounded(found: api.StreamConfig, wanted: api.StreamConfig) -> None:
    """Log a stream that exists with weaker bounds than the configuration asks: the loader cannot edit it
    (no ``STREAM.UPDATE`` right), the operator can (``nats stream edit``, or delete it before the job)."""
    def unset(value: Any) -> bool:
        return value is None or value <= 0

    weaker = [f"{key}={getattr(found, key)} (configured {getattr(wanted, key)})" for key in _BOUNDS
              if getattr(wanted, key) is not None and getattr(wanted, key) > 0
              and (unset(getattr(found, key)) or getattr(found, key) > getattr(wanted, key))]
    if weaker:
        log.warning("stream %s exists with weaker bounds than data_loader_config: %s; kept as it is (edit it with "
                    "`nats stream edit`, or delete it before the job starts)", found.name, ", ".join(weaker))


def earlier_acknowledged(end_seq: int, ack_floor: int, retention: str | None, first_seq: int | None) -> bool:
    """Whether nothing before stream sequence ``end_seq`` waits for an acknowledgement.

    ``ack_floor`` is the consumer's; ``retention`` and ``first_seq`` are the stream's (None when
    not read): in a work-queue stream an acknowledged (or terminated) message is removed, so a
    first sequence at the marker settles it even when the floor lags.
    """
    if ack_floor >= end_seq - 1:
        return True
    return retention == api.RetentionPolicy.WORK_QUEUE and first_seq is not None and first_seq >= end_seq


class _Stopped(Exception):
    """:meth:`StreamLoader.stop` was called while the loader waited."""


async def _unsubscribe(sub: Any) -> None:
    """Let go of the pull subscription. Left subscribed, the connection's drain at exit waits its whole
    bound for the subscription's pending queue, which a message delivered after the last fetch timed out
    keeps from ever emptying; such a message is not acknowledged, so the stream delivers it again."""
    try:
        await sub.unsubscribe()
    except Exception as exc:  # a closed connection has nothing left to let go of
        log.debug("unsubscribing from the stream failed: %s", exc)


class StreamLoader:
    """Pulls batches from the job's stream and forwards them; acknowledgement is the NN worker's.

    Args:
        sender: delivers each batch (embedding worker, then NN rank ``seq % world_size``).
        settings: the job's ``data_loader_config`` (stream bounds, ack wait, deliveries, in-flight window).
        slots: the configured slot names, all of which every batch must carry (None: the embedding
            worker refuses a batch without them, after the loader forwarded it).
    """

    def __init__(self, nc: NATS, subjects: Subjects, sender: BatchSender,
                 settings: DataLoaderConfig = DataLoaderConfig(), slots: tuple[str, ...] | None = None) -> None:
        self.nc = nc
        self.subjects = subjects
        self.sender = sender
        self.settings = settings
        self.schema = BatchSchema.from_config(slots, settings)
        self.bounds = BatchBounds(settings.max_batch_bytes, settings.max_batch_samples,
                                  settings.max_batch_distinct_ids)
        #: seconds the batches being forwarded get to finish once stopped
        self.drain_timeout = DRAIN_TIMEOUT_S
        self.counters: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self._window = asyncio.Semaphore(settings.max_inflight)
        self._end: tuple[int, Msg] | None = None
        self._end_logged = 0.0
        self._stop = asyncio.Event()
        self.ack_keeper = AckKeeper(nc)

    async def run(self, stop_at_end: bool = True, log_stats: bool = True) -> None:
        """Forward batches until the end marker's batches are trained (or :meth:`stop`). ``log_stats``: a
        line of the counters every :data:`STATS_LOG_INTERVAL_S` (off where the caller logs them)."""
        await ensure_streams(self.nc, self.subjects, self.settings)
        js = self.nc.jetstream()
        sub = await js.pull_subscribe_bind(durable=self.subjects.stream_consumer, stream=self.subjects.stream)
        stats_task = asyncio.get_running_loop().create_task(self._log_stats_every(STATS_LOG_INTERVAL_S)) \
            if log_stats else None
        try:
            await self._unless_stopped(self.sender.wait_for_nn_workers())
            await self._pull(sub, stop_at_end)
        except _Stopped:
            log.info("stream loader stopping: %d batch(es) still being forwarded", len(self._tasks))
        finally:
            if stats_task is not None:
                stats_task.cancel()
            await self.drain(None if not self._stop.is_set() else self.drain_timeout)
            await self.ack_keeper.close()
            await _unsubscribe(sub)

    async def _pull(self, sub: Any, stop_at_end: bool) -> None:
        last_check = 0.0
        while not self._stop.is_set():
            if self._end is not None and time.monotonic() - last_check > 0.25:
                last_check = time.monotonic()
                if await self._end_reached(sub):
                    if stop_at_end:
                        return
                    self._end = None
            try:
                msgs = await self._unless_stopped(sub.fetch(FETCH, timeout=1.0))
            except TimeoutError:
                continue
            except _Stopped:
                raise
            except Exception as exc:  # the server restarting: reconnect is nats-py's job, ours is to go on
                self.counters["fetch_errors"] += 1
                log.warning("fetch from stream %s failed: %s", self.subjects.stream, exc)
                await asyncio.sleep(0.5)
                continue
            for i, msg in enumerate(msgs):
                try:
                    await self._handle(msg)
                except _Stopped:
                    for rest in msgs[i + 1:]:  # delivered again now rather than after ack_wait
                        await self._nak(rest)
                    raise

    async def _unless_stopped(self, aw: Any) -> Any:
        """``aw``'s result, or :class:`_Stopped` (``aw`` cancelled) as soon as :meth:`stop` is called."""
        task = asyncio.ensure_future(aw)
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise _Stopped
        return task.result()

    async def _log_stats_every(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            log.info("stream loader stats", extra=figures(dict(sorted(self.stats().items()))))

    def stop(self) -> None:
        self._stop.set()

    async def drain(self, timeout: float | None = None) -> None:
        """Wait for the batches being forwarded; after ``timeout`` seconds cancel the rest (given back
        to the stream, which delivers them again)."""
        loop = asyncio.get_running_loop()
        end = None if timeout is None else loop.time() + timeout
        while self._tasks:
            left = None if end is None else end - loop.time()
            if left is not None and left <= 0:
                log.warning("%d batch(es) not forwarded within the drain bound: given back", len(self._tasks))
                for task in self._tasks:
                    task.cancel()
                end = left = None
            await asyncio.wait(list(self._tasks), timeout=left)

    async def _handle(self, msg: Msg) -> None:
        meta = msg.metadata
        seq, delivered = meta.sequence.stream, meta.num_delivered
        self.counters["received"] += 1
        if delivered > 1:
            self.counters["redelivered"] += 1
        try:
            # before decoding: a stream made without max_msg_size (older, or by hand) lets larger ones in
            self.bounds.check_bytes(len(msg.data))
        except BadRequest as exc:
            self.counters["over_bounds"] += 1
            await self._dead_letter(msg, seq, f"over the job's bounds: {exc.description}")
            return
        on_end_subject = msg.subject == self.subjects.stream_end()
        try:
            obj = unpack_message(msg.data)
            if on_end_subject or StreamEnd.is_end(obj):
                StreamEnd.from_wire(obj)
        except BadRequest as exc:
            await self._dead_letter(msg, seq, f"malformed {'end marker' if on_end_subject else 'batch'}: "
                                              f"{exc.description}")
            return
        if on_end_subject or StreamEnd.is_end(obj):
            if not on_end_subject and self.settings.end_marker_from != "batches":
                # whoever may publish a batch may publish this: it must not end the operator's job
                self.counters["end_markers_refused"] += 1
                await self._dead_letter(msg, seq, f"end marker refused: end: on {self.subjects.batches()}, where any "
                                                  f"publisher may send it; this job's stream ends only by a marker on "
                                                  f"{self.subjects.stream_end()} (data_loader_config.end_marker_from: "
                                                  f"{self.settings.end_marker_from})")
                return
            await self._on_end_marker(seq, msg)
            return
        try:
            batch = StreamBatch.from_wire(obj)
        except BadRequest as exc:
            await self._dead_letter(msg, seq, f"malformed batch: {exc.description}")
            return
        try:
            self.bounds.check(batch.features)
        except BadRequest as exc:
            self.counters["over_bounds"] += 1
            await self._dead_letter(msg, seq, f"over the job's bounds: {exc.description}")
            return
        try:
            batch = self._admit(batch)
        except BadRequest as exc:
            self.counters["schema_refused"] += 1
            await self._dead_letter(msg, seq, f"not the job's schema: {exc.description}")
            return
        except Exception as exc:  # a decoder bug must not kill every loader the message is redelivered to
            self.counters["decode_errors"] += 1
            log.exception("stream batch %d could not be decoded", seq)
            await self._dead_letter(msg, seq, f"undecodable batch: {type(exc).__name__}: {exc}")
            return
        if delivered > self.settings.max_deliveries:
            await self._dead_letter(msg, seq, f"not trained after {delivered - 1} deliveries")
            return
        # from here until the NN worker holds it, the batch must not time out into a duplicate
        self.ack_keeper.hold(msg.reply, self.settings.ack_wait_sec)
        try:
            await self._unless_stopped(self._window.acquire())  # a full window must not outlast a SIGTERM
        except _Stopped:
            self.ack_keeper.release(msg.reply)
            await self._nak(msg)
            raise
        task = asyncio.get_running_loop().create_task(self._forward(msg, seq, delivered, batch))
        self._tasks.add(task)
        task.add_done_callback(self._done)

    def _admit(self, batch: StreamBatch) -> StreamBatch:
        """``batch`` with its dense features and labels in the schema's order, or BadRequest naming the field."""
        if not batch.requires_grad:
            # its acknowledgement would wait for gradients that never come: evaluation goes through eval_ctx
            raise BadRequest("requires_grad: false: the stream carries training batches only (evaluate with "
                             "eval_ctx and an IterableDataset)")
        self.schema.check_slots([f.name for f in batch.features])
        non_id, labels = self.schema.admit(batch.non_id, batch.labels, batch.requires_grad)
        return dataclasses.replace(batch, non_id=non_id, labels=labels)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._window.release()

    async def _forward(self, msg: Msg, seq: int, delivered: int, batch: StreamBatch) -> None:
        ack = StreamAck(msg.reply, seq, delivered, self.settings.ack_wait_sec)
        try:
            await self.sender.deliver(seq, batch.ingest_request(), batch.non_id, batch.labels, batch.requires_grad,
                                      batch.meta, ack)
            self.counters["forwarded"] += 1
        except BadRequest as exc:
            # an embedding worker or NN rank refused the batch itself (say, an unknown slot): resending cannot help
            await self._dead_letter(msg, seq, f"refused by the job: {exc.description}")
        except PersiaError as exc:
            self.counters["forward_failures"] += 1
            log.warning("stream batch %d not forwarded (%s); it will be delivered again", seq, exc)
            await self._nak(msg)
        except Exception as exc:
            self.counters["forward_failures"] += 1
            log.exception("stream batch %d not forwarded: %s", seq, exc)
            await self._nak(msg)
        except asyncio.CancelledError:  # stopping: the stream delivers it again, now rather than after ack_wait
            await self._nak(msg)
            raise
        finally:
            self.ack_keeper.release(msg.reply)

    async def _nak(self, msg: Msg) -> None:
        try:
            await msg.nak(delay=nak_delay(msg.metadata.num_delivered))
        except Exception as exc:  # the ack wait redelivers it anyway
            log.debug("nak failed: %s", exc)

    async def _dead_letter(self, msg: Msg, seq: int, reason: str) -> None:
        try:
            await dead_letter(self.nc, self.subjects, msg.data, reason, seq, self.settings.dead_max_payload_bytes)
        except Exception as exc:
            # keep it in the stream rather than lose it: it comes back and is refused again (and counted
            # dead-lettered then, once its letter is stored)
            self.counters["dead_letter_failures"] += 1
            log.error("could not dead-letter stream batch %d (%s): %s", seq, reason, exc)
            await self._nak(msg)
            return
        self.counters["dead_lettered"] += 1
        log.warning("stream batch %d dead-lettered: %s", seq, reason)
        await msg.term()

    # -- end of stream --------------------------------------------------------------------------------

    async def _on_end_marker(self, seq: int, msg: Msg) -> None:
        if self._end is not None and self._end[0] != seq:
            await msg.ack()  # a second end marker adds nothing
            return
        log.info("end marker at stream sequence %d: waiting until every earlier batch is trained", seq)
        self._end = (seq, msg)

    async def _end_reached(self, sub: Any) -> bool:
        assert self._end is not None
        seq, msg = self._end
        if not await self._earlier_batches_done(sub, seq):
            await msg.in_progress()  # keep the marker from being redelivered to another loader meanwhile
            return False
        await self.drain()
        world = self.sender.world_size
        timeout = self.sender.timeout
        for rank in range(world):
            await request_with_retry(self.nc, self.subjects.nn_end(rank), NNEnd(final=True), timeout, timeout * 4)
        await msg.ack()
        self.counters["ended"] += 1
        log.info("stream ended at sequence %d: told %d NN rank(s) to finish", seq, world)
        await self._count_left(seq)
        return True

    async def _count_left(self, seq: int) -> None:
        """Say how many batches the ended stream still holds (published after its end marker): not trained."""
        try:
            info = await self.nc.jetstream().stream_info(self.subjects.stream, subjects_filter=self.subjects.batches())
        except Exception as exc:  # the ranks were told already: the job's account counts them anyway
            log.warning("could not count the batches left in stream %s after its end: %s", self.subjects.stream, exc)
            return
        left = (info.state.subjects or {}).get(self.subjects.batches(), 0)
        self.counters["left_at_end"] = left
        if left:
            log.warning("stream %s ended at sequence %d with %d batch(es) still in it (published after the end "
                        "marker): not trained by this job; its account reports them as left", self.subjects.stream,
                        seq, left)

    async def _earlier_batches_done(self, sub: Any, seq: int) -> bool:
        """Whether every message before stream sequence ``seq`` is acknowledged (or dead-lettered).

        The consumer's ack floor says so, while the marker itself is the only message unacknowledged
        below and at its sequence. After a nats-server restart the restored floor can stay behind
        acknowledgements that did land, and then it advances only once nothing is pending, the marker
        included. A work-queue stream settles it: acknowledged messages are removed, so the stream's
        first sequence reaching the marker means nothing before it is left.
        """
        info = await sub.consumer_info()
        if earlier_acknowledged(seq, info.ack_floor.stream_seq, None, None):
            return True
        stream = await self.nc.jetstream().stream_info(self.subjects.stream)
        if earlier_acknowledged(seq, info.ack_floor.stream_seq, stream.config.retention, stream.state.first_seq):
            self.counters["ack_floor_lagged"] += 1
            log.info("the consumer's ack floor (%d) lags, but the work queue holds nothing before the end marker at %d",
                     info.ack_floor.stream_seq, seq)
            return True
        now = time.monotonic()
        if now - self._end_logged >= END_LOG_INTERVAL_S:
            self._end_logged = now
            log.info("end marker at %d: waiting for earlier batches (ack floor %d, %d message(s) in the stream, "
                     "%d delivered and unacknowledged)", seq, info.ack_floor.stream_seq, stream.state.messages,
                     info.num_ack_pending)
        return False

    def stats(self) -> dict[str, int | None]:
        """The counters, the batches being forwarded now, and the end marker's sequence once seen."""
        return {**self.counters, **{f"resent_{k}": n for k, n in self.sender.resent.items()},
                "inflight": len(self._tasks), "end_marker": self._end[0] if self._end else None}

