"""PERSIA's ``persia.helper`` (``ensure_persia_service``, ``PersiaServiceCtx``): refused with what to use instead.

PERSIA spawned nats-server, the servers and cloudpickled functions as subprocesses for local tests; here a
local job is the Procfile ``persia-launcher procfile`` writes, run with honcho (docs/operations.md).
"""

from __future__ import annotations

from typing import Any

_INSTEAD = ("run a local job from the Procfile `persia-launcher procfile` writes, with `honcho start` "
            "(docs/operations.md); each role is then a script or a `persia-launcher` command, not a pickled function")


def ensure_persia_service(*args: Any, **kwargs: Any) -> Any:
    raise NotImplementedError(f"persia.helper.ensure_persia_service is not supported: {_INSTEAD}")


class PersiaServiceCtx:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError(f"persia.helper.PersiaServiceCtx is not supported: {_INSTEAD}")


__all__ = ["PersiaServiceCtx", "ensure_persia_service"]
