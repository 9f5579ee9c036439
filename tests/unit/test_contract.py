import json

import pytest
from pydantic import ValidationError

from sluice.contract import (
    ALLOWED_TRANSITIONS,
    MAX_INPUTS_PER_TASK,
    TERMINAL_STATUSES,
    BatchSubmitRequest,
    Priority,
    SubmitRequest,
    TaskMessage,
    TaskRecord,
    TaskStatus,
    TaskView,
    can_transition,
)


def test_submit_defaults_to_normal_priority():
    request = SubmitRequest(model="minilm-embed", inputs=["hi"])
    assert request.priority is Priority.normal


@pytest.mark.parametrize(
    "body, field",
    [
        ({"model": "minilm-embed", "inputs": []}, "inputs"),
        ({"model": "minilm-embed", "inputs": ["x"] * (MAX_INPUTS_PER_TASK + 1)}, "inputs"),
        ({"model": "minilm-embed", "inputs": [""]}, "inputs"),
        ({"model": "minilm-embed", "inputs": [3]}, "inputs"),
        ({"model": "Bad Name!", "inputs": ["x"]}, "model"),
        ({"model": "minilm-embed", "inputs": ["x"], "priority": "urgent"}, "priority"),
        ({"model": "minilm-embed", "inputs": ["x"], "deadline_s": 0}, "deadline_s"),
        ({"model": "minilm-embed", "inputs": ["x"], "surprise": 1}, "surprise"),
    ],
)
def test_submit_rejects_bad_bodies_naming_the_field(body, field):
    with pytest.raises(ValidationError) as info:
        SubmitRequest.model_validate(body)
    assert field in str(info.value.errors()[0]["loc"][0])


def test_terminal_statuses_have_no_way_out():
    for status in TERMINAL_STATUSES:
        assert ALLOWED_TRANSITIONS[status] == frozenset()
        assert all(not can_transition(status, target) for target in TaskStatus)


def test_transitions_only_move_forward():
    assert can_transition(TaskStatus.queued, TaskStatus.succeeded)
    assert can_transition(TaskStatus.queued, TaskStatus.cancelled)
    assert not can_transition(TaskStatus.succeeded, TaskStatus.queued)
    assert not can_transition(TaskStatus.cancelled, TaskStatus.succeeded)


def test_queue_message_round_trips_through_json():
    message = TaskMessage(task_id="a" * 32, tenant_id="t", model="m", priority=Priority.low,
                          input_count=2, inputs=["x", "y"], enqueued_at=1)
    assert TaskMessage.model_validate_json(message.model_dump_json()) == message


def test_a_queue_message_from_a_later_release_is_still_read():
    # A worker not yet upgraded must run, not drop, a task whose message has a new field.
    body = TaskMessage(task_id="a" * 32, tenant_id="t", model="m", priority=Priority.low,
                       input_count=1, inputs=["x"], enqueued_at=1).model_dump(mode="json")
    later = json.dumps({**body, "trace_context": "a field added later"})
    assert TaskMessage.model_validate_json(later).task_id == "a" * 32


def test_record_view_derives_queue_time_and_error():
    record = TaskRecord(task_id="t1", tenant_id="a", model="m", priority=Priority.high,
                        status=TaskStatus.failed, input_count=1, created_at=1000, started_at=1250,
                        finished_at=1300, error_code="model_error", error_message="boom")
    view = record.to_view()
    assert view.timings.queue_ms == 250
    assert view.error.code == "model_error" and view.error.message == "boom"


def test_a_worker_clock_behind_the_api_s_shows_no_negative_queue_time():
    # created_at is stamped by the API host, started_at by the worker's.
    record = TaskRecord(task_id="t1", tenant_id="a", model="m", priority=Priority.high, status=TaskStatus.succeeded,
                        input_count=1, created_at=1000, started_at=900)
    assert record.to_view().timings.queue_ms == 0
    assert TaskView.model_json_schema()["$defs"]["TaskTimings"]["properties"]["queue_ms"]["anyOf"][0]["minimum"] == 0


def _without_null_defaults(schema):
    """FastAPI's OpenAPI models leave out `"default": null`; nothing else differs."""
    if isinstance(schema, dict):
        return {k: _without_null_defaults(v) for k, v in schema.items() if not (k == "default" and v is None)}
    if isinstance(schema, list):
        return [_without_null_defaults(v) for v in schema]
    return schema


def test_openapi_request_schema_comes_from_the_contract():
    """The document the app serves describes its request bodies with the
    contract's own schemas, limits included."""
    from fastapi.testclient import TestClient

    from sluice.api.app import create_app
    from sluice.settings import Settings

    served = TestClient(create_app(Settings(models="synthetic"))).get("/openapi.json")
    assert served.status_code == 200
    document = served.json()
    components = document["components"]["schemas"]
    for path, model in (("/v1/tasks", SubmitRequest), ("/v1/tasks/batch", BatchSubmitRequest)):
        body = document["paths"][path]["post"]["requestBody"]
        assert body["required"] is True, path
        assert body["content"]["application/json"]["schema"] == {"$ref": f"#/components/schemas/{model.__name__}"}, path
        contract = _without_null_defaults(model.model_json_schema(ref_template="#/components/schemas/{model}"))
        for name, schema in contract.pop("$defs", {}).items():
            assert components[name] == schema, name
        assert components[model.__name__] == contract, model.__name__
    inputs = components["SubmitRequest"]["properties"]["inputs"]
    assert inputs["maxItems"] == MAX_INPUTS_PER_TASK and inputs["minItems"] == 1
    assert set(components["SubmitRequest"]["required"]) == {"model", "inputs"}


@pytest.mark.parametrize("field, value", [("task_id", ""), ("task_id", "x" * 2100), ("task_id", "a/b"),
                                          ("tenant_id", ""), ("tenant_id", "t" * 200)])
def test_a_message_with_an_id_dynamodb_or_s3_would_refuse_is_no_task(field, value):
    # On AWS an empty or 2 KB key fails the whole batch's claim (BatchGetItem's
    # ValidationException; moto lets it through): unparseable, it is dropped alone.
    good = TaskMessage(task_id="a" * 32, tenant_id="tenant-a", model="synthetic", priority=Priority.normal,
                       input_count=1, inputs=["x"], enqueued_at=0)
    body = json.loads(good.model_dump_json())
    body[field] = value
    with pytest.raises(ValidationError):
        TaskMessage.model_validate_json(json.dumps(body))
