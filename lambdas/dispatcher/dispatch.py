"""One SQS batch -> claims in the task table -> SageMaker endpoint -> outcomes.

The same task lifecycle as the EKS worker (sluice.lifecycle): check the batch's
records, run, record each outcome with a conditional write, and let
SQS redeliver what failed until maxReceiveCount moves it to the DLQ (a
requeued task failed below that is sent there, sluice.lifecycle). The only
differences: Lambda deletes the messages it is told succeeded, and the model
runs behind an endpoint.

The endpoint speaks containers/sagemaker/serve.py's many-task contract
(sluice.contract's EndpointTasksRequest -> EndpointTasksReply): the runnable
tasks of a batch go in one invocation per model, so that they share the
model's batches on the GPU; each result already has its task's shape. The
endpoint judges each task's inputs and isolates a failing task by bisection,
so a per-task error is that task's alone: a failed attempt, or final at once
when every attempt would get it (`invalid_input`, `validation_error`). An
invocation is split only to stay within SageMaker's payload limits (the
contract's MAX_TASKS_PER_CALL and MAX_INPUTS_PER_CALL, and bytes per call, see
Dispatcher); the parts run concurrently. An invocation that fails as a whole
(the container's error, a timeout, an answer that is not an EndpointTasksReply)
is a failed attempt of every task in it, and a task it does not answer is a
failed attempt of that task. One that SageMaker turned away before any container saw it
(throttled, unavailable, no model ready, no connection), or that the container
refused before running any task, ran nothing: its 400 `unknown_model` (a model
the API took before a deploy brought it to the endpoint; the EKS worker hands
such a task back too) or its 503 `model_broken` (an instance whose model failed
every task of several calls in a row, waiting for SageMaker to replace it; the
EKS worker stops and hands its messages back too). No outcome is written,
the claim's recorded start is taken back (lifecycle.unclaim) and SQS delivers
the messages again, so an endpoint outage or a broken instance does not spend
attempts, as a dependency outage does not on EKS.
"""

from __future__ import annotations

import logging
import re
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, EndpointConnectionError
from pydantic import ValidationError

from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.contract import (
    MAX_INPUTS_PER_CALL,
    MAX_TASKS_PER_CALL,
    EndpointTask,
    EndpointTasksReply,
    EndpointTasksRequest,
    ErrorResponse,
    TaskMessage,
    now_ms,
    sent_by,
)
from sluice.isolation import INVALID_RESULT
from sluice.lifecycle import (
    INVALID_INPUT, Claim, Job, Outcome, claim, gather, load_inputs, plan_outcomes, public_reason, record_outcomes,
    refused, sqs_dead_letters, unclaim, unclaim_unwritten,
)
from sluice.settings import Settings

log = logging.getLogger("sluice.dispatcher")

# SageMaker's answers for a call no container saw (InvokeEndpoint's errors).
# Not InternalFailure: it does not say that no container ran the call.
_TURNED_AWAY = {"ThrottlingException", "ServiceUnavailable", "ModelNotReadyException"}
# serve.py's refusals of a whole call before any task ran, as (the container's
# HTTP status, its error body's code): a model it does not serve, and an
# instance whose model is broken (serve.py's MODEL_BROKEN, kept equal by a test;
# not imported: serve.py loads the models, torch with them). Any other status
# or code, a 503 or a 500 included, may have run the tasks: a failed attempt.
_UNSERVED_MODEL = "unknown_model"
_MODEL_BROKEN = "model_broken"
_CALLER_GONE = "caller_gone"  # serve.py's CALLER_GONE: the call waited past our give_up_s
# caller_gone was a 503 before it became a 429: an instance a deploy has not
# replaced yet still answers so.
_REFUSED_UNRUN = {(400, _UNSERVED_MODEL), (503, _MODEL_BROKEN), (429, _CALLER_GONE), (503, _CALLER_GONE)}
# The endpoint's per-task verdicts that every attempt would repeat.
_PERMANENT = {INVALID_INPUT, INVALID_RESULT, "validation_error"}


# What a dispatch keeps, after the endpoint's longest answer (give_up_s), to
# record the outcomes: uploads and conditional writes, each up to 3 tries of 4 s.
RECORDING_RESERVE_S = 15.0
# What dead-lettering needs left of the invocation: one SendMessageBatch's 3 tries of 4 s.
DEAD_LETTER_RESERVE_S = 13.0


class TurnedAway(Exception):
    """The endpoint did not take the call: nothing ran."""



@dataclass
class Delivery:
    message_id: str
    body: str
    receive_count: int


class Dispatcher:
    def __init__(
        self,
        settings: Settings,
        endpoint: str,
        runtime,
        metrics=None,
        concurrency: int = 8,
        max_tasks_per_call: int = MAX_TASKS_PER_CALL,
        max_inputs_per_call: int = MAX_INPUTS_PER_CALL,
        max_call_bytes: int = 5 * 2**20,
        give_up_s: float | None = None,
    ):
        self.settings = settings
        self.endpoint = endpoint
        self.runtime = runtime
        # SageMaker caps a request and its response at 6 MB each. The byte cap
        # bounds the request with headroom; the input cap bounds the response.
        self.max_tasks_per_call = max_tasks_per_call
        self.max_inputs_per_call = max_inputs_per_call
        self.max_call_bytes = max_call_bytes
        # How long a call is waited for (the runtime client's read timeout): told
        # to the container, which then skips a call still queued there past it.
        self.give_up_s = give_up_s
        self.store = TaskStore(settings)
        self.payloads = PayloadStore(settings)
        self.metrics = metrics
        self._queues: PriorityQueues | None = None
        # Concurrent invocations spread one SQS batch over the endpoint's instances.
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sluice-dispatch")

    def dispatch(self, deliveries: list[Delivery], time_left_s: Callable[[], float] | None = None) -> dict[str, str]:
        """Run one batch. Returns {message_id: reason} for the messages SQS must
        deliver again; every other message is finished and may be deleted.
        `time_left_s`: what is left of the invocation (the Lambda context's)."""
        retry: dict[str, str] = {}
        jobs = self._parse(deliveries, retry)
        claimed = claim(self.store, list(jobs.values()), now_ms(), self.settings.max_attempts) if jobs else Claim()
        for job in claimed.unknown:  # for a release that knows its record's status
            self._retry(retry, job, "its record is in a status this release does not know")
        # Expired and gone (rolled back, duplicate, cancelled) tasks are simply acknowledged.
        # Per task: an unreadable inputs object is its task's outcome, not the batch's failure.
        runnable, unreadable = load_inputs(self.payloads, claimed.runnable, self.pool)
        outcomes, turned_away = self._infer(runnable, time_left_s)
        if turned_away:
            # These ran nothing, whatever the outcomes' writes do.
            unclaim(self.store, [job for job, _ in turned_away])
            for job, reason in turned_away:
                self._retry(retry, job, reason)
            if self.metrics:
                self.metrics.record_handed_back(len(turned_away))
        self._record(unreadable + outcomes, retry, claimed.spent, time_left_s)
        return retry

    # ------------------------------------------------------------ claim
    def _parse(self, deliveries: list[Delivery], retry: dict[str, str]) -> dict[str, Job]:
        """The batch's jobs. A message this release cannot parse (a value or
        rule of a newer release, during a deploy; or no task at all) goes in
        `retry`, never deleted: dropped, its task would stay queued for ever.
        After max_attempts receives SQS moves it to the DLQ, where settling
        leaves it for a release that can read it, or for operators."""
        jobs: dict[str, Job] = {}
        for d in deliveries:
            try:
                message = TaskMessage.model_validate_json(d.body)
            except ValidationError as exc:
                log.error("handing back a message this release cannot read (%d errors)", exc.error_count(),
                          extra={"message_id": d.message_id, "task_id": sent_by(d.body)[0]})
                retry[d.message_id] = "a message this release cannot read"
                continue
            gather(jobs, message, d)  # a stale delivery is left out: acknowledged, as one not in `retry`
        return jobs

    # ------------------------------------------------------------ infer
    def _infer(self, jobs: list[Job], time_left_s: Callable[[], float] | None = None,
               ) -> tuple[list[Outcome], list[tuple[Job, str]]]:
        """The outcomes, and the jobs of calls the endpoint turned away (or that
        were not made: too little of the invocation left), with why."""
        if jobs and time_left_s and self.give_up_s and time_left_s() < self.give_up_s + RECORDING_RESERVE_S:
            # A slow claim ate the time: the function would time out after the
            # endpoint answered, losing every result and spending every attempt.
            return [], [(job, "too little of the invocation left to wait for the endpoint and record its answer")
                        for job in jobs]
        by_model: dict[str, list[Job]] = {}
        for job in jobs:
            by_model.setdefault(job.message.model, []).append(job)
        calls = [call for name, group in by_model.items() for call in self._calls(name, group)]
        outcomes: list[Outcome] = []
        turned_away: list[tuple[Job, str]] = []
        started = time.perf_counter()
        for call, result in zip(calls, self.pool.map(lambda call: self._invoke(*call), calls)):
            if isinstance(result, TurnedAway):
                turned_away += [(job, str(result)) for job in call[1]]
            else:
                outcomes += result
        if self.metrics:  # the calls ran at once: Throughput counts their span, not their sum
            self.metrics.record_busy((time.perf_counter() - started) * 1000)
        return outcomes, turned_away

    def _calls(self, model: str, jobs: list[Job]) -> list[tuple[str, list[Job]]]:
        """Split one model's jobs into as few invocations as the limits allow, in
        order. A redelivery (an earlier receive left no outcome: a retry, or a
        call that killed or hung the container) goes in a call of its own, as
        on the EKS worker (sluice.worker.batcher): the records of a failed call
        come back together, and one input that takes the container down would
        fail every task beside it, each attempt, until all were dead-lettered."""
        calls: list[tuple[str, list[Job]]] = []
        current: list[Job] = []
        inputs = size = 0
        for job in jobs:
            if job.attempts > 1:
                calls.append((model, [job]))
                continue
            # Bytes, as the body is sent (UTF-8) and SageMaker and serve.py count it.
            job_size = len(_task(job).model_dump_json().encode()) + 1
            job_inputs = len(job.inputs)
            if current and (
                len(current) >= self.max_tasks_per_call
                or inputs + job_inputs > self.max_inputs_per_call
                or size + job_size > self.max_call_bytes
            ):
                calls.append((model, current))
                current, inputs, size = [], 0, 0
            # A job over a limit on its own still goes alone: the endpoint's
            # refusal is then that task's failed attempt, as it always was.
            current.append(job)
            inputs += job_inputs
            size += job_size
        if current:
            calls.append((model, current))
        return calls

    def _invoke(self, model: str, jobs: list[Job]) -> list[Outcome] | TurnedAway:
        # Not validated here: the endpoint judges each task, so that a bad one is its own error.
        request = EndpointTasksRequest.model_construct(model=model, tasks=[_task(job) for job in jobs])
        n_inputs = sum(len(job.inputs) for job in jobs)
        started = time.perf_counter()
        try:
            response = self.runtime.invoke_endpoint(
                EndpointName=self.endpoint,
                ContentType="application/json",
                Accept="application/json",
                Body=request.model_dump_json().encode(),
                **({"CustomAttributes": f"sluice-give-up-s={self.give_up_s:g}"} if self.give_up_s else {}),
            )
            answer = EndpointTasksReply.model_validate_json(response["Body"].read())
            answers = {a.task_id: a for a in answer.tasks}
            version = answer.model_version
        except (BotoCoreError, ClientError, ValueError) as exc:  # a ValidationError is a ValueError
            log.warning(f"endpoint call failed: {_describe(exc)}", extra={"model": model, "tasks": len(jobs)})
            # The tasks' own message says what failed, never AWS's text: a ModelError's
            # names the account and the endpoint's log group.
            container = _container_error(exc.response) if isinstance(exc, ClientError) else None
            reason = f"endpoint call failed: {public_reason(exc)}" + (
                f" ({container[0]} {container[1]})" if container else "")
            if _turned_away(exc):
                return TurnedAway(reason)
            return [Outcome(job, error=reason) for job in jobs]
        elapsed_ms = int((time.perf_counter() - started) * 1000)
        if self.metrics:
            self.metrics.record_batch(n_inputs, elapsed_ms, busy=False)
        outcomes = []
        for job in jobs:
            a = answers.get(job.message.task_id)
            if a is None:
                outcomes.append(Outcome(job, error="endpoint call failed: no answer for this task"))
            elif a.error is not None:
                code = a.error.code
                reason = f"{code}: {a.error.message}"
                outcomes.append(refused(job, reason, version, code) if code in _PERMANENT
                                else Outcome(job, error=reason, model_version=version))
            else:
                outcomes.append(
                    Outcome(job, result=a.result, inference_ms=elapsed_ms, batch_size=n_inputs,
                            model_version=version)
                )
        return outcomes

    # ------------------------------------------------------------ record
    def _record(self, outcomes: list[Outcome], retry: dict[str, str], spent: list[Job],
                time_left_s: Callable[[], float] | None) -> None:
        now = now_ms()
        plan = plan_outcomes(outcomes, now, self.settings)
        # A rejected outcome's task is final already: its message is simply acknowledged.
        written = record_outcomes(self.store, self.payloads, plan, self.pool)
        rejected = written.rejected
        # Failed for good or not: SQS redelivers, and after maxReceiveCount the
        # message of a task marked failed lands in the dead-letter queue; one
        # that would not reach maxReceiveCount is sent there now.
        # plan.unrunnable (inputs unreadable or refused by the model) and
        # plan.expired (past the deadline) are final at once: acknowledged.
        for o in plan.retry + plan.failed:
            if o.job.message.task_id not in rejected:
                self._retry(retry, o.job, o.error)
        if plan.unwritten:
            # Outcomes the table would not take: each its own task's, never the
            # batch's, whose written outcomes stand; a throttled one's start is
            # taken back (lifecycle.unclaim_unwritten).
            errored = written.errored
            log.warning("could not record the outcome of %d tasks, sending them back: %s", len(plan.unwritten),
                        _describe(next(iter(errored.values()))))
            unclaim_unwritten(self.store, plan, errored)
            for o in plan.unwritten:
                self._retry(retry, o.job, f"outcome not recorded: {_describe(errored[o.job.message.task_id])}")
            if self.metrics:
                self.metrics.record_handed_back(len(plan.unwritten))
        if self.metrics:  # the plan's lists: a result that could not be stored is a failed attempt
            self.metrics.record_outcomes(plan.counted(), now, plan.dropped(rejected))
        for job in spent:
            self._retry(retry, job, f"past its {self.settings.max_attempts} attempts, each without an outcome")
        failed = [o.job for o in plan.failed if o.job.message.task_id not in rejected]
        for message_id in self._dead_letter(spent + failed, time_left_s):
            del retry[message_id]  # Lambda deletes it from its queue

    def _dead_letter(self, jobs: list[Job], time_left_s: Callable[[], float] | None) -> set[str]:
        """Send to its DLQ each message of these jobs (failed, or spent: past
        max_attempts unrun) that SQS would not move there at its next receive:
        one below maxReceiveCount (max_attempts), a requeued task's
        (sluice.dlq). Returns the ids of those sent; the rest are redelivered.
        One not sent comes back: a failed task's is then acknowledged (its
        task is final), only its dead letter missing; a spent one's is spent
        again. Skipped when the invocation has too little left: a timed-out
        invocation would have every message of the batch delivered again."""
        below = [(job.message.priority, d) for job in jobs for d in job.deliveries
                 if not sqs_dead_letters(d, self.settings.max_attempts)]
        if not below:
            return set()
        if time_left_s and time_left_s() < DEAD_LETTER_RESERVE_S:
            log.warning(f"too little of the invocation left to dead-letter {len(below)} messages: redelivered")
            return set()
        sent: set[str] = set()
        for priority in {p for p, _ in below}:
            group = [d for p, d in below if p == priority]
            try:
                stored = self.queues.send_bodies(self.queues.dlq_url(priority), [d.body for d in group])
            except Exception as exc:  # noqa: BLE001 - the tasks' outcomes are written: they stand
                log.warning(f"could not dead-letter {len(group)} messages: {_describe(exc)}")
                continue
            if len(stored) < len(group):
                log.warning(f"SQS did not store {len(group) - len(stored)} of {len(group)} dead letters")
            sent |= {group[i].message_id for i in stored}
        return sent

    @property
    def queues(self) -> PriorityQueues:
        """Made on first use: only a dead letter needs it."""
        if self._queues is None:
            self._queues = PriorityQueues(self.settings)
        return self._queues

    @staticmethod
    def _retry(retry: dict[str, str], job: Job, reason: str) -> None:
        for d in job.deliveries:
            retry[d.message_id] = reason


def _task(job: Job) -> EndpointTask:
    return EndpointTask.model_construct(task_id=job.message.task_id, inputs=job.inputs)


def _turned_away(exc: Exception) -> bool:
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code")
        return code in _TURNED_AWAY or (code == "ModelError" and _container_error(exc.response) in _REFUSED_UNRUN)
    # No connection was made (a read timeout, by contrast, may have run the model).
    return isinstance(exc, (EndpointConnectionError, ConnectTimeoutError))


def _container_error(response: dict) -> tuple[int, str] | None:
    """The container's HTTP status and the code of serve.py's error body within
    a ModelError, if that is what it holds, whatever the status."""
    status = response.get("OriginalStatusCode")
    if not isinstance(status, int):
        return None
    # SageMaker passes the container's body on as OriginalMessage, and quotes it in Message.
    body = response.get("OriginalMessage")
    if body is None:
        quoted = re.search(r'with message "(.*)"', response.get("Error", {}).get("Message", ""), re.DOTALL)
        body = quoted and quoted.group(1)
    try:
        return (status, ErrorResponse.model_validate_json(body).error.code) if body else None
    except ValueError:  # not serve.py's error body
        return None


def _describe(exc: Exception) -> str:
    if isinstance(exc, ClientError):
        # A container error arrives as ModelError, its body in the message.
        error = exc.response.get("Error", {})
        return f"{error.get('Code', 'ClientError')}: {error.get('Message', '')}"[:500]
    return f"{type(exc).__name__}: {exc}"[:300]
