"""The worker's CloudWatch sink (SLUICE_METRICS_SINK=cloudwatch, what the EKS
stack sets): its metrics reach CloudWatch by PutMetricData, in the namespace
and dimension the dashboard reads, since EKS's log agent does not turn EMF
lines on stdout into metrics."""

from __future__ import annotations

import logging
import sys
from datetime import datetime, timedelta, timezone
from http.server import BaseHTTPRequestHandler
from types import SimpleNamespace

import boto3
import pytest

from sluice.worker.metrics import METRICS, NAMESPACE, WorkerMetrics, dimensions
from tests.http_stub import serving

DIMENSIONS = dimensions("sluice")  # the default deployment's
CW_DIMENSIONS = [{"Name": k, "Value": v} for k, v in DIMENSIONS.items()]


def fake_torch():
    """A GPU with 3 MiB allocated, 42% busy."""
    return SimpleNamespace(cuda=SimpleNamespace(
        is_available=lambda: True, memory_allocated=lambda: 3 * 2**20, utilization=lambda: 42))


def outcome(task_id: str, error: str | None = None):
    return SimpleNamespace(job=SimpleNamespace(message=SimpleNamespace(task_id=task_id)), error=error)


@pytest.fixture
def sink(settings, monkeypatch, capsys):
    """A WorkerMetrics with the cloudwatch sink, on a GPU, from an empty metric set."""
    monkeypatch.delenv("POWERTOOLS_METRICS_DISABLED", raising=False)
    monkeypatch.setitem(sys.modules, "torch", fake_torch())
    # The default deployment (its prefix is only the metrics' dimension here).
    metrics = WorkerMetrics(settings=settings.model_copy(update={"metrics_sink": "cloudwatch", "queue_prefix": "sluice"}))
    metrics._metrics.clear_metrics()  # Powertools shares its metric set across instances
    capsys.readouterr()
    return metrics


def statistics() -> dict[str, dict[str, float]]:
    """{metric: {SampleCount, Sum}} of the worker's metrics over the last hour and the next."""
    cloudwatch = boto3.client("cloudwatch")
    now = datetime.now(timezone.utc)
    found = {}
    for name in METRICS:
        points = cloudwatch.get_metric_statistics(
            Namespace=NAMESPACE, MetricName=name, Dimensions=CW_DIMENSIONS, StartTime=now - timedelta(hours=1),
            EndTime=now + timedelta(hours=1), Period=7200, Statistics=["SampleCount", "Sum"])["Datapoints"]
        found[name] = {s: sum(p[s] for p in points) for s in ("SampleCount", "Sum")}
    return found


def added(before: dict, after: dict) -> dict[str, tuple[float, float]]:
    """(samples, sum) each metric gained, for those that gained any."""
    gained = {name: (after[name]["SampleCount"] - before[name]["SampleCount"],
                     after[name]["Sum"] - before[name]["Sum"]) for name in after}
    return {name: g for name, g in gained.items() if g != (0, 0)}


def test_the_cloudwatch_sink_puts_every_metric_in_the_namespace_and_dimension_and_prints_nothing(sink, capsys):
    before = statistics()
    sink.record_batch(8, 12)
    sink.record_outcomes([outcome("a"), outcome("b"), outcome("c", "RuntimeError: boom"), outcome("d")], 0,
                         rejected={"d"})
    sink.record_handed_back(2)
    sink.flush()

    assert capsys.readouterr().out == ""  # no EMF line: on EKS it would only be a log line
    listed = boto3.client("cloudwatch").list_metrics(Namespace=NAMESPACE, Dimensions=CW_DIMENSIONS)["Metrics"]
    assert {m["MetricName"] for m in listed} == set(METRICS)
    assert all(m["Namespace"] == NAMESPACE == "Sluice" and m["Dimensions"] == CW_DIMENSIONS for m in listed)
    gained = added(before, statistics())
    assert gained.pop("Throughput") == (1, pytest.approx(8 / 0.012))
    assert gained == {
        "BatchSize": (1, 8), "InferenceLatency": (1, 12), "TasksSucceeded": (2, 2), "TaskAttemptsFailed": (1, 1),
        "TaskAttemptsDropped": (1, 1), "TasksHandedBack": (1, 2), "GpuUtilization": (1, 42), "GpuMemoryUsed": (1, 3),
    }


def test_a_busy_window_puts_every_value_even_past_what_powertools_holds_in_one_set(sink, capsys):
    # Powertools prints a set by itself once one metric holds 100 values;
    # with this sink those outcomes must still reach CloudWatch.
    before = statistics()
    for batch in range(10):
        sink.record_batch(25, 5)
        sink.record_outcomes([outcome(f"{batch}-{i}") for i in range(25)], 0)
    sink.flush()

    assert capsys.readouterr().out == ""
    gained = added(before, statistics())
    assert gained["TasksSucceeded"] == (250, 250)
    assert gained["BatchSize"] == (10, 250)
    assert gained["InferenceLatency"] == (10, 50)


class Refusing(BaseHTTPRequestHandler):
    """A CloudWatch endpoint that refuses every call (as for a role without
    cloudwatch:PutMetricData); counts the calls."""
    calls = 0

    def do_POST(self):
        type(self).calls += 1
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(403)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_refused_put_metric_data_drops_the_window_and_never_reaches_the_worker(sink, monkeypatch, capsys, caplog):
    before = statistics()
    with serving(Refusing) as url:
        monkeypatch.setenv("AWS_ENDPOINT_URL_CLOUDWATCH", url)
        sink.record_batch(8, 12)
        sink.record_outcomes([outcome("a")], 0)
        with caplog.at_level(logging.WARNING, logger="sluice.worker.metrics"):
            sink.flush()  # must not raise
    assert Refusing.calls >= 1
    assert "PutMetricData failed" in caplog.text
    assert capsys.readouterr().out == ""

    # The refused window is gone; the next one goes out on its own.
    monkeypatch.delenv("AWS_ENDPOINT_URL_CLOUDWATCH")
    sink.record_outcomes([outcome("b")], 0)
    sink.flush()
    assert added(before, statistics()) == {"TasksSucceeded": (1, 1)}
