"""The SageMaker dispatcher Lambda, driven by real SQS event-source events.

Tasks are submitted through the real TaskService into a moto server
(tests/conftest.py), their messages received from moto's SQS and handed to the
handler exactly as Lambda's SQS event source shapes them. The endpoint is the
real containers/sagemaker/serve.py Endpoint (with the synthetic model) behind a
stand-in for the SageMaker runtime API, reached through boto3's
AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME.
"""

from __future__ import annotations

import importlib
import io
import json
import re
import threading
import time
import uuid
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler

import boto3
import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError, ConnectTimeoutError, EndpointConnectionError

from cdk import access
from containers.sagemaker import serve
from containers.sagemaker.serve import Endpoint, RequestError
from models.synthetic import SyntheticModel
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.api.service import TaskService
from sluice.aws import new_client
from sluice.contract import Priority, SubmitRequest, TaskStatus
from sluice.dlq import list_dead, settle_dead
from sluice.settings import Settings
from tests.http_stub import serving

ENDPOINT = "sluice-endpoint"


@dataclass
class LambdaContext:
    function_name: str = "sluice-dispatcher"
    memory_limit_in_mb: int = 512
    invoked_function_arn: str = "arn:aws:lambda:us-east-1:123456789012:function:sluice-dispatcher"
    aws_request_id: str = "req"

    def get_remaining_time_in_millis(self) -> int:
        return 90_000


class SageMakerRuntime(BaseHTTPRequestHandler):
    """POST /endpoints/{name}/invocations, answered by serve.py's Endpoint.

    Container errors come back the way the runtime reports them: HTTP 424,
    error type ModelError, the container's status and body in the message and
    as OriginalStatusCode and OriginalMessage.
    An unknown endpoint name answers 503, as an endpoint that is not in service.
    """

    endpoint = Endpoint({"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)}, default_model="synthetic")
    calls: list[dict] = []
    posts: list[str] = []  # every request's path, answered or not
    custom_attributes: list[str | None] = []  # as SageMaker hands them to the container
    sends_original_message = True

    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        SageMakerRuntime.posts.append(self.path)
        match = re.fullmatch(r"/endpoints/([^/]+)/invocations", self.path)
        if not match or match.group(1) != ENDPOINT:
            return self._send(503, {"message": "endpoint not in service"}, "ServiceUnavailable")
        self.calls.append(json.loads(body))
        SageMakerRuntime.custom_attributes.append(self.headers.get(serve.CUSTOM_ATTRIBUTES))
        try:
            give_up_at = serve.give_up_at(time.monotonic(), self.headers.get(serve.CUSTOM_ATTRIBUTES))
            return self._send(200, serve.body_of(self.endpoint.invoke(body, self.headers.get("Content-Type"),
                                                                      give_up_at)))
        except RequestError as err:
            original = serve.body_of(err.reply()).decode()
            kind = "server" if err.status.value >= 500 else "client"
            message = f"Received {kind} error ({err.status.value}) from primary with message \"{original}\"."
            error = {"message": message, "OriginalStatusCode": err.status.value}
            if self.sends_original_message:
                error["OriginalMessage"] = original
            return self._send(424, error, "ModelError")

    def _send(self, status: int, payload: dict | bytes, error_type: str | None = None):
        data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        if error_type:
            self.send_header("X-Amzn-ErrorType", error_type)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def runtime_url():
    with serving(SageMakerRuntime) as url:
        yield url


@pytest.fixture
def dispatch(settings, runtime_url, monkeypatch):
    """Returns run(event) -> response, with the handler configured as the stack configures it."""
    env = {
        "AWS_ENDPOINT_URL_SAGEMAKER_RUNTIME": runtime_url,
        "SLUICE_SAGEMAKER_ENDPOINT": ENDPOINT,
        "SLUICE_INVOKE_TIMEOUT_S": "10",
        "SLUICE_TASKS_TABLE": settings.tasks_table,
        "SLUICE_BUCKET": settings.bucket,
        "SLUICE_MAX_ATTEMPTS": "3",
        # As the stack sets them: the queues by URL, whose redrive policies name the DLQs.
        "SLUICE_QUEUE_PREFIX": settings.queue_prefix,
        **{f"SLUICE_QUEUE_URL_{p.value.upper()}": PriorityQueues(settings).url(p) for p in Priority},
        "SLUICE_MODELS": "synthetic",
        "POWERTOOLS_METRICS_NAMESPACE": "Sluice",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    import lambdas.dispatcher.handler as module

    module = importlib.reload(module)  # a cold start: settings and clients from this environment

    def run(event):
        return module.handler(event, LambdaContext())

    run.module = module
    return run


def submit(settings, *requests: dict, service_settings: Settings | None = None) -> list[str]:
    service = TaskService(service_settings or settings)
    return [service.submit("tenant-a", SubmitRequest(**r), None).task_id for r in requests]


def sqs_event(settings, want: int, priority: Priority = Priority.normal, receive_count: int | None = None) -> dict:
    """Receive `want` messages from the queue and shape them as Lambda's SQS event source does."""
    sqs = boto3.client("sqs")
    url = sqs.get_queue_url(QueueName=settings.queue_name(priority))["QueueUrl"]
    arn = sqs.get_queue_attributes(QueueUrl=url, AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    messages: list[dict] = []
    deadline = time.monotonic() + 10
    while len(messages) < want and time.monotonic() < deadline:
        messages += sqs.receive_message(
            QueueUrl=url, MaxNumberOfMessages=10, WaitTimeSeconds=1, VisibilityTimeout=60,
            MessageSystemAttributeNames=["All"],
        ).get("Messages", [])
    assert len(messages) == want
    records = []
    for m in messages:
        attributes = dict(m["Attributes"])
        if receive_count is not None:
            attributes["ApproximateReceiveCount"] = str(receive_count)
        records.append({
            "messageId": m["MessageId"],
            "receiptHandle": m["ReceiptHandle"],
            "body": m["Body"],
            "attributes": attributes,
            "messageAttributes": {},
            "md5OfBody": m["MD5OfBody"],
            "eventSource": "aws:sqs",
            "eventSourceARN": arn,
            "awsRegion": "us-east-1",
        })
    return {"Records": records}


def failed_ids(response: dict) -> set[str]:
    return {f["itemIdentifier"] for f in response["batchItemFailures"]}


def rewrite_answers(d, monkeypatch, edit) -> None:
    """The endpoint's real answers, with `edit(body)` applied to each before the dispatcher reads it."""
    real = d.runtime.invoke_endpoint

    def rewritten(**kwargs):
        response = real(**kwargs)
        body = json.loads(response["Body"].read())
        edit(body)
        return {**response, "Body": io.BytesIO(json.dumps(body).encode())}

    monkeypatch.setattr(d.runtime, "invoke_endpoint", rewritten)


def counted(capsys, *names: str) -> dict[str, float]:
    """The sums of the named metrics in the EMF lines printed since the last read."""
    emitted = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"_aws"' in line]
    return {name: sum(doc[name] if isinstance(doc[name], (int, float)) else sum(doc[name])
                      for doc in emitted if name in doc) for name in names}


def assert_untouched(settings, ids: list[str]) -> None:
    """Each task is queued as before the call: no attempt, no error (the call ran nothing)."""
    store = TaskStore(settings)
    for task_id in ids:
        record = store.get(task_id)
        assert record.status == TaskStatus.queued and record.attempts == 0 and record.error_code is None


def assert_one_failed_attempt(settings, ids: list[str], says: str) -> None:
    """Each task is back in its queue with one attempt recorded: a model error whose message says `says`."""
    store = TaskStore(settings)
    for task_id in ids:
        record = store.get(task_id)
        assert record.status == TaskStatus.queued and record.attempts == 1
        assert record.error_code == "model_error" and says in record.error_message


def message_ids(event: dict, task_ids: list[str]) -> set[str]:
    return {r["messageId"] for r in event["Records"] if json.loads(r["body"])["task_id"] in task_ids}


def test_a_batch_is_one_invocation_and_every_message_is_released(dispatch, settings):
    ids = submit(settings, *({"model": "synthetic", "inputs": [f"text {i}", "more"]} for i in range(4)))
    SageMakerRuntime.calls.clear()
    response = dispatch(sqs_event(settings, 4))
    assert response == {"batchItemFailures": []}
    # One invocation carries the whole batch, so its 8 inputs share a model batch.
    assert len(SageMakerRuntime.calls) == 1
    (call,) = SageMakerRuntime.calls
    assert call["model"] == "synthetic" and sorted(t["task_id"] for t in call["tasks"]) == sorted(ids)
    store = TaskStore(settings)
    for task_id in ids:
        record = store.get(task_id)
        assert record.status == TaskStatus.succeeded
        outputs = json.loads(record.result_json)["outputs"]
        assert [o["length"] for o in outputs] == [len(record_input) for record_input in
                                                  next(t["inputs"] for t in call["tasks"] if t["task_id"] == task_id)]
        assert record.attempts == 1 and record.batch_size == 8 and record.model_version == "1"
        assert record.started_at >= record.created_at and record.finished_at >= record.started_at


def test_a_poison_input_fails_alone_and_reaches_failed_on_the_last_attempt(dispatch, settings):
    good = submit(settings, *({"model": "synthetic", "inputs": [f"ok {i}"]} for i in range(3)))
    bad = submit(settings, {"model": "synthetic", "inputs": ["boom !crash"]})
    event = sqs_event(settings, 4)
    SageMakerRuntime.calls.clear()
    response = dispatch(event)
    assert len(SageMakerRuntime.calls) == 1  # the endpoint isolates the poison task, not the dispatcher
    assert failed_ids(response) == message_ids(event, bad)
    store = TaskStore(settings)
    assert all(store.get(t).status == TaskStatus.succeeded for t in good)
    poisoned = store.get(bad[0])
    assert poisoned.status == TaskStatus.queued and poisoned.error_code == "model_error"
    assert "RuntimeError" in poisoned.error_message  # the endpoint logs the details, not the caller

    # Its third delivery: the record becomes failed, and the message is still
    # reported so that SQS moves it to the dead-letter queue.
    boto3.client("sqs").change_message_visibility(
        QueueUrl=boto3.client("sqs").get_queue_url(QueueName=settings.queue_name(Priority.normal))["QueueUrl"],
        ReceiptHandle=event["Records"][[json.loads(r["body"])["task_id"] for r in event["Records"]].index(bad[0])]["receiptHandle"],
        VisibilityTimeout=0,
    )
    last = sqs_event(settings, 1, receive_count=3)
    assert failed_ids(dispatch(last)) == message_ids(last, bad)
    final = store.get(bad[0])
    assert final.status == TaskStatus.failed and final.attempts == 3 and final.finished_at


def test_a_requeued_task_failing_below_max_receive_count_is_dead_lettered_at_once(dispatch, settings, aws_calls):
    # Settling requeued it after two runs without an outcome: its new message
    # is on its first receive, which SQS's maxReceiveCount would not dead-letter.
    (task_id,) = submit(settings, {"model": "synthetic", "inputs": ["boom !crash"]})
    event = sqs_event(settings, 1)
    event["Records"][0]["body"] = json.dumps({**json.loads(event["Records"][0]["body"]), "runs_before": 2})
    aws_calls.clear()
    assert dispatch(event) == {"batchItemFailures": []}  # Lambda deletes it from its queue
    used = {access.iam_action(service, op) for service, op in aws_calls}
    final = TaskStore(settings).get(task_id)
    assert (final.status, final.attempts, final.error_code) == (TaskStatus.failed, 3, "model_error")
    [dead] = list_dead(PriorityQueues(settings), [Priority.normal])
    assert dead["task_id"] == task_id
    # The event source grants GetQueueAttributes on the queue; the DLQs get exactly DEAD_LETTER_DLQS.
    granted = set(access.WORKER_TASKS + access.WORKER_OBJECTS + access.WORKER_RESULTS + access.DEAD_LETTER_DLQS
                  + ["sqs:GetQueueAttributes", "sagemaker:InvokeEndpoint"])
    assert "sqs:SendMessage" in used and used <= granted, used - granted


@dataclass
class EndingContext(LambdaContext):
    """An invocation with only this much left."""
    left_ms: int = 10_000

    def get_remaining_time_in_millis(self) -> int:
        return self.left_ms


@pytest.mark.parametrize("left_ms, dead_lettered", [(90_000, True), (10_000, False)])
def test_a_requeued_task_past_max_attempts_goes_to_the_dead_letter_queue_unrun(dispatch, settings, left_ms,
                                                                              dead_lettered):
    # Its runs so far each ended without an outcome (they took the container
    # down): SQS's count of its new message would let it run three more times.
    # With too little of the invocation left to send it, it is redelivered, and spent again.
    (task_id,) = submit(settings, {"model": "synthetic", "inputs": ["x"]})
    event = sqs_event(settings, 1)
    event["Records"][0]["body"] = json.dumps({**json.loads(event["Records"][0]["body"]), "runs_before": 3})
    SageMakerRuntime.calls.clear()
    response = dispatch.module.handler(event, EndingContext(left_ms=left_ms))
    assert SageMakerRuntime.calls == []
    assert failed_ids(response) == (set() if dead_lettered else message_ids(event, [task_id]))
    record = TaskStore(settings).get(task_id)
    assert (record.status, record.attempts, record.started_at) == (TaskStatus.queued, 0, None)
    assert [d["task_id"] for d in list_dead(PriorityQueues(settings), [Priority.normal])] == (
        [task_id] if dead_lettered else [])


def test_an_input_the_model_refuses_fails_at_once_and_is_acknowledged(dispatch, settings):
    good = submit(settings, {"model": "synthetic", "inputs": ["ok"]})
    bad = submit(settings, {"model": "synthetic", "inputs": ["boom !fail"]})
    response = dispatch(sqs_event(settings, 2))
    # Every attempt would get the same refusal: no retry, no dead letter.
    assert response == {"batchItemFailures": []}
    store = TaskStore(settings)
    assert store.get(good[0]).status == TaskStatus.succeeded
    refused = store.get(bad[0])
    assert refused.status == TaskStatus.failed and refused.attempts == 1
    assert refused.error_code == "invalid_input" and "!fail" in refused.error_message


def test_a_task_the_endpoint_finds_invalid_fails_at_once(dispatch, settings, monkeypatch):
    # The endpoint's limits are the API's, so this only happens when the two
    # drift apart (a rolling deploy); its verdict would be the same on every attempt.
    from pydantic import Field

    from sluice.contract import EndpointTask, EndpointTasksRequest, InputText

    class OneInput(EndpointTask):
        inputs: list[InputText] = Field(min_length=1, max_length=1)

    class Stricter(EndpointTasksRequest):
        tasks: list[OneInput] = Field(min_length=1)

    monkeypatch.setattr(serve, "EndpointTasksRequest", Stricter)
    good = submit(settings, {"model": "synthetic", "inputs": ["ok"]})
    bad = submit(settings, {"model": "synthetic", "inputs": ["a", "b"]})
    assert dispatch(sqs_event(settings, 2)) == {"batchItemFailures": []}
    store = TaskStore(settings)
    assert store.get(good[0]).status == TaskStatus.succeeded
    invalid = store.get(bad[0])
    assert invalid.status == TaskStatus.failed and invalid.error_code == "validation_error"


def test_a_result_json_cannot_hold_fails_its_task_at_once(dispatch, settings, monkeypatch):
    # It was a model_error, retried max_attempts times for the same answer.
    real = SyntheticModel.result_for_task
    monkeypatch.setattr(SyntheticModel, "result_for_task", lambda self, outputs: (
        {"score": object()} if outputs[0]["length"] == len("not json") else real(self, outputs)))
    good, bad = submit(settings, {"model": "synthetic", "inputs": ["fine"]}, {"model": "synthetic", "inputs": ["not json"]})
    assert dispatch(sqs_event(settings, 2)) == {"batchItemFailures": []}
    store = TaskStore(settings)
    assert store.get(good).status == TaskStatus.succeeded
    failed = store.get(bad)
    assert (failed.status, failed.error_code, failed.attempts) == (TaskStatus.failed, "invalid_result", 1)


def test_calls_are_the_contract_s_endpoint_requests_within_its_call_limits(dispatch, settings):
    from sluice.contract import MAX_INPUTS_PER_CALL, MAX_TASKS_PER_CALL, EndpointTasksRequest

    d = dispatch.module.dispatcher()
    assert (d.max_tasks_per_call, d.max_inputs_per_call) == (MAX_TASKS_PER_CALL, MAX_INPUTS_PER_CALL)
    ids = submit(settings, {"model": "synthetic", "inputs": ["caf\u00e9", "\u6771\u4eac"]}, {"model": "synthetic", "inputs": ["b"]})
    SageMakerRuntime.calls.clear()
    assert dispatch(sqs_event(settings, 2)) == {"batchItemFailures": []}
    (call,) = SageMakerRuntime.calls
    request = EndpointTasksRequest.model_validate(call)
    assert request.model == "synthetic" and sorted(t.task_id for t in request.tasks) == sorted(ids)
    assert ["caf\u00e9", "\u6771\u4eac"] in [t.inputs for t in request.tasks]


def test_a_record_in_a_status_this_release_does_not_know_is_retried_alone(dispatch, settings):
    # A newer release wrote it (during a deploy): its status failed the claim's
    # read for the whole SQS batch, every task in it retried.
    newer, plain = submit(settings, {"model": "synthetic", "inputs": ["a"]}, {"model": "synthetic", "inputs": ["b"]})
    store = TaskStore(settings)
    store.ddb.update_item(TableName=store.table, Key={"task_id": {"S": newer}}, UpdateExpression="SET #s = :r",
                          ExpressionAttributeNames={"#s": "status"}, ExpressionAttributeValues={":r": {"S": "running"}})
    event = sqs_event(settings, 2)
    message_of = {json.loads(r["body"])["task_id"]: r["messageId"] for r in event["Records"]}
    assert dispatch(event) == {"batchItemFailures": [{"itemIdentifier": message_of[newer]}]}
    assert store.get(plain).status == TaskStatus.succeeded


@pytest.mark.parametrize("change", [
    {"inputs": None, "input_count": 5},  # neither inline inputs nor an inputs_key
    {"priority": "urgent"},  # a value of a newer release, met on a shared queue or a redrive
    {"inputs": None, "inputs_url": "https://example.com/x", "v": 2},  # a newer way to carry inputs
])
def test_a_message_this_release_cannot_read_is_handed_back_not_deleted(dispatch, settings, change):
    # Deleted (as it used to be), its task would stay queued with no message
    # anywhere. Handed back, it reaches the DLQ after max_attempts receives,
    # where settling leaves it for a release that can read it.
    (task_id,) = submit(settings, {"model": "synthetic", "inputs": ["x"]})
    event = sqs_event(settings, 1)
    body = {k: v for k, v in {**json.loads(event["Records"][0]["body"]), **change}.items() if v is not None}
    event["Records"][0]["body"] = json.dumps(body)
    SageMakerRuntime.calls.clear()
    assert dispatch(event) == {"batchItemFailures": [{"itemIdentifier": event["Records"][0]["messageId"]}]}
    assert SageMakerRuntime.calls == []
    # Back after 2 s (2^receives), not at the end of its visibility timeout
    # (the trigger's 180 s; this test's receive set 60 s).
    assert sqs_event(settings, 1)["Records"][0]["messageId"] == event["Records"][0]["messageId"]
    assert_untouched(settings, [task_id])


def test_an_answer_off_the_contract_is_a_failed_attempt_of_the_whole_call(dispatch, settings, monkeypatch):
    ids = submit(settings, *({"model": "synthetic", "inputs": [f"w{i}"]} for i in range(2)))

    def garble(body):
        body["tasks"][0] = {"task_id": body["tasks"][0]["task_id"], "error": "a string, not {code, message}"}

    rewrite_answers(dispatch.module.dispatcher(), monkeypatch, garble)
    event = sqs_event(settings, 2)
    assert failed_ids(dispatch(event)) == {r["messageId"] for r in event["Records"]}
    assert_one_failed_attempt(settings, ids, "endpoint call failed")


def test_cancelled_expired_and_foreign_messages_are_acknowledged_without_a_call(dispatch, settings):
    cancelled, expired = submit(
        settings,
        {"model": "synthetic", "inputs": ["c"]},
        {"model": "synthetic", "inputs": ["e"], "deadline_s": 1},
    )
    TaskService(settings).cancel("tenant-a", cancelled)
    event = sqs_event(settings, 2)
    for record in event["Records"]:  # let the deadline pass without waiting for it
        body = json.loads(record["body"])
        if body["task_id"] == expired:
            body["deadline_at"] = body["enqueued_at"] - 1
            record["body"] = json.dumps(body)
    unreadable = str(uuid.uuid4())
    event["Records"].append({**event["Records"][0], "messageId": unreadable, "body": "not a task"})
    SageMakerRuntime.calls.clear()
    assert dispatch(event) == {"batchItemFailures": [{"itemIdentifier": unreadable}]}
    assert SageMakerRuntime.calls == []
    store = TaskStore(settings)
    assert store.get(cancelled).status == TaskStatus.cancelled
    assert store.get(expired).status == TaskStatus.expired


def test_large_inputs_and_results_go_through_the_bucket(dispatch, settings, monkeypatch):
    monkeypatch.setenv("SLUICE_INLINE_RESULT_MAX_BYTES", "64")
    dispatch.module._dispatcher = None  # a cold start with the smaller limit
    small_inline = settings.model_copy(update={"inline_payload_max_bytes": 16})
    (task_id,) = submit(settings, {"model": "synthetic", "inputs": ["a" * 100, "b" * 100]},
                        service_settings=small_inline)
    event = sqs_event(settings, 1)
    assert json.loads(event["Records"][0]["body"])["inputs_key"]  # a claim check, not inline inputs
    assert dispatch(event) == {"batchItemFailures": []}
    record = TaskStore(settings).get(task_id)
    assert record.status == TaskStatus.succeeded and record.result_json is None
    stored = json.loads(boto3.client("s3").get_object(Bucket=settings.bucket, Key=record.result_key)["Body"].read())
    assert [o["length"] for o in stored["outputs"]] == [100, 100]


def test_a_result_that_cannot_be_stored_is_counted_as_a_failed_attempt(dispatch, settings, monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_INLINE_RESULT_MAX_BYTES", "16")
    dispatch.module._dispatcher = None  # a cold start with the smaller limit: the result goes to the bucket
    d = dispatch.module.dispatcher()

    def bucket_down(*_, **__):
        raise EndpointConnectionError(endpoint_url="http://s3")

    monkeypatch.setattr(d.payloads, "put_json", bucket_down)
    (task_id,) = submit(settings, {"model": "synthetic", "inputs": ["a" * 100]})
    event = sqs_event(settings, 1)
    capsys.readouterr()
    assert failed_ids(dispatch(event)) == {event["Records"][0]["messageId"]}
    assert TaskStore(settings).get(task_id).error_code == "result_not_stored"
    assert counted(capsys, "TasksSucceeded", "TaskAttemptsFailed") == {"TasksSucceeded": 0, "TaskAttemptsFailed": 1}


def test_a_missing_inputs_object_fails_its_task_alone_and_is_acknowledged(dispatch, settings):
    small_inline = settings.model_copy(update={"inline_payload_max_bytes": 16})
    good, lost = submit(settings, {"model": "synthetic", "inputs": ["a" * 100]},
                        {"model": "synthetic", "inputs": ["b" * 100]}, service_settings=small_inline)
    event = sqs_event(settings, 2)
    key = next(json.loads(r["body"])["inputs_key"] for r in event["Records"] if lost in r["body"])
    boto3.client("s3").delete_object(Bucket=settings.bucket, Key=key)
    # No other delivery could read it: failed now, its message not handed back.
    assert dispatch(event) == {"batchItemFailures": []}
    store = TaskStore(settings)
    assert store.get(good).status == TaskStatus.succeeded
    record = store.get(lost)
    assert record.status == TaskStatus.failed and record.error_code == "input_unavailable"
    assert key in record.error_message and "NoSuchKey" in record.error_message


def test_an_endpoint_that_turns_calls_away_spends_no_attempt(dispatch, settings, monkeypatch, capsys):
    # SageMaker answering 503 (an endpoint not in service, scaling, throttled)
    # ran nothing. Even on a task's last delivery, the task stays queued with no
    # start recorded, and its message goes back to SQS; once dead-lettered,
    # settling hands it back instead of failing it.
    monkeypatch.setenv("SLUICE_SAGEMAKER_ENDPOINT", "an-endpoint-that-is-down")
    dispatch.module._dispatcher = None
    ids = submit(settings, {"model": "synthetic", "inputs": ["x"]}, {"model": "synthetic", "inputs": ["y"]})
    event = sqs_event(settings, 2, receive_count=3)
    capsys.readouterr()
    SageMakerRuntime.posts.clear()
    response = dispatch(event)
    assert failed_ids(response) == {r["messageId"] for r in event["Records"]}
    assert_untouched(settings, ids)
    # One call per task (redeliveries go alone), each asked once: SQS
    # redelivery is the retry, and a second try of a slow call would outlast
    # the function's timeout.
    assert SageMakerRuntime.posts == ["/endpoints/an-endpoint-that-is-down/invocations"] * 2
    # Seen on the dashboard as handed back, not as outcomes.
    assert counted(capsys, "TasksHandedBack", "TasksSucceeded", "TaskAttemptsFailed") == {
        "TasksHandedBack": 2, "TasksSucceeded": 0, "TaskAttemptsFailed": 0}

    queues, store = PriorityQueues(settings), TaskStore(settings)
    for r in event["Records"]:  # what SQS does with them after maxReceiveCount
        queues.sqs.send_message(QueueUrl=queues.dlq_url(Priority.normal), MessageBody=r["body"])
    counts = settle_dead(queues, store, [Priority.normal], max_attempts=3)
    assert counts == {"failed": 0, "requeued": 2}
    assert all(store.get(t).status == TaskStatus.queued for t in ids)


@pytest.mark.parametrize("unreachable", [EndpointConnectionError, ConnectTimeoutError])
def test_an_endpoint_that_cannot_be_reached_spends_no_attempt(dispatch, settings, unreachable):
    # No connection was made, refused or timed out: nothing ran, even on the last delivery.
    def no_connection(request, **kwargs):
        raise unreachable(endpoint_url=request.url)

    dispatch.module.dispatcher().runtime.meta.events.register(
        "before-send.sagemaker-runtime.InvokeEndpoint", no_connection)
    (task_id,) = submit(settings, {"model": "synthetic", "inputs": ["x"]})
    event = sqs_event(settings, 1, receive_count=3)
    assert failed_ids(dispatch(event)) == {event["Records"][0]["messageId"]}
    assert_untouched(settings, [task_id])


@pytest.mark.parametrize("sends_original_message", [True, False])
def test_a_model_the_endpoint_does_not_serve_yet_spends_no_attempt(dispatch, settings, monkeypatch,
                                                                   sends_original_message):
    # A deploy: the API takes a new model before the endpoint serves it, and
    # serve.py refuses the call (400 unknown_model) before any task runs. As an
    # EKS worker without the model does, the task is handed back untouched.
    monkeypatch.setattr(SageMakerRuntime, "sends_original_message", sends_original_message)
    api = settings.model_copy(update={"models": "synthetic,minilm-embed"})
    (task_id,) = submit(settings, {"model": "minilm-embed", "inputs": ["x"]}, service_settings=api)
    event = sqs_event(settings, 1, receive_count=3)
    SageMakerRuntime.calls.clear()
    assert failed_ids(dispatch(event)) == {event["Records"][0]["messageId"]}
    assert len(SageMakerRuntime.calls) == 1
    assert_untouched(settings, [task_id])


@pytest.mark.parametrize("sends_original_message", [True, False])
def test_an_endpoint_whose_model_is_broken_spends_no_attempt(dispatch, settings, monkeypatch,
                                                             sends_original_message):
    # The model failed every task of serve.BROKEN_AFTER calls in a row: serve.py
    # refuses every call (503 model_broken) before any task runs, while SageMaker
    # replaces the instance. Even on the last delivery, the tasks are handed back
    # untouched rather than failed by an instance that cannot run them.
    monkeypatch.setattr(SageMakerRuntime, "sends_original_message", sends_original_message)
    monkeypatch.setattr(SageMakerRuntime.endpoint, "broken", True)
    ids = submit(settings, {"model": "synthetic", "inputs": ["x"]}, {"model": "synthetic", "inputs": ["y"]})
    event = sqs_event(settings, 2, receive_count=3)
    SageMakerRuntime.calls.clear()
    assert failed_ids(dispatch(event)) == {r["messageId"] for r in event["Records"]}
    assert len(SageMakerRuntime.calls) == 2  # the container saw the calls (one per redelivery), and refused them
    assert_untouched(settings, ids)


def test_an_outcome_the_table_will_not_take_sends_back_its_own_task_alone(dispatch, settings):
    # One call turned away (a model the endpoint does not serve yet), another
    # answered for two tasks, and the table throttles one of their outcomes.
    # Only that task comes back, with the turned-away one: its sibling's
    # outcome stands and its message is finished, not run again. Neither
    # task that comes back ran for the record: a throttled write surely did
    # not land, so its claim's start is taken back, as the turned-away one's,
    # rather than left to count as a run in settling.
    api = settings.model_copy(update={"models": "synthetic,minilm-embed"})
    (unserved,) = submit(settings, {"model": "minilm-embed", "inputs": ["x"]}, service_settings=api)
    ran, unwritten = submit(settings, {"model": "synthetic", "inputs": ["y"]}, {"model": "synthetic", "inputs": ["z"]})
    d = dispatch.module.dispatcher()
    d.store = TaskStore(d.settings, ddb=new_client("dynamodb", d.settings))  # the hook sees this store's calls only

    def refuse_the_outcome(params, **_):
        body = params["body"].decode()
        if unwritten in body and '"succeeded"' in body:
            error = {"Code": "ProvisionedThroughputExceededException", "Message": "Rate of requests exceeds capacity"}
            return (AWSResponse(params["url"], 400, {}, None),
                    {"Error": error, "ResponseMetadata": {"HTTPStatusCode": 400}})
        return None

    d.store.ddb.meta.events.register("before-call.dynamodb.UpdateItem", refuse_the_outcome)
    event = sqs_event(settings, 3, receive_count=2)  # redeliveries: each claim records a start
    message_of = {json.loads(r["body"])["task_id"]: r["messageId"] for r in event["Records"]}
    SageMakerRuntime.calls.clear()
    assert failed_ids(dispatch(event)) == {message_of[unserved], message_of[unwritten]}
    assert sorted(call["model"] for call in SageMakerRuntime.calls) == ["minilm-embed", "synthetic", "synthetic"]
    records = TaskStore(settings).get_many([unserved, ran, unwritten])
    for task_id in (unserved, unwritten):
        record = records[task_id]
        assert (record.status, record.attempts, record.started_at, record.error_code) == (
            TaskStatus.queued, 0, None, None), task_id
    assert records[ran].status == TaskStatus.succeeded


@pytest.mark.parametrize(("status", "code"), [
    (HTTPStatus.SERVICE_UNAVAILABLE, "overloaded"),
    (HTTPStatus.SERVICE_UNAVAILABLE, "unknown_model"),
    (HTTPStatus.INTERNAL_SERVER_ERROR, "model_broken"),
    (HTTPStatus.BAD_REQUEST, "model_broken"),
])
def test_another_refusal_of_the_whole_call_from_the_container_is_a_failed_attempt(dispatch, settings, monkeypatch,
                                                                                 status, code):
    # Only the status and code serve.py refuses with before any task runs say
    # that nothing ran: any other 503 or 500 may come from a call that ran them.
    def refuse(body, content_type, give_up_at=None):
        raise RequestError(status, code, "refused")

    monkeypatch.setattr(SageMakerRuntime.endpoint, "invoke", refuse)
    ids = submit(settings, {"model": "synthetic", "inputs": ["x"]})
    event = sqs_event(settings, 1)
    assert failed_ids(dispatch(event)) == {event["Records"][0]["messageId"]}
    # The container's status and code, not SageMaker's text (on AWS it names the
    # account and the endpoint's log group).
    assert_one_failed_attempt(settings, ids, f"endpoint call failed: ModelError ({status.value} {code})")
    assert all("from primary" not in TaskStore(settings).get(task_id).error_message for task_id in ids)


def test_the_dispatcher_reads_the_endpoint_s_refusals_by_the_codes_serve_py_sends():
    from lambdas.dispatcher import dispatch as dispatch_module

    assert dispatch_module._MODEL_BROKEN == serve.MODEL_BROKEN
    assert dispatch_module._CALLER_GONE == serve.CALLER_GONE
    # 503 caller_gone: an instance of the release before, during a deploy.
    refused = {(503, serve.MODEL_BROKEN), (429, serve.CALLER_GONE), (503, serve.CALLER_GONE)}
    assert refused <= dispatch_module._REFUSED_UNRUN


def test_the_dispatcher_tells_the_container_when_it_gives_up_and_a_call_skipped_for_it_spends_no_attempt(
        dispatch, settings, monkeypatch):
    # The container skips a call still queued there past the caller's read
    # timeout (SLUICE_INVOKE_TIMEOUT_S + 5): nothing ran, so nothing is spent.
    ids = submit(settings, {"model": "synthetic", "inputs": ["x"]})
    SageMakerRuntime.custom_attributes.clear()
    event = sqs_event(settings, 1, receive_count=3)
    real_invoke = SageMakerRuntime.endpoint.invoke
    monkeypatch.setattr(SageMakerRuntime.endpoint, "invoke",
                        lambda body, content_type, give_up_at=None: real_invoke(body, content_type, 0.0))
    assert failed_ids(dispatch(event)) == {event["Records"][0]["messageId"]}
    assert SageMakerRuntime.custom_attributes == ["sluice-give-up-s=15"]
    assert_untouched(settings, ids)


def test_a_dispatch_left_too_little_time_to_wait_for_the_endpoint_hands_its_tasks_back_uncalled(
        dispatch, settings, monkeypatch):
    # A slow claim ate the invocation's time: a call now could be answered after
    # the function's timeout, its results lost and every task's attempt spent.
    ids = submit(settings, {"model": "synthetic", "inputs": ["x"]}, {"model": "synthetic", "inputs": ["y"]})
    event = sqs_event(settings, 2, receive_count=2)
    SageMakerRuntime.calls.clear()
    # The read timeout is 15 s here (SLUICE_INVOKE_TIMEOUT_S 10 + 5), the reserve to record 15 s.
    monkeypatch.setattr(LambdaContext, "get_remaining_time_in_millis", lambda self: 29_000)
    assert failed_ids(dispatch(event)) == {r["messageId"] for r in event["Records"]}
    assert SageMakerRuntime.calls == []
    assert_untouched(settings, ids)
    monkeypatch.setattr(LambdaContext, "get_remaining_time_in_millis", lambda self: 31_000)
    assert failed_ids(dispatch(event)) == set()


def test_another_400_from_the_container_is_a_failed_attempt(dispatch, settings, monkeypatch):
    # Only unknown_model says nothing ran: a call refused as invalid may have
    # been the endpoint's verdict on these very tasks.
    from pydantic import Field

    from sluice.contract import EndpointTasksRequest

    class ShortModelNamesOnly(EndpointTasksRequest):
        model: str = Field(max_length=3)

    monkeypatch.setattr(serve, "EndpointTasksRequest", ShortModelNamesOnly)
    ids = submit(settings, {"model": "synthetic", "inputs": ["x"]})
    event = sqs_event(settings, 1)
    assert failed_ids(dispatch(event)) == {event["Records"][0]["messageId"]}
    assert_one_failed_attempt(settings, ids, "validation_error")


def test_a_call_is_bounded_by_its_bytes_not_its_characters(dispatch, settings, monkeypatch):
    # \u6771 is 3 bytes in UTF-8, as the body is sent: by characters the two
    # tasks fit the dispatcher's cap together, by bytes they are over the
    # endpoint's; each alone fits both.
    d = dispatch.module.dispatcher()
    monkeypatch.setattr(d, "max_call_bytes", 4000)
    monkeypatch.setattr(SageMakerRuntime.endpoint, "max_payload_bytes", 4800)
    ids = submit(settings, *({"model": "synthetic", "inputs": ["\u6771" * 1000]} for _ in range(2)))
    SageMakerRuntime.calls.clear()
    assert dispatch(sqs_event(settings, 2)) == {"batchItemFailures": []}
    assert len(SageMakerRuntime.calls) == 2
    assert all(TaskStore(settings).get(t).status == TaskStatus.succeeded for t in ids)


def test_an_endpoint_error_for_the_whole_call_is_a_failed_attempt(dispatch, settings, monkeypatch):
    # The container answered (here: it refuses a call with a larger body than it
    # takes): the tasks may have run, so the attempt counts.
    monkeypatch.setattr(SageMakerRuntime.endpoint, "max_payload_bytes", 16)
    ids = submit(settings, {"model": "synthetic", "inputs": ["x"]}, {"model": "synthetic", "inputs": ["y"]})
    event = sqs_event(settings, 2)
    assert failed_ids(dispatch(event)) == {r["messageId"] for r in event["Records"]}
    assert_one_failed_attempt(settings, ids, "ModelError")


def test_a_batch_over_the_call_limits_is_split_and_answered_per_task(dispatch, settings, monkeypatch):
    ids = submit(settings, *({"model": "synthetic", "inputs": [f"t{i}", "u"]} for i in range(5)))
    bad = submit(settings, {"model": "synthetic", "inputs": ["x", "y !crash"]})
    d = dispatch.module.dispatcher()
    monkeypatch.setattr(d, "max_tasks_per_call", 4)
    monkeypatch.setattr(d, "max_inputs_per_call", 6)
    event = sqs_event(settings, 6)
    SageMakerRuntime.calls.clear()
    response = dispatch(event)
    calls = SageMakerRuntime.calls
    assert len(calls) == 2 and all(len(c["tasks"]) <= 4 for c in calls)
    assert all(sum(len(t["inputs"]) for t in c["tasks"]) <= 6 for c in calls)
    assert failed_ids(response) == message_ids(event, bad)
    store = TaskStore(settings)
    assert all(store.get(t).status == TaskStatus.succeeded for t in ids)
    assert store.get(bad[0]).status == TaskStatus.queued and "RuntimeError" in store.get(bad[0]).error_message


def test_per_task_answers_are_mapped_by_task_id_and_a_missing_one_is_a_failed_attempt(dispatch, settings, monkeypatch):
    ids = submit(settings, *({"model": "synthetic", "inputs": [f"v{i}"]} for i in range(3)))

    def reorder_and_drop(body):
        body["tasks"] = [a for a in reversed(body["tasks"]) if a["task_id"] != ids[1]]

    rewrite_answers(dispatch.module.dispatcher(), monkeypatch, reorder_and_drop)
    event = sqs_event(settings, 3)
    assert failed_ids(dispatch(event)) == message_ids(event, [ids[1]])
    store = TaskStore(settings)
    for i in (0, 2):
        assert json.loads(store.get(ids[i]).result_json)["outputs"][0]["length"] == len(f"v{i}")
    missing = store.get(ids[1])
    assert missing.status == TaskStatus.queued and "no answer for this task" in missing.error_message


def test_the_dispatcher_role_allows_every_call_it_makes(dispatch, settings, monkeypatch, aws_calls):
    monkeypatch.setenv("SLUICE_INLINE_RESULT_MAX_BYTES", "64")
    dispatch.module._dispatcher = None
    small_inline = settings.model_copy(update={"inline_payload_max_bytes": 16})
    ids = submit(settings, {"model": "synthetic", "inputs": ["a" * 50, "b" * 50]},
                 {"model": "synthetic", "inputs": ["bad !fail"]}, service_settings=small_inline)
    cancelled = submit(settings, {"model": "synthetic", "inputs": ["c"]})[0]
    TaskService(settings).cancel("tenant-a", cancelled)
    event = sqs_event(settings, 3)

    aws_calls.clear()  # from here on
    dispatch(event)
    # The event source mapping itself receives and deletes (its grant: WORKER_QUEUES).
    granted = set(access.WORKER_TASKS + access.WORKER_OBJECTS + access.WORKER_RESULTS + ["sagemaker:InvokeEndpoint"])
    used = {access.iam_action(service, op) for service, op in aws_calls}
    assert {"dynamodb:BatchGetItem", "dynamodb:UpdateItem", "s3:GetObject", "s3:PutObject",
            "sagemaker:InvokeEndpoint"} <= used
    assert used <= granted, used - granted
    assert TaskStore(settings).get(ids[0]).result_key


def test_an_earlier_task_s_message_under_the_same_id_is_dropped_alone(dispatch, settings):
    # An Idempotency-Key reused once its task outlived its TTL: the earlier
    # submit's message (redriven from a DLQ, say) and the current one in one batch.
    (task_id,) = submit(settings, {"model": "synthetic", "inputs": ["current"]})
    event = sqs_event(settings, 1)
    current = event["Records"][0]
    body = json.loads(current["body"])
    stale_body = {**body, "inputs": ["stale"], "enqueued_at": body["enqueued_at"] - 86_400_000}
    event["Records"].insert(0, {**current, "messageId": str(uuid.uuid4()), "body": json.dumps(stale_body)})
    SageMakerRuntime.calls.clear()
    assert dispatch(event) == {"batchItemFailures": []}
    (call,) = SageMakerRuntime.calls
    assert [(t["task_id"], t["inputs"]) for t in call["tasks"]] == [(task_id, ["current"])]
    assert TaskStore(settings).get(task_id).status == TaskStatus.succeeded


def test_the_dispatchers_throughput_counts_its_parallel_calls_span_not_their_sum(dispatch, settings, monkeypatch,
                                                                                capsys):
    # Four calls of one task each, run at once, each held 1 s: four inputs in
    # a little over 1 s of the dispatcher's time (up to 4/s), not in their 4 s summed (1/s).
    d = dispatch.module.dispatcher()
    monkeypatch.setattr(d, "max_tasks_per_call", 1)
    real = d.runtime.invoke_endpoint

    together = threading.Barrier(4, timeout=10)  # the four calls are in flight at once

    def slow(**kwargs):
        together.wait()
        time.sleep(1.0)  # stands in for the endpoint's inference, not for an event
        return real(**kwargs)

    monkeypatch.setattr(d.runtime, "invoke_endpoint", slow)
    submit(settings, *({"model": "synthetic", "inputs": [f"t{i}"]} for i in range(4)))
    event = sqs_event(settings, 4)
    capsys.readouterr()
    assert failed_ids(dispatch(event)) == set()
    emitted = [json.loads(line) for line in capsys.readouterr().out.splitlines() if '"_aws"' in line]
    [throughput] = [v for doc in emitted if "Throughput" in doc for v in
                    (doc["Throughput"] if isinstance(doc["Throughput"], list) else [doc["Throughput"]])]
    assert 1.5 < throughput <= 4.1, throughput  # the 4 s summed would be 1


def test_a_redelivered_task_goes_to_the_endpoint_in_a_call_of_its_own(dispatch, settings):
    # A call that killed or hung the container fails every task in it, and the
    # records come back together: sent together again, one input that takes
    # the container down would fail the tasks beside it until all were dead-lettered.
    submit(settings, *({"model": "synthetic", "inputs": [f"r{i}"]} for i in range(3)))
    event = sqs_event(settings, 3, receive_count=2)
    submit(settings, *({"model": "synthetic", "inputs": [f"f{i}"]} for i in range(2)))
    event["Records"] += sqs_event(settings, 2)["Records"]
    SageMakerRuntime.calls.clear()
    assert dispatch(event) == {"batchItemFailures": []}
    assert sorted(len(call["tasks"]) for call in SageMakerRuntime.calls) == [1, 1, 1, 2]


def test_a_requeued_task_failing_one_receive_short_of_max_receive_count_is_dead_lettered_at_once(
        dispatch, settings):
    # Requeued after one run without an outcome, it fails its last allowed run
    # on its new message's second receive. SQS moves a message only once its
    # receives pass maxReceiveCount (3): handed back for SQS to move, it would
    # be delivered a third time instead and, its task final, deleted, leaving
    # the failed task no dead letter.
    (task_id,) = submit(settings, {"model": "synthetic", "inputs": ["boom !crash"]})
    event = sqs_event(settings, 1, receive_count=settings.max_attempts - 1)
    event["Records"][0]["body"] = json.dumps({**json.loads(event["Records"][0]["body"]), "runs_before": 1})
    assert dispatch(event) == {"batchItemFailures": []}  # Lambda deletes it from its queue
    final = TaskStore(settings).get(task_id)
    assert (final.status, final.attempts, final.error_code) == (TaskStatus.failed, settings.max_attempts,
                                                                "model_error")
    assert [d["task_id"] for d in list_dead(PriorityQueues(settings), [Priority.normal])] == [task_id]
