"""The workers' CloudWatch metrics (sluice/worker/metrics.py): the EMF lines they
print, and the dashboard built on them (cdk/observability_construct.py), which
must read the same namespace, dimension and names or show nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from sluice.worker.metrics import DIMENSIONS, METRICS, NAMESPACE, WorkerMetrics

ROOT = Path(__file__).resolve().parents[2]
GPU_METRICS = {"GpuUtilization", "GpuMemoryUsed"}


def fake_torch(cuda: bool):
    """What WorkerMetrics reads of torch, on a machine with or without a GPU
    (3 MiB allocated, 42% busy)."""
    return SimpleNamespace(cuda=SimpleNamespace(
        is_available=lambda: cuda, memory_allocated=lambda: 3 * 2**20, utilization=lambda: 42))


def emitted(capsys, monkeypatch, cuda: bool) -> dict:
    """The one EMF document a worker prints for a batch of 8 inputs (12 ms)
    with two tasks succeeded and one failed attempt."""
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda))
    monkeypatch.delenv("POWERTOOLS_METRICS_DISABLED", raising=False)
    metrics = WorkerMetrics()
    metrics._metrics.clear_metrics()  # Powertools shares its metric set across instances: start from none
    capsys.readouterr()
    metrics.record_batch(8, 12)
    metrics.record_outcomes([SimpleNamespace(error=None), SimpleNamespace(error=None),
                             SimpleNamespace(error="RuntimeError: boom")], 0)
    metrics.flush()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return json.loads(lines[0])


def test_a_gpu_worker_prints_every_metric_in_the_namespace_and_dimension(capsys, monkeypatch):
    emf = emitted(capsys, monkeypatch, cuda=True)
    [directive] = emf["_aws"]["CloudWatchMetrics"]
    assert directive["Namespace"] == NAMESPACE == "Sluice"  # the namespace docs/architecture.md names
    assert directive["Dimensions"] == [list(DIMENSIONS)]
    assert {name: emf[name] for name in DIMENSIONS} == DIMENSIONS == {"service": "worker"}
    units = {m["Name"]: m["Unit"] for m in directive["Metrics"]}
    assert units == {
        "BatchSize": "Count", "InferenceLatency": "Milliseconds", "Throughput": "Count/Second",
        "TasksSucceeded": "Count", "TaskAttemptsFailed": "Count", "GpuUtilization": "Percent",
        "GpuMemoryUsed": "Megabytes",
    }
    assert set(units) == set(METRICS)  # what the dashboard may use is what a worker prints
    values = {name: emf[name] if isinstance(emf[name], list) else [emf[name]] for name in units}
    assert {name: v for name, v in values.items() if name != "Throughput"} == {
        "BatchSize": [8], "InferenceLatency": [12], "TasksSucceeded": [1, 1], "TaskAttemptsFailed": [1],
        "GpuUtilization": [42], "GpuMemoryUsed": [3.0],
    }
    assert len(values["Throughput"]) == 1 and values["Throughput"][0] > 0


def test_a_worker_without_a_gpu_prints_no_gpu_figures(capsys, monkeypatch):
    emf = emitted(capsys, monkeypatch, cuda=False)
    [directive] = emf["_aws"]["CloudWatchMetrics"]
    assert {m["Name"] for m in directive["Metrics"]} == set(METRICS) - GPU_METRICS


def _dashboard_and_alarm_metrics() -> list[tuple[str, str, dict]]:
    """(namespace, name, dimensions) of every metric the Observability
    construct graphs or alarms on, synthesized in a stack of its own (queues
    real, the API stage's metrics stand-ins)."""
    cdk = pytest.importorskip("aws_cdk")
    from aws_cdk import aws_cloudwatch as cw
    from aws_cdk import aws_sqs as sqs
    from aws_cdk.assertions import Template

    from cdk.config import PRIORITIES, SluiceConfig
    from cdk.observability_construct import Observability

    stack = cdk.Stack(cdk.App(), "MetricsProbe")
    stage = SimpleNamespace(**{method: (lambda **kw: cw.Metric(namespace="AWS/ApiGateway", metric_name="Probe", **kw))
                               for method in ("metric_count", "metric_client_error", "metric_server_error",
                                              "metric_latency")})
    queues = SimpleNamespace(queues={p: sqs.Queue(stack, f"Queue{p}") for p in PRIORITIES},
                             dlqs={p: sqs.Queue(stack, f"Dlq{p}") for p in PRIORITIES})
    Observability(stack, "Observability", config=SluiceConfig(), queues=queues, api=SimpleNamespace(stage=stage),
                  functions={}, gpu_metrics=[], dashboard_name="probe")
    resources = Template.from_stack(stack).to_json()["Resources"].values()

    found = []
    [dashboard] = [r for r in resources if r["Type"] == "AWS::CloudWatch::Dashboard"]
    body = dashboard["Properties"]["DashboardBody"]
    parts = body["Fn::Join"][1] if isinstance(body, dict) else [body]
    text = "".join(p if isinstance(p, str) else "TOKEN" for p in parts)  # references (queue names) as placeholders
    for widget in json.loads(text)["widgets"]:
        for row in widget["properties"].get("metrics", []):
            fields = [f for f in row if not isinstance(f, dict)]  # the options last; math expressions have none
            if fields:
                namespace, name, *dims = fields
                found.append((namespace, name, dict(zip(dims[::2], dims[1::2]))))
    for alarm in (r["Properties"] for r in resources if r["Type"] == "AWS::CloudWatch::Alarm"):
        stats = [q["MetricStat"]["Metric"] for q in alarm.get("Metrics", []) if "MetricStat" in q]
        if "MetricName" in alarm:
            stats.append({"Namespace": alarm["Namespace"], "MetricName": alarm["MetricName"],
                          "Dimensions": alarm.get("Dimensions", [])})
        found += [(m["Namespace"], m["MetricName"], {d["Name"]: d["Value"] for d in m.get("Dimensions", [])})
                  for m in stats]
    return found


def test_the_dashboard_reads_the_workers_metrics_where_they_land():
    found = _dashboard_and_alarm_metrics()
    assert any(namespace.startswith("AWS/") for namespace, _, _ in found)  # the probe saw the AWS graphs too
    # Every metric not published by an AWS service is a worker's.
    ours = [(namespace, name, dims) for namespace, name, dims in found if not namespace.startswith("AWS/")]
    assert {namespace for namespace, _, _ in ours} == {NAMESPACE}
    assert all(dims == DIMENSIONS for _, _, dims in ours), ours
    assert {name for _, name, _ in ours} == set(METRICS)  # every one it prints, and nothing else


def test_a_dashboard_metric_the_workers_do_not_print_fails_the_synth():
    pytest.importorskip("aws_cdk")
    from cdk.observability_construct import worker_metric

    with pytest.raises(ValueError, match="BatchSizes"):
        worker_metric("BatchSizes")


def test_the_cdk_app_reads_the_names_without_loading_torch():
    probe = ("import sys, cdk.functions, cdk.observability_construct; "
             "assert 'torch' not in sys.modules, 'the CDK app loaded torch'; print('ok')")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20"})
    if "No module named 'aws_cdk'" in done.stderr:
        pytest.skip("the CDK packages are not installed")
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
