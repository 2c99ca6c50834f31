"""The job's account where its run begins while batches are being dead-lettered.

A batch is dead-lettered in two steps: its letter is stored, then the batch is removed from the stream.
Rank 0 marks where the run begins (``stream_mark``) while the data loader may already be refusing batches;
a mark between the two steps once counted the batch as given to the run and its letter as before it, so
the account called one batch lost and failed a job that had lost nothing. The data loader's own count
of its letters is here too: a letter counts once it is stored.
"""

from __future__ import annotations

import asyncio

import msgpack
import nats
import pytest
from nats.aio.msg import Msg
from persia_nats.common.config import DataLoaderConfig
from persia_nats.common.dead import dead_letter
from persia_nats.common.subjects import Subjects
from persia_nats.services.data_loader.sender import BatchSender
from persia_nats.services.data_loader.stream import StreamLoader, ensure_streams
from persia_nats.services.nn_worker import account as account_mod
from persia_nats.services.nn_worker.account import stream_account, stream_mark, verdict

from tests.integration.test_stream_end_control import handle_next
from tests.natsserver import NatsServer


async def wait_for_messages(js: nats.js.JetStreamContext, stream: str, n: int) -> None:
    """An acknowledgement is one publish the server applies after it answered nothing: wait for it."""
    for _ in range(200):
        if (await js.stream_info(stream)).state.messages == n:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"{stream} never held {n} messages")


async def stream_with_batches(nc: nats.NATS, subjects: Subjects, n: int) -> nats.js.JetStreamContext:
    """The job's streams made as a data loader makes them, and ``n`` batches published on them."""
    await ensure_streams(nc, subjects)
    js = nc.jetstream()
    for i in range(n):
        await js.publish(subjects.batches(), msgpack.packb({"v": 1, "i": i}))
    return js


@pytest.mark.parametrize("listed", [True, False], ids=["removed-listed", "removed-read-one-by-one"])
async def test_a_batch_dead_lettered_as_the_run_begins_is_counted_once(
        nats_server: NatsServer, job_name: str, listed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    if not listed:  # the fallback for a stream with more removed messages than one reply should list
        monkeypatch.setattr(account_mod, "MAX_DELETED_DETAILS", 0)
    subjects = Subjects(job_name)
    nc = await nats.connect(nats_server.url)
    try:
        js = await stream_with_batches(nc, subjects, 6)
        sub = await js.pull_subscribe_bind(durable=subjects.stream_consumer, stream=subjects.stream)
        msgs: dict[int, Msg] = {m.metadata.sequence.stream: m for m in await sub.fetch(6, timeout=10)}
        assert sorted(msgs) == [1, 2, 3, 4, 5, 6]

        async def refuse(seq: int, remove: bool = True) -> None:
            await dead_letter(nc, subjects, msgs[seq].data, f"not the job's schema: batch {seq}", seq)
            if remove:
                await msgs[seq].term()

        # before the run: 1 (below the stream's first message then) and 4 (a gap above it) are gone;
        # 3's letter is stored and the batch is still in the stream as the mark is taken
        await refuse(1)
        await refuse(4)
        await refuse(3, remove=False)
        await wait_for_messages(js, subjects.stream, 4)
        mark = await stream_mark(nc, subjects)
        assert mark is not None
        assert (mark.first_seq, mark.dead_last_seq, mark.gone_before) == (2, 3, 1), mark
        assert mark.dead_in_flight == (3,), mark  # letter 3 (batch 3); letters 1 and 2 are of batches gone

        # the run: 3 is removed now, 5 refused (twice: as after a +TERM lost on the way, which brings it back)
        await msgs[3].term()
        await refuse(5, remove=False)
        await refuse(5)
        for seq in (2, 6):
            await msgs[seq].ack_sync()
        await wait_for_messages(js, subjects.stream, 0)
        account = await stream_account(nc, subjects, mark, ended=False)
        assert account == {"published": 4, "left": 0, "dead_lettered": 2, "dead_lettered_again": 1,
                           "dead_lettered_by_reason": {"not the job's schema": 2}, "stream_made_again": False}, account
        trained = 2
        assert account["published"] - trained - account["dead_lettered"] - account["left"] == 0  # nothing lost
    finally:
        await nc.close()


async def test_the_mark_reads_back_only_the_newest_letters(nats_server: NatsServer, job_name: str) -> None:
    """Letters of batches removed long before are not read one by one at every start: the scan stops after
    ``MARK_QUIET_LETTERS`` in a row of them."""
    subjects = Subjects(job_name)
    nc = await nats.connect(nats_server.url)
    try:
        n = account_mod.MARK_QUIET_LETTERS * 3
        js = await stream_with_batches(nc, subjects, n)
        sub = await js.pull_subscribe_bind(durable=subjects.stream_consumer, stream=subjects.stream)
        refused = 0
        while refused < n:  # a fetch may hand over fewer than asked for
            for msg in await sub.fetch(n - refused, timeout=10):
                await dead_letter(nc, subjects, msg.data, "not the job's schema: old", msg.metadata.sequence.stream)
                await msg.term()
                refused += 1
        await wait_for_messages(js, subjects.stream, 0)
        await js.publish(subjects.batches(), msgpack.packb({"v": 1, "i": n}))
        reads = 0
        get_msg = type(js).get_msg

        async def counting(self: object, stream: str, *args: object, **kwargs: object) -> object:
            nonlocal reads
            reads += stream == subjects.dead_stream
            return await get_msg(self, stream, *args, **kwargs)

        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(type(js), "get_msg", counting)
            mark = await stream_mark(nc, subjects)
        assert mark is not None and (mark.first_seq, mark.gone_before, mark.dead_in_flight) == (n + 1, 0, ()), mark
        assert reads == account_mod.MARK_QUIET_LETTERS, reads
    finally:
        await nc.close()


async def test_marks_taken_while_a_loader_refuses_batches_account_for_every_one(
        nats_server: NatsServer, job_name: str) -> None:
    """The race itself: a loader dead-letters batches one after another, as the data loader does (letter
    stored, then ``+TERM``), while marks are taken from another connection, as rank 0 takes its own at any
    moment. Every run that began at any of those marks was given exactly the batches dead-lettered after
    it: none lost, none counted twice."""
    subjects = Subjects(job_name)
    loader = await nats.connect(nats_server.url)
    rank0 = await nats.connect(nats_server.url)
    try:
        n = 120
        js = await stream_with_batches(loader, subjects, n)
        sub = await js.pull_subscribe_bind(durable=subjects.stream_consumer, stream=subjects.stream)

        async def refuse_all() -> None:
            done = 0
            while done < n:
                for msg in await sub.fetch(min(8, n - done), timeout=10):
                    await dead_letter(loader, subjects, msg.data, "not the job's schema: refused",
                                      msg.metadata.sequence.stream)
                    await msg.term()
                    done += 1

        async def take_marks() -> list[account_mod.StreamMark]:
            marks = []
            while not refusing.done():
                mark = await stream_mark(rank0, subjects)
                assert mark is not None
                marks.append(mark)
            return marks

        refusing = asyncio.create_task(refuse_all())
        marks = await take_marks()
        await refusing
        await wait_for_messages(js, subjects.stream, 0)
        assert len(marks) >= 5, len(marks)
        caught = 0
        for mark in marks:
            account = await stream_account(rank0, subjects, mark, ended=False)
            assert account is not None
            assert account["left"] == 0 and account["dead_lettered_again"] == 0, (mark, account)
            assert account["published"] == account["dead_lettered"], (mark, account)  # none lost, none twice
            caught += bool(mark.dead_in_flight)
        print(f"\n{len(marks)} marks while {n} batches were refused; {caught} fell between a letter and its removal")
    finally:
        await rank0.close()
        await loader.close()


async def test_a_letter_the_dead_stream_did_not_take_keeps_the_batch_and_is_not_counted(
        nats_server: NatsServer, job_name: str) -> None:
    """The data loader counts a batch dead-lettered once its letter is stored; one it could not store stays
    in the stream (given back, it comes again) and counts as a failure, not as dead-lettered as well."""
    subjects = Subjects(job_name)
    nc = await nats.connect(nats_server.url)
    try:
        await ensure_streams(nc, subjects)
        loader = StreamLoader(nc, subjects, BatchSender(nc, subjects), DataLoaderConfig(), slots=("a",))
        js = nc.jetstream()
        await js.publish(subjects.batches(), b"\x92not a batch")
        await js.delete_stream(subjects.dead_stream)  # the letter has nowhere to go
        await handle_next(loader, nc, subjects)
        assert (loader.counters["dead_letter_failures"], loader.counters["dead_lettered"]) == (1, 0), loader.counters
        assert (await js.stream_info(subjects.stream)).state.messages == 1  # kept, given back
        await ensure_streams(nc, subjects)  # the dead-letter stream again: the batch comes back after 1 s
        await handle_next(loader, nc, subjects)
        assert (loader.counters["dead_letter_failures"], loader.counters["dead_lettered"]) == (1, 1), loader.counters
        await wait_for_messages(js, subjects.stream, 0)
        letter = await js.get_msg(subjects.dead_stream, 1)
        assert letter.data == b"\x92not a batch" and letter.headers is not None
    finally:
        await nc.close()


async def test_a_stream_deleted_and_made_again_during_the_run_fails_the_account(
        nats_server: NatsServer, job_name: str) -> None:
    """What the first stream held went with it: the account cannot say what became of those batches, and
    says so, where its counts from the new stream's sequence numbers would have read as nothing lost."""
    subjects = Subjects(job_name)
    nc = await nats.connect(nats_server.url)
    try:
        js = await stream_with_batches(nc, subjects, 5)
        mark = await stream_mark(nc, subjects)
        assert mark is not None and mark.created is not None and mark.first_seq == 1
        same = await stream_account(nc, subjects, mark, ended=False)
        assert same is not None and same["stream_made_again"] is False and same["left"] == 5, same
        await js.delete_stream(subjects.stream)
        await ensure_streams(nc, subjects)  # as a data loader starting again would
        await js.publish(subjects.batches(), msgpack.packb({"v": 1, "i": 5}))
        account = await stream_account(nc, subjects, mark, ended=False)
        assert account is not None and account["stream_made_again"] is True, account
        line = verdict({**account, "trained_once": 0, "trained_more_than_once": 0, "lost": 0}, 0.0)
        assert line is not None and line.startswith("the ingestion stream was deleted and made again"), line
    finally:
        await nc.close()
