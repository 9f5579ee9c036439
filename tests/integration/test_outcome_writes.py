"""Outcome writes on the emulator: two runs of one task, large results in S3."""

from concurrent.futures import ThreadPoolExecutor

import boto3
import pytest
from botocore.exceptions import ClientError

from models.synthetic import SyntheticModel

from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import Change, TaskStore
from sluice.aws import new_client
from sluice.contract import RESULTS_PREFIX, Priority, TaskRecord, TaskStatus, now_ms
from sluice.lifecycle import Job, Outcome, plan_outcomes, record_outcomes
from sluice.worker.runner import BatchRunner
from tests.integration.resent_writes import RESENDS
from tests.integration.test_worker_runner import messages_left
from tests.reliability.harness import wait_until


def test_a_run_that_loses_the_outcome_write_leaves_the_winners_result(api, settings):
    # Two runs of one task (a duplicate delivery, a redrive's send-then-delete):
    # each uploads its large result before its conditional write, and only the
    # first write lands. The record must name the winner's bytes.
    to_s3 = settings.model_copy(update={"inline_result_max_bytes": 0})
    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["x"]},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    (delivery,) = PriorityQueues(to_s3).receive(Priority.normal, 10, 1, 30)
    store, payloads = TaskStore(to_s3), PayloadStore(to_s3)
    rejected = []
    with ThreadPoolExecutor(2) as pool:
        for run in ("winner", "loser"):
            job = Job(delivery.task(), [delivery])
            plan = plan_outcomes([Outcome(job, result={"run": run})], now_ms(), to_s3)
            applied = record_outcomes(store, payloads, plan, pool)
            assert not applied.errored
            rejected.append(applied.rejected)
    assert rejected == [set(), {task_id}]
    record = store.get(task_id)
    assert record.status.value == "succeeded"
    assert payloads.get_json(record.result_key) == {"run": "winner"}
    # The loser's upload, under its own key, is gone: nothing is left unnamed.
    listed = boto3.client("s3").list_objects_v2(Bucket=to_s3.bucket, Prefix=RESULTS_PREFIX)
    assert [o["Key"] for o in listed["Contents"]] == [record.result_key]
    view = api.get(f"/v1/tasks/{task_id}", headers={"x-api-key": api.key_a}).json()
    assert view["status"] == "succeeded" and view["result_url"]


def test_a_task_starts_when_its_batch_begins_inference_not_when_it_was_claimed(api, settings, runner):
    # A prepared batch waits behind the one on the model; its tasks' queue time
    # must count that wait, or queue_ms + inference_ms falls far short of the total.
    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["x"]},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    batch = PriorityQueues(settings).receive(Priority.normal, 10, 1, 30)
    prepared = runner.prepare(batch)
    claimed_by = now_ms()
    wait_until(lambda: now_ms() > claimed_by + 5, 5, "the clock to move past the claim")
    inferred_from = now_ms()
    runner.finish(prepared, runner.infer(prepared.jobs))
    record = TaskStore(settings).get(task_id)
    assert record.status.value == "succeeded"
    assert record.started_at >= inferred_from > claimed_by
    view = api.get(f"/v1/tasks/{task_id}", headers={"x-api-key": api.key_a}).json()["timings"]
    assert view["queue_ms"] == view["started_at"] - view["created_at"]


@pytest.mark.parametrize("resend", RESENDS, ids=lambda f: f.__name__)
def test_an_outcome_write_resent_after_it_landed_keeps_its_result(api, settings, resend):
    # Read as "another run won", the worker deleted the object the record
    # named: a task succeeded whose result was gone.
    to_s3 = settings.model_copy(update={"inline_result_max_bytes": 0})
    runner = BatchRunner(to_s3, {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})
    # A client of its own: the shared one would keep the hook for the tests after this one.
    runner.store = TaskStore(to_s3, ddb=new_client("dynamodb", to_s3))
    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["x"]},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    batch = PriorityQueues(to_s3).receive(Priority.normal, 10, 1, 30)
    landed = resend(runner.store.ddb, "result_key")
    prepared = runner.prepare(batch)
    runner.finish(prepared, runner.infer(prepared.jobs))
    assert landed == [200]
    record = TaskStore(to_s3).get(task_id)
    assert record.status.value == "succeeded"
    assert PayloadStore(to_s3).get_json(record.result_key) == {"outputs": [{"length": 1, "sha256": "2d711642b726b044"}]}
    assert PriorityQueues(to_s3).receive(Priority.normal, 10, 0, 30) == []  # acknowledged, not retried


def test_an_outcome_after_the_deadline_expires_its_task(api, settings):
    # A read of a task past its deadline expires it, running or not: were the
    # outcome written, a task's end would depend on whether its client polled.
    to_s3 = settings.model_copy(update={"inline_result_max_bytes": 0})
    runner = BatchRunner(to_s3, {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})
    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["x"], "deadline_s": 1},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    prepared = runner.prepare(PriorityQueues(to_s3).receive(Priority.normal, 10, 1, 30))
    (job,) = prepared.jobs  # claimed before its deadline
    wait_until(lambda: now_ms() > job.message.deadline_at, 5, "the task's deadline to pass")
    runner.finish(prepared, runner.infer(prepared.jobs))
    record = TaskStore(to_s3).get(task_id)
    assert (record.status.value, record.error_code, record.result_key) == ("expired", "deadline_exceeded", None)
    listed = boto3.client("s3").list_objects_v2(Bucket=to_s3.bucket, Prefix=RESULTS_PREFIX)
    assert listed.get("KeyCount") == 0  # no result was stored for it
    assert messages_left(to_s3) == 0
    view = api.get(f"/v1/tasks/{task_id}", headers={"x-api-key": api.key_a}).json()
    assert view["error"] == {"code": "deadline_exceeded", "message": "its deadline passed before it finished"}


def test_a_refused_write_whose_landing_cannot_be_read_is_its_own_changes_error(settings):
    # Where a refusal carries no old item (dynalite), the record is read to tell
    # a resend from another run's win; that read failing must stay this
    # change's error: apply_each promises every other change its own call.
    store = TaskStore(settings, ddb=new_client("dynamodb", settings))  # its own: the test replaces its calls
    for task_id in ("refused", "fine"):
        store.create(TaskRecord(task_id=task_id, tenant_id="t", model="synthetic", priority=Priority.normal,
                                status=TaskStatus.queued, input_count=1, created_at=0))
    update_item = store.ddb.update_item

    def refused_without_the_old_item(**request):
        if request["Key"]["task_id"]["S"] == "refused":
            raise ClientError({"Error": {"Code": "ConditionalCheckFailedException", "Message": "no"}}, "UpdateItem")
        return update_item(**request)

    def unreadable(**_):
        raise ClientError({"Error": {"Code": "InternalServerError", "Message": "down"}}, "GetItem")

    store.ddb.update_item, store.ddb.get_item = refused_without_the_old_item, unreadable
    finished = {"status": TaskStatus.failed.value, "finished_at": now_ms(), "error_code": "model_error",
                "error_message": "boom"}
    applied = store.apply_each([Change(t, finished, (TaskStatus.queued,)) for t in ("refused", "fine")])
    assert set(applied.errored) == {"refused"} and not applied.rejected
    assert TaskStore(settings).get("fine").status is TaskStatus.failed


def test_an_outcome_write_that_lands_but_answers_a_5xx_keeps_its_result_object(api, settings):
    # Every try of the write answered 500 (the SDK gave up), but the first one
    # landed: the record names the result's object. Deleting the upload as if
    # the write surely failed leaves a succeeded task whose result is gone.
    to_s3 = settings.model_copy(update={"inline_result_max_bytes": 0})
    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["x"]},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    (delivery,) = PriorityQueues(to_s3).receive(Priority.normal, 10, 1, 30)
    store = TaskStore(to_s3, ddb=new_client("dynamodb", to_s3))  # its own: the test replaces its calls
    update_item = store.ddb.update_item

    def landed_then_5xx(**request):
        update_item(**request)
        raise ClientError({"Error": {"Code": "InternalServerError", "Message": "lost"},
                           "ResponseMetadata": {"HTTPStatusCode": 500}}, "UpdateItem")

    store.ddb.update_item = landed_then_5xx
    plan = plan_outcomes([Outcome(Job(delivery.task(), [delivery]), result={"run": 1})], now_ms(), to_s3)
    with ThreadPoolExecutor(2) as pool:
        applied = record_outcomes(store, PayloadStore(to_s3), plan, pool)
    assert list(applied.errored) == [task_id]  # set aside: it goes back to its queue
    record = TaskStore(to_s3).get(task_id)
    assert record.status.value == "succeeded" and record.result_key
    assert PayloadStore(to_s3).get_json(record.result_key) == {"run": 1}
