"""The contract's rules, each in sluice/contract.py and held where the data is made or read."""

from __future__ import annotations

import json
import time

import pytest
from pydantic import TypeAdapter, ValidationError

from models.synthetic import SyntheticModel
from sluice.adapters.queues import Received
from sluice.adapters.task_store import Change, TaskStore
from sluice import contract
from sluice.contract import (
    Priority,
    SubmitRequest,
    TaskMessage,
    TaskRecord,
    TaskStatus,
    TaskView,
    can_transition,
    new_task_id,
    now_ms,
)

QUEUED = (TaskStatus.queued,)


# ------------------------------------------------------------ A: queue message


def message(**overrides) -> dict:
    values = dict(task_id="a" * 32, tenant_id="t", model="synthetic", priority="normal", input_count=2,
                  inputs=["x", "y"], enqueued_at=1)
    values.update(overrides)
    return values


@pytest.mark.parametrize("overrides", [
    {"inputs": None, "input_count": 5},  # neither inline inputs nor a claim check
    {"inputs_key": "inputs/t/a"},  # both
    {"input_count": 3},  # the count the batcher packs by disagrees with the inputs
    {"inputs": [], "input_count": 1},
])
def test_a_task_message_carries_its_inputs_inline_xor_by_key(overrides):
    with pytest.raises(ValidationError):
        TaskMessage.model_validate_json(json.dumps(message(**overrides)))


def test_a_claim_checked_message_counts_inputs_it_does_not_carry():
    claim_checked = TaskMessage.model_validate(message(inputs=None, inputs_key="inputs/t/a", input_count=5))
    assert claim_checked.inputs is None and claim_checked.input_count == 5


def test_a_message_without_inputs_is_handed_back_by_the_worker_not_deleted(settings):
    """No delivery of this release can run it, but deleted (as it used to be)
    its task would stay queued with no message anywhere: handed back, after
    max_attempts receives it waits in the DLQ (sluice.dlq leaves it there)."""
    from sluice.worker.runner import BatchRunner

    task_id = new_task_id()
    TaskStore(settings).create(TaskRecord(task_id=task_id, tenant_id="t", model="synthetic",
                                          priority=Priority.normal, status=TaskStatus.queued, input_count=5,
                                          created_at=now_ms()))
    body = json.dumps(message(task_id=task_id, inputs=None, input_count=5))
    received = Received(Priority.normal, "m-1", "rh-1", body, 1, time.monotonic())
    given_back = []
    runner = BatchRunner(settings, {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})
    prepared = runner.prepare([received], give_back=lambda messages, delay_s: given_back.extend(messages))
    assert prepared.ack == [] and prepared.jobs == [] and prepared.unreadable == []
    assert given_back == [received]


# --------------------------------------------------------- B, C: task records


def test_the_submit_token_is_a_record_field_kept_out_of_the_view():
    record = TaskRecord(task_id="t1", tenant_id="a", model="m", priority=Priority.high, status=TaskStatus.queued,
                        input_count=1, created_at=1, submit_token="tok")
    assert record.submit_token == "tok"
    assert "submit_token" not in record.to_view().model_dump()
    assert "submit_token" not in TaskView.model_json_schema()["properties"]


@pytest.mark.parametrize("change", [
    dict(set_values={"submit_tokn": "x"}),
    dict(set_values={"status": "failed", "eror_code": "x"}),
    dict(set_values={}, remove=("error_mesage",)),
    dict(set_values={"task_id": "another"}),  # the key
    dict(set_values={}, remove=("status",)),  # a record cannot lose a field it must have
])
def test_a_change_names_only_task_record_fields(change):
    with pytest.raises(ValueError):
        Change("t", allowed_from=QUEUED, **change)


def test_a_change_may_name_every_field_product_code_writes():
    Change("t", {"submit_token": "x", "started_at": 1, "attempts": 2, "model_version": "1", "inference_ms": 3,
                 "batch_size": 4, "result_json": "[]", "result_key": "k"}, QUEUED, remove=("error_code", "error_message"))


@pytest.mark.parametrize("target", list(TaskStatus))
@pytest.mark.parametrize("source", list(TaskStatus))
def test_a_change_of_status_follows_the_allowed_transitions(source, target):
    def build():
        return Change("t", {"status": target.value, "finished_at": 1}, (source,))

    if can_transition(source, target):
        assert build().allowed_from == (source,)
    else:
        with pytest.raises(ValueError, match="transition"):
            build()


@pytest.mark.parametrize("final", sorted(s.value for s in TaskStatus if s.is_terminal))
def test_a_final_record_is_never_written_again(final):
    with pytest.raises(ValueError):
        Change("t", {"started_at": 1}, (TaskStatus.queued, TaskStatus(final)), add_attempt=True)


def test_a_final_change_says_when_it_finished():
    with pytest.raises(ValueError, match="finished_at"):
        Change("t", {"status": TaskStatus.cancelled.value}, QUEUED)


def test_a_change_leaves_the_ttl_to_the_store():
    with pytest.raises(ValueError, match="expires_at"):
        Change("t", {"status": TaskStatus.cancelled.value, "finished_at": 1, "expires_at": 2}, QUEUED)


@pytest.mark.parametrize("final", sorted(s.value for s in TaskStatus if s.is_terminal))
def test_a_final_change_keeps_its_record_for_the_ttl_from_finishing(final):
    source = next(s for s in TaskStatus if can_transition(s, TaskStatus(final)))
    request = Change("t", {"status": final, "finished_at": 86_400_999}, (source,)).update("tasks", 7 * 86400)
    names, values = request["ExpressionAttributeNames"], request["ExpressionAttributeValues"]
    written = {names[f"#a{i}"]: values[f":v{i}"] for i in range(len(values)) if f"#a{i}" in names}
    assert written["expires_at"] == {"N": str(86_400 + 7 * 86400)}


def test_a_change_that_keeps_the_task_running_leaves_its_ttl():
    request = Change("t", {"started_at": 1}, QUEUED, add_attempt=True).update("tasks", 7 * 86400)
    assert "expires_at" not in request["ExpressionAttributeNames"].values()


def test_a_change_s_token_is_written_by_the_store_alone():
    # Set by hand beside a token, claim_token would be written twice in one expression.
    with pytest.raises(ValueError, match="token"):
        Change("t", {"started_at": 1, "claim_token": "a"}, QUEUED, add_attempt=True, token="b")


def test_a_change_needs_a_status_to_apply_from():
    with pytest.raises(ValueError):
        Change("t", {"started_at": 1}, ())


# ---------------------------------------------------- D: the endpoint's calls


BAD_INPUTS = [[], [""], ["x" * 8193], ["x"] * 65, ["ok", 3], "one string", None]


@pytest.mark.parametrize("inputs", BAD_INPUTS)
def test_an_endpoint_task_has_the_api_s_input_rules(inputs):
    for model, body in ((SubmitRequest, {"model": "synthetic", "inputs": inputs}),
                        (contract.EndpointTask, {"task_id": "a", "inputs": inputs})):
        with pytest.raises(ValidationError):
            model.model_validate(body)


def test_an_endpoint_request_is_bounded_by_the_shared_call_limits():
    assert contract.MAX_TASKS_PER_CALL <= contract.ENDPOINT_MAX_TASKS_PER_REQUEST
    assert contract.MAX_INPUTS_PER_CALL <= contract.ENDPOINT_MAX_INPUTS_PER_REQUEST
    request = contract.EndpointTasksRequest
    task = {"task_id": "a", "inputs": ["x"] * 64}
    n = contract.ENDPOINT_MAX_INPUTS_PER_REQUEST // 64
    request.model_validate({"model": "m", "tasks": [task] * n})
    with pytest.raises(ValidationError, match="inputs"):
        request.model_validate({"model": "m", "tasks": [task] * (n + 1)})
    with pytest.raises(ValidationError):
        request.model_validate({"tasks": [{"task_id": "a", "inputs": ["x"]}] * (contract.ENDPOINT_MAX_TASKS_PER_REQUEST + 1)})


@pytest.mark.parametrize("answer", [
    {"task_id": "a"},  # neither
    {"task_id": "a", "result": 1, "error": {"code": "model_error", "message": "m"}},  # both
    {"task_id": "a", "error": "a string, not {code, message}"},
])
def test_a_task_answer_holds_a_result_or_an_error(answer):
    with pytest.raises(ValidationError):
        contract.EndpointTaskAnswer.model_validate(answer)


# ------------------------------------------------------ E: the API's own rules


def test_the_api_parameters_are_the_contract_s_types():
    from fastapi.testclient import TestClient

    from sluice.api.app import create_app
    from sluice.settings import Settings

    document = TestClient(create_app(Settings(models="synthetic"))).get("/openapi.json").json()

    def param(path, verb, name):
        (found,) = [p for p in document["paths"][path][verb]["parameters"] if p["name"] == name]
        return found["schema"]

    def constraints(schema):
        return {k: v for k, v in schema.items() if k in ("type", "minLength", "maxLength", "pattern", "minimum", "maximum")}

    task_id = TypeAdapter(contract.TaskId).json_schema()
    assert constraints(param("/v1/tasks/{task_id}", "get", "task_id")) == constraints(task_id)
    assert constraints(param("/v1/tasks/{task_id}", "delete", "task_id")) == constraints(task_id)
    key = param("/v1/tasks", "post", "Idempotency-Key")["anyOf"][0]
    assert constraints(key) == constraints(TypeAdapter(contract.IdempotencyKey).json_schema())
    assert constraints(param("/v1/tasks/{task_id}", "get", "wait_s")) == constraints(TypeAdapter(contract.WaitSeconds).json_schema())
    health = document["paths"]["/health"]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert health == {"$ref": "#/components/schemas/Health"}
    assert document["components"]["schemas"]["Health"]["properties"]["status"]["const"] == "ok"


def test_every_429_and_503_in_the_api_document_names_retry_after():
    """The API sends it with each (rate limit, backlog, a dependency down):
    a client generated from the document should see it."""
    from fastapi.testclient import TestClient

    from sluice.api.app import create_app
    from sluice.settings import Settings

    document = TestClient(create_app(Settings(models="synthetic"))).get("/openapi.json").json()
    answers = [(path, verb, status, response) for path, verbs in document["paths"].items()
               for verb, operation in verbs.items() for status, response in operation["responses"].items()
               if status in ("429", "503") and path != "/ready"]  # a probe's 503: not ready, no retry asked
    assert len(answers) >= 10
    for path, verb, status, response in answers:
        assert response.get("headers", {}).get("Retry-After", {}).get("schema", {}).get("type") == "string", \
            (path, verb, status)
