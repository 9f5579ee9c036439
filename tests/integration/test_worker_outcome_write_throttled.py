"""An outcome the table will not take (its UpdateItem throttled past the SDK's
retries) is its own task's setback, never its batch's: the rest of the batch
is recorded and acknowledged, and that task goes back to its queue unclaimed."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest
from botocore.exceptions import ClientError

from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.aws import new_client
from sluice.contract import Priority, now_ms
from sluice.dlq import dead_counts, settle_dead
from sluice.lifecycle import Job, Outcome, plan_outcomes, record_outcomes
from sluice.worker.runner import hand_back
from tests.integration.test_worker_outcome_failures import receive_again, spy_visibility, task_ids
from tests.integration.test_worker_runner import messages_left, run_once
from tests.integration.test_worker_unrun_hand_backs import VISIBILITY_S, receive, redeliver, refuse, submit, throttle
from tests.reliability.harness import wait_until


def spy_deletes(runner) -> list[str]:
    """The task ids of the messages the runner deletes."""
    deleted = []
    delete_many = runner.queues.delete_many

    def spied(messages):
        deleted.extend(task_ids(messages))
        delete_many(messages)

    runner.queues.delete_many = spied
    return deleted


def result_objects(settings, task_id: str) -> int:
    return PayloadStore(settings).s3.list_objects_v2(
        Bucket=settings.bucket, Prefix=f"results/tenant-a/{task_id}/").get("KeyCount", 0)


def test_a_throttled_outcome_write_hands_back_its_own_task_and_the_batch_finishes(settings, runner):
    settings.inline_result_max_bytes = 0  # every result through S3; the runner shares this settings object
    throttled, *others = submit(settings, "throttled", "ok 1", "ok 2")
    # The throttled task is a redelivery: its claim records a start, which must be taken back.
    batch = redeliver(settings, receive(settings, [throttled, *others]), [throttled])
    runner.store = TaskStore(settings, ddb=new_client("dynamodb", settings))  # the hook sees this store's calls only
    updates = []
    runner.store.ddb.meta.events.register("before-call.dynamodb.UpdateItem",
                                          lambda params, **_: updates.append(params["body"]))
    refused = throttle(runner.store, "UpdateItem", throttled, naming='"succeeded"')  # its outcome's write only
    hidden = spy_visibility(runner)
    deleted = spy_deletes(runner)
    run_once(runner, batch)  # does not raise

    store = TaskStore(settings)
    for task_id in others:
        record = store.get(task_id)
        assert (record.status.value, record.attempts) == ("succeeded", 1) and record.result_key
        assert result_objects(settings, task_id) == 1
    assert sorted(deleted) == sorted(others)  # acknowledged in this very pass
    # Not recorded, so no attempt either: the claim's start is taken back, the
    # upload deleted, and its message handed back after a retry's backoff.
    assert refused == [throttled]
    record = store.get(throttled)
    assert (record.status.value, record.attempts, record.started_at, record.result_key, record.error_code) == (
        "queued", 0, None, None, None), record
    assert result_objects(settings, throttled) == 0
    assert [(ids, timeout_s) for ids, timeout_s, _ in hidden] == [([throttled], 4)]  # 2^2: its second receive
    # One UpdateItem per task, as on the happy path, plus the claim of the
    # redelivery and the take-back of its start.
    assert len(updates) == 3 + 1 + 1

    again = receive_again(settings, throttled, hidden[0][2], 4)
    assert again.receive_count == 3
    runner.store = store  # the table takes writes again
    run_once(runner, [again])
    record = store.get(throttled)
    assert (record.status.value, record.attempts) == ("succeeded", 3) and result_objects(settings, throttled) == 1
    assert messages_left(settings) == 0


@pytest.mark.parametrize(("code", "status"), [("ValidationException", 400), ("InternalServerError", 500)],
                         ids=["client_error", "server_error"])
def test_an_outcome_write_that_keeps_failing_unthrottled_ends_in_failed_not_requeued_for_ever(
        settings, runner, code, status):
    # Not a throttle: a write that never passes (a request the table refuses,
    # a defect), or one that may have landed (a 5xx: its outcome's attempts
    # would be the receive count). The claim's start stands, so the task
    # reaches max_attempts and settling fails it; were it taken back, each
    # dead-lettering would requeue it with a fresh receive count, for ever.
    [task_id] = submit(settings, "never recorded")
    runner.store = TaskStore(settings, ddb=new_client("dynamodb", settings))  # the hook sees this store's calls only
    refused = refuse(runner.store, "UpdateItem", task_id, '"succeeded"', code, status)  # its outcome's write only
    queues, store = PriorityQueues(settings), TaskStore(settings)
    for receive_count in range(1, settings.max_attempts + 1):  # every receive that SQS allows
        [message] = receive(settings, [task_id])
        assert message.receive_count == receive_count
        run_once(runner, [message])  # does not raise
        hand_back(queues, [message], 0)  # at once, not after the retry's backoff
    assert refused == [task_id] * settings.max_attempts
    record = store.get(task_id)
    # Starts recorded by the claims of the redeliveries, none taken back.
    assert (record.status.value, record.attempts) == ("queued", settings.max_attempts - 1), record
    wait_until(lambda: queues.receive(Priority.normal, 10, 1, 30) == [] and dead_counts(queues, [Priority.normal])[0],
               2 * VISIBILITY_S + 15, "the message dead-lettered")

    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts) == {"failed": 1, "requeued": 0}
    record = store.get(task_id)
    assert (record.status.value, record.error_code, record.attempts) == (
        "failed", "dead_lettered", settings.max_attempts)


def test_record_outcomes_makes_every_write_and_sets_aside_the_one_that_failed(settings):
    throttled, *others = submit(settings, "throttled", "ok 1", "ok 2")
    messages = receive(settings, [throttled, *others])
    store = TaskStore(settings, ddb=new_client("dynamodb", settings))
    throttle(store, "UpdateItem", throttled)
    now = now_ms()
    plan = plan_outcomes([Outcome(Job(m.task(), [m]), result={"ok": True}) for m in messages], now, settings)
    with ThreadPoolExecutor(4) as pool:
        applied = record_outcomes(store, PayloadStore(settings), plan, pool)
    assert list(applied.errored) == [throttled] and not applied.rejected
    assert applied.errored[throttled].response["Error"]["Code"] == "ProvisionedThroughputExceededException"
    assert [o.job.message.task_id for o in plan.unwritten] == [throttled]
    assert sorted(o.job.message.task_id for o in plan.succeeded) == sorted(others)
    records = TaskStore(settings).get_many([throttled, *others])
    assert {t: r.status.value for t, r in records.items()} == {
        throttled: "queued", others[0]: "succeeded", others[1]: "succeeded"}
