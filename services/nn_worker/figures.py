"""What an NN rank counts and what its training loop reports, for status replies and metrics."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

T = TypeVar("T")


class TrainingFigures:
    """A rank's counters, the gauges its training script and DataLoader report, and the latest loss.

    The runtime's owners count into :attr:`counters`, handed to each at construction; the training
    thread reports through the methods. :meth:`NNRuntime.stats` reads them all when a status reply or
    a scrape asks.
    """

    def __init__(self) -> None:
        self.counters: Counter[str] = Counter()
        self._gauges: dict[str, float] = {}
        # a tensor, read only when scraped: converting it at every step would sync the device each time
        self._loss: Any = None

    def count(self, key: str, n: int = 1) -> int:
        """Add ``n`` to counter ``key``; its new value."""
        self.counters[key] += n
        return self.counters[key]

    def host_work(self) -> _HostWork:
        """Counts the training thread's CPU inside the block into ``train_host_cpu_us``: the runtime's own work
        there (a batch taken and made tensors, its leaf gradients handed off), which the model and the
        dense step are not. Thread CPU time, so waiting for a batch counts nothing."""
        return _HostWork(self.counters)

    def host_timed(self, items: Iterable[T]) -> Iterator[T]:
        """``items``, the work of producing each counted as :meth:`host_work`."""
        it = iter(items)
        while True:
            with self.host_work():
                item = next(it, _END)
            if item is _END:
                return
            yield item

    def report(self, figures: Mapping[str, float]) -> None:
        """Gauges the training script reports (``EmbeddingCtx.report``), until replaced."""
        self._gauges.update(figures)

    def set_gauge(self, name: str, value: float) -> None:
        """One gauge the training loop keeps (the DataLoader's ``samples_per_second``)."""
        self._gauges[name] = value

    def set_loss(self, loss: Any) -> None:
        """The loss of the latest ``backward()``: a number, or a tensor converted only when read."""
        self._loss = loss

    def loss(self) -> float | None:
        return None if self._loss is None else float(self._loss)

    def gauges(self) -> dict[str, float]:
        return dict(self._gauges)


_END: Any = object()


class _HostWork:
    __slots__ = ("_counters", "_start")

    def __init__(self, counters: Counter[str]) -> None:
        self._counters = counters
        self._start = 0

    def __enter__(self) -> None:
        self._start = time.thread_time_ns()

    def __exit__(self, *exc: object) -> None:
        self._counters["train_host_cpu_us"] += (time.thread_time_ns() - self._start) // 1000


__all__ = ["TrainingFigures"]
