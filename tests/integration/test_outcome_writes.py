"""Outcome writes on the emulator: two runs of one task, large results in S3."""

from concurrent.futures import ThreadPoolExecutor

import boto3

from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.contract import RESULTS_PREFIX, Priority, now_ms
from sluice.lifecycle import Job, Outcome, plan_outcomes, record_outcomes
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
