"""Shutdown without noise: a connection its owner is closing does not warn about its server going away.

Under ``honcho start`` nats-server stops together with every service, and each draining service used to
print ``nats error: ... Connection refused`` for every reconnect attempt after the job's result line.
"""

from __future__ import annotations

import asyncio
import logging

from persia_nats.common.service import closing, connect

from tests.natsserver import start_nats_server


class _Reported(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen = asyncio.Event()

    def emit(self, record: logging.LogRecord) -> None:
        if "nats error" in record.getMessage():
            self.seen.set()


async def test_a_closing_connection_logs_its_servers_absence_at_debug_level_only(caplog):
    server = start_nats_server()
    reported = _Reported()
    logging.getLogger("persia_nats.common.service").addHandler(reported)
    try:
        nc = await connect(server.url, "closing")
        caplog.set_level(logging.DEBUG, logger="persia_nats.common.service")
        closing(nc)
        server.kill()
        await reported.seen.wait()  # a reconnect attempt has failed and been reported
        await nc.close()
    finally:
        logging.getLogger("persia_nats.common.service").removeHandler(reported)
        server.stop()
    reported = [r for r in caplog.records if "nats error" in r.getMessage()]
    assert reported and all(r.levelno == logging.DEBUG for r in reported), [(r.levelname, r.getMessage())
                                                                             for r in reported]
