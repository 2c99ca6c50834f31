"""A bounded, expiring map from batch ref to what a batch left with the worker."""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Generic, TypeVar

from common.errors import Busy, NotFound

log = logging.getLogger(__name__)

T = TypeVar("T")


class RefBuffer(Generic[T]):
    """Insertion-ordered, bounded by ``capacity``, entries older than ``expire_s`` are dropped.

    A full buffer refuses with :class:`Busy` (the sender backs off and retries, so nothing is lost);
    expired entries are counted in ``expired`` and logged, never dropped silently.
    """

    def __init__(self, name: str, capacity: int, expire_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.name = name
        self.capacity = capacity
        self.expire_s = expire_s
        self._clock = clock
        self._items: OrderedDict[int, tuple[float, T]] = OrderedDict()
        # random start so refs from a restarted worker do not collide with stale ones
        self._next = itertools.count(random.getrandbits(40))
        self.expired = 0

    def __len__(self) -> int:
        return len(self._items)

    def _expire(self) -> None:
        deadline = self._clock() - self.expire_s
        while self._items:
            ref, (born, _) = next(iter(self._items.items()))
            if born >= deadline:
                break
            del self._items[ref]
            self.expired += 1
            log.warning("%s: batch ref %d expired after %.0fs unclaimed", self.name, ref, self.expire_s)

    def ensure_room(self) -> None:
        """Raise Busy when full (after dropping expired entries): lets a caller refuse before it does
        the work of making an item."""
        self._expire()
        if len(self._items) >= self.capacity:
            raise Busy(f"{self.name} is full ({self.capacity} batches); retry later")

    def put(self, item: T, ref: int | None = None) -> int:
        """Store ``item`` and return its ref; raise Busy when full."""
        self.ensure_room()
        if ref is None:
            ref = next(self._next)
        self._items[ref] = (self._clock(), item)
        return ref

    def restore(self, ref: int, item: T) -> None:
        """Put back an item just popped (a failed request): never refused, so it cannot be lost."""
        self._items[ref] = (self._clock(), item)

    def pop(self, ref: int) -> T:
        try:
            return self._items.pop(ref)[1]
        except KeyError:
            raise NotFound(f"{self.name}: no batch with ref {ref} (never sent, already consumed, or expired)") from None
