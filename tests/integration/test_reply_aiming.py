"""Issue 38's attacks on replies and inboxes, each from the weakest user that could try it, against the
shipped secure configuration (deploy/nats-secure.conf with deploy/nats-auth.conf) on a real nats-server.

1. A request whose reply subject is the JetStream API (`$JS.API.STREAM.PURGE.<stream>`) makes no
   responder purge or delete the stream: the server refuses a reply outside the caller's inbox, and
   common/rpc.py drops such a request unserved (counted, logged) before that.
2. The outside users read no reply but their own.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator

import nats
import pytest
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import Empty
from persia_nats.common.rpc import RpcServer, request
from persia_nats.common.subjects import SERVE_QUEUE
from persia_nats.services.embedding_ps.service import EmbeddingParameterServer

from tests.integration.helpers import global_config, settle
from tests.integration.test_access_control import JOB, S, connect_as, role_env, run_secure_server
from tests.natsserver import NatsServer


@pytest.fixture(scope="module")
def secure_server() -> Iterator[NatsServer]:
    yield from run_secure_server()

AIMS = [f"$JS.API.STREAM.PURGE.{S.stream}", f"$JS.API.STREAM.DELETE.{S.stream}",
        f"$JS.API.CONSUMER.DELETE.{S.stream}.{S.stream_consumer}", f"$JS.API.STREAM.LEADER.STEPDOWN.{S.stream}",
        "$SYS.REQ.SERVER.PING", "$SRV.PING", S.nn_end(0), S.batches()]


async def client_as(server: NatsServer, user: str, errors: list[Exception]) -> nats.NATS:
    """A plain nats-py client with the user's options (its inbox prefix included), errors collected."""

    async def error_cb(exc: Exception) -> None:
        errors.append(exc)

    return await nats.connect(server.url, error_cb=error_cb, allow_reconnect=False,
                              **role_env(server, user).nats_options())


async def stream_with_batches(admin: nats.NATS, n: int) -> None:
    js = admin.jetstream()
    await js.add_stream(name=S.stream, subjects=[S.batches()])
    await js.add_consumer(S.stream, durable_name=S.stream_consumer, ack_policy="explicit")
    for i in range(n):
        await js.publish(S.batches(), f"batch-{i}".encode(), timeout=5)


async def wait_for(condition, timeout: float = 3.0) -> None:
    for _ in range(int(timeout / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)


async def test_error_replies_aimed_at_the_jetstream_api_purge_nothing(
        secure_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """`predict-client` sends malformed `serve.predict` requests whose reply subjects are the stream's
    purge, delete, its consumer's delete, a leader step-down, `$SYS`, `$SRV` and job subjects. Our
    responder (the RpcServer of the inference server, under `serving`) drops each unserved, counted;
    a responder that answers blindly (any NATS client, under `serving`) is refused by the server."""
    admin = await connect_as(secure_server, "admin")
    serving = await connect_as(secure_server, "serving")
    attacker_errors: list[Exception] = []
    attacker = await client_as(secure_server, "predict-client", attacker_errors)
    served: list[object] = []

    async def handler(req: object) -> dict:
        served.append(req)
        raise BadRequest("malformed")

    rpc = RpcServer(serving)
    try:
        await stream_with_batches(admin, 3)
        await rpc.add(S.serve_predict(), handler, queue=SERVE_QUEUE, request=None)
        await settle(serving)
        with caplog.at_level(logging.WARNING, logger="persia_nats.common.rpc"):
            for aim in AIMS:
                await attacker.publish(S.serve_predict(), b"\x80", reply=aim)
            await attacker.flush()
            await wait_for(lambda: rpc.bad_replies[S.serve_predict()] == len(AIMS))
        assert rpc.bad_replies[S.serve_predict()] == len(AIMS) and served == [] and not rpc.requests
        assert rpc.summary()["bad_replies"] == len(AIMS)
        assert "is not an inbox" in caplog.text and "STREAM.PURGE" in caplog.text
        # its own requests are still served, with an error reply on its own inbox
        reply = await attacker.request(S.serve_predict(), b"\x80", timeout=5)
        assert (reply.headers or {}).get("Nats-Service-Error-Code") == "400" and len(served) == 0
        assert attacker_errors == []  # publishing with any reply subject is the attacker's right

        # the server's own defence: a responder that replies wherever it is asked to, under `serving`
        blind_errors: list[Exception] = []
        blind = await client_as(secure_server, "serving", blind_errors)

        async def reply_blindly(msg: nats.aio.msg.Msg) -> None:
            await blind.publish(msg.reply, b"", headers={"Nats-Service-Error-Code": "400"})

        await blind.subscribe(S.serve_info(), cb=reply_blindly)
        await settle(blind)
        for aim in AIMS:
            await attacker.publish(S.serve_info(), b"", reply=aim)
        await attacker.flush()
        await wait_for(lambda: len(blind_errors) >= len(AIMS))
        refused = " ".join(str(e).lower() for e in blind_errors)
        for aim in AIMS:
            assert f'permissions violation for publish to "{aim.lower()}"' in refused, aim
        await blind.close()

        info = await admin.jetstream().stream_info(S.stream)
        assert info.state.messages == 3, info.state
        consumer = await admin.jetstream().consumer_info(S.stream, S.stream_consumer)
        assert consumer.num_pending == 3
    finally:
        await rpc.drain(1)
        try:
            await admin.jetstream().delete_stream(S.stream)
        except Exception:  # not created: the test failed before
            pass
        for nc in (attacker, serving, admin):
            await nc.close()


async def test_a_ps_error_reply_aimed_at_the_stream_by_an_nn_worker_deletes_nothing(secure_server: NatsServer) -> None:
    """The issue's other path: a PS's error reply to `ps.<i>.info`, asked by `nn-worker` (which may
    publish there) with the stream's delete as its reply subject."""
    admin = await connect_as(secure_server, "admin")
    ps_nc = await connect_as(secure_server, "ps")
    nn_errors: list[Exception] = []
    nn = await client_as(secure_server, "nn-worker", nn_errors)
    ps = EmbeddingParameterServer(ps_nc, global_config(JOB), 0, 1)
    try:
        await stream_with_batches(admin, 2)
        await ps.start()
        await settle(ps_nc)
        for aim in (f"$JS.API.STREAM.DELETE.{S.stream}", f"$JS.API.STREAM.PURGE.{S.stream}"):
            await nn.publish(S.ps(0, "info"), b"\x80", reply=aim)
        await nn.flush()
        await wait_for(lambda: ps.rpc.bad_replies[S.ps(0, "info")] == 2)
        assert ps.rpc.bad_replies[S.ps(0, "info")] == 2
        assert ps.status_map(0, "ps-0")["stats"]["bad_replies"] == 2
        assert (await admin.jetstream().stream_info(S.stream)).state.messages == 2
        # a request on its own inbox is answered as before
        assert (await request(nn, S.ps(0, "info"), Empty(), 5))["replica_index"] == 0
        assert nn_errors == []
    finally:
        await ps.stop(drain_timeout=2)
        try:
            await admin.jetstream().delete_stream(S.stream)
        except Exception:
            pass
        for nc in (nn, ps_nc, admin):
            await nc.close()


@pytest.mark.parametrize("user", ["publisher", "predict-client"])
async def test_outside_users_read_no_reply_but_their_own(secure_server: NatsServer, user: str) -> None:
    """`_INBOX.>` (every batch, embedding and prediction in flight) and the other users' inboxes are
    refused; the user's own inbox works (a JetStream ack for the publisher, a reply for the client)."""
    errors: list[Exception] = []
    nc = await client_as(secure_server, user, errors)
    admin = await connect_as(secure_server, "admin")
    try:
        others = ["_INBOX.>", "_INBOX.*.>", "_INBOX.nn-worker.>", "_INBOX.data-loader.>", "_INBOX.admin.>",
                  "_INBOX.publisher.>" if user == "predict-client" else "_INBOX.predict-client.>", ">"]
        for subject in others:
            await nc.subscribe(subject)
        await settle(nc)
        await wait_for(lambda: len(errors) >= len(others))
        refused = " ".join(str(e).lower() for e in errors)
        for subject in others:
            assert f'permissions violation for subscription to "{subject.lower()}"' in refused, subject
        # a reply another user waits for does not reach this one
        leaked: list[bytes] = []

        async def on_msg(msg: nats.aio.msg.Msg) -> None:
            leaked.append(msg.data)

        own = await nc.subscribe(f"_INBOX.{user}.>", cb=on_msg)
        await settle(nc)
        await admin.publish("_INBOX.nn-worker.x.1", b"an embedding reply")
        await admin.publish(f"_INBOX.{user}.x.1", b"its own")
        await admin.flush()
        await wait_for(lambda: bool(leaked))
        await asyncio.sleep(0.1)
        assert leaked == [b"its own"]
        await own.unsubscribe()
    finally:
        await nc.close()
        await admin.close()
