"""What a submit leaves behind when it is refused or fails, and how often an
idempotent retry re-sends: the app and TaskService in-process against the
session's moto server."""

from __future__ import annotations

import pytest
from botocore.exceptions import EndpointConnectionError

from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.api import service as service_module
from sluice.api.errors import ApiError
from sluice.api.service import TaskService
from sluice.aws import client as aws_client
from sluice.contract import BatchSubmitRequest, Priority, SubmitRequest, now_ms

SMALL = {"model": "synthetic", "inputs": ["hello"]}


def big(letter: str) -> list[str]:
    return [letter * 8000] * 10  # 80 KB: over the 64 KiB inline limit, so claim-checked


def cut(*_, **__):
    raise EndpointConnectionError(endpoint_url="http://cut")


def inputs_objects(settings) -> list[str]:
    listed = aws_client("s3", settings).list_objects_v2(Bucket=settings.bucket, Prefix="inputs/")
    return [o["Key"] for o in listed.get("Contents", [])]


def records(settings) -> int:
    return aws_client("dynamodb", settings).scan(TableName=settings.tasks_table, Select="COUNT")["Count"]


def depth(settings) -> int:
    return PriorityQueues(settings).depth(Priority.normal)


@pytest.fixture
def service(settings):
    return TaskService(settings)


# ------------------------------------- 1. a reused batch key: 409 before writing

def test_a_reused_batch_key_is_409_before_writing_even_when_its_first_record_has_expired(api, settings):
    headers = {"x-api-key": api.key_a, "Idempotency-Key": "kb"}
    first = api.post("/v1/tasks/batch", json={"tasks": [{**SMALL, "inputs": ["a0"]}, {**SMALL, "inputs": ["a1"]}]},
                     headers=headers)
    assert first.status_code == 202
    ids = [t["task_id"] for t in first.json()["tasks"]]
    # Records of one batch expire apart (each at its own finish + TTL): task 0's goes first.
    aws_client("dynamodb", settings).delete_item(TableName=settings.tasks_table, Key={"task_id": {"S": ids[0]}})
    before = depth(settings)
    other = api.post("/v1/tasks/batch", json={"tasks": [{**SMALL, "inputs": ["b0"]}, {**SMALL, "inputs": ["b1"]}]},
                     headers=headers)
    assert other.status_code == 409, other.text
    assert other.json()["error"]["code"] == "idempotency_conflict"
    # Nothing of the refused batch: no record for its task 0, no message sent.
    assert TaskStore(settings).get(ids[0]) is None
    assert depth(settings) == before == 2


# ---------------------------------------- 2. a retry re-sends at most once a while

def test_many_retries_of_one_key_leave_at_most_two_messages(api, settings):
    headers = {"x-api-key": api.key_a, "Idempotency-Key": "k1"}
    answers = [api.post("/v1/tasks", json=SMALL, headers=headers) for _ in range(30)]
    assert {a.status_code for a in answers} == {202}
    assert len({a.json()["task_id"] for a in answers}) == 1
    # The first try's message, and the first retry's re-send (it cannot tell a
    # first try that died between record and message from one that did not).
    assert depth(settings) <= 2


def test_a_retry_after_the_interval_re_sends_again(service, settings, monkeypatch):
    request = SubmitRequest(**SMALL)
    service.submit("t", request, "later-1")
    service.submit("t", request, "later-1")  # re-sends, and records when (resent_at)
    service.submit("t", request, "later-1")  # within the interval: no send
    assert depth(settings) == 2
    start = now_ms()
    monkeypatch.setattr(service_module, "now_ms", lambda: start + service_module.RESEND_INTERVAL_S * 1000 + 1)
    service.submit("t", request, "later-1")
    assert depth(settings) == 3


def test_a_re_send_that_failed_does_not_hold_back_the_next_retry(service, settings):
    request = SubmitRequest(**SMALL)
    service.submit("t", request, "lost-1")
    queues = PriorityQueues(settings)
    queues.delete_many(queues.receive(Priority.normal, 10, 1, 30))  # the first try's message is gone
    real_send = service.queues.send
    service.queues.send = cut
    with pytest.raises(ApiError) as refused:
        service.submit("t", request, "lost-1")
    assert refused.value.status == 503
    service.queues.send = real_send
    service.submit("t", request, "lost-1")  # at once, not an interval later
    assert depth(settings) == 1


# ----------------------------------------------- 3. claim-checked inputs left over

def test_a_409_with_a_different_large_body_leaves_only_the_first_inputs(api, settings):
    headers = {"x-api-key": api.key_a, "Idempotency-Key": "big-2"}
    first = api.post("/v1/tasks", json={"model": "synthetic", "inputs": big("A")}, headers=headers)
    assert first.status_code == 202
    clash = api.post("/v1/tasks", json={"model": "synthetic", "inputs": big("B")}, headers=headers)
    assert clash.status_code == 409
    (key,) = inputs_objects(settings)
    assert PayloadStore(settings).get_json(key) == big("A")


def test_a_409_batch_with_large_bodies_uploads_nothing(api, settings):
    headers = {"x-api-key": api.key_a, "Idempotency-Key": "big-batch"}
    tasks = [{"model": "synthetic", "inputs": big("A")}, {"model": "synthetic", "inputs": big("C")}]
    assert api.post("/v1/tasks/batch", json={"tasks": tasks}, headers=headers).status_code == 202
    other = [{"model": "synthetic", "inputs": big("B")}, {"model": "synthetic", "inputs": big("D")}]
    assert api.post("/v1/tasks/batch", json={"tasks": other}, headers=headers).status_code == 409
    assert len(inputs_objects(settings)) == 2


def test_a_keyless_submit_answered_503_leaves_no_inputs(service, settings):
    service.queues.send_many = cut
    with pytest.raises(ApiError) as refused:
        service.submit("t", SubmitRequest(model="synthetic", inputs=big("A")), None)
    assert refused.value.status == 503
    assert records(settings) == 0 and inputs_objects(settings) == []


def test_a_keyless_batch_answered_503_leaves_no_inputs(service, settings):
    service.queues.send_many = cut
    batch = BatchSubmitRequest(tasks=[SubmitRequest(model="synthetic", inputs=big(x)) for x in "ABC"])
    with pytest.raises(ApiError) as refused:
        service.submit_batch("t", batch, None)
    assert refused.value.status == 503
    assert records(settings) == 0 and inputs_objects(settings) == []


def test_a_keyless_batch_whose_upload_fails_midway_leaves_no_inputs(service, settings):
    real_put, puts = service.payloads.put_json, []

    def second_fails(key, body):
        puts.append(key)
        if len(puts) == 2:
            cut()
        real_put(key, body)

    service.payloads.put_json = second_fails
    batch = BatchSubmitRequest(tasks=[SubmitRequest(model="synthetic", inputs=big(x)) for x in "ABC"])
    with pytest.raises(ApiError) as refused:
        service.submit_batch("t", batch, None)
    assert refused.value.status == 503 and "payload store" in refused.value.message
    assert records(settings) == 0 and inputs_objects(settings) == []


def test_a_keyed_submit_answered_503_keeps_its_inputs_for_its_retry(service, settings):
    request = SubmitRequest(model="synthetic", inputs=big("A"))
    real_send = service.queues.send
    service.queues.send = cut
    with pytest.raises(ApiError):
        service.submit("t", request, "keyed-503")
    # A concurrent retry with the same key and body may name this very object.
    assert len(inputs_objects(settings)) == 1
    service.queues.send = real_send
    service.submit("t", request, "keyed-503")
    (message,) = PriorityQueues(settings).receive(Priority.normal, 10, 1, 30)
    assert PayloadStore(settings).get_json(message.task().inputs_key) == big("A")


# --------------------------------------------------------------------- 4. nits

def test_a_payload_store_failure_in_a_keyed_submit_names_the_payload_store(service, settings):
    service.payloads.put_json = cut
    with pytest.raises(ApiError) as refused:
        service.submit("t", SubmitRequest(model="synthetic", inputs=big("A")), "s3-down")
    assert refused.value.status == 503
    assert "payload store" in refused.value.message and "task store" not in refused.value.message
    assert records(settings) == 0


def test_an_unexpected_error_from_send_many_rolls_the_records_back(service, settings):
    def defect(messages):
        raise RuntimeError("a defect, not the network")

    service.queues.send_many = defect
    with pytest.raises(RuntimeError):
        service.submit("t", SubmitRequest(**SMALL), None)
    batch = BatchSubmitRequest(tasks=[SubmitRequest(model="synthetic", inputs=big(x)) for x in "AB"])
    with pytest.raises(RuntimeError):
        service.submit_batch("t", batch, None)
    assert records(settings) == 0 and inputs_objects(settings) == []


def test_an_unexpected_error_from_a_keyed_send_rolls_its_record_back(service, settings):
    # A keyed submit sends its message alone, not through send_many.
    def defect(message):
        raise RuntimeError("a defect, not the network")

    service.queues.send = defect
    with pytest.raises(RuntimeError):
        service.submit("t", SubmitRequest(**SMALL), "key-1")
    with pytest.raises(RuntimeError):
        service.submit_batch("t", BatchSubmitRequest(tasks=[SubmitRequest(**SMALL)]), "key-2")
    assert records(settings) == 0


def test_the_409_names_the_idempotency_key_header_as_the_422_does(api):
    too_long = api.post("/v1/tasks", json=SMALL, headers={"x-api-key": api.key_a, "Idempotency-Key": "k" * 200})
    assert too_long.status_code == 422
    (detail,) = too_long.json()["error"]["details"]
    headers = {"x-api-key": api.key_a, "Idempotency-Key": "named"}
    assert api.post("/v1/tasks", json=SMALL, headers=headers).status_code == 202
    clash = api.post("/v1/tasks", json={**SMALL, "inputs": ["other"]}, headers=headers)
    assert clash.status_code == 409
    assert clash.json()["error"]["details"][0]["field"] == detail["field"] == "header.Idempotency-Key"
