"""Worker metrics, accumulated by Powertools Metrics as an EMF metric set.

By default (SLUICE_METRICS_SINK=stdout) each flush prints an EMF line: in
Lambda (the SageMaker dispatcher) CloudWatch turns those lines into metrics.
On EKS the log agent ships container logs wrapped as {"log": ...}, not as EMF,
so the stack sets `cloudwatch`: the same serialized set is sent with
PutMetricData. Either way only flush() publishes (the timer thread, stop(),
the dispatcher per invocation), never the batch path's record_* calls.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
from collections import Counter
from collections.abc import Collection, Iterator
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from aws_lambda_powertools import Metrics
from aws_lambda_powertools.metrics import MetricUnit
from aws_lambda_powertools.metrics.functions import is_metrics_disabled
from aws_lambda_powertools.metrics.provider.cloudwatch_emf.constants import MAX_METRICS

if TYPE_CHECKING:
    from sluice.settings import Settings

log = logging.getLogger(__name__)

FLUSH_EVERY_S = 10.0

# PutMetricData's limits: entries per request, values per entry, request size.
PUT_MAX_DATA = 1000
PUT_MAX_VALUES = 150
PUT_MAX_BYTES = 1_000_000
# Upper bounds on what a value (or count), a dimension and an entry's other
# fields add to a request in the most verbose protocol botocore may use (query:
# `MetricData.member.1000.Values.member.150=<float>&`), so that a request is cut
# before it could pass PUT_MAX_BYTES whatever the encoding.
_VALUE_BYTES = 72
_FIELD_BYTES = 96
_DATUM_BYTES = 512
_ENVELOPE_BYTES = 4096

# Where the metrics land, stated once: the CDK dashboard and alarms
# (cdk/observability_construct.py) and the Lambdas' Powertools namespace
# (cdk/functions.py) import these, so this module imports only Powertools and
# the standard library (never torch: it reads torch only if a worker loaded it).
NAMESPACE = "Sluice"
SERVICE = "worker"  # Powertools makes it the `service` dimension of every metric
# Which deployment's workers (SLUICE_QUEUE_PREFIX, the stack's name_prefix): two
# stacks side by side in one account and region would otherwise add up in one series.
DEPLOYMENT = "deployment"


def dimensions(deployment: str) -> dict[str, str]:
    """Every worker metric's dimensions, as emitted (Powertools puts its default
    dimension first) and as the dashboard reads them."""
    return {DEPLOYMENT: deployment, "service": SERVICE}

METRICS = (
    "BatchSize",
    "InferenceLatency",
    "Throughput",  # inputs per second of inference: a worker's speed, idle time left out
    "TasksSucceeded",
    "TaskAttemptsFailed",
    "TaskAttemptsDropped",  # outcomes not written: the task was final already (cancelled, another run won) or past its deadline
    # Given back unrun, a receive spent and no attempt: a model this worker does
    # not serve (yet), a call the SageMaker endpoint turned away.
    "TasksHandedBack",
    "GpuUtilization",  # these two on a GPU only
    "GpuMemoryUsed",
)


class WorkerMetrics:
    def __init__(self, namespace: str = NAMESPACE, settings: Settings | None = None):
        """`settings` chooses the sink (`metrics_sink`), names the deployment
        (`queue_prefix`) and makes the CloudWatch client; without them metrics
        go to stdout, for the default deployment `sluice`."""
        self._metrics = Metrics(namespace=namespace, service=SERVICE)
        self._metrics.set_default_dimensions(**{DEPLOYMENT: settings.queue_prefix if settings else "sluice"})
        self._settings = settings
        self._sink = settings.metrics_sink if settings is not None else "stdout"
        # Sets that filled up between flushes (cloudwatch sink), kept for the next one.
        self._full: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._inputs_since_flush = 0
        self._inference_ms_since_flush = 0.0
        self._recorded = False  # Powertools warns on an empty flush: skip those
        self._stopping = threading.Event()
        self._timer: threading.Thread | None = None
        self.batches = 0
        self.inputs = 0

    def start(self, interval_s: float = FLUSH_EVERY_S) -> None:
        """Publish every interval_s from a daemon thread. Without it, what a
        worker records is printed only by flush(): the Lambda dispatcher
        flushes per invocation, and a thread would be frozen between them."""
        with self._lock:
            if self._timer is not None:
                return
            self._stopping.clear()
            self._timer = threading.Thread(target=self._flush_every, args=(interval_s,), name="sluice-metrics",
                                           daemon=True)
            self._timer.start()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the timer, then publish what it had not."""
        self._stopping.set()
        timer, self._timer = self._timer, None
        if timer is not None:
            timer.join(timeout_s)
        self.flush()

    def _flush_every(self, interval_s: float) -> None:
        while not self._stopping.wait(interval_s):
            self.flush()

    def record_batch(self, size: int, inference_ms: float, busy: bool = True) -> None:
        """`busy=False`: the batch ran beside others (the dispatcher's parallel
        endpoint calls), whose span the caller gives record_busy instead: a sum
        of overlapping times would understate Throughput by the overlap."""
        with self._lock:
            self.batches += 1
            self.inputs += size
            self._inputs_since_flush += size
            if busy:
                self._inference_ms_since_flush += inference_ms
            self._recorded = True
            self._add("BatchSize", MetricUnit.Count, size)
            self._add("InferenceLatency", MetricUnit.Milliseconds, inference_ms)
            self._gpu()

    def record_busy(self, inference_ms: float) -> None:
        """Wall-clock time in which batches recorded with busy=False ran."""
        with self._lock:
            self._inference_ms_since_flush += inference_ms

    def record_outcomes(self, outcomes, finished_at_ms: int, rejected: Collection[str] = ()) -> None:
        """`rejected`: the ids of tasks whose outcome write was refused. Their
        task had another outcome already, so this attempt neither succeeded
        nor failed it."""
        with self._lock:
            for o in outcomes:
                if o.job.message.task_id in rejected:
                    name = "TaskAttemptsDropped"
                else:
                    name = "TasksSucceeded" if o.error is None else "TaskAttemptsFailed"
                self._add(name, MetricUnit.Count, 1)
                self._recorded = True

    def record_handed_back(self, tasks: int) -> None:
        if tasks:
            with self._lock:
                self._add("TasksHandedBack", MetricUnit.Count, tasks)
                self._recorded = True

    def _add(self, name: str, unit: MetricUnit, value: float) -> None:
        if self._sink == "cloudwatch":
            held = self._metrics.metric_set
            values = held[name]["Value"] if name in held else ()
            if len(values) >= MAX_METRICS - 1 or (name not in held and len(held) >= MAX_METRICS - 1):
                # Powertools prints a set by itself once it holds 100 metrics or
                # 100 values of one: on stdout those would be lost to this sink.
                # Keep the set for the next flush instead, as Powertools would
                # have cut it (metrics cleared, dimensions kept).
                self._full.append(self._metrics.serialize_metric_set())
                held.clear()
        self._metrics.add_metric(name=name, unit=unit, value=value)

    def flush(self) -> None:
        documents: list[dict[str, Any]] = []
        with self._lock:
            if not self._recorded:
                return
            # Over the time the model ran, not the time since the last flush:
            # a worker's speed should not fall because its queue was empty.
            # Batches that all took under a millisecond (the runner's resolution) give no figure.
            if self._inputs_since_flush and self._inference_ms_since_flush > 0:
                self._add("Throughput", MetricUnit.CountPerSecond,
                          self._inputs_since_flush / (self._inference_ms_since_flush / 1000))
            try:
                if self._sink == "cloudwatch":
                    documents = self._take()
                else:
                    self._metrics.flush_metrics(raise_on_empty_metrics=False)
            except Exception:
                pass  # metrics must never take a worker down
            self._inputs_since_flush = 0
            self._inference_ms_since_flush = 0.0
            self._recorded = False
        # Outside the lock: a slow or failing CloudWatch must not hold up the
        # pipeline's record_batch/record_outcomes.
        if documents:
            self._put(documents)

    def _take(self) -> list[dict[str, Any]]:
        """The window's serialized sets, the held set cleared as flush_metrics clears it."""
        documents, self._full = self._full, []
        try:
            if self._metrics.metric_set:
                documents.append(self._metrics.serialize_metric_set())
        finally:
            self._metrics.clear_metrics()
        return [] if is_metrics_disabled() else documents

    def _put(self, documents: list[dict[str, Any]]) -> None:
        try:
            from sluice.aws import client  # boto3 only where this sink is used: the CDK app imports this module

            cloudwatch = client("cloudwatch", self._settings)
            for request in put_requests(documents):
                cloudwatch.put_metric_data(**request)
        except Exception as exc:
            # Metrics must never take a worker down; a retry would only pile
            # windows up behind an outage, so this one is dropped.
            log.warning("PutMetricData failed, this window's worker metrics are dropped: %s", exc)

    def _gpu(self) -> None:
        torch = sys.modules.get("torch")  # only a worker that loaded a torch model reports GPU figures
        if torch is None:
            return
        try:
            if torch.cuda.is_available():
                self._add("GpuMemoryUsed", MetricUnit.Megabytes, torch.cuda.memory_allocated() / 2**20)
                self._add("GpuUtilization", MetricUnit.Percent, torch.cuda.utilization())
        except Exception:
            pass


def put_requests(documents: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """PutMetricData requests carrying what the EMF documents say, each
    within PutMetricData's limits."""
    by_namespace: dict[str, list[dict[str, Any]]] = {}
    for document in documents:
        for namespace, datum in _metric_data(document):
            by_namespace.setdefault(namespace, []).append(datum)
    for namespace, data in by_namespace.items():
        batch: list[dict[str, Any]] = []
        size = _ENVELOPE_BYTES
        for datum in data:
            cost = _datum_bytes(datum)
            if batch and (len(batch) == PUT_MAX_DATA or size + cost > PUT_MAX_BYTES):
                yield {"Namespace": namespace, "MetricData": batch}
                batch, size = [], _ENVELOPE_BYTES
            batch.append(datum)
            size += cost
        if batch:
            yield {"Namespace": namespace, "MetricData": batch}


def _datum_bytes(datum: dict[str, Any]) -> int:
    fields = sum(_FIELD_BYTES + len(d["Name"]) + len(d["Value"]) for d in datum["Dimensions"])
    return _DATUM_BYTES + len(datum["MetricName"]) + fields + _VALUE_BYTES * 2 * len(datum["Values"])


def _metric_data(document: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(namespace, MetricDatum) for each metric, dimension set and run of up
    to PUT_MAX_VALUES distinct values of one EMF document, as CloudWatch
    would extract them from the line."""
    meta = document["_aws"]
    timestamp = datetime.fromtimestamp(meta["Timestamp"] / 1000, tz=timezone.utc)
    for directive in meta["CloudWatchMetrics"]:
        for dimension_set in directive["Dimensions"]:
            dimensions = [{"Name": name, "Value": str(document[name])} for name in dimension_set]
            for definition in directive["Metrics"]:
                raw = document[definition["Name"]]
                # CloudWatch refuses NaN and infinities; one must not cost the window.
                counted = Counter(float(v) for v in (raw if isinstance(raw, list) else [raw]) if math.isfinite(v))
                distinct = list(counted.items())
                for start in range(0, len(distinct), PUT_MAX_VALUES):
                    run = distinct[start:start + PUT_MAX_VALUES]
                    datum = {
                        "MetricName": definition["Name"],
                        "Dimensions": dimensions,
                        "Timestamp": timestamp,
                        # Powertools' MetricUnit names are exactly CloudWatch's StandardUnit: no translation.
                        "Unit": definition.get("Unit") or "None",
                        "Values": [value for value, _ in run],
                        "Counts": [float(count) for _, count in run],
                    }
                    if definition.get("StorageResolution") == 1:
                        datum["StorageResolution"] = 1
                    yield directive["Namespace"], datum
