"""The three SQS priority queues (each with its dead-letter queue)."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property

from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectTimeoutError,
    EndpointConnectionError,
    ReadTimeoutError,
)

from sluice.aws import client
from sluice.contract import Priority, TaskMessage
from sluice.settings import Settings

log = logging.getLogger("sluice.queues")

_SQS_BATCH = 10
# Visibility changes of many chunks (a worker's heartbeat: ~100 prefetched
# messages and the batches in hand) run this many at a time.
_PARALLEL_CHUNKS = 8
# The two characters valid in a JSON string that SQS refuses in a message body
# (InvalidMessageContents); lone surrogates never pass the contract.
_SQS_REFUSED = str.maketrans({"\ufffe": "\\ufffe", "\uffff": "\\uffff"})


def message_body(message: TaskMessage) -> str:
    """The message as JSON, with SQS's two refused characters escaped (the same JSON value)."""
    return sqs_safe(message.model_dump_json(exclude_none=True))


def sqs_safe(body: str) -> str:
    """A JSON text with SQS's two refused characters escaped (the same JSON value)."""
    return body.translate(_SQS_REFUSED) if "\ufffe" in body or "\uffff" in body else body


@dataclass
class Received:
    priority: Priority
    message_id: str
    receipt_handle: str
    body: str
    receive_count: int
    received_at: float  # time.monotonic()

    def task(self) -> TaskMessage:
        return TaskMessage.model_validate_json(self.body)


class SendFailed(Exception):
    def __init__(self, failed_ids: list[str]):
        super().__init__(f"{len(failed_ids)} messages not sent")
        self.failed_ids = failed_ids


class PriorityQueues:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.sqs = client("sqs", settings)
        self._urls: dict[str, str] = {}
        self._dlq_names: dict[str, str] = {}  # by the queue URL whose redrive policy names it
        self._lock = threading.Lock()
        self._chunk_pool: ThreadPoolExecutor | None = None  # made on first use (the API never needs it)

    @cached_property
    def poller(self):
        """The receives' client: they wait up to 20 s by design, where every other
        call is bounded short. Built by the first receive: the API, the settler
        and the dispatcher never receive, and a client costs their Lambdas'
        cold starts 50-150 ms of CPU."""
        return client("sqs", self.settings, long_poll=True)

    # ------------------------------------------------------------ addressing
    def url(self, priority: Priority) -> str:
        override = self.settings.queue_url_override(priority)
        return override or self._url_of(self.settings.queue_name(priority))

    def dlq_url(self, priority: Priority) -> str:
        override = self.settings.queue_url_override(priority)
        if override:
            with self._lock:
                name = self._dlq_names.get(override)
            if name is None:
                attrs = self.sqs.get_queue_attributes(QueueUrl=override, AttributeNames=["RedrivePolicy"])
                name = json.loads(attrs["Attributes"]["RedrivePolicy"])["deadLetterTargetArn"].rsplit(":", 1)[1]
                with self._lock:
                    self._dlq_names[override] = name
            return self._url_of(name)
        return self._url_of(self.settings.queue_name(priority, dlq=True))

    def _url_of(self, name: str) -> str:
        with self._lock:
            url = self._urls.get(name)
        if url is None:
            # Looked up outside the lock: a lookup waiting on SQS (12 s with the
            # SDK's retries) held every other queue's cached one, and every
            # submit and heartbeat behind it. Two lookups of a name at once find the same.
            url = self.sqs.get_queue_url(QueueName=name)["QueueUrl"]
            with self._lock:
                url = self._urls.setdefault(name, url)
        return url

    # ------------------------------------------------------------------ send
    def send(self, message: TaskMessage) -> None:
        self.sqs.send_message(QueueUrl=self.url(message.priority), MessageBody=message_body(message))

    def send_many(self, messages: list[TaskMessage]) -> None:
        """SendMessageBatch per priority; raises SendFailed naming the task ids not sent."""
        by_priority: dict[Priority, list[TaskMessage]] = defaultdict(list)
        for m in messages:
            by_priority[m.priority].append(m)
        failed: list[str] = []
        unreachable = False
        for priority, group in by_priority.items():
            for i in range(0, len(group), _SQS_BATCH):
                chunk = group[i : i + _SQS_BATCH]
                if unreachable:
                    failed += [m.task_id for m in chunk]
                    continue
                try:
                    response = self.sqs.send_message_batch(
                        QueueUrl=self.url(priority),
                        Entries=[
                            {"Id": str(j), "MessageBody": message_body(m)}
                            for j, m in enumerate(chunk)
                        ],
                    )
                    failed += [chunk[int(f["Id"])].task_id for f in response.get("Failed", [])]
                except (BotoCoreError, ClientError) as exc:
                    # This chunk is failed (perhaps sent: its records are rolled
                    # back, and a worker drops a message whose record is gone);
                    # the other chunks are still tried, unless SQS cannot be
                    # reached or does not answer: each would wait out the SDK's
                    # tries again (12 s), and the group's submits behind them.
                    failed += [m.task_id for m in chunk]
                    unreachable = isinstance(exc, (EndpointConnectionError, ConnectTimeoutError, ReadTimeoutError))
        if failed:
            raise SendFailed(failed)

    def send_bodies(self, url: str, bodies: list[str]) -> set[int]:
        """SendMessageBatch of these bodies as they are; returns the indexes
        SQS stored (it reports the others in `Failed` without raising)."""
        stored: set[int] = set()
        for i in range(0, len(bodies), _SQS_BATCH):
            response = self.sqs.send_message_batch(QueueUrl=url, Entries=[
                {"Id": str(j), "MessageBody": body} for j, body in enumerate(bodies[i : i + _SQS_BATCH])])
            stored |= {i + int(e["Id"]) for e in response.get("Successful", [])}
        return stored

    def dead_letter(self, messages: list[Received]) -> None:
        """Move messages to their priority's dead-letter queue now, as SQS
        does after maxReceiveCount receives: for a task failed or spent
        (sluice.lifecycle) whose message is newer than its runs (requeued by
        settling, sluice.dlq), which SQS would not move. Sent first, then deleted: a failure in between leaves
        a duplicate dead letter rather than none. Raises when any was not sent
        (it comes back, and its next receive acknowledges it: its task is final),
        having tried every priority: one whose queue failed stops no other."""
        by_priority: dict[Priority, list[Received]] = defaultdict(list)
        for m in messages:
            by_priority[m.priority].append(m)
        unsent: list[str] = []
        errors: list[Exception] = []
        for priority, group in by_priority.items():
            try:
                stored = self.send_bodies(self.dlq_url(priority), [m.body for m in group])
                unsent += [m.task().task_id for i, m in enumerate(group) if i not in stored]
                self.delete_many([m for i, m in enumerate(group) if i in stored])
            except Exception as exc:  # noqa: BLE001 - raised below, once the other priorities are moved
                errors.append(exc)
        if errors:
            raise errors[0]
        if unsent:
            raise SendFailed(unsent)

    # --------------------------------------------------------------- receive
    def receive(self, priority: Priority, max_messages: int, wait_s: int, visibility_s: int) -> list[Received]:
        response = self.poller.receive_message(
            QueueUrl=self.url(priority),
            MaxNumberOfMessages=max(1, min(_SQS_BATCH, max_messages)),
            WaitTimeSeconds=wait_s,
            VisibilityTimeout=visibility_s,
            MessageSystemAttributeNames=["ApproximateReceiveCount"],
        )
        now = time.monotonic()
        return [
            Received(
                priority=priority,
                message_id=m["MessageId"],
                receipt_handle=m["ReceiptHandle"],
                body=m["Body"],
                receive_count=int(m.get("Attributes", {}).get("ApproximateReceiveCount", "1")),
                received_at=now,
            )
            for m in response.get("Messages", [])
        ]

    def delete_many(self, messages: list[Received]) -> None:
        self._per_queue(messages, self.sqs.delete_message_batch, {}, "DeleteMessage")

    def change_visibility_many(self, messages: list[Received], timeout_s: int) -> None:
        # In parallel: one after the other, a heartbeat's 30-odd calls against a
        # slow SQS (each up to ~12 s with the SDK's retries) took minutes, its
        # last chunks extended after they had lapsed, every release waiting.
        self._per_queue(messages, self.sqs.change_message_visibility_batch, {"VisibilityTimeout": timeout_s},
                        "ChangeMessageVisibility", parallel=True)

    def _per_queue(self, messages: list[Received], call, extra: dict, what: str, parallel: bool = False) -> None:
        """Every chunk is tried: one that fails (after the SDK's retries) must not
        leave the rest unextended or undeleted. Raises the first failure after."""
        by_priority: dict[Priority, list[Received]] = defaultdict(list)
        for m in messages:
            by_priority[m.priority].append(m)
        first_error: Exception | None = None
        chunks: list[tuple[str, list[Received]]] = []
        for priority, group in by_priority.items():
            try:
                url = self.url(priority)
            except Exception as exc:
                first_error = first_error or exc
                continue
            chunks += [(url, group[i : i + _SQS_BATCH]) for i in range(0, len(group), _SQS_BATCH)]

        def attempt(job: tuple[str, list[Received]]) -> tuple[dict | None, Exception | None]:
            url, chunk = job
            entries = [{"Id": str(j), "ReceiptHandle": m.receipt_handle, **extra} for j, m in enumerate(chunk)]
            try:
                return call(QueueUrl=url, Entries=entries), None
            except Exception as exc:
                return None, exc

        answers = (list(self._pool().map(attempt, chunks)) if parallel and len(chunks) > 1
                   else [attempt(job) for job in chunks])
        refused: list[str] = []
        for answer, exc in answers:
            if exc is not None:
                first_error = first_error or exc
            else:
                refused += [f.get("Code", "?") for f in answer.get("Failed", [])]
        if refused:
            # A handle gone stale (its message was received again elsewhere) is
            # the usual cause: the message then is another delivery's to settle.
            log.warning("SQS refused %d of %d %s entries: %s", len(refused), len(messages), what,
                        ", ".join(sorted(set(refused))))
        if first_error is not None:
            raise first_error

    def _pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._chunk_pool is None:
                self._chunk_pool = ThreadPoolExecutor(_PARALLEL_CHUNKS, thread_name_prefix="sluice-sqs-chunks")
            return self._chunk_pool

    # ----------------------------------------------------------------- depth
    def depth(self, priority: Priority) -> int:
        """Approximate visible messages (sluice.api.backlog keeps the API's reading of it)."""
        attrs = self.sqs.get_queue_attributes(
            QueueUrl=self.url(priority), AttributeNames=["ApproximateNumberOfMessages"]
        )["Attributes"]
        return int(attrs.get("ApproximateNumberOfMessages", 0))
