"""What the API does, free of HTTP: submit, fetch and cancel tasks.

Submit writes the task record first and then the message; if the message cannot
be sent the record is deleted again, so a task exists with its message or not
at all. With an Idempotency-Key the task id is derived from (tenant, key), so a
retried submit finds the task it created the first time.
"""

from __future__ import annotations

import hashlib
import json
import uuid

from botocore.exceptions import BotoCoreError, ClientError

from models.registry import CATALOGUE, ModelSpec
from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues, SendFailed
from sluice.adapters.task_store import Change, TaskExists, TaskStore, TransitionRejected
from sluice.api.errors import ApiError, not_found, unavailable
from sluice.contract import (
    BatchAccepted,
    BatchSubmitRequest,
    ErrorDetail,
    ModelInfo,
    Priority,
    SubmitRequest,
    TaskAccepted,
    TaskMessage,
    TaskRecord,
    TaskStatus,
    TaskView,
    new_task_id,
    now_ms,
)
from sluice.settings import Settings

_IDEMPOTENCY_NAMESPACE = uuid.UUID("6f1d7c2e-5b0a-4d8e-9a51-3c2f7e9b1d40")
# Until workers report real throughput, queue estimates assume this rate.
_ASSUMED_TASKS_PER_S = 100.0


def idempotent_task_id(tenant_id: str, key: str) -> str:
    return uuid.uuid5(_IDEMPOTENCY_NAMESPACE, f"{tenant_id}\x00{key}").hex


def request_hash(request: SubmitRequest) -> str:
    canonical = json.dumps(request.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


class TaskService:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.store = TaskStore(settings)
        self.payloads = PayloadStore(settings)
        self.queues = PriorityQueues(settings)
        served = set(settings.model_names())
        self.models: dict[str, ModelSpec] = {n: s for n, s in CATALOGUE.items() if n in served}

    # -------------------------------------------------------------- models
    def list_models(self) -> list[ModelInfo]:
        return [
            ModelInfo(name=s.name, version=s.version, max_batch_size=s.max_batch_size, description=s.description)
            for s in self.models.values()
        ]

    def _check_model(self, request: SubmitRequest, field: str = "model") -> None:
        if request.model not in self.models:
            raise ApiError(
                422,
                "validation_error",
                f"unknown model {request.model!r}",
                [ErrorDetail(field=field, rule=f"must be one of: {', '.join(sorted(self.models))}")],
            )

    def _check_backlog(self, priority: Priority) -> int:
        depth = self.queues.depth(priority)
        if depth >= self.settings.backlog_cap:
            raise ApiError(
                429,
                "backlog_full",
                f"the {priority.value} queue holds {depth} tasks (cap {self.settings.backlog_cap}); retry later",
                headers={"Retry-After": "5"},
            )
        return depth

    # -------------------------------------------------------------- submit
    def _build(self, tenant_id: str, request: SubmitRequest, task_id: str) -> tuple[TaskRecord, TaskMessage]:
        created = now_ms()
        deadline_at = created + request.deadline_s * 1000 if request.deadline_s else None
        record = TaskRecord(
            task_id=task_id,
            tenant_id=tenant_id,
            model=request.model,
            model_version=self.models[request.model].version,
            priority=request.priority,
            status=TaskStatus.queued,
            input_count=len(request.inputs),
            request_hash=request_hash(request),
            created_at=created,
            deadline_at=deadline_at,
            metadata=request.metadata,
            expires_at=created // 1000 + self.settings.result_ttl_days * 86400,
        )
        message = TaskMessage(
            task_id=task_id,
            tenant_id=tenant_id,
            model=request.model,
            priority=request.priority,
            input_count=len(request.inputs),
            inputs=request.inputs,
            deadline_at=deadline_at,
            enqueued_at=created,
        )
        return record, message

    def _claim_check(self, message: TaskMessage) -> None:
        """Large inputs go to S3; the message carries only their key."""
        body = json.dumps(message.inputs).encode()
        if len(body) > self.settings.inline_payload_max_bytes:
            key = self.payloads.inputs_key(message.tenant_id, message.task_id)
            self.payloads.put_json(key, body)
            message.inputs, message.inputs_key = None, key

    def submit(self, tenant_id: str, request: SubmitRequest, idempotency_key: str | None) -> TaskAccepted:
        self._check_model(request)
        depth = self._check_backlog(request.priority)
        task_id = idempotent_task_id(tenant_id, idempotency_key) if idempotency_key else new_task_id()
        record, message = self._build(tenant_id, request, task_id)
        try:
            self._claim_check(message)
            self.store.create(record)
        except TaskExists as exists:
            return self._replay(exists.existing, record, message, depth)
        except (BotoCoreError, ClientError):
            raise unavailable("the task store") from None
        try:
            self.queues.send(message)
        except (BotoCoreError, ClientError):
            self._roll_back([record.task_id])
            raise unavailable("the queue") from None
        return self._accepted(record, depth)

    def _replay(self, existing: TaskRecord, record: TaskRecord, message: TaskMessage, depth: int) -> TaskAccepted:
        if existing.request_hash != record.request_hash:
            raise ApiError(
                409,
                "idempotency_conflict",
                "this Idempotency-Key was used with a different request body",
                [ErrorDetail(field="Idempotency-Key", rule="must not be reused for a different request")],
            )
        if existing.status == TaskStatus.queued:
            # The first try may have died between record and message: send again.
            # A duplicate message is harmless, the worker runs a task only once.
            try:
                self.queues.send(message)
            except (BotoCoreError, ClientError):
                raise unavailable("the queue") from None
        return self._accepted(existing, depth)

    def submit_batch(self, tenant_id: str, batch: BatchSubmitRequest, idempotency_key: str | None) -> BatchAccepted:
        for i, request in enumerate(batch.tasks):
            self._check_model(request, field=f"tasks.{i}.model")
        depths = {p: self._check_backlog(p) for p in {r.priority for r in batch.tasks}}
        if idempotency_key:
            # Each task's own key, so a retried batch resumes exactly where it stopped.
            return BatchAccepted(
                tasks=[
                    self.submit(tenant_id, request, f"{idempotency_key}#{i}")
                    for i, request in enumerate(batch.tasks)
                ]
            )
        built = [self._build(tenant_id, r, new_task_id()) for r in batch.tasks]
        records = [r for r, _ in built]
        messages = [m for _, m in built]
        try:
            for m in messages:
                self._claim_check(m)
            self.store.create_many(records)
        except (BotoCoreError, ClientError, RuntimeError):
            self._roll_back([r.task_id for r in records])
            raise unavailable("the task store") from None
        try:
            self.queues.send_many(messages)
        except SendFailed as failed:
            self._roll_back(failed.failed_ids)
            sent = len(messages) - len(failed.failed_ids)
            raise ApiError(
                503,
                "dependency_unavailable",
                f"{len(failed.failed_ids)} of {len(messages)} tasks could not be queued and were not recorded; "
                f"{sent} were queued. Send an Idempotency-Key to make retries safe.",
                headers={"Retry-After": "5"},
            ) from None
        return BatchAccepted(tasks=[self._accepted(r, depths[r.priority]) for r in records])

    def _roll_back(self, task_ids: list[str]) -> None:
        for task_id in task_ids:
            try:
                self.store.delete_if_queued(task_id)
            except (BotoCoreError, ClientError):
                # The record stays queued without a message; a retry with the same
                # Idempotency-Key re-sends it, and its deadline/TTL bound the rest.
                pass

    def _accepted(self, record: TaskRecord, depth: int) -> TaskAccepted:
        ahead = depth
        if record.priority != Priority.high:
            ahead += self._cached_depth(Priority.high)
        if record.priority == Priority.low:
            ahead += self._cached_depth(Priority.normal)
        return TaskAccepted(
            task_id=record.task_id,
            status=record.status,
            priority=record.priority,
            queue_position=ahead,
            estimated_wait_s=round(ahead / _ASSUMED_TASKS_PER_S, 2),
        )

    def _cached_depth(self, priority: Priority) -> int:
        try:
            return self.queues.depth(priority)
        except (BotoCoreError, ClientError):
            return 0

    # ---------------------------------------------------------- get/cancel
    def _owned(self, tenant_id: str, task_id: str) -> TaskRecord:
        record = self.store.get(task_id)
        # Another tenant's task answers exactly like a missing one.
        if record is None or record.tenant_id != tenant_id:
            raise not_found(task_id)
        return record

    def get(self, tenant_id: str, task_id: str) -> TaskView:
        record = self._owned(tenant_id, task_id)
        result = json.loads(record.result_json) if record.result_json else None
        url = self.payloads.presigned_get(record.result_key) if record.result_key else None
        return record.to_view(result=result, result_url=url)

    def cancel(self, tenant_id: str, task_id: str) -> TaskView:
        record = self._owned(tenant_id, task_id)
        if record.status == TaskStatus.cancelled:
            return record.to_view()
        try:
            updated = self.store.apply(
                Change(task_id, {"status": TaskStatus.cancelled.value, "finished_at": now_ms()}, (TaskStatus.queued,))
            )
        except TransitionRejected as rejected:
            status = rejected.current.status.value if rejected.current else "gone"
            raise ApiError(409, "not_cancellable", f"task {task_id} is {status}; only queued tasks can be cancelled")
        return updated.to_view()
