"""The EKS worker's IAM grants (cdk.access) against the calls a running worker
really makes, with queue URLs set as the stack sets them: receiving, claiming,
writing outcomes and large inputs/results, extending visibility, and settling
a dead-lettered task (each worker settles the DLQs, sluice.dlq)."""

from __future__ import annotations

import threading
import time

import boto3

from cdk import access
from models.synthetic import SyntheticModel
from sluice.adapters.task_store import TaskStore
from sluice.api.service import TaskService
from sluice.contract import Priority, SubmitRequest, TaskStatus
from sluice.worker.main import Worker


def test_a_running_worker_stays_within_the_eks_worker_role(settings, aws_calls):
    sqs = boto3.client("sqs")
    urls = {p: sqs.get_queue_url(QueueName=settings.queue_name(p))["QueueUrl"] for p in Priority}
    # As the stack configures the pods: explicit queue URLs, a prefix that is not the queues'.
    dlq = sqs.get_queue_url(QueueName=settings.queue_name(Priority.normal, dlq=True))["QueueUrl"]
    settings = settings.model_copy(update={
        **{f"queue_url_{p.value}": url for p, url in urls.items()},
        "queue_prefix": "not-the-stacks-prefix", "inline_payload_max_bytes": 64, "inline_result_max_bytes": 1,
        "dlq_settle_s": 0.2,
    })
    service = TaskService(settings)
    ids = [service.submit("tenant-a", SubmitRequest(model="synthetic", inputs=[x * 100]), None).task_id
           for x in "ab"]
    dead = service.submit("tenant-a", SubmitRequest(model="synthetic", inputs=["dead-lettered"]), None).task_id
    # Its message goes to the DLQ unrun, as after receives that ended without an outcome.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        messages = sqs.receive_message(QueueUrl=urls[Priority.normal], MaxNumberOfMessages=10).get("Messages", [])
        mine = [m for m in messages if dead in m["Body"]]
        for m in messages:
            sqs.change_message_visibility(QueueUrl=urls[Priority.normal], ReceiptHandle=m["ReceiptHandle"],
                                          VisibilityTimeout=0 if m not in mine else 30)
        if mine:
            sqs.send_message(QueueUrl=dlq, MessageBody=mine[0]["Body"])
            sqs.delete_message(QueueUrl=urls[Priority.normal], ReceiptHandle=mine[0]["ReceiptHandle"])
            break
    else:
        raise AssertionError("the dead-lettered task's message was not received within 10 s")

    aws_calls.clear()  # from here on
    worker = Worker(settings, {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    store = TaskStore(settings)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(r.status == TaskStatus.succeeded for r in store.get_many(ids + [dead]).values()):
                break
            time.sleep(0.1)
        else:
            raise AssertionError(f"not all succeeded within 30 s: {store.get_many(ids + [dead])}")
    finally:
        worker.stop()
        thread.join(15)
    assert not thread.is_alive()

    granted = set(access.WORKER_TASKS + access.WORKER_OBJECTS + access.WORKER_RESULTS + access.WORKER_QUEUES
                  + access.SETTLE_TASKS + access.SETTLE_QUEUES + access.SETTLE_DLQS + access.DEAD_LETTER_DLQS)
    used = {access.iam_action(service, op) for service, op in aws_calls}
    assert {"sqs:ReceiveMessage", "sqs:DeleteMessage", "sqs:SendMessage", "dynamodb:BatchGetItem",
            "dynamodb:UpdateItem", "s3:GetObject", "s3:PutObject"} <= used, used
    assert used <= granted, used - granted
