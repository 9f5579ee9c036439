"""The API Lambda handler, driven by real API Gateway (REST, proxy) events.

API Gateway has already checked the key when the event arrives; the handler
must take the tenant from requestContext.identity.apiKeyId. Everything behind
the handler is real: the FastAPI app through Mangum, talking HTTP to a moto
server (tests/conftest.py) for DynamoDB, SQS and S3.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import logging
import time
import uuid
from dataclasses import dataclass

import boto3
import pytest

from cdk import access
from sluice.contract import Priority


@dataclass
class LambdaContext:
    function_name: str = "sluice-api"
    memory_limit_in_mb: int = 1024
    invoked_function_arn: str = "arn:aws:lambda:us-east-1:123456789012:function:sluice-api"
    aws_request_id: str = "req"

    def get_remaining_time_in_millis(self) -> int:
        return 29_000


def proxy_event(method: str, path: str, *, key_id: str | None, body=None, resource: str | None = None,
                headers: dict | None = None) -> dict:
    """An API Gateway REST API proxy-integration event, as the service sends it."""
    headers = {"Host": "abc123.execute-api.us-east-1.amazonaws.com", "User-Agent": "pytest",
               "X-Forwarded-Proto": "https", **(headers or {})}
    if body is not None:
        headers["Content-Type"] = "application/json"
    if key_id:
        headers["x-api-key"] = "the-secret-key-value"
    path_params = None
    if resource and "{task_id}" in resource:
        path_params = {"task_id": path.rsplit("/", 1)[1]}
    request_id = str(uuid.uuid4())
    return {
        "resource": resource or path,
        "path": path,
        "httpMethod": method,
        "headers": headers,
        "multiValueHeaders": {k: [v] for k, v in headers.items()},
        "queryStringParameters": None,
        "multiValueQueryStringParameters": None,
        "pathParameters": path_params,
        "stageVariables": None,
        "requestContext": {
            "resourceId": "abc1de",
            "resourcePath": resource or path,
            "httpMethod": method,
            "extendedRequestId": request_id,
            "requestTime": "22/Nov/2026:03:00:00 +0000",
            "path": f"/v1{path}",
            "accountId": "123456789012",
            "protocol": "HTTP/1.1",
            "stage": "v1",
            "domainPrefix": "abc123",
            "requestTimeEpoch": int(time.time() * 1000),
            "requestId": request_id,
            "identity": {
                "cognitoIdentityPoolId": None,
                "accountId": None,
                "cognitoIdentityId": None,
                "caller": None,
                "apiKey": "the-secret-key-value" if key_id else None,
                "apiKeyId": key_id,
                "sourceIp": "203.0.113.9",
                "principalOrgId": None,
                "accessKey": None,
                "cognitoAuthenticationType": None,
                "cognitoAuthenticationProvider": None,
                "userArn": None,
                "userAgent": "pytest",
                "user": None,
            },
            "domainName": "abc123.execute-api.us-east-1.amazonaws.com",
            "apiId": "abc123",
        },
        "body": json.dumps(body) if body is not None else None,
        "isBase64Encoded": False,
    }


@pytest.fixture
def handler(settings, monkeypatch):
    """lambdas.api.handler imported with the environment the CDK stack gives it."""
    sqs = boto3.client("sqs")
    env = {
        "SLUICE_AUTH_MODE": "apigateway",
        "SLUICE_TASKS_TABLE": settings.tasks_table,
        "SLUICE_KEYS_TABLE": settings.keys_table,
        "SLUICE_BUCKET": settings.bucket,
        "SLUICE_MODELS": "synthetic",
        "SLUICE_RATE_LIMIT_PER_S": "0",
        "POWERTOOLS_SERVICE_NAME": "api",
    }
    for p in Priority:
        env[f"SLUICE_QUEUE_URL_{p.value.upper()}"] = sqs.get_queue_url(QueueName=settings.queue_name(p))["QueueUrl"]
    # A wrong prefix proves the explicit URLs are what the app uses.
    env["SLUICE_QUEUE_PREFIX"] = "not-the-stacks-prefix"
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    import lambdas.api.handler as module

    module = importlib.reload(module)
    module.queue_urls = {p: env[f"SLUICE_QUEUE_URL_{p.value.upper()}"] for p in Priority}
    return module


def call(handler, event) -> tuple[int, dict]:
    response = handler.handler(event, LambdaContext())
    body = json.loads(response["body"]) if response.get("body") else None
    return response["statusCode"], body


def test_health_answers_without_a_key(handler):
    status, body = call(handler, proxy_event("GET", "/health", key_id=None))
    assert status == 200 and body == {"status": "ok"}


def test_the_api_key_id_becomes_the_tenant(handler, settings):
    status, accepted = call(
        handler,
        proxy_event("POST", "/v1/tasks", key_id="kid-alpha", body={"model": "synthetic", "inputs": ["hello"]},
                    resource="/v1/tasks"),
    )
    assert status == 202, accepted
    task_id = accepted["task_id"]

    item = boto3.client("dynamodb").get_item(TableName=settings.tasks_table, Key={"task_id": {"S": task_id}})["Item"]
    assert item["tenant_id"] == {"S": "kid-alpha"}

    messages = boto3.client("sqs").receive_message(
        QueueUrl=handler.queue_urls[Priority.normal], MaxNumberOfMessages=10, WaitTimeSeconds=1
    )["Messages"]
    sent = [json.loads(m["Body"]) for m in messages]
    assert {"task_id": task_id, "tenant_id": "kid-alpha"}.items() <= next(
        m for m in sent if m["task_id"] == task_id
    ).items()

    status, view = call(handler, proxy_event("GET", f"/v1/tasks/{task_id}", key_id="kid-alpha",
                                             resource="/v1/tasks/{task_id}"))
    assert status == 200 and view["status"] == "queued" and view["model"] == "synthetic"


def test_another_key_cannot_see_or_cancel_the_task(handler):
    _, accepted = call(
        handler,
        proxy_event("POST", "/v1/tasks", key_id="kid-alpha",
                    body={"model": "synthetic", "inputs": ["x"], "priority": "low"}, resource="/v1/tasks"),
    )
    task_id = accepted["task_id"]
    for method in ("GET", "DELETE"):
        status, body = call(handler, proxy_event(method, f"/v1/tasks/{task_id}", key_id="kid-beta",
                                                 resource="/v1/tasks/{task_id}"))
        assert status == 404 and body["error"]["code"] == "not_found"
    status, body = call(handler, proxy_event("DELETE", f"/v1/tasks/{task_id}", key_id="kid-alpha",
                                             resource="/v1/tasks/{task_id}"))
    assert status == 200 and body["status"] == "cancelled"


def test_idempotency_key_is_per_api_key(handler):
    body = {"model": "synthetic", "inputs": ["same"], "priority": "high"}
    headers = {"Idempotency-Key": "order-42"}
    first = call(handler, proxy_event("POST", "/v1/tasks", key_id="kid-alpha", body=body, headers=headers))[1]
    again = call(handler, proxy_event("POST", "/v1/tasks", key_id="kid-alpha", body=body, headers=headers))[1]
    other = call(handler, proxy_event("POST", "/v1/tasks", key_id="kid-beta", body=body, headers=headers))[1]
    assert first["task_id"] == again["task_id"] != other["task_id"]


def test_no_key_id_in_the_context_is_refused(handler):
    # Only possible if a route were deployed without ApiKeyRequired: the app
    # still refuses to guess a tenant.
    status, body = call(handler, proxy_event("GET", "/v1/models", key_id=None))
    assert status == 401 and body["error"]["code"] == "unauthenticated"


def test_models_and_validation_errors_through_the_gateway_event(handler):
    status, body = call(handler, proxy_event("GET", "/v1/models", key_id="kid-alpha"))
    assert status == 200 and [m["name"] for m in body["models"]] == ["synthetic"]
    status, body = call(
        handler,
        proxy_event("POST", "/v1/tasks", key_id="kid-alpha", body={"model": "synthetic", "inputs": []}),
    )
    assert status == 422 and body["error"]["code"] == "validation_error"


def test_the_api_role_allows_every_call_the_handler_makes(handler, settings, monkeypatch, aws_calls):
    monkeypatch.setenv("SLUICE_INLINE_PAYLOAD_MAX_BYTES", "64")
    handler = importlib.reload(handler)  # claim checks for anything over 64 bytes
    aws_calls.clear()
    kid = "kid-gamma"
    _, one = call(handler, proxy_event("POST", "/v1/tasks", key_id=kid,
                                       body={"model": "synthetic", "inputs": ["y" * 200]}))
    call(handler, proxy_event("POST", "/v1/tasks", key_id=kid, headers={"Idempotency-Key": "k1"},
                              body={"model": "synthetic", "inputs": ["z"]}))
    call(handler, proxy_event("POST", "/v1/tasks", key_id=kid, headers={"Idempotency-Key": "k1"},
                              body={"model": "synthetic", "inputs": ["z"]}))
    status, _ = call(handler, proxy_event("POST", "/v1/tasks/batch", key_id=kid,
                                          body={"tasks": [{"model": "synthetic", "inputs": ["a"]},
                                                          {"model": "synthetic", "inputs": ["b"], "priority": "low"}]}))
    assert status == 202
    call(handler, proxy_event("GET", f"/v1/tasks/{one['task_id']}", key_id=kid, resource="/v1/tasks/{task_id}"))
    long_poll = proxy_event("GET", f"/v1/tasks/{one['task_id']}", key_id=kid, resource="/v1/tasks/{task_id}")
    long_poll["queryStringParameters"] = {"wait_s": "0.2"}
    long_poll["multiValueQueryStringParameters"] = {"wait_s": ["0.2"]}
    status, polled = call(handler, long_poll)
    assert status == 200 and polled["status"] == "queued", polled
    call(handler, proxy_event("DELETE", f"/v1/tasks/{one['task_id']}", key_id=kid, resource="/v1/tasks/{task_id}"))
    status, ready = call(handler, proxy_event("GET", "/ready", key_id=kid))
    assert status == 200, ready
    # The same key with another large body: 409 (the record read before the upload).
    call(handler, proxy_event("POST", "/v1/tasks", key_id=kid, headers={"Idempotency-Key": "k2"},
                              body={"model": "synthetic", "inputs": ["v" * 200]}))
    status, _ = call(handler, proxy_event("POST", "/v1/tasks", key_id=kid, headers={"Idempotency-Key": "k2"},
                                          body={"model": "synthetic", "inputs": ["w" * 200]}))
    assert status == 409

    granted = set(access.API_TASKS + access.API_OBJECTS + access.API_BUCKET + access.API_QUEUES)
    used = {access.iam_action(service, op) for service, op in aws_calls}
    assert {"dynamodb:PutItem", "dynamodb:BatchWriteItem", "dynamodb:BatchGetItem", "sqs:SendMessage",
            "s3:PutObject", "dynamodb:GetItem"} <= used
    assert used <= granted, used - granted


def test_responses_stay_out_of_the_traces(handler):
    """Bodies hold results, client metadata and presigned URLs: as the stage keeps
    them out of its logs, the handler's trace keeps them out of X-Ray."""
    recorded: list[tuple[str, object]] = []

    class Subsegment:
        def put_metadata(self, key, value, namespace=None):
            recorded.append((key, value))

        def put_annotation(self, *args, **kwargs):
            pass

        def add_exception(self, *args, **kwargs):
            pass

    class Provider:
        @contextlib.contextmanager
        def in_subsegment(self, name=None, **kwargs):
            yield Subsegment()

        def put_annotation(self, *args, **kwargs):
            pass

    handler.tracer.provider, handler.tracer.disabled = Provider(), False
    try:
        status, accepted = call(handler, proxy_event("POST", "/v1/tasks", key_id="kid-trace", body={
            "model": "synthetic", "inputs": ["private text"], "metadata": {"patient": "jane doe"}}))
        assert status == 202
        status, view = call(handler, proxy_event("GET", f"/v1/tasks/{accepted['task_id']}", key_id="kid-trace",
                                                 resource="/v1/tasks/{task_id}"))
    finally:
        handler.tracer.disabled = True
    assert status == 200 and view["metadata"] == {"patient": "jane doe"}
    assert "jane doe" not in json.dumps(recorded, default=str)


def test_the_app_s_log_lines_carry_the_lambda_context(handler, monkeypatch):
    """sluice.* loggers write Powertools' JSON, with the invocation's request and correlation ids."""
    monkeypatch.setenv("SLUICE_TASKS_TABLE", "a-table-that-does-not-exist")
    handler = importlib.reload(handler)
    written = io.StringIO()
    for h in logging.getLogger("sluice").handlers:  # the Powertools logger's handler, if it was handed over
        monkeypatch.setattr(h, "stream", written)
    event = proxy_event("GET", "/v1/tasks/t-123", key_id="kid-logs", resource="/v1/tasks/{task_id}")
    status, body = call(handler, event)
    assert status == 503
    lines = [json.loads(line) for line in written.getvalue().splitlines()]
    (logged,) = [line for line in lines if line["message"].startswith("dependency call failed")]
    assert logged["level"] == "WARNING" and logged["service"] == "sluice-api" and logged["name"] == "sluice.api"
    assert logged["correlation_id"] == event["requestContext"]["requestId"]
    assert logged["function_request_id"] == LambdaContext.aws_request_id


SECRET = "SECRET-PAYLOAD jane.doe@example.com"


def _a_bug(monkeypatch):
    from sluice.api.service import TaskService

    def submit(self, tenant_id, request, idempotency_key):
        raise RuntimeError(f"could not handle {request.inputs[0]}")  # as a library error may quote its input

    monkeypatch.setattr(TaskService, "submit", submit)


def test_a_bug_answers_500_and_keeps_its_message_out_of_every_log(handler, monkeypatch, caplog):
    # Starlette re-raises after its 500 handler, and Mangum then logged the
    # whole traceback, message and payload included, to CloudWatch.
    _a_bug(monkeypatch)
    caplog.set_level(logging.DEBUG)
    status, body = call(handler, proxy_event("POST", "/v1/tasks", key_id="kid-alpha",
                                             body={"model": "synthetic", "inputs": [SECRET]}, resource="/v1/tasks"))
    assert (status, body["error"]["code"]) == (500, "internal_error")
    assert "unhandled RuntimeError" in caplog.text  # where it happened is logged
    assert SECRET not in caplog.text

