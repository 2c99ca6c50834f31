"""What an NN rank counts and what its training loop reports, for status replies and metrics."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any


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


__all__ = ["TrainingFigures"]
