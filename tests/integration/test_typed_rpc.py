"""RpcServer decodes each request into the type its subject was registered with, on a real nats-server:
the handler gets the object, a malformed request is answered 400 naming the field and counted, and the
handler never sees it."""

from __future__ import annotations

import nats
import pytest
from persia_nats.common.codec import pack
from persia_nats.common.errors import BadRequest
from persia_nats.common.messages import NNEnd, Ok
from persia_nats.common.rpc import RpcServer, request

from tests.integration.helpers import settle


async def test_handlers_get_the_request_type_and_refusals_are_named_and_counted(nats_server):
    server_nc, client = await nats.connect(nats_server.url), await nats.connect(nats_server.url)
    rpc = RpcServer(server_nc)
    subject = f"typed.test.{id(rpc)}"
    seen: list[object] = []

    async def on_end(end: NNEnd) -> Ok:
        seen.append(end)
        return Ok()

    try:
        await rpc.add(subject, on_end, request=NNEnd)
        await settle(server_nc)
        reply = await request(client, subject, NNEnd(1, 2, 7), 5)
        assert Ok.from_wire(reply) == Ok() and seen == [NNEnd(1, 2, 7)]
        assert Ok.from_wire(await request(client, subject, NNEnd(final=True), 5)) == Ok()
        for bad, field in (({"v": 1, "final": "yes"}, "final"),
                           ({"v": 1, "loader_index": 2, "loader_size": 2, "batches": 0}, "loader_index"),
                           ({"v": True, "final": True}, "version")):
            with pytest.raises(BadRequest, match=field):
                await request(client, subject, pack(bad), 5)
        assert seen == [NNEnd(1, 2, 7), NNEnd(final=True)]  # the refused ones never reached the handler
        assert rpc.requests[subject] == 5 and rpc.errors[(subject, 400)] == 3
    finally:
        await rpc.drain(5)
        await client.close()
        await server_nc.close()
