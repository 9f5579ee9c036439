"""What the API does, free of HTTP: submit, fetch and cancel tasks.

Submit writes the task record first and then the message; if the message cannot
be sent the record is deleted again, so a task exists with its message or not
at all. When the table is unreachable too (a network cut takes both), the
delete is retried in the background until it lands: a record left behind would
be a task `queued` forever with no message to run it.

With an Idempotency-Key the task id is derived from (tenant, key), so a retried
submit finds the task it created the first time. Each submit writes its own
token on the record; a retry re-sends the message and then claims the record
it read with its token (only while that record still holds the token it read),
so the first try's pending compensation can no longer delete it.
A retry never deletes a record: the task may be one already accepted (202).
The claim records when its message went out (`resent_at`); a retry that finds
it younger than RESEND_INTERVAL_S does not send again.

Claim-checked inputs are uploaded before the record is written. A submit that
is refused (409) or, without a key, rolled back deletes what it uploaded: no
record names it. A keyed submit's rollback keeps it: a concurrent retry with
the same key and body names the very same object.
"""

from __future__ import annotations

import enum
import hashlib
import json
import logging
import queue
import secrets
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from botocore.exceptions import BotoCoreError, ClientError, ConnectTimeoutError, ReadTimeoutError

from models.registry import CATALOGUE, ModelSpec
from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues, SendFailed
from sluice.adapters.task_store import (Change, TaskExists, TaskStore, TransitionRejected, UnreadableRecord,
                                        expire)
from sluice.api.backlog import QueueBacklog
from sluice.api.errors import ApiError, idempotency_conflict, newer_record, not_found, unavailable
from sluice.api.group_commit import GroupCommit
from sluice.contract import (
    MESSAGE_RETENTION_S,
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

log = logging.getLogger("sluice.api")

_IDEMPOTENCY_NAMESPACE = uuid.UUID("6f1d7c2e-5b0a-4d8e-9a51-3c2f7e9b1d40")

# How long a retry of a queued task trusts the last re-send of its message. Its
# `resent_at` is written only after SQS accepted that message, so a re-send that failed
# or died leaves none and the next retry sends at once: this interval never delays
# the recovery of a first try that died between record and message. It bounds the
# duplicates a client retrying in a loop adds (each counts against the backlog cap
# and may run the task twice) to one a minute, while a message lost after SQS took
# it (a purged queue) is still put back by a retry within a minute.
RESEND_INTERVAL_S = 60


def _resent_lately(record: TaskRecord) -> bool:
    """Whether a retry re-sent the task's message within RESEND_INTERVAL_S and then claimed its record."""
    return record.resent_at is not None and abs(now_ms() - record.resent_at) < RESEND_INTERVAL_S * 1000


def idempotent_task_id(tenant_id: str, key: str) -> str:
    return uuid.uuid5(_IDEMPOTENCY_NAMESPACE, f"{tenant_id}\x00{key}").hex


def batch_task_id(tenant_id: str, key: str, index: int) -> str:
    """Apart from single submits' ids: a single submit's key can never name a batch's task."""
    return uuid.uuid5(_IDEMPOTENCY_NAMESPACE, f"{tenant_id}\x00batch\x00{key}\x00{index}").hex


class Fingerprint:
    """An Idempotency-Key's request, as its record holds it. `legacy` hashes
    every field with its default (`request_hash`: what every release compares,
    this one's predecessors too, so a rollback keeps matching). `stable` hashes
    the fields apart from those at their defaults (`request_fingerprint`): a
    release that adds an optional field, or a client that spells out a
    default, hashes the same body alike, so a retry that crosses a deploy is
    not a 409 for its own request. Either matching is the same request."""

    def __init__(self, legacy: str, stable: str):
        self.legacy, self.stable = legacy, stable

    def matches(self, record: TaskRecord) -> bool:
        return record.request_hash == self.legacy or (
            record.request_fingerprint is not None and record.request_fingerprint == self.stable)

    def indexed(self, index: int) -> Fingerprint:
        """A batch's task's: the whole batch's, and the task's place in it."""
        return Fingerprint(f"{self.legacy}#{index}", f"{self.stable}#{index}")


def _digest(fields: dict) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def request_hash(request: SubmitRequest | BatchSubmitRequest) -> str:
    """Every field with its default: what `request_hash` has always held."""
    return _digest(request.model_dump(mode="json"))


def fingerprint_of(request: SubmitRequest | BatchSubmitRequest) -> Fingerprint:
    return Fingerprint(request_hash(request), _digest(request.model_dump(mode="json", exclude_defaults=True)))


class _Unread(enum.Enum):
    UNREAD = "unread"


UNREAD = _Unread.UNREAD  # TaskService.get: the caller has not read the record

KEYED_BATCH_THREADS = 8  # a keyed batch's creates at once (TaskService._create_keyed)


# A write that got no answer may land later: a hung table (a frozen process, a
# stalled link) applies what it holds when it wakes, each of the SDK's tries of
# it, before or after the rollback's delete. The rollback deletes again, every
# _WATCH_EVERY_S, for this long after such a write failed.
LATE_WRITE_WATCH_S = 30.0
_WATCH_EVERY_S = 1.0


class _Rollback(NamedTuple):
    task_id: str
    token: str
    since: float  # handed to the background (time.monotonic())
    watch_until: float  # a record not found may land until then (LATE_WRITE_WATCH_S)
    due: float  # not tried again before


class Compensator:
    """Deletes the records of submits whose message was never sent: at once,
    and, while the table cannot be reached, again in the background with
    backoff. Bounded: past `max_pending` or `give_up_s` a task id is logged
    (ids only, never payloads) for an operator instead of being held."""

    def __init__(self, store: TaskStore, max_pending: int = 10_000, give_up_s: float = 900.0):
        self.store = store
        self.give_up_s = give_up_s
        self._pending: queue.Queue = queue.Queue(maxsize=max_pending)
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        # Handed to the background and neither deleted nor given up yet; what
        # drain waits for, and names if shutdown comes first.
        self._unsettled: Counter[str] = Counter()  # a retried submit may hand the same id over twice
        self._settled = threading.Condition()
        self._wake = threading.Event()  # drain: retry now, not after the backoff

    def undo(self, task_ids: list[str], token: str, after: Exception | None = None) -> None:
        """`after`: the error of the write being undone. A timeout says the
        table hangs: a delete tried here would wait out the same timeouts
        (12 s) before the submit could answer, and a group commit's later
        submits behind it. Such a write may also land later (LATE_WRITE_WATCH_S)."""
        if after is not None and _timed_out(after):
            for task_id in task_ids:
                self._later(task_id, token, watch_s=LATE_WRITE_WATCH_S)
            return
        for i, task_id in enumerate(task_ids):
            try:
                self.store.delete_if_queued(task_id, token)
            except Exception as exc:  # noqa: BLE001 - a record left behind is the one outcome to avoid
                _log_unexpected(exc, task_id)
                # The table is out of reach: the rest would each wait out the
                # same timeouts (while a group commit holds its submits), so
                # they all go to the background at once.
                for later in task_ids[i:]:
                    self._later(later, token)
                return

    def pending(self) -> int:
        return self._pending.qsize()

    def drain(self, timeout_s: float) -> list[str]:
        """At shutdown: waits up to timeout_s for the background's rollbacks to
        land, and logs the id of each that did not (its record may stay
        `queued` with no message until its TTL) for an operator. The thread is
        a daemon: without this wait the process would exit and drop them."""
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        with self._settled:
            self._settled.wait_for(lambda: not self._unsettled, timeout=max(0.0, deadline - time.monotonic()))
            left = sorted(+self._unsettled)
        for task_id in left:
            log.error("could not roll back task %s before shutdown: it may stay queued without a message", task_id)
        return left

    def _settle(self, task_id: str) -> None:
        with self._settled:
            self._unsettled[task_id] -= 1
            if self._unsettled[task_id] <= 0:
                del self._unsettled[task_id]
            self._settled.notify_all()

    def _later(self, task_id: str, token: str, watch_s: float = 0.0) -> None:
        """`watch_s`: how long a record not found may still land (LATE_WRITE_WATCH_S)."""
        with self._settled:
            self._unsettled[task_id] += 1
        now = time.monotonic()
        try:
            self._pending.put_nowait(_Rollback(task_id, token, now, now + watch_s, now))
        except queue.Full:
            log.error("could not roll back task %s: compensation backlog full", task_id)
            self._settle(task_id)
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="sluice-compensate", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        backoff = 0.5
        held: _Rollback | None = None  # one to retry that found the queue full
        while True:
            if held is not None:
                item, held = held, None
            else:
                try:
                    item = self._pending.get(timeout=60)
                except queue.Empty:
                    with self._lock:  # an item put while this thread decided to stop would wait forever
                        if self._pending.empty():
                            self._thread = None
                            return
                    continue
            if item.due > time.monotonic():  # a watched one: what is behind it waits _WATCH_EVERY_S at most
                self._wake.wait(item.due - time.monotonic())
            try:
                kept = self.store.delete_if_queued(item.task_id, item.token)
            except Exception as exc:  # noqa: BLE001 - this thread is the backlog's only reader: it must not die
                _log_unexpected(exc, item.task_id)
                if time.monotonic() - item.since > self.give_up_s:
                    log.error("gave up rolling back task %s after %.0fs", item.task_id, self.give_up_s)
                    self._settle(item.task_id)
                    continue
                failed = True
            else:
                failed = False
                backoff = 0.5
                # Kept: another submit claimed the record. Draining: a write
                # that may never land does not hold up the shutdown.
                if kept or time.monotonic() >= item.watch_until or self._wake.is_set():
                    self._settle(item.task_id)
                    continue
                item = item._replace(due=time.monotonic() + _WATCH_EVERY_S)  # none left now; the write may land yet
            try:
                self._pending.put_nowait(item)
            except queue.Full:
                # Requests filled the queue while this delete was tried. This
                # thread is the queue's only reader, so a blocking put would
                # wait for ever: the delete is retried in place instead.
                held = item
            if not failed:
                continue  # a watched one waits for its due time, not a backoff
            if self._wake.is_set():
                time.sleep(0.2)  # draining: retry soon, not after a backoff that drain would not outlive
            else:
                self._wake.wait(backoff)
                backoff = min(backoff * 2, 10.0)


def _timed_out(exc: Exception) -> bool:
    """Whether a call's last try waited out its timeout (a reset or refused
    connection fails at once; a ClientError is an answer)."""
    return isinstance(exc, (ReadTimeoutError, ConnectTimeoutError))


def _log_unexpected(exc: Exception, task_id: str) -> None:
    """An AWS error is the table out of reach, retried quietly; anything else is logged with its traceback."""
    if not isinstance(exc, (BotoCoreError, ClientError)):
        log.error("rolling back task %s failed unexpectedly; retrying", task_id, exc_info=exc)


class TaskService:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.store = TaskStore(settings)
        self.payloads = PayloadStore(settings)
        self.queues = PriorityQueues(settings)
        self.compensator = Compensator(self.store)
        self.group_commit = GroupCommit(self._write_fresh)
        self.backlog = QueueBacklog(self.queues.depth, settings.backlog_cap)
        served = set(settings.model_names())
        self.models: dict[str, ModelSpec] = {n: s for n, s in CATALOGUE.items() if n in served}

    # -------------------------------------------------------------- models
    def list_models(self) -> list[ModelInfo]:
        return [
            ModelInfo(name=s.name, version=s.version, max_batch_size=s.max_batch_size, description=s.description)
            for s in self.models.values()
        ]

    def _check_models(self, requests: list[SubmitRequest], fields: list[str]) -> None:
        """One 422 naming every task whose model is not served, as a schema error names every field."""
        unknown = [(r.model, f) for r, f in zip(requests, fields) if r.model not in self.models]
        if unknown:
            names = ", ".join(dict.fromkeys(repr(model) for model, _ in unknown))
            rule = f"must be one of: {', '.join(sorted(self.models))}"
            raise ApiError(422, "validation_error", f"unknown model {names}",
                           [ErrorDetail(field=field, rule=rule) for _, field in unknown])

    def _check_backlog(self, priority: Priority) -> int:
        depth = self.backlog.depth(priority)
        if depth >= self.settings.backlog_cap:
            raise ApiError(
                429,
                "backlog_full",
                f"the {priority.value} queue holds {depth} tasks (cap {self.settings.backlog_cap}); retry later",
                headers={"Retry-After": "5"},
            )
        return depth

    # -------------------------------------------------------------- submit
    def _build(
        self, tenant_id: str, request: SubmitRequest, task_id: str, fingerprint: Fingerprint | None = None
    ) -> tuple[TaskRecord, TaskMessage]:
        """`fingerprint`: what a replay must match (default: the request's hash)."""
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
            # A keyless submit is never matched: its hash only names its claim-checked inputs.
            request_hash=fingerprint.legacy if fingerprint else request_hash(request),
            request_fingerprint=fingerprint.stable if fingerprint else None,
            created_at=created,
            deadline_at=deadline_at,
            metadata=request.metadata,
            # Not before the task's message can have run (SQS keeps one up to
            # MESSAGE_RETENTION_S; a worker drops a message whose record is gone,
            # as a rolled-back submit's), nor within the TTL of its deadline.
            # The outcome write renews it to the TTL from finishing (sluice.lifecycle).
            expires_at=max(created // 1000 + MESSAGE_RETENTION_S,
                           (deadline_at or created) // 1000 + self.settings.result_ttl_days * 86400),
        )
        return record, self._message_of(record, request)

    def _needs_claim_check(self, message: TaskMessage) -> bool:
        return len(json.dumps(message.inputs).encode()) > self.settings.inline_payload_max_bytes

    def _claim_check(self, record: TaskRecord, message: TaskMessage, stored: bool = False) -> str | None:
        """Large inputs go to S3; the message carries only their key. `stored`:
        they are there already (a record is written only after its inputs).
        Returns the key it uploaded, if any."""
        body = json.dumps(message.inputs).encode()
        if len(body) <= self.settings.inline_payload_max_bytes:
            return None
        key = self.payloads.inputs_key(message.tenant_id, message.task_id, record.request_hash)
        if not stored:
            self.payloads.put_json(key, body)
        message.inputs, message.inputs_key = None, key
        return None if stored else key

    def _discard_inputs(self, keys: list[str | None]) -> None:
        """Deletes inputs uploaded for tasks that no record names: a refused or
        rolled-back submit's. Best effort: the bucket's lifecycle rule is the
        backstop, so a failure is logged and the answer stays the submit's."""
        for key in keys:
            if key is None:
                continue
            try:
                self.payloads.delete(key)
            except Exception as exc:  # noqa: BLE001 - the client's answer is the submit's error, not this
                log.warning("could not delete the inputs %s of a submit that recorded no task: %s",
                            key, type(exc).__name__)

    def submit(self, tenant_id: str, request: SubmitRequest, idempotency_key: str | None) -> TaskAccepted:
        try:
            self._check_models([request], ["model"])
            depth = self._check_backlog(request.priority)
        except ApiError:
            if idempotency_key:
                retried = self._retry_of_accepted(
                    tenant_id, [(idempotent_task_id(tenant_id, idempotency_key), request, fingerprint_of(request))])
                if retried is not None:
                    return retried[0]
            raise
        if not idempotency_key:
            # A fresh id cannot collide, so the record needs no condition and
            # can share a write with other submits (sluice.api.group_commit).
            record, message = self._build(tenant_id, request, new_task_id())
            try:
                uploaded = self._claim_check(record, message)
            except (BotoCoreError, ClientError):
                raise unavailable("the payload store") from None
            try:
                self.group_commit.submit((record, message))
            except Exception:
                # Its record is rolled back (at once or in the background): no task names the inputs.
                self._discard_inputs([uploaded])
                raise
            return self._accepted(record, depth)
        return self._submit_once(tenant_id, request, idempotent_task_id(tenant_id, idempotency_key), None, depth)

    def _submit_once(
        self, tenant_id: str, request: SubmitRequest, task_id: str, fingerprint: Fingerprint | None, depth: int,
        key_checked: bool = False,
    ) -> TaskAccepted:
        """The submit of an Idempotency-Key: created once, replayed after.
        `key_checked`: its record was read already (a batch reads all of its own)."""
        fingerprint = fingerprint or fingerprint_of(request)
        record, message = self._build(tenant_id, request, task_id, fingerprint)
        if not key_checked and self._needs_claim_check(message):
            # A key reused with another body is refused before its inputs go up:
            # they would be under a key no record names. (One that races this
            # read is refused after; its upload is left to the bucket's
            # lifecycle rule, since a concurrent retry may name the same object.)
            self._refuse_reused_key(self._read_records([task_id]), [(task_id, fingerprint)])
        try:
            uploaded = self._claim_check(record, message)
        except (BotoCoreError, ClientError):
            raise unavailable("the payload store") from None
        token = secrets.token_hex(8)
        # Twice at most: a retry may find the record of a first try that its
        # compensation deletes right then; the second round creates it afresh.
        # (Whatever else fails, the inputs stay: a concurrent retry with this
        # key and body names the same object.)
        for _ in range(2):
            try:
                self.store.create(record, token)
            except TaskExists as exists:
                # A 409 here leaves its inputs (see above): a retry with the same
                # key and body, racing it after the first try's rollback, names them.
                accepted = self._replay(exists.existing, request, fingerprint, token, depth)
                if accepted is not None:
                    return accepted
                continue
            except (BotoCoreError, ClientError) as err:
                # The write may have landed even though its reply was lost: undo
                # it (a no-op if it did not), else it would wait for a message
                # that is never sent.
                self.compensator.undo([task_id], token, after=err)
                raise unavailable("the task store") from None
            self._send(message, token)
            return self._accepted(record, depth)
        raise unavailable("the task store")

    def _write_fresh(self, group: list[tuple[TaskRecord, TaskMessage]], token: str | None = None) -> dict[int, ApiError]:
        """Records, then messages, for tasks with fresh ids: one BatchWriteItem
        per 25 and one SendMessageBatch per 10 per queue. Returns {index: error}
        for the tasks not queued; their records are rolled back."""
        records = [r for r, _ in group]
        messages = [m for _, m in group]
        token = token or secrets.token_hex(8)
        try:
            self.store.create_many(records, token)
        except (BotoCoreError, ClientError, RuntimeError) as err:
            self.compensator.undo([r.task_id for r in records], token, after=err)
            return {i: unavailable("the task store") for i in range(len(group))}
        except BaseException:
            self.compensator.undo([r.task_id for r in records], token)
            raise
        try:
            self.queues.send_many(messages)
        except (BotoCoreError, ClientError):
            # Which messages went out is unknown. Every record is rolled back;
            # a message whose record is gone is dropped by the worker.
            self.compensator.undo([r.task_id for r in records], token)
            return {i: unavailable("the queue") for i in range(len(group))}
        except SendFailed as failed:
            self.compensator.undo(failed.failed_ids, token)
            lost = set(failed.failed_ids)
        except BaseException:
            # Not an AWS error (a defect): which messages went out is unknown
            # just the same, so every record is rolled back, as above.
            self.compensator.undo([r.task_id for r in records], token)
            raise
        else:
            lost = set()
        for m in messages:
            if m.task_id not in lost:
                self.backlog.sent(m.priority, 1)
        return {i: unavailable("the queue") for i, m in enumerate(messages) if m.task_id in lost}

    def _send(self, message: TaskMessage, token: str) -> None:
        """A first submit's message; its record is rolled back if it cannot be sent."""
        try:
            self.queues.send(message)
        except (BotoCoreError, ClientError):
            self.compensator.undo([message.task_id], token)
            raise unavailable("the queue") from None
        except BaseException:
            # Not an AWS error (a defect): whether it went out is unknown just
            # the same, so the record is rolled back, as _write_fresh does.
            self.compensator.undo([message.task_id], token)
            raise
        self.backlog.sent(message.priority, 1)

    def _replay(
        self, existing: TaskRecord, request: SubmitRequest, fingerprint: Fingerprint, token: str, depth: int
    ) -> TaskAccepted | None:
        """The task this Idempotency-Key created; None if it vanished meanwhile."""
        if not fingerprint.matches(existing):
            raise idempotency_conflict()
        # A message re-sent past the deadline would only be dropped by a worker.
        existing = self._expired_if_overdue(existing)
        if existing.status != TaskStatus.queued:
            return self._accepted(existing, depth)
        if _resent_lately(existing):
            # A replay re-sent its message moments ago, after which it claimed
            # the record: the message is queued and no rollback can delete the
            # record (the claim replaced the first try's token), so this retry
            # adds no duplicate.
            return self._accepted(existing, depth)
        # The first try may have died between record and message: send again,
        # then claim the record. A duplicate message costs a backlog slot and
        # perhaps a second run, hence at most one re-send per interval (above).
        # Sending first means a failure leaves the record
        # as it was: it may be a task already accepted with its message queued,
        # so a replay never rolls it back (and the first try's own pending
        # rollback, if any, still applies to a record that has no message).
        message = self._message_of(existing, request)
        self._claim_check(existing, message, stored=True)
        try:
            self.queues.send(message)
        except (BotoCoreError, ClientError):
            raise unavailable("the queue") from None
        self.backlog.sent(message.priority, 1)
        try:
            # The claim records the re-send too, only once the message went out,
            # and only on the record read: one written afresh since (its first
            # try rolled back, another retry created it) is that retry's, and
            # its rollback may still delete it.
            only_if = {"submit_token": existing.submit_token} if existing.submit_token else {}
            self.store.apply(Change(existing.task_id, {"submit_token": token, "resent_at": now_ms()},
                                    (TaskStatus.queued,), only_if=only_if))
        except TransitionRejected as rejected:
            current = rejected.current
            if current is not None and (current.status != TaskStatus.queued or _resent_lately(current)):
                # Final meanwhile, or another retry re-sent its message and claimed it: accepted either way.
                return self._accepted(current, depth)
            return None  # gone, or written afresh since: the caller's next round reads it again
        except (BotoCoreError, ClientError):
            # The claim may or may not have landed; the record stays either way.
            # If the first try's rollback deletes it, the worker drops the
            # message just sent and the client's next retry creates the task.
            raise unavailable("the task store") from None
        return self._accepted(existing, depth)

    @staticmethod
    def _message_of(record: TaskRecord, request: SubmitRequest) -> TaskMessage:
        """A recorded task's message, as its first try sent it and a retry
        sends it again: a worker checks only the message's deadline, so it is
        the record's, not one counted from a retry. It carries the runs its
        task had, as a requeue's does (sluice.dlq): SQS counts a new message's
        receives from 1. None recorded: its first message may not have been
        received yet."""
        return TaskMessage(
            task_id=record.task_id,
            tenant_id=record.tenant_id,
            model=record.model,
            priority=record.priority,
            input_count=record.input_count,
            inputs=request.inputs,
            deadline_at=record.deadline_at,
            enqueued_at=record.created_at,
            runs_before=record.runs() if record.attempts or record.error_code else None,
        )

    def _retry_of_accepted(
        self, tenant_id: str, tasks: list[tuple[str, SubmitRequest, Fingerprint]]
    ) -> list[TaskAccepted] | None:
        """For a submit with an Idempotency-Key that the model or backlog checks
        refuse, given (task id, request, fingerprint) per task: it may be the
        retry of one already accepted (its reply lost), which gets its tasks
        back whatever the queue holds or the models served now. None when any
        task is still to be created: only creating one is checked."""
        existing = self._read_records([task_id for task_id, _, _ in tasks])
        if len(existing) < len(tasks):
            return None
        # Every task checked before any is replayed: a 409 re-sends nothing.
        self._refuse_reused_key(existing, [(task_id, fingerprint) for task_id, _, fingerprint in tasks])
        token = secrets.token_hex(8)
        accepted = []
        for task_id, request, fingerprint in tasks:
            record = existing[task_id]
            replayed = self._replay(record, request, fingerprint, token, self.backlog.estimate(record.priority))
            if replayed is None:  # rolled back meanwhile: it is to be created again
                return None
            accepted.append(replayed)
        return accepted

    def _read_records(self, task_ids: list[str]) -> dict[str, TaskRecord]:
        try:
            return self.store.get_many(task_ids)
        except (BotoCoreError, ClientError, RuntimeError):
            raise unavailable("the task store") from None
        except UnreadableRecord as exc:  # the batch's own: ids derive from its tenant's key
            raise newer_record(exc.task_id) from None

    @staticmethod
    def _refuse_reused_key(existing: dict[str, TaskRecord], tasks: list[tuple[str, Fingerprint]]) -> None:
        """409 if any (task id, fingerprint) names a record of another request."""
        if any(task_id in existing and not fingerprint.matches(existing[task_id]) for task_id, fingerprint in tasks):
            raise idempotency_conflict()

    def submit_batch(self, tenant_id: str, batch: BatchSubmitRequest, idempotency_key: str | None) -> BatchAccepted:
        whole = fingerprint_of(batch) if idempotency_key else None
        try:
            self._check_models(batch.tasks, [f"tasks.{i}.model" for i in range(len(batch.tasks))])
            depths = {p: self._check_backlog(p) for p in {r.priority for r in batch.tasks}}
        except ApiError:
            if idempotency_key:
                retried = self._retry_of_accepted(tenant_id, [
                    (batch_task_id(tenant_id, idempotency_key, i), request, whole.indexed(i))
                    for i, request in enumerate(batch.tasks)
                ])
                if retried is not None:
                    return BatchAccepted(tasks=retried)
            raise
        if idempotency_key:
            # Each task is created once under its own id, so a retried batch
            # resumes exactly where it stopped. Each must match the whole batch,
            # so a key reused for another batch is refused before any input,
            # record or message is written: all n records are read first, as
            # the batch's records expire apart (each at its own finish + TTL)
            # and the first task's may be gone while a later one's remains.
            tasks = [(batch_task_id(tenant_id, idempotency_key, i), whole.indexed(i)) for i in range(len(batch.tasks))]
            self._refuse_reused_key(self._read_records([task_id for task_id, _ in tasks]), tasks)
            accepted = self._create_keyed(tenant_id, batch.tasks, tasks, depths)
            # Positions once every task is sent, as for a batch without a key.
            return BatchAccepted(tasks=self._in_batch_order(accepted, depths))
        built = [self._build(tenant_id, r, new_task_id()) for r in batch.tasks]
        token = secrets.token_hex(8)
        uploaded: list[str | None] = []
        try:
            for r, m in built:
                uploaded.append(self._claim_check(r, m))
        except (BotoCoreError, ClientError):
            self._discard_inputs(uploaded)
            raise unavailable("the payload store") from None
        try:
            errors = self._write_fresh(built, token)
        except Exception:
            self._discard_inputs(uploaded)  # every record is rolled back
            raise
        if errors:
            # All or nothing: the client learns no task id from a 503, so the
            # tasks that did go out are rolled back too (a worker drops a
            # message whose record is gone), and their inputs deleted.
            kept = [r.task_id for i, (r, _) in enumerate(built) if i not in errors]
            if kept:
                self.compensator.undo(kept, token)
            self._discard_inputs(uploaded)
            raise next(iter(errors.values()))
        return BatchAccepted(tasks=self._in_batch_order([r for r, _ in built], depths))

    def _create_keyed(self, tenant_id: str, requests: list[SubmitRequest], tasks: list[tuple[str, Fingerprint]],
                      depths: dict[Priority, int]) -> list[TaskAccepted]:
        """A keyed batch's tasks, each created once under its own id (a
        conditional put and a send apiece), KEYED_BATCH_THREADS at a time: one
        after the other, 100 tasks were 200 round trips in one request, behind
        API Gateway's 29 s. The first failure starts no more (against a stalled
        table each would wait out its own timeouts, wave after wave), and every
        one started is waited for before the answer: a 503 never leaves a write
        in flight for the client's retry to meet. Its own threads: another
        request's batch never waits behind this one's."""
        failed = threading.Event()

        def create(request: SubmitRequest, task_id: str, fingerprint: Fingerprint) -> TaskAccepted | None:
            if failed.is_set():
                return None  # not started: nothing written, the retry creates it
            try:
                return self._submit_once(tenant_id, request, task_id, fingerprint, depths[request.priority],
                                         key_checked=True)
            except BaseException:
                failed.set()
                raise

        with ThreadPoolExecutor(max_workers=min(KEYED_BATCH_THREADS, len(tasks)),
                                thread_name_prefix="sluice-keyed") as pool:
            created = [pool.submit(create, request, task_id, fingerprint)
                       for request, (task_id, fingerprint) in zip(requests, tasks)]
        errors = [f.exception() for f in created if f.exception() is not None]
        if errors:
            raise errors[0]  # the first in batch order
        return [f.result() for f in created]

    def _in_batch_order(self, tasks: list[TaskRecord] | list[TaskAccepted],
                        depths: dict[Priority, int]) -> list[TaskAccepted]:
        """Each task of a batch behind the batch's earlier tasks of its priority
        (those of higher priorities are in the queue estimates already)."""
        earlier: Counter[Priority] = Counter()
        placed = []
        for task in tasks:
            placed.append(self._accepted(task, depths[task.priority], earlier[task.priority]))
            earlier[task.priority] += 1
        return placed

    def _accepted(self, task: TaskRecord | TaskAccepted, depth: int, batch_ahead: int = 0) -> TaskAccepted:
        """`depth`: the priority's depth before this submit sent anything;
        `batch_ahead`: its batch's tasks of that priority sent before it."""
        ahead = 0
        if task.status == TaskStatus.queued:  # an idempotent retry may find it finished
            # `depth` is what the cap was held against; the position counts down
            # at the workers' pace since the queue was read, as the others do.
            ahead = min(depth, self.backlog.estimate(task.priority)) + batch_ahead
            if task.priority != Priority.high:
                ahead += self.backlog.estimate(Priority.high)
            if task.priority == Priority.low:
                ahead += self.backlog.estimate(Priority.normal)
        rate = self.backlog.drain_rate()
        if ahead == 0:
            wait: float | None = 0.0
        else:
            wait = round(ahead / rate, 1) if rate else None  # no drain measured yet, or none now
        return TaskAccepted(task_id=task.task_id, status=task.status, priority=task.priority,
                            queue_position=ahead, estimated_wait_s=wait)

    # ---------------------------------------------------------- get/cancel
    def _read(self, tenant_id: str, task_id: str) -> TaskRecord | None:
        try:
            return self.store.get(task_id)
        except UnreadableRecord as exc:
            raise self.unreadable(tenant_id, exc) from None

    @staticmethod
    def unreadable(tenant_id: str, exc: UnreadableRecord) -> ApiError:
        """What a request is told of a record a newer release wrote: its own
        tenant a 503 to retry (the deploy rolls on), any other the 404 of a
        missing task, as ever."""
        return newer_record(exc.task_id) if exc.tenant_id == tenant_id else not_found(exc.task_id)

    def _owned(self, tenant_id: str, task_id: str, record: TaskRecord | None) -> TaskRecord:
        # Another tenant's task answers exactly like a missing one.
        if record is None or record.tenant_id != tenant_id:
            raise not_found(task_id)
        return self._expired_if_overdue(record)

    def _expired_if_overdue(self, record: TaskRecord) -> TaskRecord:
        """Past its deadline without an outcome: a result now is no longer
        wanted, so the record says so at once rather than when a worker gets to it."""
        if not record.overdue(now_ms()):
            return record
        try:
            return self.store.apply(expire(record.task_id, now_ms()))
        except TransitionRejected as rejected:
            return rejected.current or record

    def get(self, tenant_id: str, task_id: str, record: TaskRecord | None | _Unread = UNREAD) -> TaskView:
        """The task's view; `record` when the caller has just read it (the long
        poll's shared round, consistent: None there is a task that does not
        exist). Not read again either way: a second read for a missing task
        alone would time apart another tenant's task from no task."""
        if record is UNREAD:
            record = self._read(tenant_id, task_id)
        return self.view(self._owned(tenant_id, task_id, record))

    def view(self, record: TaskRecord) -> TaskView:
        result = json.loads(record.result_json) if record.result_json else None
        url = self.payloads.presigned_get(record.result_key) if record.result_key else None
        return record.to_view(result=result, result_url=url)

    def cancel(self, tenant_id: str, task_id: str) -> TaskView:
        record = self._owned(tenant_id, task_id, self._read(tenant_id, task_id))
        if record.status == TaskStatus.cancelled:
            return record.to_view()
        try:
            updated = self.store.apply(
                Change(task_id, {"status": TaskStatus.cancelled.value, "finished_at": now_ms()}, (TaskStatus.queued,))
            )
        except UnreadableRecord as exc:  # a newer release wrote it since it was read
            raise self.unreadable(tenant_id, exc) from None
        except TransitionRejected as rejected:
            current = rejected.current
            if current is None:  # rolled back since it was read
                raise not_found(task_id) from None
            if current.status == TaskStatus.cancelled:
                # A cancel that raced this one won: the same answer as a repeated cancel.
                return current.to_view()
            raise ApiError(409, "not_cancellable", f"task {task_id} is {current.status.value}; a task can be cancelled only until its outcome is recorded")
        return updated.to_view()
