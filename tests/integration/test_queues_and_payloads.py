"""SQS priority queues and the S3 payload store on the emulator, over HTTP."""

import dataclasses
import json
import threading
import urllib.request
from urllib.parse import urlsplit

import pytest
from botocore.exceptions import ConnectTimeoutError, EndpointConnectionError, ReadTimeoutError

from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues, SendFailed
from sluice.adapters.task_store import TaskStore
from sluice.contract import Priority, TaskMessage, TaskRecord, TaskStatus
from sluice.dlq import list_dead, redrive, settle_dead


class SqsSeam:
    """Test seam over the real client, set on one PriorityQueues instance (the
    shared cached client stays as it is): a subclass replaces the calls it
    changes, and every other call goes through."""

    def __init__(self, sqs):
        self.sqs = sqs

    def __getattr__(self, name):
        return getattr(self.sqs, name)


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



def test_a_queue_url_lookup_in_flight_does_not_hold_up_the_cached_ones(settings):
    # The lookup ran under the lock every url() takes: one waiting on a slow
    # SQS held every submit's and heartbeat's cached lookup behind it.
    queues = PriorityQueues(settings)
    queues.url(Priority.normal)  # cached from here on
    asked, release = threading.Event(), threading.Event()

    class HeldLookups(SqsSeam):
        def get_queue_url(self, **params):
            asked.set()
            release.wait(10)
            return self.sqs.get_queue_url(**params)

    queues.sqs = HeldLookups(queues.sqs)
    lookup = threading.Thread(target=queues.dlq_url, args=(Priority.high,))
    lookup.start()
    cached = threading.Event()
    try:
        assert asked.wait(5), "the DLQ's lookup never asked SQS"
        threading.Thread(target=lambda: (queues.url(Priority.normal), cached.set()), daemon=True).start()
        assert cached.wait(5), "a cached queue URL waited on another queue's lookup"
    finally:
        release.set()
        lookup.join(10)
    assert queues.dlq_url(Priority.high).endswith(settings.queue_name(Priority.high, dlq=True))


def test_a_failed_chunk_or_entry_does_not_stop_the_others_and_is_logged(settings, caplog, monkeypatch):
    # A heartbeat extending 25 messages: the first chunk's call failing must not
    # leave the next 15 to lapse, and entries SQS refuses must not pass unseen.
    queues = PriorityQueues(settings)
    queues.send_many([message(f"c{i}") for i in range(25)])
    held = drain(queues, Priority.normal, 25)
    assert len(held) == 25
    calls = []
    real = queues.sqs.change_message_visibility_batch

    def first_chunk_fails(**kwargs):  # the chunks' calls run in parallel: told apart by content
        calls.append(len(kwargs["Entries"]))
        if kwargs["Entries"][0]["ReceiptHandle"] == held[0].receipt_handle:
            raise ConnectionError("reset by peer")
        return real(**kwargs)

    monkeypatch.setattr(queues.sqs, "change_message_visibility_batch", first_chunk_fails)  # a shared client
    stale = dataclasses.replace(held[-1], receipt_handle="not-a-receipt-handle")
    with pytest.raises(ConnectionError):
        queues.change_visibility_many(held[:-1] + [stale], 0)
    assert sorted(calls) == [5, 10, 10]  # every chunk tried, in parallel (any order)
    assert "1 of 25" in caplog.text and "ChangeMessageVisibility" in caplog.text, caplog.text
    # The later chunks landed: those messages are visible again at once.
    back = drain(queues, Priority.normal, 14)
    assert {m.message_id for m in back} >= {m.message_id for m in held[10:24]}

def test_the_chunks_of_one_visibility_change_run_at_once(settings, monkeypatch):
    # One after the other, a heartbeat's 30-odd chunks against a slow SQS (each
    # up to ~12 s with the SDK's retries) took minutes, its last chunks extended
    # after they had lapsed. Here two chunks must be in flight together: the
    # first waits for the second at a barrier, which one-by-one calls never reach.
    queues = PriorityQueues(settings)
    queues.send_many([message(f"p{i}") for i in range(20)])
    held = drain(queues, Priority.normal, 20)
    assert len(held) == 20
    both_in_flight = threading.Barrier(2, timeout=10)
    real = queues.sqs.change_message_visibility_batch

    def meets_the_other_chunk(**kwargs):
        both_in_flight.wait()  # BrokenBarrierError after 10 s if the chunks run one by one
        return real(**kwargs)

    monkeypatch.setattr(queues.sqs, "change_message_visibility_batch", meets_the_other_chunk)  # a shared client
    queues.change_visibility_many(held, 0)
    assert len(drain(queues, Priority.normal, 20)) == 20  # both chunks landed: visible again at once


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


def dead_letter(queues: PriorityQueues, store: TaskStore, task_ids: list[str], status=TaskStatus.queued,
                attempts: int = 0) -> None:
    """Tasks whose messages are in the normal DLQ, in the order given."""
    for task_id in task_ids:
        store.create(TaskRecord(task_id=task_id, tenant_id="t", model="synthetic", priority=Priority.normal,
                                status=status, input_count=1, created_at=0, attempts=attempts))
    for i in range(0, len(task_ids), 10):
        queues.sqs.send_message_batch(QueueUrl=queues.dlq_url(Priority.normal), Entries=[
            {"Id": str(j), "MessageBody": message(t).model_dump_json(exclude_none=True)}
            for j, t in enumerate(task_ids[i:i + 10])])


def depth(queues: PriorityQueues, url: str) -> tuple[int, int]:
    """(visible, hidden) messages: exact on moto."""
    a = queues.sqs.get_queue_attributes(
        QueueUrl=url, AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])
    return int(a["Attributes"]["ApproximateNumberOfMessages"]), int(a["Attributes"]["ApproximateNumberOfMessagesNotVisible"])


def test_settling_reaches_tasks_behind_more_than_a_hundred_kept_messages(settings):
    """Messages of tasks that failed in the model stay in the DLQ for operators;
    moto hands them out in insertion order, so a round that stopped after the
    first hundred would never reach the tasks behind them."""
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dlq = queues.dlq_url(Priority.normal)
    dead_letter(queues, store, [f"final{i}" for i in range(130)], status=TaskStatus.failed, attempts=2)
    dead_letter(queues, store, ["handed-back"])  # never ran: requeued
    dead_letter(queues, store, ["crashed"], attempts=settings.max_attempts - 1)  # ran each time: failed
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts) == {"failed": 1, "requeued": 1}
    assert store.get("crashed").status is TaskStatus.failed and store.get("crashed").error_code == "dead_lettered"
    assert [m.task().task_id for m in drain(queues, Priority.normal, 1)] == ["handed-back"]
    # What it kept is all there and visible again, for `sluice dlq` and the DLQ alarm.
    assert depth(queues, dlq) == (131, 0)
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts) == {"failed": 0, "requeued": 0}
    assert depth(queues, dlq) == (131, 0)
    # A round is bounded: one that may look at 50 messages reaches none behind
    # them, and keeps the 50 it passed hidden, so the next rounds start past them.
    dead_letter(queues, store, ["late"])
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts, scan=50) == {"failed": 0, "requeued": 0}
    assert depth(queues, dlq) == (82, 50)
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts, scan=50) == {"failed": 0, "requeued": 0}
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts, scan=50) == {"failed": 0, "requeued": 1}


def test_a_settling_process_reads_a_final_tasks_record_once(settings):
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, [f"final{i}" for i in range(30)], status=TaskStatus.failed, attempts=2)
    read: list[str] = []
    real = store.get_many
    store.get_many = lambda ids, *args, **kwargs: read.extend(ids) or real(ids, *args, **kwargs)
    known: set[str] = set()
    settle_dead(queues, store, [Priority.normal], settings.max_attempts, known_final=known)
    assert sorted(read) == sorted(f"final{i}" for i in range(30)) and len(known) == 30
    read.clear()
    dead_letter(queues, store, ["handed-back"])
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts,
                       known_final=known) == {"failed": 0, "requeued": 1}
    assert read == ["handed-back"]  # the final ones were not read again


class FailsToStore(SqsSeam):
    """SendMessageBatch stores every entry but those of `task_id` on moto, and
    reports that one in `Failed`, as SQS does for an entry it could not store
    (HTTP 200, nothing raised)."""

    def __init__(self, sqs, task_id: str):
        super().__init__(sqs)
        self.task_id = task_id

    def send_message_batch(self, QueueUrl, Entries):
        refused = [e for e in Entries if json.loads(e["MessageBody"])["task_id"] == self.task_id]
        sent = [e for e in Entries if e not in refused]
        response = self.sqs.send_message_batch(QueueUrl=QueueUrl, Entries=sent) if sent else {}
        return {"Successful": response.get("Successful", []), "Failed": response.get("Failed", []) + [
            {"Id": e["Id"], "SenderFault": False, "Code": "InternalError", "Message": "not stored"} for e in refused]}


def test_a_dead_letter_send_that_raises_for_one_priority_leaves_the_others_moved(settings):
    # The first priority whose send raised ended the call: the messages of the
    # priorities after it were never sent to their dead-letter queues.
    queues = PriorityQueues(settings)
    queues.send_many([message("h", Priority.high), message("l", Priority.low)])
    held = drain(queues, Priority.high, 1) + drain(queues, Priority.low, 1)
    high_dlq = queues.dlq_url(Priority.high)

    class HighDlqDown(SqsSeam):
        def send_message_batch(self, QueueUrl, Entries):
            if QueueUrl == high_dlq:
                raise EndpointConnectionError(endpoint_url="http://down")
            return self.sqs.send_message_batch(QueueUrl=QueueUrl, Entries=Entries)

    real, queues.sqs = queues.sqs, HighDlqDown(queues.sqs)
    with pytest.raises(EndpointConnectionError):
        queues.dead_letter(held)
    queues.sqs = real
    assert [d["task_id"] for d in list_dead(queues, [Priority.low])] == ["l"]
    assert depth(queues, queues.url(Priority.low)) == (0, 0)  # moved, not left behind
    assert depth(queues, queues.url(Priority.high)) == (0, 1)  # still held: it comes back


@pytest.mark.parametrize("move", ["settle", "redrive"])
def test_a_dead_letter_sqs_did_not_store_elsewhere_stays_in_the_dlq(settings, move):
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dlq = queues.dlq_url(Priority.normal)
    dead_letter(queues, store, ["a", "b", "c"])
    real, queues.sqs = queues.sqs, FailsToStore(queues.sqs, "b")
    if move == "settle":
        assert settle_dead(queues, store, [Priority.normal], settings.max_attempts) == {"failed": 0, "requeued": 2}
    else:
        assert redrive(queues, [Priority.normal]) == 2
    assert depth(queues, dlq) == (1, 0)  # b's message, visible again
    assert [json.loads(d["body"])["task_id"] for d in list_dead(queues, [Priority.normal])] == ["b"]
    queues.sqs = real  # the next round moves it
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts) == {"failed": 0, "requeued": 1}
    assert depth(queues, dlq) == (0, 0)
    assert sorted(m.task().task_id for m in drain(queues, Priority.normal, 3)) == ["a", "b", "c"]


@pytest.mark.parametrize("ids, unstored", [
    (["a", "b", "c"], "b"),
    # SendMessageBatch takes ten: each chunk's entry ids count from 0 again.
    # Read as the first chunk's, a later chunk's successes passed an unsent
    # message for stored (deleted, lost) and the later ones for unsent.
    ([f"t{i:02}" for i in range(14)], "t03"),
], ids=["one_chunk", "two_chunks"])
def test_a_message_dead_lettered_by_a_worker_is_deleted_only_once_sqs_stored_it(settings, ids, unstored):
    # A requeued task failed below maxReceiveCount (PriorityQueues.dead_letter):
    # one SQS did not store stays in its queue and is named; the others move.
    queues = PriorityQueues(settings)
    queues.send_many([message(t) for t in ids])
    held = drain(queues, Priority.normal, len(ids))
    real, queues.sqs = queues.sqs, FailsToStore(queues.sqs, unstored)
    with pytest.raises(SendFailed) as failed:
        queues.dead_letter(held)
    queues.sqs = real
    assert failed.value.failed_ids == [unstored]
    assert sorted(d["task_id"] for d in list_dead(queues, [Priority.normal])) == [t for t in ids if t != unstored]
    assert depth(queues, queues.url(Priority.normal)) == (0, 1)  # its own, still held by this worker


def test_payloads_round_trip_and_presigned_url_serves_the_object(settings):
    store = PayloadStore(settings)
    key = store.result_key("acme", "task1", "run1")
    store.put_json(key, json.dumps({"embeddings": [[0.5]]}).encode())
    assert store.get_json(key) == {"embeddings": [[0.5]]}
    with urllib.request.urlopen(store.presigned_get(key), timeout=5) as response:
        assert json.loads(response.read()) == {"embeddings": [[0.5]]}


def test_without_a_public_endpoint_urls_name_the_endpoint_in_use(settings, moto_endpoint):
    # AWS leaves SLUICE_S3_PUBLIC_ENDPOINT unset: one client signs and calls, as before.
    store = PayloadStore(settings)
    assert settings.s3_public_endpoint is None and store.signer is store.s3
    url = urlsplit(store.presigned_get(store.result_key("acme", "t", "r")))
    assert f"{url.scheme}://{url.netloc}" == moto_endpoint


def test_a_public_endpoint_changes_only_the_presigned_urls(settings, moto_endpoint):
    # On-prem the API reaches MinIO as http://minio:9000; clients reach the host's
    # published port. `.invalid` never resolves, so a put or get sent there fails.
    public = settings.model_copy(update={"s3_public_endpoint": "http://s3.public.invalid:9000"})
    store = PayloadStore(public)
    key = store.result_key("acme", "task-public", "run1")
    store.put_json(key, json.dumps({"ok": 1}).encode())
    assert store.get_json(key) == {"ok": 1}  # both went to the real endpoint
    url = urlsplit(store.presigned_get(key))
    assert (url.scheme, url.netloc) == ("http", "s3.public.invalid:9000")
    assert url.path == f"/{settings.bucket}/{key}"  # path style, as MinIO needs
    assert "X-Amz-Signature=" in url.query
    # Another name for the same server: the URL it signs serves the object.
    port = urlsplit(moto_endpoint).port
    store = PayloadStore(settings.model_copy(update={"s3_public_endpoint": f"http://localhost:{port}"}))
    url = store.presigned_get(key)
    assert url.startswith(f"http://localhost:{port}/{settings.bucket}/")
    with urllib.request.urlopen(url, timeout=5) as response:
        assert json.loads(response.read()) == {"ok": 1}


@pytest.mark.parametrize("silence", [ReadTimeoutError, EndpointConnectionError, ConnectTimeoutError])
def test_a_send_that_sqs_does_not_answer_fails_the_rest_at_once(settings, monkeypatch, silence):
    # Each chunk's call waits out the SDK's tries (3 x 4 s) when SQS does not
    # answer; a group commit's 25 submits made three such calls in a row.
    queues = PriorityQueues(settings)
    calls = []

    def no_answer(**kwargs):
        calls.append(len(kwargs["Entries"]))
        raise silence(endpoint_url="http://sqs")

    monkeypatch.setattr(queues.sqs, "send_message_batch", no_answer)
    with pytest.raises(SendFailed) as failed:
        queues.send_many([message(f"s{i}") for i in range(25)])
    assert calls == [10] and len(failed.value.failed_ids) == 25


def test_a_message_sqs_reports_not_stored_is_named_by_send_many(settings):
    # SendMessageBatch answers 200 and lists an entry it could not store in
    # `Failed`. Read as sent, its submit answers 202 and its record waits
    # `queued` for a message that never comes.
    queues = PriorityQueues(settings)
    queues.sqs = FailsToStore(queues.sqs, "lost")
    with pytest.raises(SendFailed) as failed:
        queues.send_many([message("kept"), message("lost"), message("kept-too")])
    assert failed.value.failed_ids == ["lost"]
    assert sorted(m.task().task_id for m in drain(queues, Priority.normal, 2)) == ["kept", "kept-too"]
