"""The batch runner on the emulator: a task that cannot finish here fails (or
leaves) alone, and the rest of its batch is recorded."""

import json
import logging
import time

import pytest
from botocore.exceptions import ClientError
from fastapi.testclient import TestClient

from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.api.app import create_app
from sluice.contract import Priority
from sluice.worker.metrics import WorkerMetrics
from tests.integration.test_worker_runner import messages_left, receive_all, run_once, submit
from tests.reliability.harness import wait_until


def task_ids(messages):
    return [json.loads(m.body)["task_id"] for m in messages]


def spy_visibility(runner):
    """Each visibility change the runner makes: (task ids, timeout_s, when)."""
    changes = []
    change_visibility = runner.queues.change_visibility_many

    def timed_change(messages, timeout_s):
        changes.append((task_ids(messages), timeout_s, time.monotonic()))
        change_visibility(messages, timeout_s)

    runner.queues.change_visibility_many = timed_change
    return changes


def receive_again(settings, task_id, hidden_at, hidden_s):
    """The message of `task_id`, hidden at `hidden_at` for `hidden_s`: not
    receivable before that (checked only while the backoff surely runs), then
    receivable again."""
    queues = PriorityQueues(settings)
    early = queues.receive(Priority.normal, 10, 0, 30)
    if time.monotonic() - hidden_at < hidden_s:
        assert early == [], "the message was visible before its delay ended"
    got = early or wait_until(lambda: queues.receive(Priority.normal, 10, 1, 30), hidden_s + 15,
                              f"task {task_id}'s message to be visible again")
    assert task_ids(got) == [task_id]
    return got[0]


def test_a_result_that_cannot_be_stored_fails_only_its_own_attempt(api, settings, runner):
    settings.inline_result_max_bytes = 300  # the runner shares this settings object
    big = api.post("/v1/tasks", json={"model": "synthetic", "inputs": [f"in {i}" for i in range(8)]},
                   headers={"x-api-key": api.key_a}).json()["task_id"]
    small = submit(api, "inline")
    refused = submit(api, "x !fail")
    # S3 refuses this one task's result object, whatever the SDK's retries did.
    put_json = runner.payloads.put_json

    def slow_down(key, body):
        if f"/{big}/" in key:
            raise ClientError({"Error": {"Code": "SlowDown", "Message": "Please reduce your request rate."}},
                              "PutObject")
        put_json(key, body)

    runner.payloads.put_json = slow_down
    changes = spy_visibility(runner)
    run_once(runner, receive_all(settings, 3))

    store = TaskStore(settings)
    done = store.get(small)
    assert (done.status.value, done.attempts) == ("succeeded", 1) and done.result_json
    failed = store.get(refused)
    assert (failed.status.value, failed.error_code) == ("failed", "invalid_input")
    # The model ran: a failed attempt, recorded and retried like a model error.
    lost = store.get(big)
    assert (lost.status.value, lost.attempts, lost.result_key) == ("queued", 1, None), lost
    assert lost.started_at and lost.error_code == "result_not_stored" and "SlowDown" in lost.error_message
    assert [(ids, timeout_s) for ids, timeout_s, _ in changes] == [([big], 2)]  # the first retry's backoff
    # The others' messages are deleted; the lost one's comes back after its backoff.
    again = receive_again(settings, big, changes[0][2], 2)
    assert again.receive_count == 2

    runner.payloads.put_json = put_json  # S3 is back
    run_once(runner, [again])
    record = store.get(big)
    assert (record.status.value, record.error_code) == ("succeeded", None) and record.result_key
    assert len(PayloadStore(settings).get_json(record.result_key)["outputs"]) == 8
    assert messages_left(settings) == 0


def test_a_task_for_a_model_this_worker_does_not_serve_is_handed_back_unclaimed(
        api, settings, runner, caplog, capsys):
    # A rolling deploy: the API already takes minilm-embed, this worker serves only synthetic.
    newer = TestClient(create_app(settings.model_copy(update={"models": "synthetic,minilm-embed"})),
                       raise_server_exceptions=False)
    served = [submit(api, f"ok{i}") for i in range(2)]
    elsewhere = newer.post("/v1/tasks", json={"model": "minilm-embed", "inputs": ["not here"]},
                           headers={"x-api-key": api.key_a}).json()["task_id"]
    settings.visibility_timeout_s = 4  # its hand-back delay is a quarter of it: 1 s
    changes = spy_visibility(runner)
    runner.metrics = WorkerMetrics()  # EMF on stdout
    batch = receive_all(settings, 3)
    with caplog.at_level(logging.WARNING, logger="sluice.worker"):
        prepared = run_once(runner, batch)

    store = TaskStore(settings)
    assert all(store.get(t).status.value == "succeeded" for t in served)
    record = store.get(elsewhere)  # no table write: no start, no error, no attempt
    assert (record.status.value, record.attempts, record.started_at, record.error_code) == ("queued", 0, None, None)
    assert [j.message.task_id for j in prepared.jobs] == [t for t in task_ids(batch) if t != elsewhere]
    assert [(ids, timeout_s) for ids, timeout_s, _ in changes] == [([elsewhere], 1)]
    warnings = [r for r in caplog.records if "does not serve" in r.getMessage()]
    assert len(warnings) == 1 and "minilm-embed" in warnings[0].getMessage()
    capsys.readouterr()
    runner.metrics.flush()
    (emf,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert emf["TasksHandedBack"] == [1] and emf["TasksSucceeded"] == [1, 1]
    # Neither deleted nor failed: receivable again, by a worker that serves it perhaps.
    again = receive_again(settings, elsewhere, changes[0][2], 1)
    assert again.receive_count == 2

    # Handed back again through the worker's give_back, which first stops its heartbeat extending it.
    given = []
    assert runner.prepare([again], lambda messages, delay_s: given.append((messages, delay_s))).jobs == []
    assert given == [([again], 1)]
    assert store.get(elsewhere).attempts == 0


def test_a_task_past_its_deadline_expires_even_for_a_model_this_worker_does_not_serve(api, settings, runner):
    # Handed back, it would circle until a worker with the model came, or for the queue's whole retention.
    newer = TestClient(create_app(settings.model_copy(update={"models": "synthetic,minilm-embed"})),
                       raise_server_exceptions=False)
    late = newer.post("/v1/tasks", json={"model": "minilm-embed", "inputs": ["not here"], "deadline_s": 1},
                      headers={"x-api-key": api.key_a}).json()["task_id"]
    (message,) = receive_all(settings, 1)
    body = json.loads(message.body)
    body["deadline_at"] = 1  # the deadline passed, without waiting for it
    message.body = json.dumps(body)
    given = []
    prepared = runner.prepare([message], lambda messages, delay_s: given.append(messages))
    assert prepared.jobs == [] and given == [] and prepared.ack == [message]
    record = TaskStore(settings).get(late)
    assert (record.status.value, record.error_code, record.attempts) == ("expired", "deadline_exceeded", 0)


def test_a_failed_delete_leaves_the_rest_of_finish_made(api, settings, runner):
    """finish's queue calls stand alone: a DeleteMessageBatch that fails (its
    messages come back, and their next receive acknowledges them) does not
    skip the failed attempt's backoff."""
    ok = submit(api, "ok")
    crashed = submit(api, "x !crash")

    def delete_refused(messages):
        raise ClientError({"Error": {"Code": "InternalError", "Message": "try again"}}, "DeleteMessageBatch")

    runner.queues.delete_many = delete_refused
    changes = spy_visibility(runner)
    prepared = runner.prepare(receive_all(settings, 2))
    with pytest.raises(ClientError, match="DeleteMessageBatch"):
        runner.finish(prepared, runner.infer(prepared.jobs))
    assert [(ids, timeout_s) for ids, timeout_s, _ in changes] == [([crashed], 2)]  # the first retry's backoff
    assert TaskStore(settings).get(ok).status.value == "succeeded"
