"""Promise 4, the moments the outage scenario can only hit by chance: a submit
interrupted between its record and its message leaves the two together or
neither. In-process TaskService against the session's emulator, with faults
injected at exact points.
"""

from __future__ import annotations

import threading

import pytest
from botocore.exceptions import EndpointConnectionError, ReadTimeoutError

from models.synthetic import SyntheticModel

from sluice.adapters.queues import PriorityQueues
from sluice.api.errors import ApiError
from sluice.api.service import Compensator, TaskService, idempotent_task_id
from sluice.contract import BatchSubmitRequest, Priority, SubmitRequest, TaskRecord, TaskStatus, now_ms
from sluice.worker.runner import BatchRunner
from tests.reliability.harness import wait_until

REQUEST = SubmitRequest(model="synthetic", inputs=["atomic"])


def cut(*_, **__):
    raise EndpointConnectionError(endpoint_url="http://cut")


@pytest.fixture
def service(settings):
    return TaskService(settings)


def only_record(service):
    return service.store.ddb.scan(TableName=service.settings.tasks_table)["Items"]


def rollbacks_cut_off(service) -> threading.Event:
    """The table refuses the submit's rollback deletes until the returned event is cleared."""
    table_down = threading.Event()
    table_down.set()
    real_delete = service.store.delete_if_queued

    def delete(task_id, token=None):
        if table_down.is_set():
            cut()
        return real_delete(task_id, token)

    service.store.delete_if_queued = delete
    return table_down


def visible(settings) -> int:
    return PriorityQueues(settings).depth(Priority.normal)


def test_a_record_write_whose_reply_is_lost_is_undone(service, settings):
    # A submit without an Idempotency-Key writes through the group commit.
    real_create = service.store.create_many

    def lands_then_cut(records, token=None):
        real_create(records, token)
        cut()

    service.store.create_many = lands_then_cut
    with pytest.raises(ApiError) as refused:
        service.submit("t", REQUEST, None)
    assert refused.value.status == 503 and refused.value.headers["Retry-After"]
    assert only_record(service) == [] and visible(settings) == 0


def test_a_timed_out_write_that_lands_after_its_rollback_is_rolled_back_too(service, settings):
    # A hung table applies the SDK's held tries of a write when it wakes: after
    # the rollback's first delete had found nothing, a record with no message.
    record = TaskRecord(task_id="late", tenant_id="t", model="synthetic", priority=Priority.normal,
                        status=TaskStatus.queued, input_count=1, created_at=now_ms())
    found = []
    real_delete = service.store.delete_if_queued

    def delete(task_id, token=None):
        found.append(real_delete(task_id, token))
        return found[-1]

    service.store.delete_if_queued = delete
    service.compensator.undo([record.task_id], "tok", after=ReadTimeoutError(endpoint_url="http://hung"))
    wait_until(lambda: found, 5, "the rollback's first delete")
    service.store.create(record, "tok")  # the held write lands now
    wait_until(lambda: not only_record(service), 10, "the late record's rollback",
               state=lambda: (only_record(service), found))


def test_when_the_table_is_down_too_the_rollback_lands_when_it_returns(service, settings):
    table_down = rollbacks_cut_off(service)
    service.queues.send_many = cut
    with pytest.raises(ApiError):
        service.submit("t", REQUEST, None)
    assert len(only_record(service)) == 1 and service.compensator.pending() == 1  # half-written, for now
    table_down.clear()
    wait_until(lambda: only_record(service) == [], 10, "the background rollback")


def test_an_idempotent_retry_keeps_the_record_its_first_try_was_rolling_back(service, settings):
    table_down = rollbacks_cut_off(service)
    real_send = service.queues.send
    service.queues.send = cut
    with pytest.raises(ApiError):
        service.submit("t", REQUEST, "key-1")
    service.queues.send = real_send
    accepted = service.submit("t", REQUEST, "key-1")  # the client's retry, queue back
    assert accepted.task_id == idempotent_task_id("t", "key-1")
    table_down.clear()
    wait_until(lambda: service.compensator.pending() == 0, 10, "the first try's rollback to be tried")
    record = service.store.get(accepted.task_id)
    # The first try's rollback no longer applies: the task has its record and its message.
    assert record is not None and record.status == TaskStatus.queued
    assert visible(settings) == 1


def test_a_retry_whose_message_cannot_be_sent_keeps_the_task_its_first_try_queued(service, settings):
    accepted = service.submit("t", REQUEST, "key-2")  # 202: record and message
    real_send = service.queues.send
    service.queues.send = cut
    with pytest.raises(ApiError) as refused:
        service.submit("t", REQUEST, "key-2")  # the client's retry (its first reply lost), the queue down
    service.queues.send = real_send
    assert refused.value.status == 503
    # Nothing rolled back the accepted task, nor is waiting to.
    assert service.compensator.pending() == 0
    record = service.store.get(accepted.task_id)
    assert record is not None and record.status == TaskStatus.queued
    assert visible(settings) == 1


def test_a_retry_whose_claim_reply_is_lost_keeps_the_task_its_first_try_queued(service, settings):
    accepted = service.submit("t", REQUEST, "key-3")
    real_apply = service.store.apply

    def lands_then_cut(change):
        real_apply(change)
        cut()

    service.store.apply = lands_then_cut
    with pytest.raises(ApiError) as refused:
        service.submit("t", REQUEST, "key-3")
    service.store.apply = real_apply
    assert refused.value.status == 503
    assert service.compensator.pending() == 0
    record = service.store.get(accepted.task_id)
    assert record is not None and record.status == TaskStatus.queued
    assert visible(settings) >= 1  # the first message, and the retry's duplicate


def test_a_retry_that_cannot_send_either_leaves_the_first_tries_rollback_to_land(service, settings):
    table_down = rollbacks_cut_off(service)
    real_send = service.queues.send
    service.queues.send = cut
    for _ in range(2):  # the first try and its retry: neither message goes out
        with pytest.raises(ApiError):
            service.submit("t", REQUEST, "key-4")
    service.queues.send = real_send
    table_down.clear()
    # The retry changed nothing, so the first try's pending rollback still applies.
    wait_until(lambda: only_record(service) == [], 10, "the first try's rollback")
    assert visible(settings) == 0


def test_a_rollback_retried_while_submits_fill_its_backlog_still_lands(service):
    compensator = Compensator(service.store, max_pending=2)
    ids = [f"stalled-{i}" for i in range(3)]
    for task_id in ids:
        service.store.create(TaskRecord(task_id=task_id, tenant_id="t", model="synthetic", priority=Priority.normal,
                                        status=TaskStatus.queued, input_count=1, created_at=now_ms()), "token")
    table_down, background_trying, backlog_full = threading.Event(), threading.Event(), threading.Event()
    table_down.set()
    real_delete = service.store.delete_if_queued

    def delete(task_id, token=None):
        if table_down.is_set():
            if threading.current_thread().name == "sluice-compensate":
                background_trying.set()
                backlog_full.wait(10)  # this try outlasts the submits below, as a timeout would
            cut()
        real_delete(task_id, token)

    service.store.delete_if_queued = delete
    compensator.undo(ids[:1], "token")  # to the background, which takes it off the backlog to try it
    assert background_trying.wait(10)
    compensator.undo(ids[1:2], "token")  # two more failed submits meanwhile: the backlog is full
    compensator.undo(ids[2:], "token")
    assert compensator.pending() == 2
    backlog_full.set()  # the background try fails now and finds no room to put its task back
    table_down.clear()
    wait_until(lambda: only_record(service) == [], 10, "every rollback, once the table is back",
               state=lambda: f"pending={compensator.pending()} records={len(only_record(service))}")


class CutAfterFirstBatch:
    """The SQS client, with the connection lost after the first SendMessageBatch."""

    def __init__(self, sqs):
        self._sqs, self.calls = sqs, 0

    def __getattr__(self, name):
        return getattr(self._sqs, name)

    def send_message_batch(self, **kwargs):
        self.calls += 1
        if self.calls > 1:
            cut()
        return self._sqs.send_message_batch(**kwargs)


def test_a_batch_cut_off_while_sending_leaves_no_records(service, settings):
    service.queues.sqs = CutAfterFirstBatch(service.queues.sqs)
    batch = BatchSubmitRequest(tasks=[SubmitRequest(model="synthetic", inputs=[f"b{i}"]) for i in range(25)])
    with pytest.raises(ApiError) as refused:
        service.submit_batch("t", batch, None)
    assert refused.value.status == 503
    assert only_record(service) == []
    # The first chunk's messages went out before the cut; with their records
    # gone a worker acknowledges them without running anything.
    queues = PriorityQueues(settings)
    received = queues.receive(Priority.normal, 10, 0, 30)
    assert len(received) == 10
    runner = BatchRunner(settings, {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})
    prepared = runner.prepare(received)
    assert prepared.jobs == [] and len(prepared.ack) == 10


def test_a_rollback_that_fails_unexpectedly_is_retried_not_dropped(service):
    """Not only the AWS errors: whatever a delete raises, the record is deleted
    once the table answers, at once and in the background alike."""
    ids = ["odd-0", "odd-1"]
    for task_id in ids:
        service.store.create(TaskRecord(task_id=task_id, tenant_id="t", model="synthetic", priority=Priority.normal,
                                        status=TaskStatus.queued, input_count=1, created_at=now_ms()), "token")
    failures = {"left": 3}  # the try at once, then the background's first two
    real_delete = service.store.delete_if_queued

    def delete(task_id, token=None):
        if failures["left"] > 0:
            failures["left"] -= 1
            raise RuntimeError("a defect, not the network")
        real_delete(task_id, token)

    service.store.delete_if_queued = delete
    service.compensator.undo(ids, "token")
    wait_until(lambda: only_record(service) == [], 10, "both rollbacks, after the unexpected errors",
               state=lambda: f"pending={service.compensator.pending()} failures left={failures['left']}")


def test_shutdown_waits_for_a_rollback_still_retrying_to_land(service, settings):
    table_down = rollbacks_cut_off(service)
    service.queues.send_many = cut
    with pytest.raises(ApiError):
        service.submit("t", REQUEST, None)
    table_down.clear()  # the background is in its backoff: its next try would land, but not yet
    assert service.compensator.drain(10) == []
    assert only_record(service) == []  # landed before drain returned: the process may exit now


def test_shutdown_names_each_rollback_that_could_not_land(service, caplog):
    rollbacks_cut_off(service)  # and it stays down
    service.queues.send_many = cut
    with pytest.raises(ApiError):
        service.submit("t", REQUEST, None)
    [record] = only_record(service)
    task_id = record["task_id"]["S"]
    with caplog.at_level("ERROR", logger="sluice.api"):
        assert service.compensator.drain(0.5) == [task_id]
    assert any(task_id in r.getMessage() and "shutdown" in r.getMessage() for r in caplog.records), caplog.text
