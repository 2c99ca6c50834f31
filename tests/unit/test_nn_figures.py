"""What an NN rank's training loop reports, and the call timer its metrics endpoint exports."""

from __future__ import annotations

from persia_nats.services.nn_worker.figures import TrainingFigures
from persia_nats.services.nn_worker.metrics import CallTimes
from prometheus_client import CollectorRegistry


class _Loss:
    """Stands in for a loss tensor: counts its conversions (each would sync the device)."""

    def __init__(self, value: float) -> None:
        self.value, self.reads = value, 0

    def __float__(self) -> float:
        self.reads += 1
        return self.value


def test_the_loss_is_converted_only_when_read():
    figures = TrainingFigures()
    assert figures.loss() is None
    loss = _Loss(0.25)
    for _ in range(3):
        figures.set_loss(loss)
    assert loss.reads == 0
    assert figures.loss() == 0.25 and loss.reads == 1


def test_counts_and_gauges_are_kept_apart_and_replaced_by_name():
    figures = TrainingFigures()
    assert figures.count("batches_failed") == 1 and figures.count("batches_failed", 2) == 3
    figures.report({"test_auc": 0.5, "epoch": 1.0})
    figures.report({"test_auc": 0.75})
    figures.set_gauge("samples_per_second", 10.0)
    assert figures.gauges() == {"test_auc": 0.75, "epoch": 1.0, "samples_per_second": 10.0}
    assert dict(figures.counters) == {"batches_failed": 3}


def test_calls_are_counted_only_once_exported():
    calls = CallTimes()
    calls.observe("lookup", 0.1)  # before an endpoint serves: nothing to count into
    registry = CollectorRegistry(auto_describe=False)
    calls.export(registry, ("nn-worker", "job", "0"))
    calls.observe("lookup", 0.2)
    calls.observe("grad", 0.3)
    calls.observe("unknown", 1.0)
    labels = {"role": "nn-worker", "persia_job": "job", "replica": "0"}
    count = registry.get_sample_value
    assert count("persia_nn_worker_lookup_duration_seconds_count", labels) == 1
    assert count("persia_nn_worker_lookup_duration_seconds_sum", labels) == 0.2
    assert count("persia_nn_worker_grad_push_duration_seconds_count", labels) == 1
