"""The example publisher against a message id someone else claimed first (issue 38, item 3): the stream
keeps the first message under an id for its duplicate window and acks a later one as a duplicate
without storing it. A first send acked as a duplicate is a lost batch, and the publisher says so."""

from __future__ import annotations

import sys

import msgpack
import nats
import pytest

from tests.procs import ROOT

sys.path.insert(0, str(ROOT / "examples" / "clients"))
import publish_stream  # noqa: E402


async def test_a_pre_claimed_id_stops_the_publisher_and_a_resumed_run_skips_what_is_held(nats_server, job_name):
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    subject = f"persia.{job_name}.batches"
    await js.add_stream(name=f"PERSIA_{job_name}", subjects=[subject])
    try:
        junk = msgpack.packb({"v": 1, "junk": True})
        await js.publish(subject, junk, headers={"Nats-Msg-Id": "run-0"})  # the squatter's copy
        real = msgpack.packb({"v": 1, "end": True})
        with pytest.raises(publish_stream.DuplicateIdError, match="'run-0'.*this run did not send"):
            await publish_stream.publish_with_retry(js, subject, real, "run-0", patience=5)
        # resuming a run of ours: what the stream holds under our ids is not sent again, and not an error
        assert await publish_stream.publish_with_retry(js, subject, real, "run-0", patience=5, resuming=True) == -1
        assert await publish_stream.publish_with_retry(js, subject, real, "run-1", patience=5) > 0
        state = (await js.stream_info(f"PERSIA_{job_name}")).state
        assert state.messages == 2, state
    finally:
        await js.delete_stream(f"PERSIA_{job_name}")
        await nc.close()
