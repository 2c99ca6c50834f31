"""One warning line per PERSIA argument that has no effect here, once per process (a loop may pass it often)."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("persia")
_warned: set[str] = set()


def no_effect(where: str, name: str, value: Any, why: str) -> None:
    """Log ``where(name=value) has no effect here: why``, the first time ``where`` and ``name`` come by."""
    if (key := f"{where}.{name}") in _warned:
        return
    _warned.add(key)
    log.warning("%s(%s=%r) has no effect here: %s", where, name, value, why)
