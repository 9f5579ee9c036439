"""A batch's task lifecycle, one rule set for the EKS worker
(sluice.worker.runner) and the SageMaker dispatcher Lambda.

Claiming: each task moves to `running` by a conditional update (from
`queued|running`; a redelivery counts a new attempt), or to `expired` past its
deadline. The update is the check, so no read comes first: a rejected claim
means the task is missing (its submit was rolled back), already final (a
duplicate, a cancel), or contended; only those few are read back.

Outcomes: a success is written only from `running` (so a finished result is never
overwritten), inline when small and through S3 when large. A failure keeps the
task `running` with its last error while attempts remain, and marks it `failed`
once the message's receive count reaches max_attempts; that message's next
receive then moves it to the dead-letter queue.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.task_store import Change, TaskStore
from sluice.contract import TaskMessage, TaskStatus
from sluice.settings import Settings

_ERROR_CHARS = 1000
_ACTIVE = (TaskStatus.queued, TaskStatus.running)


@dataclass
class Job:
    """One task of a batch, with every delivery of it that the batch holds."""

    message: TaskMessage
    deliveries: list[Any]
    inputs: list[str] = field(default_factory=list)

    @property
    def attempts(self) -> int:
        return max(d.receive_count for d in self.deliveries)


@dataclass
class Outcome:
    job: Job
    result: Any = None
    error: str | None = None
    inference_ms: int = 0
    batch_size: int = 0
    model_version: str | None = None


@dataclass
class Claim:
    runnable: list[Job] = field(default_factory=list)
    expired: list[Job] = field(default_factory=list)  # past the deadline: acknowledge
    gone: list[Job] = field(default_factory=list)  # missing or already final: acknowledge
    contended: list[Job] = field(default_factory=list)  # another change won: leave for redelivery


def claim(store: TaskStore, jobs: list[Job], now: int, version_of: Callable[[str], str | None]) -> Claim:
    result = Claim()
    changes: list[Change] = []
    for job in jobs:
        task_id = job.message.task_id
        if job.message.deadline_at is not None and job.message.deadline_at <= now:
            changes.append(Change(task_id, {"status": TaskStatus.expired.value, "finished_at": now}, _ACTIVE))
            result.expired.append(job)
            continue
        changes.append(
            Change(
                task_id,
                {"status": TaskStatus.running.value, "model_version": version_of(job.message.model)},
                _ACTIVE,
                set_if_missing={"started_at": now},
                add_attempt=True,
            )
        )
        result.runnable.append(job)
    rejected = store.apply_many(changes) if changes else set()
    if rejected:
        current = store.get_many(rejected)
        for job in [j for j in result.runnable if j.message.task_id in rejected]:
            result.runnable.remove(job)
            record = current.get(job.message.task_id)
            (result.gone if record is None or record.status.is_terminal else result.contended).append(job)
    return result


@dataclass
class OutcomePlan:
    changes: list[Change] = field(default_factory=list)
    uploads: list[tuple[str, bytes]] = field(default_factory=list)
    succeeded: list[Outcome] = field(default_factory=list)
    retry: list[Outcome] = field(default_factory=list)  # attempts remain
    failed: list[Outcome] = field(default_factory=list)  # final; its message goes to the DLQ


def plan_outcomes(outcomes: list[Outcome], now: int, settings: Settings) -> OutcomePlan:
    plan = OutcomePlan()
    for o in outcomes:
        task_id = o.job.message.task_id
        if o.error is None:
            values: dict[str, Any] = {
                "status": TaskStatus.succeeded.value,
                "finished_at": now,
                "inference_ms": o.inference_ms,
                "batch_size": o.batch_size,
            }
            body = json.dumps(o.result, separators=(",", ":"))
            if len(body) > settings.inline_result_max_bytes:
                key = PayloadStore.result_key(o.job.message.tenant_id, task_id)
                plan.uploads.append((key, body.encode()))
                values["result_key"] = key
            else:
                values["result_json"] = body
            plan.changes.append(Change(task_id, values, (TaskStatus.running,), remove=("error_code", "error_message")))
            plan.succeeded.append(o)
            continue
        values = {"error_code": "model_error", "error_message": o.error[:_ERROR_CHARS]}
        if o.job.attempts >= settings.max_attempts:
            values.update(status=TaskStatus.failed.value, finished_at=now)
            plan.failed.append(o)
        else:
            plan.retry.append(o)
        plan.changes.append(Change(task_id, values, (TaskStatus.running,)))
    return plan
