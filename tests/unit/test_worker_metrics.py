"""The workers' CloudWatch metrics (sluice/worker/metrics.py): the EMF lines they
print, and the dashboard built on them (cdk/observability_construct.py), which
must read the same namespace, dimension and names or show nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

import sluice.worker.metrics as worker_metrics
from sluice.worker.metrics import METRICS, NAMESPACE, WorkerMetrics, dimensions

ROOT = Path(__file__).resolve().parents[2]
GPU_METRICS = {"GpuUtilization", "GpuMemoryUsed"}
DIMENSIONS = dimensions("sluice")  # the default deployment's
DIMENSIONS_ROW = [part for item in DIMENSIONS.items() for part in item]  # as a dashboard row names them


def fake_torch(cuda: bool):
    """What WorkerMetrics reads of torch, on a machine with or without a GPU
    (3 MiB allocated, 42% busy)."""
    return SimpleNamespace(cuda=SimpleNamespace(
        is_available=lambda: cuda, memory_allocated=lambda: 3 * 2**20, utilization=lambda: 42))


def outcome(task_id: str, error: str | None = None):
    """What WorkerMetrics reads of a lifecycle.Outcome."""
    return SimpleNamespace(job=SimpleNamespace(message=SimpleNamespace(task_id=task_id)), error=error)


def fresh_metrics(capsys, monkeypatch) -> WorkerMetrics:
    monkeypatch.delenv("POWERTOOLS_METRICS_DISABLED", raising=False)
    metrics = WorkerMetrics()
    metrics._metrics.clear_metrics()  # Powertools shares its metric set across instances: start from none
    capsys.readouterr()
    return metrics


def printed(capsys) -> list[dict]:
    return [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.strip()]


def values(emf: dict, name: str) -> list:
    return emf[name] if isinstance(emf[name], list) else [emf[name]]


def emitted(capsys, monkeypatch, cuda: bool) -> dict:
    """The one EMF document a worker prints for a batch of 8 inputs (12 ms)
    with two tasks succeeded, one failed attempt, one outcome whose write
    was rejected and two tasks handed back unrun."""
    monkeypatch.setitem(sys.modules, "torch", fake_torch(cuda))
    metrics = fresh_metrics(capsys, monkeypatch)
    metrics.record_batch(8, 12)
    metrics.record_outcomes([outcome("a"), outcome("b"), outcome("c", "RuntimeError: boom"), outcome("d")], 0,
                            rejected={"d"})
    metrics.record_handed_back(2)
    metrics.flush()
    lines = printed(capsys)
    assert len(lines) == 1, lines
    return lines[0]


def test_a_gpu_worker_prints_every_metric_in_the_namespace_and_dimension(capsys, monkeypatch):
    emf = emitted(capsys, monkeypatch, cuda=True)
    [directive] = emf["_aws"]["CloudWatchMetrics"]
    assert directive["Namespace"] == NAMESPACE == "Sluice"  # the namespace docs/architecture.md names
    assert directive["Dimensions"] == [list(DIMENSIONS)]
    assert {name: emf[name] for name in DIMENSIONS} == DIMENSIONS == {"service": "worker", "deployment": "sluice"}
    units = {m["Name"]: m["Unit"] for m in directive["Metrics"]}
    assert units == {
        "BatchSize": "Count", "InferenceLatency": "Milliseconds", "Throughput": "Count/Second",
        "TasksSucceeded": "Count", "TaskAttemptsFailed": "Count", "TaskAttemptsDropped": "Count",
        "TasksHandedBack": "Count", "GpuUtilization": "Percent", "GpuMemoryUsed": "Megabytes",
    }
    assert set(units) == set(METRICS)  # what the dashboard may use is what a worker prints
    assert {name: values(emf, name) for name in units} == {
        "BatchSize": [8], "InferenceLatency": [12], "Throughput": [8 / 0.012], "TasksSucceeded": [1, 1],
        "TaskAttemptsFailed": [1], "TaskAttemptsDropped": [1], "TasksHandedBack": [2], "GpuUtilization": [42], "GpuMemoryUsed": [3.0],
    }


def test_a_worker_without_a_gpu_prints_no_gpu_figures(capsys, monkeypatch):
    emf = emitted(capsys, monkeypatch, cuda=False)
    [directive] = emf["_aws"]["CloudWatchMetrics"]
    assert {m["Name"] for m in directive["Metrics"]} == set(METRICS) - GPU_METRICS


def test_an_outcome_whose_write_was_rejected_is_no_success_or_failure(capsys, monkeypatch):
    # The task was cancelled meanwhile, or another delivery recorded it first:
    # what stands is that other outcome, counted where it was written.
    metrics = fresh_metrics(capsys, monkeypatch)
    metrics.record_outcomes([outcome("won"), outcome("cancelled"), outcome("lost", "RuntimeError: boom"),
                             outcome("failed", "RuntimeError: boom")], 0, rejected={"cancelled", "lost"})
    metrics.flush()
    [emf] = printed(capsys)
    assert values(emf, "TasksSucceeded") == [1]
    assert values(emf, "TaskAttemptsFailed") == [1]
    assert values(emf, "TaskAttemptsDropped") == [1, 1]


def test_throughput_is_over_the_time_spent_inferring_not_the_time_since_the_last_flush(capsys, monkeypatch):
    now = [1000.0]  # a monotonic clock the test moves: the worker then idles a minute
    monkeypatch.setattr(worker_metrics, "time", SimpleNamespace(monotonic=lambda: now[0]), raising=False)
    metrics = fresh_metrics(capsys, monkeypatch)
    metrics.record_batch(8, 100)
    metrics.record_batch(12, 100)
    now[0] += 60
    metrics.flush()
    [emf] = printed(capsys)
    assert values(emf, "Throughput") == [pytest.approx(100.0)]  # 20 inputs in 0.2 s of inference


def test_throughput_of_batches_run_at_once_is_over_their_span(capsys, monkeypatch):
    # The SageMaker dispatcher's endpoint calls run in parallel: 8 calls of 10
    # inputs, 1 s each, all at once, are 80 inputs a second, not 10.
    metrics = fresh_metrics(capsys, monkeypatch)
    for _ in range(8):
        metrics.record_batch(10, 1000, busy=False)
    metrics.record_busy(1000)
    metrics.flush()
    [emf] = printed(capsys)
    assert values(emf, "Throughput") == [pytest.approx(80.0)]
    assert values(emf, "InferenceLatency") == [1000] * 8  # each call's own time


def test_a_started_worker_publishes_a_burst_without_waiting_for_another_task(capsys, monkeypatch):
    metrics = fresh_metrics(capsys, monkeypatch)
    published = threading.Event()
    flush_metrics = metrics._metrics.flush_metrics

    def flush_and_tell(**kwargs):
        flush_metrics(**kwargs)
        published.set()

    monkeypatch.setattr(metrics._metrics, "flush_metrics", flush_and_tell)
    metrics.record_batch(8, 12)
    metrics.record_outcomes([outcome("a")], 0)  # the burst's last task: nothing follows it
    metrics.start(interval_s=0.01)
    try:
        assert published.wait(timeout=10), "the timer published nothing"
    finally:
        metrics.stop()
    [emf] = printed(capsys)
    assert values(emf, "BatchSize") == [8] and values(emf, "TasksSucceeded") == [1]


def test_stopping_ends_the_timer_at_once_and_publishes_what_it_had_not(capsys, monkeypatch):
    metrics = fresh_metrics(capsys, monkeypatch)
    metrics.start(interval_s=3600)
    metrics.record_outcomes([outcome("a")], 0)
    metrics.stop(timeout_s=10)  # a worker's shutdown must not wait out the interval
    assert "sluice-metrics" not in {t.name for t in threading.enumerate()}
    [emf] = printed(capsys)
    assert values(emf, "TasksSucceeded") == [1]


def cloudwatch_sink(capsys, monkeypatch) -> WorkerMetrics:
    from sluice.settings import Settings

    monkeypatch.delenv("POWERTOOLS_METRICS_DISABLED", raising=False)
    metrics = WorkerMetrics(settings=Settings(metrics_sink="cloudwatch"))
    metrics._metrics.clear_metrics()
    capsys.readouterr()
    return metrics


def test_workers_print_unless_told_to_put(monkeypatch):
    from sluice.settings import Settings, SettingsError

    monkeypatch.delenv("SLUICE_METRICS_SINK", raising=False)
    assert Settings().metrics_sink == "stdout"  # make run, on-prem and the Lambda dispatcher
    monkeypatch.setenv("SLUICE_METRICS_SINK", "cloudwatch")
    assert Settings().metrics_sink == "cloudwatch"
    monkeypatch.setenv("SLUICE_METRICS_SINK", "logs")
    with pytest.raises(SettingsError, match="SLUICE_METRICS_SINK"):
        Settings()


def test_a_refused_put_metric_data_is_a_warning_not_a_dead_worker(capsys, monkeypatch, caplog):
    import logging

    import sluice.aws
    from botocore.exceptions import ClientError

    tried = []

    def refuse(**request):
        tried.append(request)
        raise ClientError({"Error": {"Code": "AccessDenied", "Message": "not allowed"}}, "PutMetricData")

    monkeypatch.setattr(sluice.aws, "client", lambda service, settings: SimpleNamespace(put_metric_data=refuse))
    metrics = cloudwatch_sink(capsys, monkeypatch)
    metrics.record_batch(8, 12)
    metrics.record_outcomes([outcome("a")], 0)
    with caplog.at_level(logging.WARNING, logger="sluice.worker.metrics"):
        metrics.flush()
    assert tried and tried[0]["Namespace"] == NAMESPACE
    assert "AccessDenied" in caplog.text
    assert capsys.readouterr().out == ""
    assert not metrics._metrics.metric_set  # the window is dropped, not carried into the next


def test_every_powertools_unit_is_a_cloudwatch_unit():
    # The EMF unit goes to PutMetricData as it is.
    import botocore.session
    from aws_lambda_powertools.metrics import MetricUnit

    model = botocore.session.get_session().get_service_model("cloudwatch")
    assert {u.value for u in MetricUnit} <= set(model.shape_for("StandardUnit").enum)


def emf_document(metrics: int, values: int, distinct: bool) -> dict:
    names = [f"M{i}" for i in range(metrics)]
    document = {"_aws": {"Timestamp": 1_700_000_000_000, "CloudWatchMetrics": [{
        "Namespace": NAMESPACE, "Dimensions": [list(DIMENSIONS)],
        "Metrics": [{"Name": n, "Unit": "Milliseconds"} for n in names]}]}, **DIMENSIONS}
    for n in names:
        document[n] = [float(v if distinct else 1) + 0.123456789 for v in range(values)]
    return document


def test_put_requests_stay_within_put_metric_data_limits():
    from urllib.parse import urlencode

    import botocore.session
    from botocore.serialize import create_serializer

    documents = [emf_document(metrics=100, values=400, distinct=True) for _ in range(12)]
    documents.append(emf_document(metrics=3, values=500, distinct=False))
    requests = list(worker_metrics.put_requests(documents))
    model = botocore.session.get_session().get_service_model("cloudwatch")
    operation = model.operation_model("PutMetricData")
    for request in requests:
        assert request["Namespace"] == NAMESPACE
        assert len(request["MetricData"]) <= 1000
        for datum in request["MetricData"]:
            assert len(datum["Values"]) == len(datum["Counts"]) <= 150
            assert datum["Dimensions"] == [{"Name": k, "Value": v} for k, v in DIMENSIONS.items()]
            assert datum["Unit"] == "Milliseconds"
        for protocol in ("query", "json", "smithy-rpc-v2-cbor"):  # whichever botocore picks
            body = create_serializer(protocol).serialize_to_request(request, operation)["body"]
            sent = urlencode(body).encode() if isinstance(body, dict) else body  # query: form fields
            assert len(sent) <= 1_000_000, protocol
    # Every value once, counted as often as it was recorded.
    sent = [(d["MetricName"], v, c) for r in requests for d in r["MetricData"] for v, c in zip(d["Values"], d["Counts"])]
    assert sum(c for *_, c in sent) == 12 * 100 * 400 + 3 * 500
    assert len(sent) == 12 * 100 * 400 + 3
    assert len(requests) > 1


def _synth_observability(config=None) -> tuple[list[dict], list[dict]]:
    """The Observability construct's resources and its dashboard's widgets,
    synthesized in a stack of its own (queues real, the API stage's metrics
    stand-ins)."""
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
    Observability(stack, "Observability", config=config or SluiceConfig(), queues=queues, api=SimpleNamespace(stage=stage),
                  functions={}, gpu_metrics=[], dashboard_name="probe")
    resources = list(Template.from_stack(stack).to_json()["Resources"].values())
    [dashboard] = [r for r in resources if r["Type"] == "AWS::CloudWatch::Dashboard"]
    body = dashboard["Properties"]["DashboardBody"]
    parts = body["Fn::Join"][1] if isinstance(body, dict) else [body]
    text = "".join(p if isinstance(p, str) else "TOKEN" for p in parts)  # references (queue names) as placeholders
    return resources, json.loads(text)["widgets"]


def _dashboard_and_alarm_metrics(config=None) -> list[tuple[str, str, dict]]:
    """(namespace, name, dimensions) of every metric the Observability
    construct graphs or alarms on."""
    resources, widgets = _synth_observability(config)
    found = []
    for widget in widgets:
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


def test_each_deployment_s_dashboard_reads_its_own_workers_metrics(monkeypatch):
    # Two stacks side by side in one account (each its own name_prefix): their
    # workers' series must not add up on either dashboard.
    pytest.importorskip("aws_cdk")
    from cdk.config import SluiceConfig

    found = _dashboard_and_alarm_metrics(SluiceConfig(name_prefix="acme"))
    ours = [dims for namespace, _, dims in found if not namespace.startswith("AWS/")]
    assert ours and all(dims == dimensions("acme") for dims in ours), ours
    # What a worker of that stack emits (SluiceEks and the dispatcher pass SLUICE_QUEUE_PREFIX).
    from sluice.settings import Settings

    metrics = WorkerMetrics(settings=Settings(queue_prefix="acme"))
    metrics.record_batch(4, 10.0)
    lines = []
    monkeypatch.setattr("builtins.print", lambda line, **_: lines.append(line))
    metrics.flush()
    [emf] = [json.loads(line) for line in lines]
    assert {name: emf[name] for name in dimensions("acme")} == dimensions("acme")


def test_the_dashboard_shows_the_inputs_per_second_of_all_workers_together():
    pytest.importorskip("aws_cdk")
    _, widgets = _synth_observability()
    [throughput] = [w["properties"] for w in widgets if w["properties"].get("title") == "Throughput (inputs/s)"]
    rows = throughput["metrics"]
    expressions = [row[0] for row in rows if len(row) == 1 and "expression" in row[0]]
    hidden = {row[-1]["id"]: row[:-1] + [row[-1].get("stat")] for row in rows
              if isinstance(row[-1], dict) and "id" in row[-1] and row[-1].get("visible") is False}
    # A Sum over every worker's batches, per second of the period: eight
    # workers show eight times one worker's rate, an idle minute shows 0.
    [total] = [e for e in expressions if e.get("yAxis", "left") == "left"]
    assert total["expression"].replace(" ", "") == "inputs/PERIOD(inputs)"
    assert hidden["inputs"] == [NAMESPACE, "BatchSize", *DIMENSIONS_ROW, "Sum"]
    # A per-worker figure may only be averaged, and on its own axis.
    averaged = [row for row in rows if row[:2] == [NAMESPACE, "Throughput"]]
    assert averaged and all(row[-1].get("stat") in (None, "Average") and row[-1].get("yAxis") == "right"
                            for row in averaged)


def test_a_dashboard_metric_the_workers_do_not_print_fails_the_synth():
    pytest.importorskip("aws_cdk")
    from cdk.observability_construct import worker_metric

    with pytest.raises(ValueError, match="BatchSizes"):
        worker_metric("BatchSizes", "sluice")


def test_the_cdk_app_reads_the_names_without_loading_torch():
    probe = ("import sys, cdk.functions, cdk.observability_construct; "
             "assert 'torch' not in sys.modules, 'the CDK app loaded torch'; print('ok')")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "JSII_SILENCE_WARNING_END_OF_LIFE_NODE_VERSION": "20"})
    if "No module named 'aws_cdk'" in done.stderr:
        pytest.skip("the CDK packages are not installed")
    assert done.stdout.strip() == "ok", done.stderr[-2000:]
