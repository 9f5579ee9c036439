"""The SageMaker backend's scheduled settler, with the environment the stack
gives it, against the moto server (tests/conftest.py).

Two tasks whose messages reached the dead-letter queue without an outcome: one
that started max_attempts times is failed, one that never ran is requeued.
"""

from __future__ import annotations

import importlib
import json
import time
from types import SimpleNamespace

import boto3

from cdk import access
from sluice.adapters.task_store import Change, TaskStore
from sluice.api.service import TaskService
from sluice.contract import Priority, SubmitRequest, TaskStatus
from tests.reliability.harness import wait_until


def test_the_settler_settles_dead_lettered_tasks_within_its_grants(settings, monkeypatch, aws_calls):
    sqs = boto3.client("sqs")
    urls = {p: sqs.get_queue_url(QueueName=settings.queue_name(p))["QueueUrl"] for p in Priority}
    env = {
        "SLUICE_TASKS_TABLE": settings.tasks_table,
        "SLUICE_MAX_ATTEMPTS": "3",
        "SLUICE_QUEUE_PREFIX": settings.queue_prefix,
        **{f"SLUICE_QUEUE_URL_{p.value.upper()}": url for p, url in urls.items()},
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    service = TaskService(settings)
    crashed, never_ran = (service.submit("tenant-a", SubmitRequest(model="synthetic", inputs=[x]), None).task_id
                          for x in ("crashed", "never ran"))
    dlq = sqs.get_queue_url(QueueName=settings.queue_name(Priority.normal, dlq=True))["QueueUrl"]
    moved = []

    def move_to_dlq() -> bool:  # what the redrive policy does after the last receive
        for m in sqs.receive_message(QueueUrl=urls[Priority.normal], MaxNumberOfMessages=10,
                                     WaitTimeSeconds=1).get("Messages", []):
            sqs.send_message(QueueUrl=dlq, MessageBody=m["Body"])
            sqs.delete_message(QueueUrl=urls[Priority.normal], ReceiptHandle=m["ReceiptHandle"])
            moved.append(json.loads(m["Body"])["task_id"])
        return len(moved) >= 2

    wait_until(move_to_dlq, 15, "both submits' messages to be moved to the dead-letter queue", state=lambda: moved)
    assert sorted(moved) == sorted([crashed, never_ran])
    store = TaskStore(settings)
    # Its three starts' record: the first delivery's start is not written (sluice.lifecycle).
    store.apply(Change(crashed, {"attempts": 2}, (TaskStatus.queued,)))

    aws_calls.clear()  # from here on
    import lambdas.settler.handler as module

    module = importlib.reload(module)
    counts = module.handler({"source": "aws.events"}, SimpleNamespace(
        function_name="sluice-settler", memory_limit_in_mb=256, aws_request_id="req",
        invoked_function_arn="arn:aws:lambda:us-east-1:123456789012:function:sluice-settler",
        get_remaining_time_in_millis=lambda: 60_000))

    assert counts == {"failed": 1, "requeued": 1}
    failed = store.get(crashed)
    assert failed.status == TaskStatus.failed and failed.error_code == "dead_lettered"
    requeued = sqs.receive_message(QueueUrl=urls[Priority.normal], MaxNumberOfMessages=10, WaitTimeSeconds=1)
    assert [never_ran in m["Body"] for m in requeued.get("Messages", [])] == [True]

    granted = set(access.SETTLE_TASKS + access.SETTLE_QUEUES + access.SETTLE_DLQS)
    used = {access.iam_action(service, op) for service, op in aws_calls}
    assert {"dynamodb:BatchGetItem", "dynamodb:UpdateItem", "sqs:SendMessage", "sqs:ReceiveMessage"} <= used
    assert used <= granted, used - granted


def test_the_settler_stops_receiving_in_time_to_finish_its_round_inside_its_timeout(settings, monkeypatch):
    # Three priorities of 15 s of receiving each, then hiding and showing
    # again what they passed, ran past the function's 60 s: the hides were
    # skipped and the next round started at the same head.
    import lambdas.settler.handler as module

    rounds = []
    monkeypatch.setattr(module, "settle_dead", lambda *a, until=None, **k: rounds.append(until) or {})
    now = time.monotonic()
    module.handler({"source": "aws.events"}, SimpleNamespace(
        function_name="sluice-settler", memory_limit_in_mb=256, aws_request_id="req",
        invoked_function_arn="arn:aws:lambda:us-east-1:123456789012:function:sluice-settler",
        get_remaining_time_in_millis=lambda: 60_000))
    assert rounds and rounds[0] <= now + 60 - module.AFTER_RECEIVING_S + 1
