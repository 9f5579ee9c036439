"""A batch's task lifecycle, one rule set for the EKS worker
(sluice.worker.runner) and the SageMaker dispatcher Lambda.

A task stays `queued` until its outcome is written, and the outcome is its one
table write on the happy path: each write is a conditional UpdateItem, which
no emulator or DynamoDB batch API can group, so writes per task set the
ceiling (docs/benchmarks.md).

Claiming: past its deadline a task becomes `expired`. A first delivery is
checked with one BatchGetItem for the whole batch: a missing record (its submit
was rolled back) or a final one (a duplicate, a cancel) is acknowledged without
running. So is a message of an earlier task under the same id (its
Idempotency-Key's task outlived its TTL and the key made a new one): every
claim and expiry holds a message to the record created when it was (its
`enqueued_at` is the record's `created_at`). A run's number (Job.attempts) is
its message's receive count plus the runs before that message was sent: a task
that dead-letter settling requeued gets a new message, whose receives SQS
counts from 1 again, carrying its runs so far (`runs_before`, sluice.dlq).
A job whose run's number would pass max_attempts is spent (unless its task is
final or gone: acknowledged, as any): not run, its message sent to the
dead-letter queue, where settling fails or requeues the task by its record
(its runs before ended without an outcome, none failed it). A redelivery, or
the first delivery of such a message, means an earlier attempt ended without
an outcome (a worker died, a reply was lost), so its start is recorded: a conditional update
(`queued` only, made with a token so that the SDK's resend of it, its
answer lost, adds nothing) adds one to `attempts`, which lets dead-letter settling tell a
task that keeps killing its worker from one that was only handed back. So a
claimed task that goes back without running (its batch's preparation failed
after the claim, a worker stopping hands back the batches prepared behind the
one in inference, its outcome's write was throttled) has that start taken back
(unclaim), with the `started_at` the claim replaced: settling counts starts.
Only while the record still shows that claim's start: one that another claim
has replaced since (the messages went back first, or came twice) stands.

A record in a status this release does not know (a newer one wrote it, during
a deploy) is neither run nor acknowledged: its job is `unknown`, handed back for
a release that knows it.

Outcomes: written only while the task is `queued`, so a finished result is
never overwritten and a cancel that lands during inference wins (the result is
dropped). One that comes after the task's deadline expires it instead, as the
API's read of it would have meanwhile. Results go inline when small and through S3 when large, under a key
of their own run's, so a run that loses the write never replaces the object
the record names (record_outcomes deletes the loser's). A result that cannot
be uploaded is its own task's failed attempt (`result_not_stored`), never the
batch's: the other outcomes are written all the same. So is an outcome the
table would not take (record_outcomes): not recorded, it is set aside for its
task to go back to its queue, and the rest are written. Its start is taken
back only where the write was throttled (`task_store.throttled`): any other error may
have landed, or will fail every delivery alike, so the start stands and the
task reaches max_attempts rather than run for ever. A failure
keeps the task `queued` with its last error while attempts remain, and marks it
`failed` once its run's number reaches max_attempts. Its message then goes to
the dead-letter queue: SQS moves it at its next receive once its receive count
reached maxReceiveCount (max_attempts); a requeued task's message, below that,
is sent there by the worker. A permanent failure (an
inputs object that does not exist or is not a JSON list of strings, or an input
the model refuses) is marked `failed` at once: no other attempt could succeed.
A final outcome renews the record's TTL (`expires_at`, set by the task store
for every change to a final status): a result is kept for result_ttl_days
from finishing, however long its task waited to run.

Inputs: read per task after claiming (load_inputs), so one unreadable inputs
object is an outcome of its own task, never a failure of its batch.
"""

from __future__ import annotations

import logging
import uuid
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError
from pydantic_core import PydanticSerializationError, to_json

from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.task_store import Applied, Change, TaskStore, expire, surely_not_applied, throttled
from sluice.contract import TaskMessage, TaskStatus
from sluice.isolation import INVALID_RESULT, MODEL_ERROR  # MODEL_ERROR: this attempt's crash, retried
from sluice.settings import Settings

log = logging.getLogger("sluice.lifecycle")

_ERROR_CHARS = 1000
_QUEUED = (TaskStatus.queued,)


@dataclass
class Job:
    """One task of a batch, with every delivery of it that the batch holds."""

    message: TaskMessage
    deliveries: list[Any]
    inputs: list[str] = field(default_factory=list)
    started_at: int | None = None
    # Set by claim when it recorded this redelivery's start (attempts + 1):
    # the started_at it wrote (what unclaim's condition looks for; started_at
    # above moves on to when inference began), and the one it replaced (what
    # unclaim puts back). None: no start of this job's to take back.
    recorded_start: int | None = None
    started_before: int | None = None
    # Per delivery, its message's runs_before: a task's requeued or re-sent
    # message and its first one may come in one batch, each counting apart.
    earlier_runs: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.earlier_runs:
            self.earlier_runs = [self.message.runs_before or 0] * len(self.deliveries)

    @property
    def attempts(self) -> int:
        """This run's number: the task's runs before a delivery's message was
        sent (settling's requeue, sluice.dlq) and that message's receives."""
        return max(runs + d.receive_count for runs, d in zip(self.earlier_runs, self.deliveries))


def sqs_dead_letters(delivery: Any, max_attempts: int) -> bool:
    """Whether SQS moves this delivery's message to its DLQ at its next receive:
    its receive count reached maxReceiveCount (max_attempts). One below it (a
    requeued task's, failed or spent) its worker or dispatcher sends there."""
    return delivery.receive_count >= max_attempts


def gather(jobs: dict[str, Job], message: TaskMessage, delivery: Any) -> list[Any]:
    """Add a delivery to the batch's job of its task; returns the deliveries
    this makes stale, to acknowledge unrun. The same task delivered twice is
    one job. Two messages of one id from different submits (an Idempotency-Key
    reused once its task outlived its TTL) are two tasks: the later submit's
    is the record's now, and the earlier's can only be dropped by the claim,
    which must not take the later one's delivery with it."""
    job = jobs.get(message.task_id)
    if job is None or message.enqueued_at > job.message.enqueued_at:
        jobs[message.task_id] = Job(message, [delivery])
        return job.deliveries if job is not None else []
    if message.enqueued_at < job.message.enqueued_at:
        return [delivery]
    job.deliveries.append(delivery)
    job.earlier_runs.append(message.runs_before or 0)
    return []


@dataclass
class Outcome:
    job: Job
    result: Any = None
    error: str | None = None
    inference_ms: int = 0
    batch_size: int = 0
    model_version: str | None = None
    error_code: str = MODEL_ERROR
    permanent: bool = False  # no other attempt can succeed: failed now, whatever attempts remain


@dataclass
class Claim:
    runnable: list[Job] = field(default_factory=list)
    expired: list[Job] = field(default_factory=list)  # past the deadline: acknowledge
    gone: list[Job] = field(default_factory=list)  # missing or already final: acknowledge
    # Past max_attempts, every run before it ended without an outcome, its task
    # still queued: to the dead-letter queue unrun, where settling fails or
    # requeues the task by its record.
    spent: list[Job] = field(default_factory=list)
    # Its record is in a status this release does not know (a newer release
    # wrote it, during a deploy): neither run nor acknowledged, handed back for
    # a release that knows it.
    unknown: list[Job] = field(default_factory=list)


def claim(store: TaskStore, jobs: list[Job], now: int, max_attempts: int) -> Claim:
    """Sort the jobs into runnable, expired, gone and spent, recording each
    redelivery's start. Raises when a write or the read fails, having taken
    back the starts it recorded: the batch goes back unrun.

    Spent: a requeued task's message (runs_before) is not dead-lettered by SQS
    until its own receives reach maxReceiveCount, so a task whose runs kill
    its worker (no outcome, no failure) would run past max_attempts."""
    result = Claim()
    expiries: list[Change] = []
    redelivered: list[Job] = []
    first: list[Job] = []
    over: list[Job] = []  # spent unless final or missing: read with the first deliveries
    for job in jobs:
        job.started_at = now
        if job.message.past_deadline(now):
            expiries.append(expire(job.message.task_id, now, job.message.enqueued_at))
            result.expired.append(job)
        elif job.attempts > max_attempts:
            over.append(job)
        elif job.attempts > 1:
            redelivered.append(job)
        else:
            first.append(job)
    # A rejected expiry is of a final or missing record, acknowledged all the same (one in an unknown status: below).
    token = uuid.uuid4().hex  # this claim's: an SDK resend of its write must not add a second start
    changes = expiries + [
        Change(j.message.task_id, {"started_at": now}, _QUEUED, add_attempt=True, returns_old=True,
               only_if={"created_at": j.message.enqueued_at}, token=token)
        for j in redelivered
    ]
    applied = store.apply_each(changes) if changes else Applied()
    _note_recorded_starts(redelivered, applied, now)
    # A refused start or expiry means a final or missing record, or one in a
    # status this release does not know: read with the first deliveries to tell which.
    refused = [j for j in redelivered + result.expired if j.message.task_id in applied.rejected]
    unknown: set[str] = set()
    try:
        if applied.errored:
            raise next(iter(applied.errored.values()))
        read = first + over + refused
        statuses = store.statuses([j.message.task_id for j in read],
                                  created={j.message.task_id: j.message.enqueued_at for j in read},
                                  unknown=unknown) if read else {}
    except Exception:
        unclaim(store, redelivered)
        raise
    for job in [j for j in result.expired if j.message.task_id in unknown]:
        result.expired.remove(job)
        result.unknown.append(job)
    for jobs_read, if_queued in ((redelivered, result.runnable), (first, result.runnable), (over, result.spent)):
        for job in jobs_read:
            task_id = job.message.task_id
            if task_id in unknown:
                result.unknown.append(job)
            elif jobs_read is redelivered:
                (result.gone if task_id in applied.rejected else if_queued).append(job)
            else:
                status = statuses.get(task_id)
                (result.gone if status is None or status.is_terminal else if_queued).append(job)
    return result


def _note_recorded_starts(redelivered: list[Job], applied: Applied, now: int) -> None:
    """Which starts the claim recorded, for unclaim. One whose call failed is
    not among them: a throttled write did not land, and a start wrongly taken
    back would let a task that kills its workers run once more than allowed."""
    for job in redelivered:
        if job.message.task_id in applied.replaced:
            # None: the claim's answer was lost, and with it the start it
            # replaced; a take-back then leaves the task without a start.
            replaced = applied.replaced[job.message.task_id] or {}
            job.recorded_start = now
            job.started_before = replaced.get("started_at")


def unclaim(store: TaskStore, jobs: list[Job]) -> None:
    """For jobs that did not run after all, or whose outcome was not recorded
    (the endpoint turned the call away unread, the worker handed the batch
    back): take back the start a redelivery's claim recorded, so that
    settling, which counts recorded starts, hands such a task back rather
    than failing it as one that kept killing its worker; and put back the
    started_at it replaced (or remove it, where the claim recorded the first
    one), so that the task does not show a start that ran nothing.

    Only while the record still shows this claim's start (its started_at and
    `queued`): a caller may hand the messages back first, and another claim
    of the task (another worker's, or a duplicate message's) may have
    recorded its own start since, which stands. This one's is then left
    counted too: the attempts cannot be told apart from an outcome's written
    since (its receive count, exact), and a run counted too many at worst
    fails a task one delivery early, where one too few could let a task
    that kills its workers run once more than allowed.

    Best effort, never raising: its callers are handing messages back, often
    from a failure or a dying process, and a start not taken back costs one
    run in settling's count, never a task."""
    recorded = [j for j in jobs if j.recorded_start is not None]
    if not recorded:
        return
    try:
        errored = store.apply_each([_take_back(j) for j in recorded]).errored
    except Exception as exc:  # noqa: BLE001 - see the docstring
        errored = {j.message.task_id: exc for j in recorded}
    for job in recorded:  # a rejected one is final already, or another claim's: nothing to take back
        if job.message.task_id not in errored:
            job.recorded_start = None  # once: a second unclaim of the job changes nothing
    if errored:
        log.warning("could not take back the recorded start of %d tasks: %s", len(errored),
                    _describe(next(iter(errored.values()))))


def _take_back(job: Job) -> Change:
    still_ours = {"started_at": job.recorded_start}
    if job.started_before is None:
        return Change(job.message.task_id, {}, _QUEUED, add_attempt=-1, remove=("started_at",), only_if=still_ours)
    return Change(job.message.task_id, {"started_at": job.started_before}, _QUEUED, add_attempt=-1,
                  only_if=still_ours)


INPUT_UNAVAILABLE = "input_unavailable"
INVALID_INPUT = "invalid_input"  # the model refuses the input (models.base.ModelInputError)
_MISSING = {"NoSuchKey", "NotFound", "404"}


def _describe(exc: Exception) -> str:
    """An AWS error by its code and message, any other by its type and text: for the log."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        return f"{error.get('Code') or 'ClientError'}: {error.get('Message', '')}"
    return f"{type(exc).__name__}: {exc}"


def public_reason(exc: Exception) -> str:
    """A failed call as a task's error message may tell its tenant: the AWS error
    code or the exception's type, never its text. That names the account, the
    role, KMS keys and endpoints (AccessDenied: User: arn:aws:sts::123456789012:
    assumed-role/...), which are the operator's: the log line beside it has them."""
    if isinstance(exc, ClientError):
        return exc.response.get("Error", {}).get("Code") or "ClientError"
    return type(exc).__name__


def _logged(key: str, exc: Exception) -> str:
    log.warning("could not read inputs object %s: %s", key, _describe(exc))
    return public_reason(exc)


def load_inputs(payloads: PayloadStore, jobs: list[Job], pool: Executor) -> tuple[list[Job], list[Outcome]]:
    """Give each job its inputs: inline in its message, or the S3 object its
    message names (claim check), each read on its own. Returns the jobs to run
    and an error outcome (`input_unavailable`, naming the key) for each job
    whose object could not be read; the rest of the batch runs all the same.
    A missing object, or one that is not a JSON list of strings, fails its task
    at once; any other error (throttling, a 5xx, a timeout, a reset connection)
    is a failed attempt, retried like a model error."""

    def load(job: Job) -> Outcome | None:
        key = job.message.inputs_key
        try:
            inputs = payloads.get_json(key)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code") or "ClientError"
            if code in _MISSING:
                return _unreadable(job, f"inputs object {key!r} does not exist ({code})", permanent=True)
            return _unreadable(job, f"inputs object {key!r} could not be read: {_logged(key, exc)}")
        except BotoCoreError as exc:  # before ValueError: some of botocore's errors are ValueErrors too
            return _unreadable(job, f"inputs object {key!r} could not be read: {_logged(key, exc)}")
        except ValueError as exc:  # not JSON, not UTF-8
            return _unreadable(job, f"inputs object {key!r} is not JSON: {exc}", permanent=True)
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is this task's attempt only
            return _unreadable(job, f"inputs object {key!r} could not be read: {_logged(key, exc)}")
        if not isinstance(inputs, list) or not all(isinstance(text, str) for text in inputs):
            return _unreadable(job, f"inputs object {key!r} is not a JSON list of strings", permanent=True)
        job.inputs = inputs
        return None

    fetch: list[Job] = []
    for job in jobs:
        if job.message.inputs is not None:
            job.inputs = job.message.inputs
        else:
            fetch.append(job)
    errors = [o for o in pool.map(load, fetch) if o is not None]
    failed = {id(o.job) for o in errors}
    return [job for job in jobs if id(job) not in failed], errors


def _unreadable(job: Job, reason: str, permanent: bool = False) -> Outcome:
    return Outcome(job, error=reason, error_code=INPUT_UNAVAILABLE, permanent=permanent)


def refused(job: Job, reason: str, model_version: str | None, code: str = INVALID_INPUT) -> Outcome:
    """The model (or the endpoint in front of it) refuses the task's input:
    every attempt would fail the same way."""
    return Outcome(job, error=reason, error_code=code, permanent=True, model_version=model_version)


@dataclass
class Upload:
    task_id: str
    key: str
    body: bytes


@dataclass
class OutcomePlan:
    now: int
    max_attempts: int
    changes: list[Change] = field(default_factory=list)
    uploads: list[Upload] = field(default_factory=list)
    succeeded: list[Outcome] = field(default_factory=list)
    retry: list[Outcome] = field(default_factory=list)  # attempts remain
    failed: list[Outcome] = field(default_factory=list)  # final; its message goes to the DLQ
    # Final at once (its inputs cannot be read, or the model refuses them): no
    # delivery could change it, so its message is deleted.
    unrunnable: list[Outcome] = field(default_factory=list)
    # Came after the task's deadline: expired, the result or error dropped, the
    # message deleted. The API's read of a task past its deadline expires it,
    # running or not, so the outcome cannot depend on whether a client polled.
    expired: list[Outcome] = field(default_factory=list)
    # Taken out of the lists above by record_outcomes: the table did not take
    # their write (throttled past the SDK's retries, a 5xx, no answer).
    unwritten: list[Outcome] = field(default_factory=list)

    def counted(self) -> list[Outcome]:
        """The outcomes the metrics count (the unwritten as handed back)."""
        return self.succeeded + self.unrunnable + self.retry + self.failed + self.expired

    def dropped(self, rejected: set[str]) -> set[str]:
        """The tasks whose attempt neither succeeded nor failed them: final
        already (`rejected` by the table), or past their deadline."""
        return rejected | {o.job.message.task_id for o in self.expired}


def plan_outcomes(outcomes: list[Outcome], now: int, settings: Settings) -> OutcomePlan:
    plan = OutcomePlan(now, settings.max_attempts)
    for o in outcomes:
        task_id = o.job.message.task_id
        if o.job.message.past_deadline(now):
            plan.changes.append(expire(task_id, now, o.job.message.enqueued_at))
            plan.expired.append(o)
            continue
        if o.error is None:
            values: dict[str, Any] = {
                "status": TaskStatus.succeeded.value,
                "finished_at": now,
                "inference_ms": o.inference_ms,
                "batch_size": o.batch_size,
                **_started(o, now),
            }
            # pydantic-core's encoder: the same JSON values as json.dumps at a
            # sixth of the CPU (0.025 against 0.14 ms for 384 floats), which
            # matters once a GPU makes the model cheap. NaN and infinities are
            # null, as JSON has them: inline or in S3, any client parses it.
            try:
                body = to_json(o.result, inf_nan_mode="null")
            except PydanticSerializationError as exc:
                # A model's result that JSON cannot hold (a tensor, a numpy
                # scalar) is its own task's failure, never its batch's: the
                # same inputs would give the same result again.
                o.error, o.error_code, o.permanent = f"the model's result is not JSON: {exc}", INVALID_RESULT, True
                _plan_error(plan, o)
                continue
            if len(body) > settings.inline_result_max_bytes:
                key = PayloadStore.result_key(o.job.message.tenant_id, task_id, uuid.uuid4().hex)
                plan.uploads.append(Upload(task_id, key, body))
                values["result_key"] = key
            else:
                values["result_json"] = body.decode()
            plan.changes.append(Change(task_id, values, _QUEUED, remove=("error_code", "error_message")))
            plan.succeeded.append(o)
            continue
        _plan_error(plan, o)
    return plan


def _started(o: Outcome, now: int) -> dict[str, Any]:
    started: dict[str, Any] = {"started_at": o.job.started_at or now, "attempts": o.job.attempts}
    if o.model_version:
        started["model_version"] = o.model_version
    return started


def _plan_error(plan: OutcomePlan, o: Outcome) -> None:
    values = {"error_code": o.error_code, "error_message": o.error[:_ERROR_CHARS], **_started(o, plan.now)}
    if o.permanent or o.job.attempts >= plan.max_attempts:
        values.update(status=TaskStatus.failed.value, finished_at=plan.now)
        (plan.unrunnable if o.permanent else plan.failed).append(o)
    else:
        plan.retry.append(o)
    plan.changes.append(Change(o.job.message.task_id, values, _QUEUED))


RESULT_NOT_STORED = "result_not_stored"


def record_outcomes(store: TaskStore, payloads: PayloadStore, plan: OutcomePlan, pool: Executor) -> Applied:
    """Upload the plan's large results, then write its outcomes, each on its
    own. Returns what the writes did: `rejected`, the ids of the tasks final
    already (another delivery finished it, or it was cancelled or expired
    meanwhile), which stands; `errored`, those whose write failed, whose
    outcomes are moved to `plan.unwritten`: not recorded, so their tasks go
    back to their queue (as if they had not run where `task_store.throttled`). The upload of a rejected
    outcome is deleted (it was under its own run's key), and that of an
    unwritten one where its write surely did not land.

    Each upload stands alone: a task whose result could not be stored is moved
    in the plan from `succeeded` to `retry` (or `failed` on its last attempt),
    and the rest of the batch's outcomes are written all the same."""

    def put(upload: Upload) -> str | None:
        try:
            payloads.put_json(upload.key, upload.body)
        except Exception as exc:  # noqa: BLE001 - whatever it is, it is this task's attempt only
            log.warning("could not store the result of task %s: %s", upload.task_id, _describe(exc))
            return public_reason(exc)
        return None

    unstored = {u.task_id: why for u, why in zip(plan.uploads, list(pool.map(put, plan.uploads))) if why}
    if unstored:
        _retry_unstored(plan, unstored)
    applied = store.apply_each(plan.changes) if plan.changes else Applied()
    # An unwritten outcome whose write may have landed keeps its object: the
    # record may name it (the bucket's expiry rule removes it otherwise).
    _delete_uploads(payloads, [u for u in plan.uploads if u.task_id in applied.rejected or (
        u.task_id in applied.errored and surely_not_applied(applied.errored[u.task_id]))])
    if applied.errored:
        _set_aside_unwritten(plan, applied.errored)
    return applied


def unclaim_unwritten(store: TaskStore, plan: OutcomePlan, errored: dict[str, Exception]) -> None:
    """For the outcomes record_outcomes set aside (`plan.unwritten`), whose
    tasks go back to their queue: a throttled write surely did not land and
    the table will take it later, so that attempt is not counted and its
    claim's start is taken back. Any other error keeps the start: it may have
    landed, or every delivery would fail alike, and a task whose starts were
    always taken back would be requeued by settling for ever; counted, it
    reaches max_attempts and settling fails it."""
    unclaim(store, [o.job for o in plan.unwritten if throttled(errored[o.job.message.task_id])])


def _delete_uploads(payloads: PayloadStore, uploads: list[Upload]) -> None:
    for upload in uploads:
        try:
            payloads.delete(upload.key)
        except (BotoCoreError, ClientError) as exc:  # the bucket's expiry rule removes it later
            log.warning("could not delete a dropped result %s: %s", upload.key, type(exc).__name__)


def _set_aside_unwritten(plan: OutcomePlan, errored: dict[str, Exception]) -> None:
    """A plan holds one outcome per task, so a task id names it."""
    for name in ("succeeded", "retry", "failed", "unrunnable", "expired"):
        outcomes = getattr(plan, name)
        plan.unwritten += [o for o in outcomes if o.job.message.task_id in errored]
        setattr(plan, name, [o for o in outcomes if o.job.message.task_id not in errored])
    plan.uploads = [u for u in plan.uploads if u.task_id not in errored]


def _retry_unstored(plan: OutcomePlan, unstored: dict[str, str]) -> None:
    """The model ran, so this is a failed attempt like a model error: its
    attempt is recorded (settling counts it) and it is retried, the result
    being lost with it. A plan holds one change per task, so a task id names it."""
    lost = [o for o in plan.succeeded if o.job.message.task_id in unstored]
    plan.succeeded = [o for o in plan.succeeded if o.job.message.task_id not in unstored]
    plan.uploads = [u for u in plan.uploads if u.task_id not in unstored]
    plan.changes = [c for c in plan.changes if c.task_id not in unstored]
    for o in lost:
        why = unstored[o.job.message.task_id]
        _plan_error(plan, Outcome(o.job, error=f"result could not be stored: {why}", error_code=RESULT_NOT_STORED,
                                  model_version=o.model_version))

