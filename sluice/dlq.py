"""Dead-letter queue inspection and redrive."""

from __future__ import annotations

import json

from sluice.adapters.queues import PriorityQueues
from sluice.contract import Priority


def list_dead(queues: PriorityQueues, priorities: list[Priority], limit: int = 100, store=None) -> list[dict]:
    """Peek at DLQ messages (received with visibility 0, so they stay where they
    are). With a TaskStore, each also names its task and that task's status:
    a redriven message of a task that is already final is acknowledged without
    running again (its outcome stands), so only unfinished tasks gain from it."""
    found: list[dict] = []
    for priority in priorities:
        url = queues.dlq_url(priority)
        seen: set[str] = set()
        while len(found) < limit:
            response = queues.sqs.receive_message(
                QueueUrl=url, MaxNumberOfMessages=10, VisibilityTimeout=0, WaitTimeSeconds=0,
                MessageSystemAttributeNames=["ApproximateReceiveCount", "SentTimestamp"],
            )
            fresh = [m for m in response.get("Messages", []) if m["MessageId"] not in seen]
            if not fresh:
                break
            for m in fresh:
                seen.add(m["MessageId"])
                found.append({"priority": priority.value, "message_id": m["MessageId"], "body": m["Body"],
                              "attributes": m.get("Attributes", {})})
    found = found[:limit]
    if store is not None:
        for item in found:
            task_id = _task_id(item["body"])
            item["task_id"] = task_id
        records = store.get_many([i["task_id"] for i in found if i["task_id"]])
        for item in found:
            record = records.get(item["task_id"]) if item["task_id"] else None
            item["task_status"] = record.status.value if record else None
    return found


def _task_id(body: str) -> str | None:
    try:
        value = json.loads(body).get("task_id")
    except (ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


def redrive(queues: PriorityQueues, priorities: list[Priority], limit: int = 100) -> int:
    """Move DLQ messages back to their source queue: send first, then delete,
    so a failure in between duplicates a message rather than losing it."""
    moved = 0
    for priority in priorities:
        dlq, source = queues.dlq_url(priority), queues.url(priority)
        while moved < limit:
            response = queues.sqs.receive_message(QueueUrl=dlq, MaxNumberOfMessages=min(10, limit - moved),
                                                  VisibilityTimeout=30, WaitTimeSeconds=0)
            messages = response.get("Messages", [])
            if not messages:
                break
            queues.sqs.send_message_batch(
                QueueUrl=source, Entries=[{"Id": str(i), "MessageBody": m["Body"]} for i, m in enumerate(messages)]
            )
            queues.sqs.delete_message_batch(
                QueueUrl=dlq, Entries=[{"Id": str(i), "ReceiptHandle": m["ReceiptHandle"]} for i, m in enumerate(messages)]
            )
            moved += len(messages)
    return moved
