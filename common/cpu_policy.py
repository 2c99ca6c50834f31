"""How a role's threads yield the CPU to the NN worker's on cores they share.

On one host (``honcho start``, ``persia-launcher`` roles side by side, a small machine) the PS, the
embedding workers and the data loader run on the cores the NN worker's dense step needs. The NN
worker's training thread is the job's critical path: every time another role wakes up on a message
and takes one of its cores, the dense step's threads wait for each other at the next barrier, and a
core can sit idle while the step's other thread waits to run. Linux's ``SCHED_IDLE`` policy runs a
thread only on a core nobody else wants and never lets it take one from a running thread, so the
sparse roles then fill the gaps of the dense step instead of stretching it. On 2 cores
(``benchmarks/bench_e2e.py``) that trained 20% more samples a second at batch 1024 and 7% more at 4096.

``PERSIA_CPU_POLICY`` chooses, per process:

- ``normal`` (or unset): the kernel's default policy (``SCHED_OTHER``).
- ``idle``: ``SCHED_IDLE``, for the PS, embedding workers and data loader on a host they share with
  the NN worker and nothing else. Never for the NN worker. On a host with other busy work an idle
  role gets next to no CPU, and its job crawls.
- ``batch``: ``SCHED_BATCH``: the kernel's default share, without preempting a running thread on
  wake-up.

Every thread of the process takes the policy, and so does every thread or process it starts later.
Containers are scheduled as groups (one cgroup each), so the policy orders threads within one
container only: between containers, give the sparse roles a small CPU weight instead (Docker's
``cpu_shares``). Where the platform has no such policies (not Linux) nothing is changed.

The NN worker's own threads share its cores too. torch runs its CPU work on an OpenMP team, whose
idle workers by default spin for up to about 3 ms after each parallel region before they sleep
(libgomp's default where its threads are no more than the cores). That time is taken from the NN
worker's I/O thread and from the sparse roles, so ``persia-launcher nn-worker`` starts each rank with
``OMP_WAIT_POLICY=PASSIVE`` (:func:`openmp_env`): the workers sleep as soon as a region ends. Set
``OMP_WAIT_POLICY`` (or ``GOMP_SPINCOUNT``, ``KMP_BLOCKTIME``) yourself to choose otherwise, say for
an NN worker alone on a host of many cores training on the CPU.

The nats-server is a Go program, and its garbage collector is about half of its CPU on a busy job: by
default (``GOGC=100``) Go collects whenever the heap doubles, and a server that relays every batch's
ids, rows and gradients allocates buffers for each message over a live heap of a few megabytes, so
the heap doubles many times a second. Every nats-server the project starts (the
Procfile, ``persia-launcher procfile``, the compose and Kubernetes files, the Helm chart, the test
and benchmark fixtures) runs with :data:`NATS_SERVER_GO_ENV`: ``GOGC=400`` lets the heap grow to five
times what is live before a collection, and ``GOMEMLIMIT`` caps that growth, so a server holding a
large backlog (up to ``max_pending`` per slow client) collects as often as it must to stay under the
cap instead of growing fivefold. On 2 cores at batch 1024 the server's CPU fell from 4.5-5.2 to 2.5-2.7
us a sample and its resident memory rose from 24 to 34 MB (``GOGC=1000`` saved no more CPU and took
60-80 MB). Set ``GOGC`` or ``GOMEMLIMIT`` in the server's environment to choose otherwise.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from persia_nats.common.errors import ConfigError

log = logging.getLogger(__name__)

CHOICES = ("normal", "batch", "idle")
ENV = "PERSIA_CPU_POLICY"
#: the variables that say how an OpenMP runtime's idle threads wait (GNU's and LLVM's / Intel's)
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
# nats-server's garbage collector (see above); the compose and Kubernetes files carry the same GOGC and a
# GOMEMLIMIT below their memory limit (tests/unit/test_deploy_files.py holds them to it)
NATS_SERVER_GO_ENV = {"GOGC": "400", "GOMEMLIMIT": "2GiB"}


def choice_from_env(environ: dict[str, str] | None = None) -> str:
    """The policy ``PERSIA_CPU_POLICY`` names (``normal`` when unset or empty).

    Raises:
        ConfigError: it names none of :data:`CHOICES`.
    """
    raw = (os.environ if environ is None else environ).get(ENV, "")
    choice = raw.strip().lower() or "normal"
    if choice not in CHOICES:
        raise ConfigError(f"{ENV}={raw!r}: expected one of {', '.join(CHOICES)}")
    return choice


def apply_cpu_policy(environ: dict[str, str] | None = None) -> str | None:
    """Give every thread of this process the policy ``PERSIA_CPU_POLICY`` names.

    Returns the policy set, or None where nothing was changed (``normal``, or a platform without
    ``sched_setscheduler``).

    Raises:
        ConfigError: ``PERSIA_CPU_POLICY`` names no policy, or the kernel refused it.
    """
    choice = choice_from_env(environ)
    if choice == "normal" or not sys.platform.startswith("linux") or not hasattr(os, "sched_setscheduler"):
        return None
    policy = os.SCHED_IDLE if choice == "idle" else os.SCHED_BATCH
    # a thread's policy is its own: set each one running now; threads made later inherit it
    for tid in _threads():
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except ProcessLookupError:  # the thread ended meanwhile
            continue
        except OSError as exc:
            raise ConfigError(f"{ENV}={choice}: the kernel refused it: {exc}") from None
    log.debug("CPU policy %s for every thread", choice)
    return choice


def openmp_env(environ: Mapping[str, str]) -> dict[str, str]:
    """What an NN worker rank's environment gets on top of ``environ``: ``OMP_WAIT_POLICY=PASSIVE``,
    unless ``environ`` sets one of :data:`OPENMP_WAIT_VARS` (the user's choice wins).

    The runtime reads it once, when torch loads it, so it goes into the rank's environment before
    the rank starts. On 2 cores at batch 1024, with the sparse roles beside it (``bench_e2e.py``'s
    pipeline), the NN worker with torch's two threads spinning waited for batches 36-39% of the time
    and trained 34.4-35.6k samples/s; with them passive, 12-16% and 37.4-40.5k (three runs each,
    taking turns). On an H100 host the training loop's worker spun 7.3 us a sample at batch 1024,
    more than the loop itself spent."""
    if any(environ.get(name, "").strip() for name in OPENMP_WAIT_VARS):
        return {}
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def nats_server_env(environ: Mapping[str, str]) -> dict[str, str]:
    """A nats-server's environment: ``environ`` with :data:`NATS_SERVER_GO_ENV` for what it leaves unset."""
    return {**NATS_SERVER_GO_ENV, **{k: v for k, v in environ.items() if k not in NATS_SERVER_GO_ENV or v.strip()}}


def _threads() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread at least
        return [0]


__all__ = ["CHOICES", "ENV", "NATS_SERVER_GO_ENV", "OPENMP_WAIT_VARS", "apply_cpu_policy", "choice_from_env",
           "nats_server_env", "openmp_env"]
