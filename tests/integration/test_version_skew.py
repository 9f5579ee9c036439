"""Mixed releases: while a deploy rolls (or rolls back), this release reads
messages and records that a newer one wrote. Whatever it cannot read it leaves
for a release that can: it never deletes such a message, never takes such a
record for a final or missing one, and never lets one fail its neighbours."""

from __future__ import annotations

import json

import pytest
from boto3.dynamodb.types import TypeSerializer

from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.contract import Priority, TaskMessage, TaskRecord, TaskStatus
from sluice.dlq import settle_dead
from tests.integration.test_worker_runner import messages_left, receive_all

_ser = TypeSerializer()


def record(task_id: str, tenant: str = "t") -> TaskRecord:
    return TaskRecord(task_id=task_id, tenant_id=tenant, model="synthetic", priority=Priority.normal,
                      status=TaskStatus.queued, input_count=1, created_at=1000)


def message(task_id: str, tenant: str = "t", **changes) -> dict:
    body = TaskMessage(task_id=task_id, tenant_id=tenant, model="synthetic", priority=Priority.normal,
                       input_count=1, inputs=["x"], enqueued_at=1000).model_dump(mode="json", exclude_none=True)
    return {k: v for k, v in {**body, **changes}.items() if v is not None}


def send(settings, body: dict, priority=Priority.normal, dlq: bool = False) -> None:
    queues = PriorityQueues(settings)
    queues.sqs.send_message(QueueUrl=queues.dlq_url(priority) if dlq else queues.url(priority),
                            MessageBody=json.dumps(body))


def dead_letters(settings, priority: Priority) -> int:
    queues = PriorityQueues(settings)
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"]
    attributes = queues.sqs.get_queue_attributes(QueueUrl=queues.dlq_url(priority), AttributeNames=names)
    return sum(int(attributes["Attributes"][n]) for n in names)


NEWER_MESSAGES = {
    "a new priority": {"priority": "urgent"},  # met on a shared queue, or redriven there
    "a new way to carry inputs": {"inputs": None, "inputs_url": "https://example.com/x", "v": 2},
    "a wider tenant id rule": {"tenant_id": "alice@example.com"},
}


@pytest.mark.parametrize("case", sorted(NEWER_MESSAGES))
def test_a_message_this_release_cannot_parse_is_handed_back_not_deleted(settings, runner, case):
    changes = NEWER_MESSAGES[case]
    store = TaskStore(settings)
    store.create(record("newer", tenant=changes.get("tenant_id", "t")))
    send(settings, message("newer", **changes))
    prepared = runner.prepare(receive_all(settings, 1))
    runner.finish(prepared, runner.infer(prepared.jobs))
    assert prepared.ack == [] and prepared.jobs == []
    assert messages_left(settings) == 1, f"{case}: deleted unrun, its task left queued with no message anywhere"
    assert store.get("newer").status == TaskStatus.queued and store.get("newer").attempts == 0


def test_settling_leaves_a_dead_letter_it_cannot_parse_and_settles_the_rest(settings):
    """Requeued by this release, the message would only come back to it; left
    in the DLQ, a newer release's settling requeues it (or operators see it)."""
    queues, store = PriorityQueues(settings), TaskStore(settings)
    store.create(record("newer"))
    send(settings, message("newer", priority="urgent"), Priority.high, dlq=True)
    send(settings, {"not": "a task"}, Priority.high, dlq=True)
    store.create(record("handed-back"))  # no outcome and no recorded start: requeued
    send(settings, message("handed-back"), Priority.normal, dlq=True)
    counts = settle_dead(queues, store, list(Priority), settings.max_attempts)
    assert counts == {"failed": 0, "requeued": 1}
    assert dead_letters(settings, Priority.high) == 2 and dead_letters(settings, Priority.normal) == 0
    assert messages_left(settings) == 1
