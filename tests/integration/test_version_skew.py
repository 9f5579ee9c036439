"""Mixed releases: while a deploy rolls (or rolls back), this release reads
messages and records that a newer one wrote. Whatever it cannot read it leaves
for a release that can: it never deletes such a message, never takes such a
record for a final or missing one, and never lets one fail its neighbours."""

from __future__ import annotations

import json

import pytest
from boto3.dynamodb.types import TypeSerializer

from sluice import cli
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import Change, TaskStore
from sluice.api.errors import ApiError
from sluice.api.service import TaskService
from sluice.contract import BatchSubmitRequest, Priority, SubmitRequest, TaskMessage, TaskRecord, TaskStatus
from sluice.dlq import list_dead, settle_dead
from tests.integration.test_dlq import operator_env  # noqa: F401 - a fixture
from tests.integration.test_worker_runner import messages_left, receive_all

_ser = TypeSerializer()


def record(task_id: str, tenant: str = "t") -> TaskRecord:
    return TaskRecord(task_id=task_id, tenant_id=tenant, model="synthetic", priority=Priority.normal,
                      status=TaskStatus.queued, input_count=1, created_at=1000)


def message(task_id: str, tenant: str = "t", **changes) -> dict:
    body = TaskMessage(task_id=task_id, tenant_id=tenant, model="synthetic", priority=Priority.normal,
                       input_count=1, inputs=["x"], enqueued_at=1000).model_dump(mode="json", exclude_none=True)
    return {k: v for k, v in {**body, **changes}.items() if v is not None}


def put_newer_record(store: TaskStore, task_id: str, tenant: str = "t", **attributes) -> None:
    """A record as a newer release writes it: a status or priority this one does not know."""
    item = {**record(task_id, tenant).model_dump(mode="json", exclude_none=True), **attributes}
    store.ddb.put_item(TableName=store.table, Item={k: _ser.serialize(v) for k, v in item.items()})


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


# --------------------------------------------------------------------- records

def test_a_record_in_a_status_this_release_does_not_know_is_handed_back_and_fails_no_neighbour(settings, runner):
    # It used to fail the claim's read: the whole batch back, a receive of each spent.
    store = TaskStore(settings)
    put_newer_record(store, "newer", status="running")
    store.create(record("plain"))
    send(settings, message("newer"))
    send(settings, message("plain"))
    given_back = []
    prepared = runner.prepare(receive_all(settings, 2), give_back=lambda messages, _: given_back.extend(messages))
    assert [j.message.task_id for j in prepared.jobs] == ["plain"] and prepared.ack == []
    assert [m.task().task_id for m in given_back] == ["newer"]


def test_a_redelivery_of_a_record_in_an_unknown_status_is_handed_back_not_taken_for_final(settings, runner):
    # Its start's conditional write is refused, which read as a final task: acknowledged, deleted.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    put_newer_record(store, "newer", status="running")
    send(settings, message("newer"))
    [first] = receive_all(settings, 1)
    queues.sqs.change_message_visibility(QueueUrl=queues.url(Priority.normal), ReceiptHandle=first.receipt_handle,
                                         VisibilityTimeout=0)
    [again] = receive_all(settings, 1)
    assert again.receive_count == 2
    given_back = []
    prepared = runner.prepare([again], give_back=lambda messages, _: given_back.extend(messages))
    assert prepared.ack == [] and prepared.jobs == [] and given_back == [again]


def test_settling_passes_a_record_it_cannot_read_and_settles_the_other_queues(settings):
    # It used to raise on the high DLQ, so normal and low were never reached, every round.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    put_newer_record(store, "newer", status="running")
    send(settings, message("newer"), Priority.high, dlq=True)
    store.create(record("handed-back"))
    send(settings, message("handed-back"), Priority.normal, dlq=True)
    assert settle_dead(queues, store, list(Priority), settings.max_attempts) == {"failed": 0, "requeued": 1}
    assert dead_letters(settings, Priority.high) == 1
    listed = list_dead(queues, list(Priority), store=store)
    assert [(i["task_id"], i["task_status"]) for i in listed] == [("newer", "running")]


def test_dlq_list_shows_a_record_it_cannot_read(operator_env, capsys):  # noqa: F811
    store = TaskStore(operator_env)
    put_newer_record(store, "newer", priority="urgent")
    send(operator_env, message("newer"), Priority.normal, dlq=True)
    assert cli.main(["dlq", "list"]) == 0  # it used to end in a traceback
    assert "newer" in capsys.readouterr().out


@pytest.mark.parametrize("attributes", [{"status": "running"}, {"priority": "urgent"}])
def test_the_api_answers_a_record_a_newer_release_wrote_with_a_503_and_another_tenant_with_a_404(api, settings,
                                                                                                  attributes):
    # Each used to be a 500, another tenant's too: a task it does not own, shown to exist.
    put_newer_record(TaskStore(settings), "newer", tenant="tenant-a", **attributes)
    own = {"x-api-key": api.key_a}
    with api:  # one event loop for the app's lifetime, as a server has (the long poll's waiter)
        answers = [api.get("/v1/tasks/newer", headers=own), api.get("/v1/tasks/newer?wait_s=1", headers=own),
                   api.delete("/v1/tasks/newer", headers=own)]
        other = [api.get("/v1/tasks/newer", headers={"x-api-key": api.key_b}),
                 api.get("/v1/tasks/newer?wait_s=1", headers={"x-api-key": api.key_b}),
                 api.delete("/v1/tasks/newer", headers={"x-api-key": api.key_b})]
    assert [(r.status_code, r.json()["error"]["code"]) for r in answers] == [(503, "record_unreadable")] * 3
    assert all(r.headers["retry-after"] for r in answers)
    assert [(r.status_code, r.json()["error"]["code"]) for r in other] == [(404, "not_found")] * 3


# ----------------------------------------------------------------- idempotency

class SubmitRequestOfNextRelease(SubmitRequest):
    """A newer release's request: one optional field more."""

    callback_url: str | None = None


def test_an_idempotent_retry_across_a_release_that_adds_an_optional_field_is_the_same_request(settings):
    # The hash covered every field with its default: the same body hashed apart
    # under the two releases, and the client's retry was a 409 for its own request.
    body = {"model": "synthetic", "inputs": ["x"]}
    service = TaskService(settings)
    first = service.submit("tenant-a", SubmitRequest.model_validate(body), "key-1")  # its answer lost
    again = service.submit("tenant-a", SubmitRequestOfNextRelease.model_validate(body), "key-1")
    assert again.task_id == first.task_id
    with pytest.raises(ApiError) as refused:  # another body under the key is still refused
        service.submit("tenant-a", SubmitRequest.model_validate({**body, "inputs": ["y"]}), "key-1")
    assert refused.value.status == 409


# request_hash as releases before the stable fingerprint computed it (96f508d).
EARLIER_RELEASES_HASH = {
    "single": "9b2717c8b694240b9e539459332e88ec7671481f04fb26cbdf9cf07dc2c919e3",
    "batch": "da424bdd48d4ee29453cc14615b6f83325603abbd780880def27630a8f4b3f0b",
}


def test_the_record_keeps_the_hash_earlier_releases_compare_so_a_rollback_still_matches(settings):
    service, store = TaskService(settings), TaskStore(settings)
    request = SubmitRequest.model_validate({"model": "synthetic", "inputs": ["x"]})
    batch = BatchSubmitRequest.model_validate({"tasks": [{"model": "synthetic", "inputs": ["a"]}]})
    single = store.get(service.submit("tenant-a", request, "key-1").task_id)
    in_batch = store.get(service.submit_batch("tenant-a", batch, "key-2").tasks[0].task_id)
    assert single.request_hash == EARLIER_RELEASES_HASH["single"]
    assert in_batch.request_hash == EARLIER_RELEASES_HASH["batch"] + "#0"


def test_a_record_an_earlier_release_wrote_still_matches_its_retry(settings):
    service, store = TaskService(settings), TaskStore(settings)
    request = SubmitRequest.model_validate({"model": "synthetic", "inputs": ["x"]})
    first = service.submit("tenant-a", request, "key-1")
    store.ddb.update_item(TableName=store.table, Key={"task_id": {"S": first.task_id}},
                          UpdateExpression="REMOVE request_fingerprint")  # as they wrote it
    assert service.submit("tenant-a", request, "key-1").task_id == first.task_id


def test_a_default_spelled_out_or_left_out_is_the_same_request(settings):
    service = TaskService(settings)
    body = {"model": "synthetic", "inputs": ["x"]}
    first = service.submit("tenant-a", SubmitRequest.model_validate(body), "key-1")
    spelled = SubmitRequest.model_validate({**body, "priority": "normal", "metadata": None})
    assert service.submit("tenant-a", spelled, "key-1").task_id == first.task_id


def test_a_message_past_its_deadline_whose_record_is_in_an_unknown_status_is_handed_back(settings, runner):
    # Its expiry (queued only) is refused, which read as final: the message was deleted.
    store = TaskStore(settings)
    put_newer_record(store, "newer", status="running")
    send(settings, message("newer", deadline_at=1001))
    given_back = []
    prepared = runner.prepare(receive_all(settings, 1), give_back=lambda messages, _: given_back.extend(messages))
    assert prepared.ack == [] and [m.task().task_id for m in given_back] == ["newer"]


def test_a_record_a_newer_release_rewrites_while_settling_fails_it_stops_no_round(settings):
    # Read as queued with its runs spent, then rewritten before the failure's
    # write: the rejection's record could not be read, and the round stopped there.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    store.create(record("spent"))
    store.apply(Change("spent", {"attempts": settings.max_attempts}, (TaskStatus.queued,)))
    send(settings, message("spent"), Priority.high, dlq=True)
    store.create(record("handed-back"))
    send(settings, message("handed-back"), Priority.normal, dlq=True)
    real_apply = store.apply

    def rewritten_first(change):
        if change.task_id == "spent":
            put_newer_record(store, "spent", status="running")
        return real_apply(change)

    store.apply = rewritten_first
    assert settle_dead(queues, store, list(Priority), settings.max_attempts) == {"failed": 0, "requeued": 1}
