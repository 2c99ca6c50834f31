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


def _burn(seconds: float) -> None:
    import time

    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_host_work_counts_the_threads_cpu_not_its_waits():
    import time

    figures = TrainingFigures()
    with figures.host_work():
        _burn(0.05)
    burned = figures.counters["train_host_cpu_us"]
    assert 50_000 <= burned < 500_000, burned
    with figures.host_work():
        time.sleep(0.2)  # waiting for a batch: no CPU of this thread
    assert figures.counters["train_host_cpu_us"] - burned < 20_000, figures.counters


def test_host_timed_counts_producing_each_item_not_what_the_loop_does_with_it():
    def batches():
        for i in range(3):
            _burn(0.02)
            yield i

    figures = TrainingFigures()
    seen = []
    for item in figures.host_timed(batches()):
        seen.append(item)
        _burn(0.05)  # the model's step: not the runtime's work
    assert seen == [0, 1, 2]
    assert 60_000 <= figures.counters["train_host_cpu_us"] < 140_000, figures.counters


def test_host_timed_passes_on_an_error_with_the_time_counted():
    def failing():
        _burn(0.02)
        raise RuntimeError("lookup failed")
        yield  # a generator

    figures = TrainingFigures()
    try:
        list(figures.host_timed(failing()))
    except RuntimeError as exc:
        assert str(exc) == "lookup failed"
    else:
        raise AssertionError("the error was swallowed")
    assert figures.counters["train_host_cpu_us"] >= 20_000
