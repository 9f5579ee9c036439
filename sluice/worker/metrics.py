"""Worker metrics as CloudWatch Embedded Metric Format (Powertools Metrics).

EMF lines go to stdout; on EKS/SageMaker the CloudWatch agent or log driver
turns them into metrics without any PutMetricData call on the hot path.
"""

from __future__ import annotations

import sys
import threading
import time

from aws_lambda_powertools import Metrics
from aws_lambda_powertools.metrics import MetricUnit

FLUSH_EVERY_S = 10.0

# Where the metrics land, stated once: the CDK dashboard and alarms
# (cdk/observability_construct.py) and the Lambdas' Powertools namespace
# (cdk/functions.py) import these, so this module imports only Powertools and
# the standard library (never torch: it reads torch only if a worker loaded it).
NAMESPACE = "Sluice"
SERVICE = "worker"  # Powertools makes it the `service` dimension of every metric
DIMENSIONS = {"service": SERVICE}
METRICS = (
    "BatchSize",
    "InferenceLatency",
    "Throughput",
    "TasksSucceeded",
    "TaskAttemptsFailed",
    "GpuUtilization",  # these two on a GPU only
    "GpuMemoryUsed",
)


class WorkerMetrics:
    def __init__(self, namespace: str = NAMESPACE):
        self._metrics = Metrics(namespace=namespace, service=SERVICE)
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._inputs_since_flush = 0
        self._recorded = False  # Powertools warns on an empty flush: skip those
        self.batches = 0
        self.inputs = 0

    def record_batch(self, size: int, inference_ms: int) -> None:
        with self._lock:
            self.batches += 1
            self.inputs += size
            self._inputs_since_flush += size
            self._recorded = True
            self._metrics.add_metric(name="BatchSize", unit=MetricUnit.Count, value=size)
            self._metrics.add_metric(name="InferenceLatency", unit=MetricUnit.Milliseconds, value=inference_ms)
            self._gpu()

    def record_outcomes(self, outcomes, finished_at_ms: int) -> None:
        with self._lock:
            for o in outcomes:
                name = "TasksSucceeded" if o.error is None else "TaskAttemptsFailed"
                self._metrics.add_metric(name=name, unit=MetricUnit.Count, value=1)
                self._recorded = True
        self.maybe_flush()

    def maybe_flush(self) -> None:
        if time.monotonic() - self._last_flush >= FLUSH_EVERY_S:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            if not self._recorded:
                self._last_flush = time.monotonic()
                return
            elapsed = max(1e-6, time.monotonic() - self._last_flush)
            if self._inputs_since_flush:
                self._metrics.add_metric(
                    name="Throughput", unit=MetricUnit.CountPerSecond, value=self._inputs_since_flush / elapsed
                )
            try:
                self._metrics.flush_metrics(raise_on_empty_metrics=False)
            except Exception:
                pass  # metrics must never take a worker down
            self._last_flush = time.monotonic()
            self._inputs_since_flush = 0
            self._recorded = False

    def _gpu(self) -> None:
        torch = sys.modules.get("torch")  # only a worker that loaded a torch model reports GPU figures
        if torch is None:
            return
        try:
            if torch.cuda.is_available():
                self._metrics.add_metric(
                    name="GpuMemoryUsed", unit=MetricUnit.Megabytes, value=torch.cuda.memory_allocated() / 2**20
                )
                self._metrics.add_metric(name="GpuUtilization", unit=MetricUnit.Percent, value=torch.cuda.utilization())
        except Exception:
            pass
