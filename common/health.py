"""Liveness and readiness of a role, asked over NATS (``persia-launcher health``).

Two questions, because a probe that conflates them either kills a replica in the middle of a long
checkpoint load or sends work to one that cannot do it yet:

- **live**: the role's process answers its info subject at all. Each role answers from early in its
  start (a PS before it loads its shard), so a long legitimate operation stays live.
- **ready**: it can do its job now, judged from that same answer:

  ============================  =====================================  ============================================
  target                        subject                                ready when
  ============================  =====================================  ============================================
  embedding-parameter-server    ``ps.<i>.info``                        ``ready``: its shard is loaded and it serves
                                                                       lookups (``waiting_for`` says what it waits on)
  embedding-worker              ``ew.replica.<i>.info``                it answers: it subscribes only once it found
                                                                       every PS replica and configured them
  nn-worker                     ``nn.info``                            ``ready``: the rendezvous of its ranks is done
  serve                         ``serve.info``                         ``checkpoint`` names a loaded checkpoint
  ============================  =====================================  ============================================

Each subject is one its role's NATS user may request (common/permissions.py, where persia/commands.py
names them), so the check runs in the role's own container with the role's own credentials.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client as NATS
from persia_nats.common.errors import PersiaError, describe
from persia_nats.common.messages import Empty
from persia_nats.common.rpc import request

TARGETS = ("embedding-parameter-server", "embedding-worker", "nn-worker", "serve")


@dataclass(frozen=True, slots=True)
class Health:
    """One check's outcome: ``live`` (the role answered), ``ready`` and, when not, ``why``."""

    target: str
    subject: str
    live: bool
    ready: bool
    why: str = ""
    info: Mapping[str, Any] = field(default_factory=dict)


def not_ready_reason(target: str, info: Mapping[str, Any]) -> str:
    """Why a role that answered with ``info`` cannot do its job yet; "" when it can."""
    if target in ("embedding-parameter-server", "nn-worker") and "ready" not in info:
        return "its info reply has no 'ready'"
    if target == "embedding-parameter-server":
        if info["ready"] is True:
            return ""
        return f"waiting for {info.get('waiting_for') or 'its start'}"
    if target == "nn-worker":
        return "" if info["ready"] is True else "waiting for the rendezvous of its NN ranks"
    if target == "serve":
        if info.get("checkpoint"):
            return ""
        rejected = info.get("rejected")
        tried = f"; rejected: {', '.join(sorted(rejected))}" if isinstance(rejected, Mapping) and rejected else ""
        return f"no checkpoint loaded yet (predict answers 503 until one is){tried}"
    return ""  # embedding-worker: it answers only once it can work


async def check(nc: NATS, subject: str, target: str, timeout: float) -> Health:
    """Ask ``target`` on its info ``subject`` (``persia.launcher.health_subject``) and judge its answer;
    never raises for an absent or failing role."""
    try:
        info = dict(await request(nc, subject, Empty(), timeout))
    except PersiaError as exc:
        return Health(target, subject, live=False, ready=False, why=describe(exc))
    why = not_ready_reason(target, info)
    return Health(target, subject, live=True, ready=not why, why=why, info=info)
