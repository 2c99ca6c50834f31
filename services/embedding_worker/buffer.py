"""A bounded, expiring map from batch ref to what a batch left with the worker."""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from persia_nats.common.errors import Busy, NotFound, PayloadTooLarge

log = logging.getLogger(__name__)

T = TypeVar("T")


class RefBuffer(Generic[T]):
    """Insertion-ordered, bounded by ``capacity`` entries and ``max_bytes`` (each entry's ``sizeof``).

    An entry older than ``expire_s`` is dropped; so is one older than ``full_expire_s`` once the
    buffer is full, so batches nobody claims (a client that ingests and never looks up) hold the room
    for seconds, not for ``expire_s``. A full buffer refuses with :class:`Busy` (the sender backs off
    and retries, so nothing is lost), or, through :meth:`wait_for_room`, lets a caller wait until an
    entry leaves; expired entries are counted in ``expired`` and logged, never dropped silently.
    """

    def __init__(self, name: str, capacity: int, expire_s: float, clock: Callable[[], float] = time.monotonic,
                 *, max_bytes: int | None = None, full_expire_s: float | None = None,
                 sizeof: Callable[[T], int] = lambda item: 0) -> None:
        self.name = name
        self.capacity = capacity
        self.expire_s = expire_s
        self.max_bytes = max_bytes
        self.full_expire_s = expire_s if full_expire_s is None else min(full_expire_s, expire_s)
        self._clock = clock
        self._sizeof = sizeof
        self._items: OrderedDict[int, tuple[float, int, T]] = OrderedDict()
        # random start so refs from a restarted worker do not collide with stale ones
        self._next = itertools.count(random.getrandbits(40))
        self.expired = 0
        self.nbytes = 0
        #: set whenever an entry leaves, for callers waiting for room; made on first use, inside the loop
        self._freed: asyncio.Event | None = None

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, ref: int) -> bool:
        return ref in self._items

    def _full(self, adding: int) -> bool:
        return len(self._items) >= self.capacity or (
            self.max_bytes is not None and self.nbytes + adding > self.max_bytes)

    def _expire(self, age_s: float) -> None:
        deadline = self._clock() - age_s
        while self._items:
            ref, (born, _, _) = next(iter(self._items.items()))
            if born >= deadline:
                break
            self._remove(ref)
            self.expired += 1
            log.warning("%s: batch ref %d expired after %.0fs unclaimed", self.name, ref, age_s)

    def _remove(self, ref: int) -> T:
        _, size, item = self._items.pop(ref)
        self.nbytes -= size
        if self._freed is not None:
            self._freed.set()
        return item

    async def wait_for_room(self, nbytes: int, wait_s: float, recheck_s: float = 1.0,
                            give_up: Callable[[], str | None] = lambda: None) -> None:
        """:meth:`ensure_room`, waiting up to ``wait_s`` seconds for an entry to leave; Busy after that,
        or as soon as ``give_up()`` says why not to wait any more (checked at each wake-up, see :meth:`wake`).

        Entries leave when popped (woken at once) or when they expire, which happens only as room is
        checked: hence a check every ``recheck_s`` too.
        """
        loop = asyncio.get_running_loop()
        end = loop.time() + wait_s
        if self._freed is None:
            self._freed = asyncio.Event()
        while True:
            try:
                self.ensure_room(nbytes)
                return
            except Busy:
                left = end - loop.time()
                reason = give_up()
                if reason is not None:
                    raise Busy(f"{self.name} is full and {reason}; retry later") from None
                if left <= 0:
                    raise
            self._freed.clear()
            try:
                await asyncio.wait_for(self._freed.wait(), min(left, recheck_s))
            except TimeoutError:
                pass

    def ensure_room(self, nbytes: int = 0) -> None:
        """Raise Busy when an entry of ``nbytes`` does not fit (after dropping expired entries): lets a
        caller refuse before it does the work of making an item."""
        if self.max_bytes is not None and nbytes > self.max_bytes:
            # waiting cannot help: answering "busy" would have the sender retry for ever
            raise PayloadTooLarge(f"{self.name}: a batch of {nbytes} bytes can never fit its {self.max_bytes}")
        self._expire(self.expire_s)
        if self._full(nbytes):
            self._expire(self.full_expire_s)
        if self._full(nbytes):
            raise Busy(f"{self.name} is full ({len(self._items)} of {self.capacity} batches, {self.nbytes} + "
                       f"{nbytes} bytes of {self.max_bytes}); retry later")

    def put(self, item: T, ref: int | None = None) -> int:
        """Store ``item`` and return its ref; raise Busy when full."""
        size = self._sizeof(item)
        self.ensure_room(size)
        if ref is None:
            ref = next(self._next)
        self._items[ref] = (self._clock(), size, item)
        self.nbytes += size
        return ref

    def restore(self, ref: int, item: T) -> None:
        """Put back an item just popped (a failed request): never refused, so it cannot be lost."""
        size = self._sizeof(item)
        self._items[ref] = (self._clock(), size, item)
        self.nbytes += size

    def get(self, ref: int) -> T:
        """The item of ``ref``, left in place."""
        try:
            return self._items[ref][2]
        except KeyError:
            raise NotFound(f"{self.name}: no batch with ref {ref} (never sent, already consumed, or expired)") from None

    def pop(self, ref: int) -> T:
        try:
            return self._remove(ref)
        except KeyError:
            raise NotFound(f"{self.name}: no batch with ref {ref} (never sent, already consumed, or expired)") from None

    def wake(self) -> None:
        """Have every :meth:`wait_for_room` check again now (and ask its ``give_up``)."""
        if self._freed is not None:
            self._freed.set()

    def clear(self) -> None:
        self._items.clear()
        self.nbytes = 0
        if self._freed is not None:
            self._freed.set()
