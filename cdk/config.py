"""The stack's typed configuration, read from CDK context.

Every option lives under the context key ``sluice`` (cdk.json holds the
defaults). Single options can be overridden on the command line with dotted
keys, e.g. ``cdk deploy -c sluice.max_workers=16 SluiceEks``; command-line
context values arrive as strings, so every field is parsed and checked here
rather than trusted.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field, fields
from typing import Any, Literal, get_args, get_origin, get_type_hints

from sluice.contract import Priority
from sluice.settings import models_problem

Backend = Literal["eks", "sagemaker"]
PRIORITIES = tuple(p.value for p in Priority)


@dataclass(frozen=True)
class UsagePlan:
    name: str
    rate_per_s: float
    burst: int
    quota_per_day: int


@dataclass(frozen=True)
class SluiceConfig:
    # Which worker backends app.py synthesizes: one stack per backend.
    backends: tuple[Backend, ...] = ("eks", "sagemaker")
    # Prefix of queue names (SLUICE_QUEUE_PREFIX), so `sluice dlq` finds them.
    name_prefix: str = "sluice"

    # Worker image: build context and Dockerfile, relative to the repository root.
    image_directory: str = "."
    image_file: str = "containers/worker/Dockerfile"

    models: str = "minilm-embed,synthetic"
    max_batch_size: int = 32
    max_wait_ms: int = 10
    # The slowest batch the worker may run. Queue visibility, the dispatcher's
    # timeout and the pods' termination grace period are all derived from it.
    longest_batch_s: int = 60
    max_attempts: int = 3
    result_ttl_days: int = 7

    # API
    usage_plans: tuple[UsagePlan, ...] = (
        UsagePlan("standard", rate_per_s=50, burst=100, quota_per_day=1_000_000),
    )
    api_memory_mb: int = 1024
    stage_name: str = "prod"  # the URL is ./prod/v1/tasks: the API versions its own paths
    waf: bool = True
    waf_rate_limit_per_5min: int = 20_000

    # EKS
    kubernetes_version: str = "1.35"
    gpu_instance_types: tuple[str, ...] = ("g5.xlarge",)
    min_nodes: int = 0
    max_nodes: int = 4
    min_workers: int = 0
    max_workers: int = 4
    # Messages per worker KEDA aims for (queueLength of the aws-sqs-queue trigger).
    messages_per_worker: int = 200
    # Both must support kubernetes_version. KEDA supports three Kubernetes
    # minors per release (2.17: 1.30-1.32); the Cluster Autoscaler only the
    # minor it was built for, so its image is pinned to the cluster's
    # (v<kubernetes_version>.0) whatever the chart's default (9.59.0: 1.35.0).
    keda_chart_version: str = "2.21.0"
    cluster_autoscaler_chart_version: str = "9.59.0"

    # SageMaker
    sagemaker_instance_type: str = "ml.g5.xlarge"
    # The hosting AMI, for its NVIDIA driver: without one, SageMaker's default
    # for ml.g4dn/g5/p4d is driver 470 (CUDA 11.4), on which the worker image's
    # CUDA 12 torch finds no GPU and /ping never answers. gpu-3-1: driver 550.
    sagemaker_inference_ami: str = "al2-ami-sagemaker-inference-gpu-3-1"
    min_instances: int = 1
    max_instances: int = 4
    # Autoscaling's target for SageMaker's ConcurrentRequestsPerModel: the calls
    # an instance's container holds at once, running or waiting. serve.py runs
    # one call per model at a time (the rest wait behind its lock), and each
    # dispatcher invocation sends its batch as one call per model and waits
    # for it: 2 is one call running and the next one ready, so the GPU does not
    # idle while a dispatcher records its outcomes; past it calls queue, and an
    # instance is added. A call's wait counts against SageMaker's 60 s
    # invocation timeout, so a higher target lets calls queue into timeouts
    # (failed attempts) before the endpoint scales; 1 or less adds an instance
    # before any call waits.
    concurrent_requests_per_instance: float = 2.0
    dispatcher_batch_size: int = 32
    dispatcher_batching_window_s: int = 1
    # Lambda pollers per priority queue (2 is the service minimum).
    dispatcher_max_concurrency: dict[str, int] = field(
        default_factory=lambda: {"high": 20, "normal": 10, "low": 4}
    )
    # Reserve the dispatcher their sum of the region's Lambda concurrency. Unreserved,
    # long polls can take it all (deploy.md); a throttled batch comes back only
    # after the queue's visibility timeout with its receive count raised, and
    # receives count as attempts. An account whose unreserved concurrency would
    # fall under 100 refuses the reservation: turn it off there.
    reserve_dispatcher_concurrency: bool = True

    # Alarms
    oldest_message_slo_s: dict[str, int] = field(
        default_factory=lambda: {"high": 60, "normal": 300, "low": 3600}
    )
    api_5xx_rate_pct: float = 1.0
    api_p99_latency_ms: int = 1500  # per submit route (POST /v1/tasks, /v1/tasks/batch), not long polls
    alarm_email: str | None = None

    # ------------------------------------------------------------ derived
    @property
    def visibility_timeout_s(self) -> int:
        # Room for one full batch plus its claim/record round trips, twice over:
        # a worker that dies mid-batch gives its messages back within this.
        return 2 * self.longest_batch_s + 60

    @property
    def dispatcher_timeout_s(self) -> int:
        # SQS event sources require the queue's visibility >= the function timeout.
        return min(self.longest_batch_s + 30, self.visibility_timeout_s)

    @property
    def dispatcher_reserved_concurrency(self) -> int | None:
        return sum(self.dispatcher_max_concurrency.values()) if self.reserve_dispatcher_concurrency else None

    @property
    def termination_grace_s(self) -> int:
        return self.longest_batch_s + 30

    @property
    def inference_timeout_s(self) -> int:
        # A batch running twice the longest there should be is a hung GPU: the
        # worker exits and hands its messages back. The worker's own default
        # (900 s) would keep them hidden, heartbeat after heartbeat, that long.
        return 2 * self.longest_batch_s

    @property
    def lifecycle_env(self) -> dict[str, str]:
        """The task-lifecycle settings every writer of task records shares (the
        API, workers, the dispatcher, the settler): a final status renews its
        record's TTL from result_ttl_days, and attempts count to max_attempts,
        whoever writes them."""
        return {"SLUICE_MAX_ATTEMPTS": str(self.max_attempts), "SLUICE_RESULT_TTL_DAYS": str(self.result_ttl_days)}

    # ------------------------------------------------------------ reading
    @classmethod
    def from_context(cls, node) -> "SluiceConfig":
        """Defaults <- context ``sluice`` (a dict) <- context ``sluice.<option>`` keys."""
        raw: dict[str, Any] = {}
        base = node.try_get_context("sluice")
        if isinstance(base, str):
            base = json.loads(base)
        if base:
            raw.update(base)
        # Every dotted key, not only the known ones: a misspelt or removed
        # option given with -c is refused by from_dict, not silently ignored.
        for key, value in node.get_all_context().items():
            if key.startswith("sluice.") and value is not None:
                raw[key.removeprefix("sluice.")] = value
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "SluiceConfig":
        replaced = sorted(set(raw) & set(_REPLACED))
        if replaced:
            raise ValueError("; ".join(f"sluice.{old}: {_REPLACED[old]}" for old in replaced))
        known = {f.name for f in fields(cls)}
        unknown = set(raw) - known
        if unknown:
            raise ValueError(f"unknown sluice context options: {', '.join(sorted(unknown))}")
        hints = get_type_hints(cls)
        values = {name: _coerce(name, hints[name], value) for name, value in raw.items()}
        config = cls(**values)
        config.validate()
        return config

    def with_backend(self, backend: Backend) -> "SluiceConfig":
        return dataclasses.replace(self, backends=(backend,))

    @property
    def backend(self) -> Backend:
        if len(self.backends) != 1:
            raise ValueError("a stack is built for exactly one backend")
        return self.backends[0]

    def validate(self) -> None:
        problems = []
        for b in self.backends:
            if b not in get_args(Backend):
                problems.append(f"backends: {b!r} is not one of {get_args(Backend)}")
        if not self.backends:
            problems.append("backends: at least one")
        if not 1 <= self.longest_batch_s <= 3600:
            problems.append("longest_batch_s: 1..3600")
        if "sagemaker" in self.backends and self.longest_batch_s > 60:
            problems.append("longest_batch_s: a SageMaker real-time invocation ends after 60 s")
        models = models_problem(self.models)
        if models:
            # The API, the dispatcher, the settler and the workers all refuse it
            # as they start: after a deploy that "succeeded" (EKS) or rolls back
            # after the endpoint's 10-minute health check (SageMaker).
            problems.append(f"models: {self.models!r} {models.message()}")
        if not 1 <= self.max_batch_size <= 10_000:
            problems.append("max_batch_size: 1..10000")
        if self.max_wait_ms < 0:
            problems.append("max_wait_ms: 0 or more")
        if self.result_ttl_days < 1:
            problems.append("result_ttl_days: 1 or more")
        if not 1 <= self.max_attempts <= 1000:
            problems.append("max_attempts: 1..1000 (it is also the queues' maxReceiveCount)")
        if not 0 <= self.min_workers <= self.max_workers:
            problems.append("min_workers <= max_workers")
        if not 0 <= self.min_nodes <= self.max_nodes or self.max_nodes < 1:
            problems.append("0 <= min_nodes <= max_nodes, max_nodes >= 1")
        if not 1 <= self.min_instances <= self.max_instances:
            problems.append("1 <= min_instances <= max_instances")
        if not 0 < self.concurrent_requests_per_instance <= 1000:
            problems.append("concurrent_requests_per_instance: more than 0, at most 1000")
        if not 1 <= self.dispatcher_batch_size <= 100:
            # Every endpoint call of a batch runs at once (one call per task at
            # worst), so that the batch fits one invocation timeout.
            problems.append("dispatcher_batch_size: 1..100")
        if not 0 <= self.dispatcher_batching_window_s <= 300:
            problems.append("dispatcher_batching_window_s: 0..300")
        if self.dispatcher_batch_size > 10 and self.dispatcher_batching_window_s < 1:
            problems.append("dispatcher_batch_size > 10 needs dispatcher_batching_window_s >= 1")
        for name in ("dispatcher_max_concurrency", "oldest_message_slo_s"):
            mapping = getattr(self, name)
            if set(mapping) != set(PRIORITIES):
                problems.append(f"{name}: needs exactly the keys {PRIORITIES}")
        if any(not 2 <= v <= 1000 for v in self.dispatcher_max_concurrency.values()):
            problems.append("dispatcher_max_concurrency: 2..1000 per priority")
        if "sagemaker" in self.backends and not _nvidia_gpu(self.sagemaker_instance_type.removeprefix("ml.")):
            problems.append(f"sagemaker_instance_type: {self.sagemaker_instance_type!r} has no NVIDIA GPU, and the "
                            "endpoint runs its model with SLUICE_DEVICE=cuda (ml.g4dn, ml.g5, ml.g6, ml.p4d, ...)")
        if "eks" in self.backends:
            problems += [f"gpu_instance_types: {t!r} has no NVIDIA GPU, and the workers run with SLUICE_DEVICE=cuda "
                         "(g4dn, g5, g6, p4d, ...)" for t in self.gpu_instance_types if not _nvidia_gpu(t)]
        if not _KUBERNETES_MINOR.fullmatch(self.kubernetes_version):
            problems.append(f"kubernetes_version: {self.kubernetes_version!r} should be a minor version, such as 1.35")
        if not self.usage_plans:
            problems.append("usage_plans: at least one")
        # The longest queue name is `<prefix>-normal-dlq`; SQS takes 80 characters of these.
        if not _NAME_PREFIX.fullmatch(self.name_prefix):
            problems.append(f"name_prefix: {self.name_prefix!r} should be 1-69 letters, digits, '-' or '_' "
                            "(queue names are <prefix>-normal-dlq and the like, at most 80 characters)")
        if not 1 <= self.result_ttl_days <= 3650:
            problems.append("result_ttl_days: 1..3650")
        if problems:
            raise ValueError("invalid sluice configuration: " + "; ".join(problems))


_NAME_PREFIX = re.compile(r"[A-Za-z0-9_-]{1,69}")
_KUBERNETES_MINOR = re.compile(r"1\.\d{2,}")

# Options that are gone, each with what replaces it. Refused by name, since a
# value set for the old meaning cannot be carried over.
_REPLACED = {
    "invocations_per_instance": (
        "removed: the endpoint scales on concurrent requests per instance, not invocations per minute; "
        "set sluice.concurrent_requests_per_instance instead (default 2)"
    ),
}


# EC2 and SageMaker families with NVIDIA GPUs: g and p then a generation
# (g4dn, g5, g6e, p4d, p5...), less g4ad (AMD GPUs) and g5g (Arm CPUs, which
# the x86 images do not run on). A CPU instance would fail only at deploy
# time, when the model cannot load and the health check times out.
_NVIDIA_FAMILY = re.compile(r"^(?!g4ad\.|g5g\.)[gp]\d+[a-z0-9-]*\.[a-z0-9]+$")


def _nvidia_gpu(instance_type: str) -> bool:
    return bool(_NVIDIA_FAMILY.match(instance_type))


def _coerce(name: str, hint: Any, value: Any) -> Any:
    """Turn a context value (JSON or a command-line string) into the field's type."""
    origin = get_origin(hint)
    args = get_args(hint)
    try:
        if hint is bool:
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(value)
                return value.lower() in ("true", "1", "yes")
            return bool(value)
        if hint is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(value)
        if hint is float:
            return float(value)
        if hint is str:
            return str(value)
        if origin is Literal:
            if value not in args:
                raise ValueError(value)
            return value
        if _is_optional(hint):
            if value in (None, "", "null", "none"):
                return None
            return _coerce(name, next(a for a in args if a is not type(None)), value)
        if origin is tuple:
            items = _as_list(value)
            inner = args[0]
            if inner is UsagePlan:
                return tuple(UsagePlan(**item) if isinstance(item, dict) else item for item in items)
            return tuple(_coerce(name, inner, item) for item in items)
        if origin is dict:
            if isinstance(value, str):
                value = json.loads(value)
            return {str(k): _coerce(name, args[1], v) for k, v in dict(value).items()}
    except (TypeError, ValueError, json.JSONDecodeError) as exc:
        raise ValueError(f"sluice.{name}: cannot read {value!r} as {hint}") from exc
    raise TypeError(f"sluice.{name}: unsupported type {hint}")


def _is_optional(hint: Any) -> bool:
    return type(None) in get_args(hint)


def _as_list(value: Any) -> list:
    if isinstance(value, str):
        text = value.strip()
        if text.startswith("["):
            return json.loads(text)
        return [part.strip() for part in text.split(",") if part.strip()]
    return list(value)
