"""The batch runner on the emulator: claims, outcomes, isolation, duplicates."""

import json
import threading
import time
import urllib.request

import pytest

from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.contract import Priority
from tests.reliability.harness import wait_until


def receive_all(settings, want):
    queues = PriorityQueues(settings)
    got = []
    for _ in range(30):
        for p in Priority:
            got += queues.receive(p, 10, 0, 30)
        if len(got) >= want:
            break
    return got


def messages_left(settings) -> int:
    """Every message still on the queues, the hidden and the delayed too: a
    receive would miss one that a run left in flight or gave a backoff."""
    queues = PriorityQueues(settings)
    names = ["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
             "ApproximateNumberOfMessagesDelayed"]
    return sum(int(queues.sqs.get_queue_attributes(QueueUrl=queues.url(p), AttributeNames=names)["Attributes"][n])
               for p in Priority for n in names)


def run_once(runner, batch):
    prepared = runner.prepare(batch)
    runner.finish(prepared, runner.infer(prepared.jobs))
    return prepared


def test_batch_succeeds_and_acks(api, settings, runner):
    ids = [api.post("/v1/tasks", json={"model": "synthetic", "inputs": [f"x{i}", "y"]},
                    headers={"x-api-key": api.key_a}).json()["task_id"] for i in range(5)]
    run_once(runner, receive_all(settings, 5))
    for task_id in ids:
        view = api.get(f"/v1/tasks/{task_id}", headers={"x-api-key": api.key_a}).json()
        assert view["status"] == "succeeded"
        assert len(view["result"]["outputs"]) == 2
        assert view["batch_size"] == 10 and view["attempts"] == 1
        assert view["timings"]["started_at"] >= view["timings"]["created_at"]
    assert messages_left(settings) == 0  # every message deleted


def submit(api, text):
    return api.post("/v1/tasks", json={"model": "synthetic", "inputs": [text]},
                    headers={"x-api-key": api.key_a}).json()["task_id"]


def test_a_crashing_input_fails_alone_and_is_retried(api, settings, runner):
    good = [submit(api, f"ok{i}") for i in range(6)]
    bad = submit(api, "x !crash")
    run_once(runner, receive_all(settings, 7))
    store = TaskStore(settings)
    assert all(store.get(t).status.value == "succeeded" for t in good)
    crashed = store.get(bad)
    assert crashed.status.value == "queued" and "!crash" in crashed.error_message and crashed.attempts == 1
    assert crashed.error_code == "model_error"


def test_an_input_the_model_refuses_fails_at_once(api, settings, runner):
    # The model's own verdict on an input (ModelInputError) would be the same on
    # every attempt: failed now, its message deleted rather than retried to the DLQ.
    good = [submit(api, f"ok{i}") for i in range(6)]
    bad = submit(api, "x !fail")
    run_once(runner, receive_all(settings, 7))
    store = TaskStore(settings)
    assert all(store.get(t).status.value == "succeeded" for t in good)
    refused = store.get(bad)
    assert refused.status.value == "failed" and refused.attempts == 1, refused
    assert refused.error_code == "invalid_input" and "!fail" in refused.error_message
    assert messages_left(settings) == 0  # every message deleted, the refused one too


def test_cancelled_and_expired_tasks_never_run(api, settings, runner):
    cancelled = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["c"]},
                         headers={"x-api-key": api.key_a}).json()["task_id"]
    api.delete(f"/v1/tasks/{cancelled}", headers={"x-api-key": api.key_a})
    expired = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["e"], "deadline_s": 1},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    batch = receive_all(settings, 2)
    for m in batch:  # make the deadline pass without waiting for it
        body = json.loads(m.body)
        if body["task_id"] == expired:
            body["deadline_at"] = 1
            m.body = json.dumps(body)
    prepared = run_once(runner, batch)
    assert prepared.jobs == []
    store = TaskStore(settings)
    assert store.get(cancelled).status.value == "cancelled" and store.get(cancelled).attempts == 0
    assert store.get(expired).status.value == "expired"
    assert store.get(expired).to_view().error.code == "deadline_exceeded"  # says why it has no result
    assert store.get(cancelled).to_view().error is None  # the client's own doing
    assert messages_left(settings) == 0


def test_duplicate_delivery_cannot_overwrite_a_result(api, settings, runner):
    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["once"]},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    [first] = receive_all(settings, 1)
    run_once(runner, [first])
    before = TaskStore(settings).get(task_id)
    run_once(runner, [first])  # the same message delivered again after it finished
    after = TaskStore(settings).get(task_id)
    assert before.result_json == after.result_json and after.attempts == 1 and after.finished_at == before.finished_at


def test_a_cancel_during_inference_wins_and_the_result_is_dropped(api, settings, runner):
    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["too late"]},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    prepared = runner.prepare(receive_all(settings, 1))
    assert [j.message.task_id for j in prepared.jobs] == [task_id]
    outcomes = runner.infer(prepared.jobs)
    cancel = api.delete(f"/v1/tasks/{task_id}", headers={"x-api-key": api.key_a})
    assert cancel.status_code == 200 and cancel.json()["status"] == "cancelled"
    runner.finish(prepared, outcomes)
    record = TaskStore(settings).get(task_id)
    assert record.status.value == "cancelled" and record.result_json is None
    assert messages_left(settings) == 0  # acknowledged, not retried


def test_a_task_cancelled_while_the_model_refuses_its_input_is_acknowledged(api, settings, runner):
    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["x !fail"]},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    [message] = receive_all(settings, 1)
    message.receive_count = settings.max_attempts
    prepared = runner.prepare([message])
    outcomes = runner.infer(prepared.jobs)
    assert outcomes[0].error
    assert api.delete(f"/v1/tasks/{task_id}", headers={"x-api-key": api.key_a}).status_code == 200
    runner.finish(prepared, outcomes)
    assert TaskStore(settings).get(task_id).status.value == "cancelled"
    # Deleted, not made visible for the dead-letter queue: the task is final.
    assert messages_left(settings) == 0


def test_a_redelivery_records_its_start_before_running(api, settings, runner):
    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["again"]},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    [message] = receive_all(settings, 1)
    message.receive_count = 2  # an earlier delivery ended without an outcome
    prepared = runner.prepare([message])
    started = TaskStore(settings).get(task_id)
    assert (started.status.value, started.attempts) == ("queued", 1) and started.started_at
    runner.finish(prepared, runner.infer(prepared.jobs))
    final = TaskStore(settings).get(task_id)
    assert (final.status.value, final.attempts) == ("succeeded", 2)


def test_large_inputs_and_results_travel_through_s3(api, settings, runner):
    # The API and the runner share this settings object.
    settings.inline_payload_max_bytes = 1024
    settings.inline_result_max_bytes = 256
    texts = [f"sentence {i} " * 20 for i in range(10)]
    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": texts},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    [message] = receive_all(settings, 1)
    body = json.loads(message.body)
    assert body.get("inputs") is None and body["inputs_key"].startswith("inputs/") and task_id in body["inputs_key"]
    run_once(runner, [message])
    view = api.get(f"/v1/tasks/{task_id}", headers={"x-api-key": api.key_a}).json()
    assert view["status"] == "succeeded" and view["result"] is None
    with urllib.request.urlopen(view["result_url"], timeout=5) as response:
        result = json.loads(response.read())
    assert [o["length"] for o in result["outputs"]] == [len(t) for t in texts]


def submit_through_s3(api, settings, texts):
    """Tasks whose inputs are over the inline limit: their messages name an S3 object."""
    settings.inline_payload_max_bytes = 16  # the API and the runner share this settings object
    return [api.post("/v1/tasks", json={"model": "synthetic", "inputs": [text * 8]},
                     headers={"x-api-key": api.key_a}).json()["task_id"] for text in texts]


def inputs_keys(batch):
    return {json.loads(m.body)["task_id"]: json.loads(m.body)["inputs_key"] for m in batch}


def test_a_missing_inputs_object_fails_only_its_own_task(api, settings, runner):
    good = submit_through_s3(api, settings, [f"healthy {i} " for i in range(4)])
    [bad] = submit_through_s3(api, settings, ["gone "])
    batch = receive_all(settings, 5)
    keys = inputs_keys(batch)
    assert set(keys) == {*good, bad} and all(keys.values())
    PayloadStore(settings).delete(keys[bad])  # expired by the bucket's lifecycle rule, say
    prepared = run_once(runner, batch)
    assert {j.message.task_id for j in prepared.jobs} == set(good)
    store = TaskStore(settings)
    for task_id in good:  # ran in this very pass, not after the bad one's retries
        record = store.get(task_id)
        assert (record.status.value, record.attempts) == ("succeeded", 1)
    failed = store.get(bad)
    assert failed.status.value == "failed" and failed.error_code == "input_unavailable"
    assert keys[bad] in failed.error_message and "NoSuchKey" in failed.error_message
    view = api.get(f"/v1/tasks/{bad}", headers={"x-api-key": api.key_a}).json()
    assert view["status"] == "failed" and view["error"]["code"] == "input_unavailable"
    assert messages_left(settings) == 0  # final: every message deleted, none left to redeliver


def test_an_inputs_object_that_cannot_be_read_now_is_retried_alone(api, settings, runner):
    import boto3
    from botocore.awsrequest import AWSResponse
    from botocore.config import Config

    from sluice.aws import client_config

    good = submit_through_s3(api, settings, [f"healthy {i} " for i in range(3)])
    [flaky] = submit_through_s3(api, settings, ["flaky "])
    batch = receive_all(settings, 4)
    key = inputs_keys(batch)[flaky]
    # S3 throttles this one object: every read of it is answered 503 SlowDown.
    # This runner's own client, so no other test sees the hook; no SDK retries, so no SDK backoff either.
    once = client_config(settings).merge(Config(retries={"mode": "standard", "max_attempts": 1}))
    runner.payloads.s3 = boto3.session.Session().client("s3", config=once)
    throttled = []

    def slow_down(request, **_):
        if request.url.split("?")[0].endswith(f"/{key}"):
            throttled.append(request.url)
            body = (b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate for "
                    b"arn:aws:s3:::operator-bucket.</Message></Error>")
            return AWSResponse(request.url, 503, {}, _Raw(body))
        return None

    runner.payloads.s3.meta.events.register_first("before-send.s3.GetObject", slow_down)
    # When the runner hides a message for its backoff: until then it cannot be received.
    hidden = []
    change_visibility = runner.queues.change_visibility_many

    def timed_change(messages, timeout_s):
        hidden.append(([json.loads(m.body)["task_id"] for m in messages], timeout_s, time.monotonic()))
        change_visibility(messages, timeout_s)

    runner.queues.change_visibility_many = timed_change
    run_once(runner, batch)
    assert [(ids, timeout_s) for ids, timeout_s, _ in hidden] == [([flaky], 2)]  # the first retry's backoff
    queues = PriorityQueues(settings)
    # Neither deleted nor visible at once: it is held for its retry backoff, then comes back.
    early = queues.receive(Priority.normal, 10, 0, 30)
    # Only a receive answered within the backoff must find nothing; on a machine
    # stalled for 2 s the message may rightly be back already, and is the retry below.
    if time.monotonic() - hidden[0][2] < 2:
        assert early == [], "the retried message was visible before its backoff ended"
    assert throttled, "the throttled object was never read"
    store = TaskStore(settings)
    assert all(store.get(t).status.value == "succeeded" for t in good)
    record = store.get(flaky)
    assert record.status.value == "queued" and record.error_code == "input_unavailable"
    assert key in record.error_message and "SlowDown" in record.error_message
    # AWS's text is the operator's (it can name accounts, roles and keys), not the tenant's.
    assert "arn:" not in record.error_message and "request rate" not in record.error_message
    [again] = early or queues.receive(Priority.normal, 10, 10, 30)
    assert json.loads(again.body)["task_id"] == flaky and again.receive_count == 2


class _Raw:
    """The raw body of a canned HTTP answer, as botocore reads it."""

    def __init__(self, body: bytes):
        self.body = body

    def stream(self, **_):
        yield self.body


def test_long_poll_returns_as_soon_as_the_task_is_final(api, settings, runner, entered_waiters):
    import threading

    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["wait for me"]},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    queued = api.get(f"/v1/tasks/{task_id}?wait_s=0.3", headers={"x-api-key": api.key_a})
    assert queued.status_code == 200 and queued.json()["status"] == "queued"  # timed out, still queued
    batch = receive_all(settings, 1)

    # The app's waiter, as its next wait() shows it: the GET must be parked
    # there, waiting for an outcome, before the worker writes one. (A GET whose
    # first look came after the outcome would pass with the long poll broken.)
    waiters = entered_waiters

    def parked() -> bool:
        return bool(waiters) and any(not w.any_state for w in list(waiters[-1]._waiting.get(task_id, [])))

    wait_s = 20  # the most a client may ask for
    answered = []
    waiting = threading.Thread(target=lambda: answered.append(api.get(
        f"/v1/tasks/{task_id}?wait_s={wait_s}", headers={"x-api-key": api.key_a})), daemon=True)
    waiting.start()
    wait_until(parked, 10, "the long poll to park in the API's CompletionWaiter")
    assert waiting.is_alive(), answered and answered[0].json()  # parked, not answered yet

    run_once(runner, batch)
    # The waiter reads every 50 ms; 5 s is ample on a loaded machine and a
    # quarter of wait_s, which a waiter that never woke early would take.
    waiting.join(5)
    assert not waiting.is_alive(), f"the long poll did not answer within 5 s of the outcome (wait_s={wait_s})"
    [response] = answered
    assert response.status_code == 200, response.text
    view = response.json()
    assert view["status"] == "succeeded" and view["result"]["outputs"][0]["length"] == 11
    other = api.get(f"/v1/tasks/{task_id}?wait_s=1", headers={"x-api-key": api.key_b})
    assert other.status_code == 404
    assert api.get(f"/v1/tasks/{task_id}?wait_s=21", headers={"x-api-key": api.key_a}).status_code == 422


def test_long_poll_on_a_task_past_its_deadline_answers_expired_at_once(api, settings):
    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["late"], "deadline_s": 1},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    deadline_at = TaskStore(settings).get(task_id).deadline_at
    view = api.get(f"/v1/tasks/{task_id}?wait_s=15", headers={"x-api-key": api.key_a}).json()
    late_s = time.time() - deadline_at / 1000
    assert view["status"] == "expired"
    assert view["error"]["code"] == "deadline_exceeded", view
    # "At once": the waiter reads every 50 ms, then the route marks the task
    # expired, two or three emulator calls of ~10 ms (a few hundred on a loaded
    # 2-core machine). 3 s after the deadline is ten times that, and still far
    # from the 14 s a GET that only noticed the deadline when wait_s ran out would take.
    assert late_s < 3, f"the long poll answered {late_s:.1f}s after the deadline"


def test_a_long_poll_on_a_table_that_does_not_answer_is_503_within_its_wait(api, settings, monkeypatch):
    # Not after the SDK's retries (~12 s), whatever wait_s the client asked for.
    task_id = submit(api, "stalled")
    from sluice.adapters.task_store import TaskStore as Store

    released = threading.Event()
    real_get_many = Store.get_many

    def stalled(self, task_ids, *args):
        released.wait(20)
        return real_get_many(self, task_ids, *args)

    monkeypatch.setattr(Store, "get_many", stalled)
    try:
        with api:  # one event loop for the app's lifetime, as a server has: a request does not wait out its tasks
            started = time.monotonic()
            response = api.get(f"/v1/tasks/{task_id}?wait_s=1", headers={"x-api-key": api.key_a})
            took = time.monotonic() - started
            released.set()
    finally:
        released.set()
    assert response.status_code == 503 and response.json()["error"]["code"] == "dependency_unavailable", response.text
    assert took < 10, f"answered after {took:.1f} s"


def test_a_long_poll_whose_first_read_is_slow_answers_within_its_wait(api, settings, monkeypatch):
    # The wait counts from the request, first read included: a slow first read
    # (the SDK retrying a throttle) followed by a full wait_s would run past it,
    # and on AWS past API Gateway's 29 s, a 504 instead of the task's state.
    task_id = submit(api, "slow first read")
    from sluice.adapters.task_store import TaskStore as Store

    real_get_many = Store.get_many
    first = threading.Event()

    def slow_first(self, task_ids, *args):
        if not first.is_set():
            first.set()
            time.sleep(3)  # stands in for the SDK's retries, not for an event
        return real_get_many(self, task_ids, *args)

    monkeypatch.setattr(Store, "get_many", slow_first)
    with api:
        started = time.monotonic()
        response = api.get(f"/v1/tasks/{task_id}?wait_s=5", headers={"x-api-key": api.key_a})
        took = time.monotonic() - started
    assert response.status_code == 200 and response.json()["status"] == "queued", response.text
    # 5 s and the route's own calls; the old code took 3 + 5 s.
    assert took < 7, f"answered after {took:.1f} s of a 5 s wait"


def test_a_long_poll_reads_as_much_for_another_tenants_task_as_for_none(api, settings, monkeypatch):
    # Both answer 404; were a missing task read once more, the time the second
    # read takes would tell a tenant that a task id it guessed (an Idempotency-Key
    # task id is derived from the tenant and the key) exists for someone else.
    foreign = submit(api, "someone else's")  # key_a's task
    from sluice.adapters.task_store import TaskStore as Store

    reads: list[str] = []
    real_get, real_get_many = Store.get, Store.get_many
    monkeypatch.setattr(Store, "get", lambda self, task_id, *a, **k: reads.append("get") or real_get(
        self, task_id, *a, **k))
    monkeypatch.setattr(Store, "get_many", lambda self, ids, *a, **k: reads.append("get_many") or real_get_many(
        self, ids, *a, **k))
    seen = {}
    with api:
        for name, task_id in (("foreign", foreign), ("missing", "0" * 32)):
            reads.clear()
            response = api.get(f"/v1/tasks/{task_id}?wait_s=1", headers={"x-api-key": api.key_b})
            assert response.status_code == 404, response.text
            seen[name] = list(reads)
    assert seen["foreign"] == seen["missing"] == ["get_many"], seen


def test_a_bisected_batch_is_counted_once_with_the_time_of_its_failed_runs(settings):
    # Only the runs that succeeded were recorded: a batch split around a
    # poison input showed Throughput about 3 x the model's pace, and its halves as batches.
    from types import SimpleNamespace

    from models.synthetic import SyntheticModel
    from sluice.contract import TaskMessage
    from sluice.lifecycle import Job
    from sluice.worker.runner import BatchRunner

    recorded = []

    class Recorder:
        def record_batch(self, size, inference_ms, busy=True):
            recorded.append((size, inference_ms))

    runner = BatchRunner(settings, {"synthetic": SyntheticModel(base_ms=0, per_item_ms=20, faults=True)},
                         metrics=Recorder())
    texts = ["a", "b", "c", "x !crash", "d", "e", "f", "g"]
    jobs = [Job(TaskMessage(task_id=f"t{i}", tenant_id="t", model="synthetic", priority=Priority.normal,
                            input_count=1, inputs=[text], enqueued_at=0), [SimpleNamespace(receive_count=1)],
                inputs=[text]) for i, text in enumerate(texts)]
    started = time.perf_counter()
    outcomes = runner.infer(jobs)
    took_ms = (time.perf_counter() - started) * 1000
    assert sorted(o.job.message.task_id for o in outcomes if o.error) == ["t3"]
    assert [size for size, _ in recorded] == [8]
    assert recorded[0][1] >= 0.9 * took_ms, (recorded, took_ms)


@pytest.mark.parametrize("last", [False, True], ids=["retried", "last_attempt"])
def test_a_task_cancelled_during_a_crashing_attempt_is_acknowledged(api, settings, runner, last):
    # A model error (retried, or failing the task on its last attempt) whose
    # write the cancel beat: its message is deleted, not left to come back
    # after its visibility timeout and spend a receive (on the last, into the DLQ).
    task_id = api.post("/v1/tasks", json={"model": "synthetic", "inputs": ["x !crash"]},
                       headers={"x-api-key": api.key_a}).json()["task_id"]
    [message] = receive_all(settings, 1)
    if last:
        message.receive_count = settings.max_attempts
    prepared = runner.prepare([message])
    outcomes = runner.infer(prepared.jobs)
    assert outcomes[0].error and not outcomes[0].permanent
    assert api.delete(f"/v1/tasks/{task_id}", headers={"x-api-key": api.key_a}).status_code == 200
    runner.finish(prepared, outcomes)
    assert TaskStore(settings).get(task_id).status.value == "cancelled"
    assert messages_left(settings) == 0
