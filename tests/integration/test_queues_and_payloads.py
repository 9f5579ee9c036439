"""SQS priority queues and the S3 payload store on the emulator, over HTTP."""

import json
import urllib.request

from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues
from sluice.contract import Priority, TaskMessage
from sluice.dlq import list_dead, redrive


def message(task_id: str, priority=Priority.normal) -> TaskMessage:
    return TaskMessage(task_id=task_id, tenant_id="t", model="synthetic", priority=priority,
                       input_count=1, inputs=["x"], enqueued_at=0)


def drain(queues: PriorityQueues, priority: Priority, want: int):
    got = []
    for _ in range(20):
        got += queues.receive(priority, 10, wait_s=0, visibility_s=30)
        if len(got) >= want:
            break
    return got


def test_send_receive_delete_per_priority(settings):
    queues = PriorityQueues(settings)
    queues.send_many([message(f"t{i}", Priority.high if i % 2 else Priority.low) for i in range(24)])
    high, low = drain(queues, Priority.high, 12), drain(queues, Priority.low, 12)
    assert len(high) == 12 and len(low) == 12
    assert all(m.task().priority is Priority.high for m in high)
    queues.delete_many(high + low)
    assert queues.receive(Priority.high, 10, 0, 0) == []


def test_third_failed_receive_moves_a_message_to_the_dlq(settings):
    queues = PriorityQueues(settings)
    queues.send(message("poison"))
    for attempt in range(1, 4):
        [m] = drain(queues, Priority.normal, 1)
        assert m.receive_count == attempt
        queues.change_visibility_many([m], 0)  # the worker gives up on it
    assert queues.receive(Priority.normal, 10, 0, 30) == []  # the 4th receive redrives it
    dead = list_dead(queues, [Priority.normal])
    assert [json.loads(d["body"])["task_id"] for d in dead] == ["poison"]
    assert redrive(queues, [Priority.normal]) == 1
    [back] = drain(queues, Priority.normal, 1)
    assert back.task().task_id == "poison"


def test_payloads_round_trip_and_presigned_url_serves_the_object(settings):
    store = PayloadStore(settings)
    key = store.result_key("acme", "task1")
    store.put_json(key, json.dumps({"embeddings": [[0.5]]}).encode())
    assert store.get_json(key) == {"embeddings": [[0.5]]}
    with urllib.request.urlopen(store.presigned_get(key), timeout=5) as response:
        assert json.loads(response.read()) == {"embeddings": [[0.5]]}
