"""What a retry with an Idempotency-Key gets back, and how long a task's record
lasts: in-process TaskService (and worker) against the emulator."""

import itertools
import json
import threading
from types import SimpleNamespace

import pytest
from botocore.exceptions import EndpointConnectionError, ReadTimeoutError

from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import Change
from sluice.api.errors import ApiError
from sluice.api.service import KEYED_BATCH_THREADS, TaskService, batch_task_id, idempotent_task_id, request_hash
from sluice.contract import (
    MAX_DEADLINE_S,
    MESSAGE_RETENTION_S,
    BatchSubmitRequest,
    Priority,
    SubmitRequest,
    TaskMessage,
    TaskRecord,
    TaskStatus,
    now_ms,
)
from sluice.dlq import settle_dead
from sluice.lifecycle import Job, claim
from sluice.worker.runner import hand_back

REQUEST = SubmitRequest(model="synthetic", inputs=["again"])


def cut(*_, **__):
    raise EndpointConnectionError(endpoint_url="http://cut")


@pytest.fixture
def service(settings):
    return TaskService(settings)


# ------------------------------------------------- a retry is not refused anew

def test_a_retry_of_an_accepted_task_is_not_refused_when_its_queue_is_full(settings):
    service = TaskService(settings.model_copy(update={"backlog_cap": 1}))
    first = service.submit("t", REQUEST, "full-1")
    with pytest.raises(ApiError) as refused:
        service.submit("t", REQUEST, "full-2")  # a new task: the queue is at its cap
    assert refused.value.status == 429
    again = service.submit("t", REQUEST, "full-1")  # the first one's retry, its reply lost
    assert again.task_id == first.task_id and again.status == TaskStatus.queued


def test_a_retried_batch_is_not_refused_when_its_queue_is_full(settings):
    service = TaskService(settings.model_copy(update={"backlog_cap": 2}))
    batch = BatchSubmitRequest(tasks=[REQUEST, SubmitRequest(model="synthetic", inputs=["other"])])
    first = service.submit_batch("t", batch, "batch-full-1")
    again = service.submit_batch("t", batch, "batch-full-1")
    assert [t.task_id for t in again.tasks] == [t.task_id for t in first.tasks]
    with pytest.raises(ApiError) as refused:
        service.submit_batch("t", batch, "batch-full-2")
    assert refused.value.status == 429


def test_a_retry_of_an_accepted_task_is_not_refused_when_its_model_is_no_longer_served(settings):
    first = TaskService(settings).submit("t", REQUEST, "model-1")
    redeployed = TaskService(settings.model_copy(update={"models": "minilm-embed"}))
    again = redeployed.submit("t", REQUEST, "model-1")
    assert again.task_id == first.task_id
    with pytest.raises(ApiError) as refused:
        redeployed.submit("t", REQUEST, "model-2")  # a new task for it is refused
    assert refused.value.status == 422


# ------------------------------------------------------- what a replay re-sends

def test_a_replayed_message_keeps_the_records_deadline(service, settings, monkeypatch):
    request = SubmitRequest(model="synthetic", inputs=["late"], deadline_s=60)
    task_id = service.submit("t", request, "deadline-1").task_id
    record = service.store.get(task_id)
    queues = PriorityQueues(settings)
    # The first try's message is gone (it died between record and message, say).
    queues.delete_many(queues.receive(Priority.normal, 10, 1, 30))
    monkeypatch.setattr("sluice.api.service.now_ms", lambda: record.created_at + 30_000)  # the retry, 30 s on
    service.submit("t", request, "deadline-1")
    (resent,) = queues.receive(Priority.normal, 10, 1, 30)
    message = resent.task()
    # A worker checks only the message's deadline.
    assert message.deadline_at == record.deadline_at
    assert message.enqueued_at == record.created_at


def test_a_retry_past_the_deadline_answers_expired_and_sends_nothing(service, settings, monkeypatch):
    # A worker would only drop a message sent now: it would take a backlog
    # slot, and the retry would report queued a task that can never run.
    request = SubmitRequest(model="synthetic", inputs=["too late"], deadline_s=60)
    task_id = service.submit("t", request, "past-deadline-1").task_id
    record = service.store.get(task_id)
    queues = PriorityQueues(settings)
    queues.delete_many(queues.receive(Priority.normal, 10, 1, 30))  # the first try's message, say lost
    monkeypatch.setattr("sluice.api.service.now_ms", lambda: record.deadline_at + 1_000)
    again = service.submit("t", request, "past-deadline-1")
    assert (again.task_id, again.status) == (task_id, TaskStatus.expired)
    assert service.store.get(task_id).status == TaskStatus.expired
    assert queues.receive(Priority.normal, 10, 0, 30) == []


def test_a_replayed_message_names_the_inputs_its_first_try_stored(service, settings):
    inputs = ["L" * 8000] * 10  # over the inline limit: claim-checked
    request = SubmitRequest(model="synthetic", inputs=inputs)
    task_id = service.submit("t", request, "big-1").task_id
    queues = PriorityQueues(settings)
    queues.delete_many(queues.receive(Priority.normal, 10, 1, 30))
    service.submit("t", request, "big-1")
    (resent,) = queues.receive(Priority.normal, 10, 1, 30)
    message = resent.task()
    assert message.task_id == task_id and message.inputs is None
    assert PayloadStore(settings).get_json(message.inputs_key) == inputs


@pytest.mark.parametrize("recorded, runs_before", [
    ({}, None),  # no run recorded: its message may not have been received yet
    ({"attempts": 2, "error_code": "model_error", "error_message": "RuntimeError: boom"}, 2),  # two failed runs
    ({"attempts": 1}, 2),  # a redelivery recorded its start: the first delivery's run is counted too
])
def test_a_replayed_message_carries_the_runs_its_task_had(service, settings, recorded, runs_before):
    # SQS counts the re-sent message's receives from 1: without its runs so far,
    # the task would get max_attempts more (sluice.lifecycle).
    task_id = service.submit("t", REQUEST, "runs-1").task_id
    queues = PriorityQueues(settings)
    queues.delete_many(queues.receive(Priority.normal, 10, 1, 30))
    if recorded:
        service.store.apply(Change(task_id, recorded, (TaskStatus.queued,)))
    service.submit("t", REQUEST, "runs-1")
    (resent,) = queues.receive(Priority.normal, 10, 1, 30)
    assert resent.task().runs_before == runs_before


def test_a_keyed_batch_cut_mid_way_answers_503_without_saying_nothing_was_recorded(service):
    batch = BatchSubmitRequest(tasks=[SubmitRequest(model="synthetic", inputs=[f"b{i}"]) for i in range(2)])
    ids = [batch_task_id("t", "cut-1", i) for i in range(2)]
    real_send = service.queues.send
    service.queues.send = lambda message: real_send(message) if message.task_id == ids[0] else cut()
    with pytest.raises(ApiError) as refused:
        service.submit_batch("t", batch, "cut-1")
    assert refused.value.status == 503 and refused.value.code == "dependency_unavailable"
    # Its first task is recorded and queued: the answer must not deny it.
    assert list(service.store.get_many(ids)) == ids[:1]
    assert "nothing was recorded" not in refused.value.message
    assert "Idempotency-Key" in refused.value.message
    service.queues.send = real_send
    assert [t.task_id for t in service.submit_batch("t", batch, "cut-1").tasks] == ids


def test_a_keyed_batch_creates_its_tasks_at_once_not_one_after_another(service):
    # 200 round trips one after the other for 100 tasks, behind API Gateway's 29 s.
    batch = BatchSubmitRequest(tasks=[SubmitRequest(model="synthetic", inputs=[f"c{i}"]) for i in range(4)])
    all_writing = threading.Barrier(4, timeout=10)  # broken, raising, unless all four creates overlap
    real_create = service.store.create

    def create(record, token=None):
        all_writing.wait()
        return real_create(record, token)

    service.store.create = create
    accepted = service.submit_batch("t", batch, "at-once").tasks
    assert [t.task_id for t in accepted] == [batch_task_id("t", "at-once", i) for i in range(4)]


def test_a_keyed_batch_against_a_stalled_table_starts_no_more_creates_after_the_first_failure(service):
    # Every create waits out its own timeouts (~12 s on a stalled table): all
    # 100 waited for, in waves of eight, were minutes past API Gateway's 29 s.
    batch = BatchSubmitRequest(tasks=[SubmitRequest(model="synthetic", inputs=[f"s{i}"]) for i in range(20)])
    tried = []

    def stalled(record, token=None):
        tried.append(record.task_id)
        raise ReadTimeoutError(endpoint_url="http://table")

    service.store.create = stalled
    with pytest.raises(ApiError) as refused:
        service.submit_batch("t", batch, "stalled")
    assert refused.value.status == 503
    assert 1 <= len(tried) <= KEYED_BATCH_THREADS, len(tried)


# ------------------------------------------------------------------- cancel

def test_two_cancels_racing_both_answer_cancelled(service):
    task_id = service.submit("t", REQUEST, None).task_id
    both_read = threading.Barrier(2, timeout=10)
    reads = itertools.count()
    real_get = service.store.get

    def get(task_id):
        record = real_get(task_id)
        if next(reads) < 2:  # each cancel's first read: both see `queued` before either writes
            both_read.wait()
        return record

    service.store.get = get
    answers = []

    def cancel():
        try:
            answers.append(service.cancel("t", task_id).status)
        except ApiError as refused:
            answers.append(refused.status)

    threads = [threading.Thread(target=cancel) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    assert answers == [TaskStatus.cancelled, TaskStatus.cancelled]


def test_a_cancel_of_a_task_rolled_back_meanwhile_is_not_found(service):
    task_id = service.submit("t", REQUEST, None).task_id
    real_get = service.store.get

    def read_then_rolled_back(task_id):
        record = real_get(task_id)
        service.store.delete_if_queued(task_id)
        return record

    service.store.get = read_then_rolled_back
    with pytest.raises(ApiError) as refused:
        service.cancel("t", task_id)
    assert refused.value.status == 404


def test_a_retry_answers_202_only_for_the_record_it_claimed(settings):
    """B, a retry, finds A's record; A's rollback deletes it before B's claim;
    C, a third try, writes it afresh just then. B's claim did not land, so B
    must not answer 202 for C's record, which C's own rollback may delete."""
    task_id = idempotent_task_id("t", "raced")
    a, b, c = TaskService(settings), TaskService(settings), TaskService(settings)
    a.store.create(a._build("t", REQUEST, task_id)[0], "token-a")  # A: record written, message not yet sent
    send, get = b.queues.send, b.store.get

    def sent_then_a_rolls_back(message):
        send(message)
        a.store.delete_if_queued(task_id, "token-a")  # A's send failed: its rollback lands

    def c_writes_first(task_id_):  # B's rejected claim reads the record back
        if c.store.get(task_id) is None:
            c.store.create(c._build("t", REQUEST, task_id)[0], "token-c")  # C: record written, no message yet
        return get(task_id_)

    b.queues.send, b.store.get = sent_then_a_rolls_back, c_writes_first
    assert b.submit("t", REQUEST, "raced").status == TaskStatus.queued  # B: 202
    c.store.delete_if_queued(task_id, "token-c")  # C's send failed: its rollback
    assert get(task_id) is not None, "B answered 202 for a task that is gone"


# ---------------------------------------------------------- the record's TTL

def test_a_record_outlives_its_message_and_its_deadline_by_the_ttl(service, settings):
    ttl_s = settings.result_ttl_days * 86400
    latest = service.store.get(service.submit("t", SubmitRequest(
        model="synthetic", inputs=["x"], deadline_s=MAX_DEADLINE_S), "ttl-1").task_id)
    assert latest.expires_at >= latest.deadline_at // 1000 + ttl_s
    waiting = service.store.get(service.submit("t", REQUEST, "ttl-2").task_id)
    assert waiting.expires_at >= waiting.created_at // 1000 + MESSAGE_RETENTION_S


def test_a_finished_task_keeps_its_outcome_for_the_ttl_from_finishing(service, settings, runner, monkeypatch):
    ok = service.submit("t", SubmitRequest(model="synthetic", inputs=["fine"]), None).task_id
    refused = service.submit("t", SubmitRequest(model="synthetic", inputs=["!fail"]), None).task_id
    finished_at = service.store.get(ok).created_at + 20 * 86400 * 1000  # it waited 20 days in the queue
    monkeypatch.setattr("sluice.worker.runner.now_ms", lambda: finished_at)
    prepared = runner.prepare(PriorityQueues(settings).receive(Priority.normal, 10, 1, 30))
    runner.finish(prepared, runner.infer(prepared.jobs))
    for task_id, status in ((ok, TaskStatus.succeeded), (refused, TaskStatus.failed)):
        record = service.store.get(task_id)
        assert record.status == status and record.finished_at == finished_at
        assert record.expires_at == finished_at // 1000 + settings.result_ttl_days * 86400


# Every final status is an outcome a client may come back for: each renews the
# record's TTL from its finishing, whichever part of Sluice wrote it.
LONG_AGO = 1_000_000  # ms


def waited_long(store, task_id: str, **recorded) -> None:
    """A task queued long ago, its record's TTL from the submit an hour away."""
    store.create(TaskRecord(task_id=task_id, tenant_id="t", model="synthetic", priority=Priority.normal,
                            status=TaskStatus.queued, input_count=1, created_at=LONG_AGO,
                            expires_at=now_ms() // 1000 + 3600, **recorded))


def assert_kept_for_the_ttl_from_finishing(record, status, settings):
    assert record.status is status
    assert record.expires_at == record.finished_at // 1000 + settings.result_ttl_days * 86400


def test_a_cancelled_task_is_kept_for_the_ttl_from_its_cancel(service, settings):
    waited_long(service.store, "cancelled-late")
    service.cancel("t", "cancelled-late")
    assert_kept_for_the_ttl_from_finishing(service.store.get("cancelled-late"), TaskStatus.cancelled, settings)


def test_a_task_expired_when_read_is_kept_for_the_ttl_from_expiring(service, settings):
    waited_long(service.store, "expired-read", deadline_at=LONG_AGO + 1000)
    service.get("t", "expired-read")
    assert_kept_for_the_ttl_from_finishing(service.store.get("expired-read"), TaskStatus.expired, settings)


def test_a_task_expired_by_a_claim_is_kept_for_the_ttl_from_expiring(service, settings):
    waited_long(service.store, "expired-claimed", deadline_at=LONG_AGO + 1000)
    message = TaskMessage(task_id="expired-claimed", tenant_id="t", model="synthetic", priority=Priority.normal,
                          input_count=1, inputs=["x"], enqueued_at=LONG_AGO, deadline_at=LONG_AGO + 1000)
    delivery = SimpleNamespace(receive_count=1)
    assert claim(service.store, [Job(message, [delivery])], now_ms(), max_attempts=3).expired
    assert_kept_for_the_ttl_from_finishing(service.store.get("expired-claimed"), TaskStatus.expired, settings)


def test_a_task_failed_by_dead_letter_settling_is_kept_for_the_ttl_from_settling(service, settings):
    waited_long(service.store, "settled", attempts=settings.max_attempts - 1)
    queues = PriorityQueues(settings)
    body = TaskMessage(task_id="settled", tenant_id="t", model="synthetic", priority=Priority.normal,
                       input_count=1, inputs=["x"], enqueued_at=LONG_AGO).model_dump_json(exclude_none=True)
    queues.sqs.send_message(QueueUrl=queues.dlq_url(Priority.normal), MessageBody=body)
    assert settle_dead(queues, service.store, [Priority.normal], settings.max_attempts)["failed"] == 1
    assert_kept_for_the_ttl_from_finishing(service.store.get("settled"), TaskStatus.failed, settings)


# DynamoDB deletes an item some time after its TTL (up to days), the emulators
# never: a record past its TTL reads as gone everywhere, as the docs promise.
def outlive_ttl(store, task_id: str) -> None:
    store.ddb.update_item(TableName=store.table, Key={"task_id": {"S": task_id}},
                          UpdateExpression="SET expires_at = :past", ExpressionAttributeValues={":past": {"N": "1"}})


def test_a_record_past_its_ttl_is_not_found(service):
    task_id = service.submit("t", REQUEST, None).task_id
    outlive_ttl(service.store, task_id)
    for call in (service.get, service.cancel):
        with pytest.raises(ApiError) as gone:
            call("t", task_id)
        assert gone.value.status == 404


def test_an_idempotency_key_whose_task_is_past_its_ttl_creates_a_new_task(service):
    first = service.submit("t", REQUEST, "outlived")
    service.cancel("t", first.task_id)
    outlive_ttl(service.store, first.task_id)
    other = SubmitRequest(model="synthetic", inputs=["another body, the key free again"])
    again = service.submit("t", other, "outlived")
    assert again.task_id == first.task_id and again.status == TaskStatus.queued
    record = service.store.get(again.task_id)
    assert record.status == TaskStatus.queued and record.request_hash == request_hash(other)


NEW_INPUT = "the new task's own input"


def reused_key(service, queues, key: str):
    """A keyed task's message received, then its record past its TTL and the
    key used again: (the task id, the earlier task's message)."""
    old = service.submit("t", REQUEST, key)
    (message,) = queues.receive(Priority.normal, 10, 1, 30)
    outlive_ttl(service.store, old.task_id)
    assert service.submit("t", SubmitRequest(model="synthetic", inputs=[NEW_INPUT]), key).task_id == old.task_id
    return old.task_id, message


@pytest.mark.parametrize("delivery", ["first", "redelivered", "past its deadline"])
def test_a_message_of_an_earlier_task_under_a_reused_key_never_runs_as_the_new_one(service, settings, runner,
                                                                                   delivery):
    # Once a key's task has outlived its TTL the key makes a new task under the
    # same id; a message of the old one still about (re-sent by a retry, redriven
    # from a DLQ) carries the old inputs, and must not run or settle the new task.
    queues = PriorityQueues(settings)
    task_id, message = reused_key(service, queues, "reused")
    new_created = service.store.get(task_id).created_at
    assert message.task().enqueued_at != new_created
    if delivery == "redelivered":
        hand_back(queues, [message], 0)
        message = next(m for m in queues.receive(Priority.normal, 10, 1, 30) if m.receive_count == 2)
    elif delivery == "past its deadline":
        body = json.loads(message.body)
        body["deadline_at"] = 1
        message.body = json.dumps(body)
    prepared = runner.prepare([message])
    assert prepared.jobs == [] and prepared.ack == [message]
    record = service.store.get(task_id)
    assert (record.status, record.attempts, record.created_at) == (TaskStatus.queued, 0, new_created)


@pytest.mark.parametrize("old_first", [True, False])
def test_in_one_batch_the_earlier_task_s_message_under_a_reused_key_is_dropped_alone(service, settings, runner,
                                                                                     old_first):
    queues = PriorityQueues(settings)
    _, stale = reused_key(service, queues, "reused-in-a-batch")
    (current,) = queues.receive(Priority.normal, 10, 1, 30)
    prepared = runner.prepare([stale, current] if old_first else [current, stale])
    assert [job.deliveries for job in prepared.jobs] == [[current]] and prepared.ack == [stale]
    assert prepared.jobs[0].inputs == [NEW_INPUT]


def test_two_retries_at_once_of_an_accepted_task_at_a_full_queue_both_get_it_back(settings):
    full = settings.model_copy(update={"backlog_cap": 1})
    first = TaskService(full).submit("t", REQUEST, "both-retry")
    one, other = TaskService(full), TaskService(full)
    send = one.queues.send

    def the_other_retry_claims_first(message):
        send(message)
        assert other.submit("t", REQUEST, "both-retry").task_id == first.task_id

    one.queues.send = the_other_retry_claims_first
    again = one.submit("t", REQUEST, "both-retry")  # its claim finds the other's: accepted all the same, not a 429
    assert again.task_id == first.task_id and again.status == TaskStatus.queued


def test_a_retry_never_claims_a_record_written_afresh_after_its_read(settings):
    """B, a retry, reads A's record and re-sends its message; A's rollback
    deletes the record and C writes it afresh, all before B's claim. B's
    message names A's record (its created_at), which a worker drops: were B's
    claim to land on C's record, C's rollback would leave it, queued with no
    message to run it."""
    task_id = idempotent_task_id("t", "raced afresh")
    a, b, c = TaskService(settings), TaskService(settings), TaskService(settings)
    first = a._build("t", REQUEST, task_id)[0]
    a.store.create(first, "token-a")  # A: record written, message not yet sent
    send, raced = b.queues.send, []

    def sent_then_a_rolls_back_and_c_writes(message):
        send(message)
        if not raced:
            raced.append(message)
            a.store.delete_if_queued(task_id, "token-a")  # A's send failed: its rollback lands
            while now_ms() <= first.created_at:
                pass  # C's record is another one: created later
            c.store.create(c._build("t", REQUEST, task_id)[0], "token-c")  # C: record written, no message yet

    b.queues.send = sent_then_a_rolls_back_and_c_writes
    assert b.submit("t", REQUEST, "raced afresh").status == TaskStatus.queued  # B: 202
    c.store.delete_if_queued(task_id, "token-c")  # C's send failed: its rollback
    record = b.store.get(task_id)
    assert record is not None, "B answered 202 for a task that is gone"
    sent = PriorityQueues(settings).receive(Priority.normal, 10, 1, 30)
    assert record.created_at in {m.task().enqueued_at for m in sent}, "no message runs the record B answered for"
