"""One SQS batch -> claims in the task table -> SageMaker endpoint -> outcomes.

The same task lifecycle as the EKS worker (sluice.worker.runner): claim with a
conditional write, run, record the outcome with a conditional write, and let
SQS redeliver what failed until maxReceiveCount moves it to the DLQ. The only
differences: Lambda deletes the messages it is told succeeded, and the model
runs behind an endpoint.

The endpoint speaks containers/sagemaker/serve.py's contract: one task per
invocation, {"model": name, "inputs": [...]} -> {"model_version", "result"},
where the result already has the task's shape. Invocations for the tasks of
a batch run concurrently; a 4xx (a bad input) or 5xx is a failed attempt of
that task alone.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from botocore.exceptions import BotoCoreError, ClientError
from pydantic import ValidationError

from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.task_store import Change, TaskStore
from sluice.contract import TaskMessage, TaskStatus, now_ms
from sluice.outcomes import Job, Outcome, plan_outcomes
from sluice.settings import Settings

log = logging.getLogger("sluice.dispatcher")

_ACTIVE = (TaskStatus.queued, TaskStatus.running)


@dataclass
class Delivery:
    message_id: str
    body: str
    receive_count: int


class Dispatcher:
    def __init__(self, settings: Settings, endpoint: str, runtime, metrics=None, concurrency: int = 8):
        self.settings = settings
        self.endpoint = endpoint
        self.runtime = runtime
        self.store = TaskStore(settings)
        self.payloads = PayloadStore(settings)
        self.metrics = metrics
        # Concurrent invocations spread one SQS batch over the endpoint's instances.
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="sluice-dispatch")

    def dispatch(self, deliveries: list[Delivery]) -> dict[str, str]:
        """Run one batch. Returns {message_id: reason} for the messages SQS must
        deliver again; every other message is finished and may be deleted."""
        retry: dict[str, str] = {}
        jobs = self._parse(deliveries)
        runnable = self._claim(jobs, retry)
        runnable = self._load_inputs(runnable, retry)
        outcomes = self._infer(runnable)
        self._record(outcomes, retry)
        return retry

    # ------------------------------------------------------------ claim
    def _parse(self, deliveries: list[Delivery]) -> dict[str, Job]:
        jobs: dict[str, Job] = {}
        for d in deliveries:
            try:
                message = TaskMessage.model_validate_json(d.body)
            except ValidationError:
                # Not a task: redelivering it cannot help. Acknowledged and logged.
                log.error("dropping a message that is not a task", extra={"message_id": d.message_id})
                continue
            if message.task_id in jobs:
                jobs[message.task_id].deliveries.append(d)
            else:
                jobs[message.task_id] = Job(message, [d])
        return jobs

    def _claim(self, jobs: dict[str, Job], retry: dict[str, str]) -> list[Job]:
        if not jobs:
            return []
        records = self.store.get_many(jobs)
        now = now_ms()
        changes: list[Change] = []
        runnable: list[Job] = []
        for task_id, job in jobs.items():
            record = records.get(task_id)
            if record is None or record.status.is_terminal:
                continue  # rolled-back submit, duplicate or cancelled: nothing to run
            if job.message.deadline_at is not None and job.message.deadline_at <= now:
                changes.append(Change(task_id, {"status": TaskStatus.expired.value, "finished_at": now}, _ACTIVE))
                continue
            changes.append(
                Change(
                    task_id,
                    {"status": TaskStatus.running.value, "model_version": self._version(job.message.model)},
                    _ACTIVE,
                    set_if_missing={"started_at": now},
                    add_attempt=True,
                )
            )
            runnable.append(job)
        rejected = self.store.apply_many(changes) if changes else set()
        if rejected:
            fresh = self.store.get_many(rejected)
            for job in [j for j in runnable if j.message.task_id in rejected]:
                runnable.remove(job)
                current = fresh.get(job.message.task_id)
                if current is not None and not current.status.is_terminal:
                    self._retry(retry, job, "claim lost to a concurrent update")
        return runnable

    def _version(self, model: str) -> str | None:
        from models.registry import get_spec  # torch-free catalogue

        spec = get_spec(model)
        return spec.version if spec else None

    def _load_inputs(self, jobs: list[Job], retry: dict[str, str]) -> list[Job]:
        def load(job: Job) -> bool:
            if job.message.inputs is not None:
                job.inputs = job.message.inputs
                return True
            try:
                job.inputs = self.payloads.get_json(job.message.inputs_key)
                return True
            except (BotoCoreError, ClientError) as exc:
                self._retry(retry, job, f"inputs not readable: {type(exc).__name__}")
                return False

        loaded = list(self.pool.map(load, jobs))
        return [job for job, ok in zip(jobs, loaded) if ok]

    # ------------------------------------------------------------ infer
    def _infer(self, jobs: list[Job]) -> list[Outcome]:
        return list(self.pool.map(self._invoke, jobs))

    def _invoke(self, job: Job) -> Outcome:
        payload = {"model": job.message.model, "inputs": job.inputs}
        started = time.perf_counter()
        try:
            response = self.runtime.invoke_endpoint(
                EndpointName=self.endpoint,
                ContentType="application/json",
                Accept="application/json",
                Body=json.dumps(payload, separators=(",", ":")).encode(),
            )
            body = json.loads(response["Body"].read())
            result = body["result"]
        except (BotoCoreError, ClientError, ValueError, KeyError, TypeError) as exc:
            reason = f"endpoint call failed: {_describe(exc)}"
            log.warning(reason, extra={"task_id": job.message.task_id, "model": job.message.model})
            return Outcome(job, error=reason)
        elapsed_ms = int((time.perf_counter() - started) * 1000)
        if self.metrics:
            self.metrics.record_batch(len(job.inputs), elapsed_ms)
        return Outcome(job, result=result, inference_ms=elapsed_ms, batch_size=len(job.inputs))

    # ------------------------------------------------------------ record
    def _record(self, outcomes: list[Outcome], retry: dict[str, str]) -> None:
        now = now_ms()
        plan = plan_outcomes(outcomes, now, self.settings)
        list(self.pool.map(lambda kv: self.payloads.put_json(*kv), plan.uploads))
        if plan.changes:
            # A rejected change means another delivery already finished the task:
            # its outcome stands, and this message is simply acknowledged.
            self.store.apply_many(plan.changes)
        # Failed for good or not: SQS redelivers, and after maxReceiveCount the
        # message of a task marked failed lands in the dead-letter queue.
        for o in plan.retry + plan.failed:
            self._retry(retry, o.job, o.error)
        if self.metrics:
            self.metrics.record_outcomes(outcomes, now)

    @staticmethod
    def _retry(retry: dict[str, str], job: Job, reason: str) -> None:
        for d in job.deliveries:
            retry[d.message_id] = reason


def _describe(exc: Exception) -> str:
    if isinstance(exc, ClientError):
        # A container error arrives as ModelError, its body in the message.
        error = exc.response.get("Error", {})
        return f"{error.get('Code', 'ClientError')}: {error.get('Message', '')}"[:500]
    return f"{type(exc).__name__}: {exc}"[:300]
