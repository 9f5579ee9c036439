"""Worker metrics as CloudWatch Embedded Metric Format (Powertools Metrics).

EMF lines go to stdout; on EKS/SageMaker the CloudWatch agent or log driver
turns them into metrics without any PutMetricData call on the hot path.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Collection

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
    "Throughput",  # inputs per second of inference: a worker's speed, idle time left out
    "TasksSucceeded",
    "TaskAttemptsFailed",
    "TaskAttemptsDropped",  # outcomes not written: the task was final already (cancelled, or another run won)
    "GpuUtilization",  # these two on a GPU only
    "GpuMemoryUsed",
)


class WorkerMetrics:
    def __init__(self, namespace: str = NAMESPACE):
        self._metrics = Metrics(namespace=namespace, service=SERVICE)
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

    def record_batch(self, size: int, inference_ms: float) -> None:
        with self._lock:
            self.batches += 1
            self.inputs += size
            self._inputs_since_flush += size
            self._inference_ms_since_flush += inference_ms
            self._recorded = True
            self._metrics.add_metric(name="BatchSize", unit=MetricUnit.Count, value=size)
            self._metrics.add_metric(name="InferenceLatency", unit=MetricUnit.Milliseconds, value=inference_ms)
            self._gpu()

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
                self._metrics.add_metric(name=name, unit=MetricUnit.Count, value=1)
                self._recorded = True

    def flush(self) -> None:
        with self._lock:
            if not self._recorded:
                return
            # Over the time the model ran, not the time since the last flush:
            # a worker's speed should not fall because its queue was empty.
            # Batches that all took under a millisecond (the runner's resolution) give no figure.
            if self._inputs_since_flush and self._inference_ms_since_flush > 0:
                self._metrics.add_metric(
                    name="Throughput",
                    unit=MetricUnit.CountPerSecond,
                    value=self._inputs_since_flush / (self._inference_ms_since_flush / 1000),
                )
            try:
                self._metrics.flush_metrics(raise_on_empty_metrics=False)
            except Exception:
                pass  # metrics must never take a worker down
            self._inputs_since_flush = 0
            self._inference_ms_since_flush = 0.0
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
