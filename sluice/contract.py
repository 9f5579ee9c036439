"""The one contract: API bodies, queue messages and stored task records.

The OpenAPI schema, the SQS message body and the DynamoDB item are all produced
from the models in this module, so the three can never drift apart.
"""

from __future__ import annotations

import enum
import json
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

SCHEMA_VERSION = 1

# Limits that are part of the contract (the API rejects anything beyond them).
MAX_INPUTS_PER_TASK = 64
MAX_INPUT_CHARS = 8192
MAX_TASKS_PER_BATCH = 100
MAX_DEADLINE_S = 7 * 24 * 3600
MAX_METADATA_KEYS = 16
MAX_TASK_ID_CHARS = 64
MAX_IDEMPOTENCY_KEY_CHARS = 128
MAX_WAIT_S = 20  # GET /v1/tasks/{task_id}?wait_s=: the longest long poll

# One call of the SageMaker endpoint (containers/sagemaker/serve.py). SageMaker
# caps a request and its response at 6 MB each: the dispatcher sends at most
# MAX_TASKS_PER_CALL tasks and MAX_INPUTS_PER_CALL inputs a call (256 MiniLM
# embeddings are about 2 MB of JSON); the endpoint takes up to the ENDPOINT_
# limits from any caller.
MAX_TASKS_PER_CALL = 64
MAX_INPUTS_PER_CALL = 256
ENDPOINT_MAX_TASKS_PER_REQUEST = MAX_TASKS_PER_BATCH
ENDPOINT_MAX_INPUTS_PER_REQUEST = 1024

# SQS's longest retention, on every queue: a message must outlive its task's
# deadline, or SQS deletes it unseen (no DLQ, no settling) and the task stays
# queued until its record expires.
MESSAGE_RETENTION_S = 14 * 24 * 3600

# Object key prefixes in the payload bucket: claim-checked inputs, large results.
INPUTS_PREFIX = "inputs/"
RESULTS_PREFIX = "results/"


def payload_ttl_days(prefix: str, result_ttl_days: int) -> int:
    """Days the bucket keeps an object after its upload. A result lives as
    long as its finished task's record. Inputs are uploaded at submit, so they
    are kept while their task may still run (its message's retention) and no
    shorter than results: with inputs expiring after result_ttl_days, a task
    that waited longer in its queue would fail as `input_unavailable`. (A task
    redriven from a dead-letter queue gets a new message, not new inputs: past
    these days it fails so.)"""
    if prefix == INPUTS_PREFIX:
        return max(result_ttl_days, -(-MESSAGE_RETENTION_S // 86400))
    return result_ttl_days

MODEL_NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,63}$"  # a catalogue name outside it no request could carry
ModelName = Annotated[str, StringConstraints(pattern=MODEL_NAME_PATTERN)]
InputText = Annotated[str, StringConstraints(min_length=1, max_length=MAX_INPUT_CHARS)]
MetadataKey = Annotated[str, StringConstraints(min_length=1, max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=256)]
# A task's inputs, as the API takes them and the endpoint runs them.
TaskInputs = Annotated[list[InputText], Field(min_length=1, max_length=MAX_INPUTS_PER_TASK)]
# The API's path and header parameters (sluice/api/app.py).
TASK_ID_PATTERN = r"^[A-Za-z0-9_-]+$"  # the CLI checks ids with it too, before they go into a URL
TaskId = Annotated[str, StringConstraints(min_length=1, max_length=MAX_TASK_ID_CHARS, pattern=TASK_ID_PATTERN)]
# An API key's id on AWS (API Gateway's, alphanumeric), a tenant name on-prem
# (sluice.adapters.api_keys.check_tenant: 64 at most); it names S3 keys too.
TenantId = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")]
IdempotencyKey = Annotated[str, StringConstraints(min_length=1, max_length=MAX_IDEMPOTENCY_KEY_CHARS)]
WaitSeconds = Annotated[float, Field(ge=0, le=MAX_WAIT_S, allow_inf_nan=False)]  # nan, inf: "finite_number", not a bound


class Priority(str, enum.Enum):
    high = "high"
    normal = "normal"
    low = "low"


class TaskStatus(str, enum.Enum):
    queued = "queued"
    succeeded = "succeeded"
    failed = "failed"
    cancelled = "cancelled"
    expired = "expired"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL_STATUSES


TERMINAL_STATUSES = frozenset(
    {TaskStatus.succeeded, TaskStatus.failed, TaskStatus.cancelled, TaskStatus.expired}
)

# Every legal move of a task. A task stays `queued` while a worker runs it: the
# outcome is its one write (a per-task `running` write would double the table
# writes of every task), so a cancel is honoured until the result is recorded.
# Nothing ever leaves a terminal status.
ALLOWED_TRANSITIONS: dict[TaskStatus, frozenset[TaskStatus]] = {
    TaskStatus.queued: frozenset(
        {TaskStatus.succeeded, TaskStatus.failed, TaskStatus.cancelled, TaskStatus.expired}
    ),
    TaskStatus.succeeded: frozenset(),
    TaskStatus.failed: frozenset(),
    TaskStatus.cancelled: frozenset(),
    TaskStatus.expired: frozenset(),
}


def can_transition(current: TaskStatus, target: TaskStatus) -> bool:
    return target in ALLOWED_TRANSITIONS[current]


def new_task_id() -> str:
    return uuid.uuid4().hex


def now_ms() -> int:
    return int(time.time() * 1000)


def deadline_passed(deadline_at: int | None, now: int) -> bool:
    """Whether a task's deadline (epoch ms; None: it has none) has passed at
    `now`: the one rule the API, the workers and the dispatcher expire by."""
    return deadline_at is not None and deadline_at <= now


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", use_enum_values=False)


# ---------------------------------------------------------------- API bodies


class SubmitRequest(_Strict):
    """What a client posts to create one task."""

    model: ModelName = Field(description="Name of a model from GET /v1/models.")
    inputs: TaskInputs = Field(description="Texts to run through the model; results come back in the same order.")
    priority: Priority = Priority.normal
    # Strict: "10" or true is refused here as API Gateway's model (the same
    # schema) refuses it on AWS, so both deployments answer alike.
    deadline_s: int | None = Field(
        default=None,
        strict=True,
        ge=1,
        le=MAX_DEADLINE_S,
        description="Seconds from now by which the task must finish: one that has not by then is expired, "
                    "whether or not a worker had started it (a result that comes later is dropped). A whole "
                    "number written without a fraction or exponent (10, not 10.0 or 1e1).",
    )
    metadata: dict[MetadataKey, MetadataValue] | None = Field(
        default=None, max_length=MAX_METADATA_KEYS
    )


class BatchSubmitRequest(_Strict):
    tasks: list[SubmitRequest] = Field(min_length=1, max_length=MAX_TASKS_PER_BATCH)


class TaskAccepted(BaseModel):
    task_id: str
    status: TaskStatus
    priority: Priority
    queue_position: int = Field(description="Approximate number of tasks ahead of this one: those queued at "
                                            "its priority and at the higher ones.")
    estimated_wait_s: float | None = Field(description="The queue position over the rate at which workers "
                                                       "have lately taken tasks off the queues while tasks waited; "
                                                       "null while no such rate is measured (the queues have not "
                                                       "held a backlog yet).")


class BatchAccepted(BaseModel):
    tasks: list[TaskAccepted]


class TaskTimings(BaseModel):
    created_at: int = Field(description="Unix epoch milliseconds.")
    started_at: int | None = Field(default=None, description="When its batch began inference (on SageMaker: when "
                                                             "its endpoint call was made).")
    finished_at: int | None = Field(default=None, description="When its outcome was recorded.")
    queue_ms: int | None = Field(default=None, ge=0, description="started_at - created_at: waiting in its queue and "
                                                                 "behind the batch ahead of it on the model.")
    inference_ms: int | None = Field(default=None, description="The model's time for the batch it ran in; the rest "
                                                               "of finished_at - started_at is recording outcomes.")


class TaskError(BaseModel):
    code: str = Field(description="model_error (this attempt's crash; retried), invalid_input (the model refuses "
                                  "the input), invalid_result (the model's result is not JSON), input_unavailable (a claim-checked input cannot be read), result_not_stored "
                                  "(its large result could not be uploaded; retried), "
                                  "validation_error, dead_lettered (it kept failing its worker), deadline_exceeded "
                                  "(it had not finished by its deadline).")
    message: str


class TaskView(BaseModel):
    """What GET /v1/tasks/{task_id} returns."""

    task_id: str
    status: TaskStatus
    priority: Priority
    model: str
    model_version: str | None = None
    result: Any | None = Field(default=None, description="Inline result when it is small.")
    result_url: str | None = Field(default=None, description="Presigned URL of a large result.")
    error: TaskError | None = None
    timings: TaskTimings
    batch_size: int | None = None
    attempts: int = Field(
        default=0, description="Deliveries of the task to a worker so far, as its last recorded attempt counted them."
    )
    metadata: dict[str, str] | None = None


class ModelInfo(BaseModel):
    name: str
    version: str
    max_batch_size: int = Field(
        description="The model's bound on inputs per forward pass on a CPU worker: a deployment may batch fewer "
        "(SLUICE_MAX_BATCH_SIZE), a CUDA worker more. Not a limit on a request, whose `inputs` have their own."
    )
    description: str


class ModelList(BaseModel):
    models: list[ModelInfo]


class Health(BaseModel):
    """GET /health: the process answers (no dependency is touched)."""

    status: Literal["ok"]


class Readiness(BaseModel):
    """GET /ready: 200 when every dependency answers, 503 naming the ones that do not."""

    status: Literal["ready", "not_ready"]
    checks: dict[str, str] = Field(description='"ok", or the error a dependency answered with.')


class ErrorDetail(BaseModel):
    field: str
    rule: str


class ErrorBody(BaseModel):
    code: str
    message: str
    details: list[ErrorDetail] = []


class ErrorResponse(BaseModel):
    error: ErrorBody


# ------------------------------------------------------------ queue and store


def sent_by(body: str) -> tuple[str | None, int | None]:
    """(task id, enqueued_at) of the submit that sent a message, as far as its
    body says, read as plain JSON: also from a body this release cannot parse
    as a TaskMessage (a newer release's, during a rolling deploy)."""
    try:
        fields = json.loads(body)
    except ValueError:
        return None, None
    if not isinstance(fields, dict):
        return None, None
    task_id, enqueued_at = fields.get("task_id"), fields.get("enqueued_at")
    return (task_id if isinstance(task_id, str) else None,
            enqueued_at if isinstance(enqueued_at, int) and not isinstance(enqueued_at, bool) else None)


class TaskMessage(_Strict):
    """The SQS message body. Inputs travel inline, or by reference when large."""

    # Read by workers of other releases while a deploy rolls: one that does not
    # know a field added later runs the task all the same. One it cannot parse
    # at all (a value or rule of a newer release) it hands back unrun, never
    # deletes: dropped, its task would stay queued for ever.
    model_config = ConfigDict(extra="ignore", use_enum_values=False)

    v: int = SCHEMA_VERSION
    # Bounded as the API makes them: a message with an id DynamoDB refuses as a
    # key (empty, over 2048 bytes) would fail its whole batch's claim on AWS
    # (moto lets it through); unparseable, it is handed back alone.
    task_id: TaskId
    tenant_id: TenantId
    model: str
    priority: Priority
    input_count: int = Field(ge=1, description="Lets the batcher pack without fetching the inputs.")
    inputs: list[str] | None = None
    inputs_key: str | None = Field(default=None, description="S3 key of the inputs (claim check).")
    deadline_at: int | None = None
    enqueued_at: int = Field(description="Its task record's created_at: a claim holds the message to that "
                                         "record, not a later task's under the same id (sluice.lifecycle).")
    runs_before: int | None = Field(
        default=None, ge=1,
        description="Runs of the task before this message was sent: set by dead-letter settling when it "
                    "requeues a task (sluice.dlq), and by an idempotent retry's re-send, whose new message SQS "
                    "counts from 1 again.")

    @model_validator(mode="after")
    def _inputs_inline_xor_by_key(self) -> TaskMessage:
        # A message that breaks this is not a task this release can run: workers and
        # the dispatcher hand it back, never delete it (sluice.worker.runner.prepare).
        if (self.inputs is None) == (self.inputs_key is None):
            raise ValueError("a task message carries its inputs inline or an inputs_key, exactly one of them")
        if self.inputs is not None and len(self.inputs) != self.input_count:
            raise ValueError(f"input_count is {self.input_count} but the message carries {len(self.inputs)} inputs")
        return self

    def past_deadline(self, now: int) -> bool:
        """Whether its task's deadline has passed at `now` (ms): a claim then
        expires it, and so does an outcome that comes after it."""
        return deadline_passed(self.deadline_at, now)


class TaskRecord(BaseModel):
    """One item of the tasks table."""

    model_config = ConfigDict(extra="ignore")

    task_id: str
    tenant_id: str
    model: str
    model_version: str | None = None
    priority: Priority
    status: TaskStatus
    input_count: int
    request_hash: str | None = None
    # The same request's hash without its default values, which a release that
    # adds an optional field leaves alone (sluice.api.service.Fingerprint).
    request_fingerprint: str | None = None
    created_at: int
    deadline_at: int | None = None
    started_at: int | None = None
    finished_at: int | None = None
    inference_ms: int | None = None
    batch_size: int | None = None
    attempts: int = 0
    result_json: str | None = None
    result_key: str | None = None
    error_code: str | None = None
    error_message: str | None = None
    metadata: dict[str, str] | None = None
    expires_at: int | None = Field(default=None, description="DynamoDB TTL, epoch seconds.")
    # Which submit wrote or last claimed the record: only that submit's rollback
    # may delete it (sluice.api.service). Internal: never part of the view.
    submit_token: str | None = None
    # When a retry of an idempotent submit last re-sent the task's message
    # (epoch ms): retries within RESEND_INTERVAL_S send no more. Internal too.
    resent_at: int | None = None
    # Which claim recorded the latest start (sluice.lifecycle): the SDK's
    # resend of that claim's write, its answer lost, finds it and is known as
    # the same write, not a second start. Internal too.
    claim_token: str | None = None

    def overdue(self, now: int) -> bool:
        """Still `queued` past its deadline: it will never run, and a read of it expires it."""
        return self.status == TaskStatus.queued and deadline_passed(self.deadline_at, now)

    def runs(self) -> int:
        """How often a queued task started, as its record tells once its first
        delivery was received (sluice.lifecycle). An attempt that wrote an
        error wrote its run's number, exact, and each later start adds one.
        Without one, only redeliveries recorded their start: the first
        delivery's is added, whether it ran or was handed back unrun."""
        return self.attempts if self.error_code else self.attempts + 1

    def to_view(self, result: Any = None, result_url: str | None = None) -> TaskView:
        # created_at is the API host's clock, started_at the worker's: a worker
        # whose clock is behind would show a negative wait.
        queue_ms = max(0, self.started_at - self.created_at) if self.started_at else None
        error = (
            TaskError(code=self.error_code, message=self.error_message or "")
            if self.error_code
            else None
        )
        return TaskView(
            task_id=self.task_id,
            status=self.status,
            priority=self.priority,
            model=self.model,
            model_version=self.model_version,
            result=result,
            result_url=result_url,
            error=error,
            timings=TaskTimings(
                created_at=self.created_at,
                started_at=self.started_at,
                finished_at=self.finished_at,
                queue_ms=queue_ms,
                inference_ms=self.inference_ms,
            ),
            batch_size=self.batch_size,
            attempts=self.attempts,
            metadata=self.metadata,
        )


# ------------------------------------------- SageMaker endpoint (serve.py) calls
#
# The dispatcher Lambda (lambdas/dispatcher/dispatch.py) sends EndpointTasksRequest
# and reads EndpointTasksReply; containers/sagemaker/serve.py reads and answers
# them, and also takes a single EndpointRequest (-> EndpointResult). Its errors
# for a whole request are ErrorResponse. Unknown fields are ignored both ways,
# so either side may be a release ahead while a deploy rolls.


class _Call(BaseModel):
    model_config = ConfigDict(extra="ignore")


class EndpointRequest(_Call):
    """One task's inputs (or a bare JSON list of them), run as one result."""

    model: str | None = Field(default=None, description="The endpoint's first model when absent.")
    inputs: list[InputText] = Field(min_length=1, max_length=ENDPOINT_MAX_INPUTS_PER_REQUEST)


class EndpointResult(_Call):
    model: str
    model_version: str
    result: Any


class EndpointTask(_Call):
    task_id: str = Field(min_length=1)
    inputs: TaskInputs


class EndpointTasksRequest(_Call):
    """Many tasks in one call, sharing the model's batches. The endpoint judges
    each task's inputs on its own: a task that breaks the rules gets a
    `validation_error` answer and the others still run."""

    model: str | None = Field(default=None, description="The endpoint's first model when absent.")
    tasks: list[EndpointTask] = Field(min_length=1, max_length=ENDPOINT_MAX_TASKS_PER_REQUEST)

    @model_validator(mode="after")
    def _inputs_per_request(self) -> EndpointTasksRequest:
        total = sum(len(task.inputs) for task in self.tasks)
        if total > ENDPOINT_MAX_INPUTS_PER_REQUEST:
            raise ValueError(f"the tasks hold {total} inputs; at most {ENDPOINT_MAX_INPUTS_PER_REQUEST} a request")
        return self


class EndpointTaskAnswer(_Call):
    """A task's result, or its error: `validation_error` and `invalid_input`
    would be the same on every attempt, `model_error` is this attempt's."""

    task_id: str
    result: Any = None
    error: TaskError | None = None

    @model_validator(mode="after")
    def _result_xor_error(self) -> EndpointTaskAnswer:
        if ("result" in self.model_fields_set) == (self.error is not None):
            raise ValueError("a task's answer holds its result or its error, exactly one of them")
        return self


class EndpointTasksReply(_Call):
    model: str
    model_version: str
    tasks: list[EndpointTaskAnswer] = Field(description="One answer per task, in request order.")


class ApiKeyRecord(BaseModel):
    """One item of the API keys table; the key itself is never stored, only its hash."""

    key_hash: str
    tenant_id: str
    key_id: str
    created_at: int
    revoked: bool = False
