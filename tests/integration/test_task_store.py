"""The tasks table on a real (emulated) DynamoDB: conditional writes hold."""

import pytest

from sluice.adapters.task_store import Change, TaskExists, TaskStore, TransitionRejected
from sluice.contract import Priority, TaskRecord, TaskStatus, new_task_id, now_ms

QUEUED = (TaskStatus.queued,)


def record(**overrides) -> TaskRecord:
    values = dict(task_id=new_task_id(), tenant_id="acme", model="synthetic", priority=Priority.normal,
                  status=TaskStatus.queued, input_count=1, created_at=now_ms())
    values.update(overrides)
    return TaskRecord(**values)


@pytest.fixture
def store(settings):
    return TaskStore(settings)


def test_create_is_once_only(store):
    r = record(metadata={"team": "search"})
    store.create(r)
    with pytest.raises(TaskExists) as info:
        store.create(r.model_copy(update={"input_count": 9}))
    assert info.value.existing.input_count == 1
    assert store.get(r.task_id).metadata == {"team": "search"}


def test_a_finished_task_never_moves_back(store):
    r = record()
    store.create(r)
    store.apply(Change(r.task_id, {"started_at": 5}, QUEUED, add_attempt=True))
    store.apply(Change(r.task_id, {"status": "succeeded", "finished_at": now_ms(), "result_json": "[1]"}, QUEUED))
    with pytest.raises(TransitionRejected) as info:
        store.apply(Change(r.task_id, {"started_at": 6}, QUEUED, add_attempt=True))
    assert info.value.current.status is TaskStatus.succeeded
    with pytest.raises(TransitionRejected):
        store.apply(Change(r.task_id, {"status": "succeeded", "finished_at": now_ms(), "result_json": "[2]"}, QUEUED))
    final = store.get(r.task_id)
    assert final.result_json == "[1]" and final.attempts == 1 and final.started_at == 5


def test_apply_many_applies_what_it_can_and_names_the_rest(store):
    queued, cancelled = record(), record(status=TaskStatus.cancelled)
    store.create(queued)
    store.create(cancelled)
    rejected = store.apply_many([
        Change(t.task_id, {"started_at": 5}, QUEUED, add_attempt=True) for t in (queued, cancelled)
    ])
    assert rejected == {cancelled.task_id}
    started = store.get(queued.task_id)
    assert (started.status, started.started_at, started.attempts) == (TaskStatus.queued, 5, 1)
    assert store.get(cancelled.task_id).status is TaskStatus.cancelled


def test_get_many_and_compensating_delete(store):
    records = [record() for _ in range(3)]
    store.create_many(records)
    assert set(store.get_many([r.task_id for r in records] + ["missing"])) == {r.task_id for r in records}
    assert store.delete_if_queued(records[0].task_id) is False  # none left
    assert store.get(records[0].task_id) is None
    assert store.delete_if_queued(records[0].task_id) is False  # none there: a late write may land yet
    store.apply(Change(records[1].task_id, {"status": "cancelled", "finished_at": now_ms()}, QUEUED))
    assert store.delete_if_queued(records[1].task_id) is True  # not queued any more: kept
    assert store.get(records[1].task_id) is not None


def test_statuses_reads_only_the_status_of_tasks_that_exist(store):
    records = [record() for _ in range(120)]  # more than one BatchGetItem of 100 keys
    store.create_many(records)
    store.apply(Change(records[0].task_id, {"status": "cancelled", "finished_at": now_ms()}, QUEUED))
    statuses = store.statuses([r.task_id for r in records] + ["missing"])
    assert set(statuses) == {r.task_id for r in records}
    assert statuses[records[0].task_id] is TaskStatus.cancelled
    assert {statuses[r.task_id] for r in records[1:]} == {TaskStatus.queued}


def test_keys_left_unprocessed_are_read_again_with_backoff_then_reported(store, monkeypatch):
    # DynamoDB answers a throttled BatchGetItem with UnprocessedKeys, not an error.
    from sluice.adapters import task_store

    r = record()
    store.create(r)
    real, throttled_for, slept = store.ddb.batch_get_item, [2], []

    def throttled(**request):
        if throttled_for[0] > 0:
            throttled_for[0] -= 1
            return {"Responses": {}, "UnprocessedKeys": request["RequestItems"]}
        return real(**request)

    monkeypatch.setattr(store.ddb, "batch_get_item", throttled)
    monkeypatch.setattr(task_store.time, "sleep", slept.append)
    assert store.statuses([r.task_id]) == {r.task_id: TaskStatus.queued}
    assert slept == [0.05, 0.1]
    throttled_for[0] = 1000
    with pytest.raises(RuntimeError, match="1 task records could not be read"):
        store.get_many([r.task_id])
    assert throttled_for[0] == 1000 - 6


def test_an_attempt_is_taken_back_without_other_changes(store):
    r = record()
    store.create(r)
    store.apply(Change(r.task_id, {"started_at": 5}, QUEUED, add_attempt=True))
    store.apply(Change(r.task_id, {}, QUEUED, add_attempt=-1))
    again = store.get(r.task_id)
    assert again.attempts == 0 and again.started_at == 5 and again.status is TaskStatus.queued


def test_the_submit_token_is_part_of_the_record(store):
    r = record()
    store.create(r, token="tok-1")
    assert store.get(r.task_id).submit_token == "tok-1"
    # An idempotent retry claims the record with its own token...
    assert store.apply(Change(r.task_id, {"submit_token": "tok-2"}, QUEUED)).submit_token == "tok-2"
    assert store.delete_if_queued(r.task_id, "tok-1") is True  # ...so the first try's rollback leaves it alone
    assert store.get(r.task_id).submit_token == "tok-2"
    fresh = [record() for _ in range(2)]
    store.create_many(fresh, token="tok-3")
    assert {t.submit_token for t in store.get_many([t.task_id for t in fresh]).values()} == {"tok-3"}
