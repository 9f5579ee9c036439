"""The HTTP API against the emulator: auth, validation, idempotency, cancel."""

import json
import logging
import time
from types import SimpleNamespace

import pytest
from botocore.client import BaseClient
from botocore.exceptions import ClientError
from fastapi.testclient import TestClient

from sluice.adapters import task_store
from sluice.adapters.api_keys import ApiKeys
from sluice.adapters.payload_store import PayloadStore
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.aws import client as aws_client
from sluice.contract import Priority


def submit(api, key, body=None, **headers):
    body = body or {"model": "synthetic", "inputs": ["hello"]}
    return api.post("/v1/tasks", json=body, headers={"x-api-key": key, **headers})


def asgi_scope(method: str, path: str, query: bytes = b"", headers=()) -> dict:
    """A request as uvicorn hands it to the app: for the tests that drive the
    app over ASGI, where a client can leave mid-request or stall its body."""
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method, "scheme": "http",
            "path": path, "raw_path": path.encode(), "root_path": "", "query_string": query,
            "server": ("127.0.0.1", 8000), "client": ("127.0.0.1", 5000),
            "headers": [(b"host", b"sluice"), (b"content-type", b"application/json"), *headers]}


def nothing_recorded(settings) -> bool:
    ddb = aws_client("dynamodb", settings)
    items = ddb.scan(TableName=settings.tasks_table, Select="COUNT")["Count"]
    queues = PriorityQueues(settings)
    visible = sum(queues.depth(p) for p in Priority)
    return items == 0 and visible == 0


def test_ready_notices_a_queue_that_is_gone(api, settings):
    assert api.get("/ready").status_code == 200  # every queue's URL is now known
    sqs = aws_client("sqs", settings)
    sqs.delete_queue(QueueUrl=sqs.get_queue_url(QueueName=settings.queue_name(Priority.low))["QueueUrl"])
    ready = api.get("/ready")
    assert ready.status_code == 503 and ready.json()["checks"]["queues"] != "ok", ready.text


def test_health_needs_no_key_and_ready_checks_dependencies(api):
    assert api.get("/health").json() == {"status": "ok"}
    ready = api.get("/ready")
    assert ready.status_code == 200 and set(ready.json()["checks"].values()) == {"ok"}


def test_missing_key_is_401_and_unknown_or_revoked_key_is_403(api):
    assert api.get("/v1/models").status_code == 401
    assert api.get("/v1/models", headers={"x-api-key": "sk_nope"}).status_code == 403
    key, _ = api.keys.create("tenant-c")
    assert api.get("/v1/models", headers={"x-api-key": key}).status_code == 200
    api.keys.revoke(key)
    assert api.get("/v1/models", headers={"x-api-key": key}).status_code == 403


def test_a_key_is_revoked_by_its_id_or_by_itself_whatever_its_form(api):
    # make run registers SLUICE_API_KEY as given, which need not start with sk_.
    chosen, _ = api.keys.create("tenant-c", "my-chosen-demo-key")
    generated, record = api.keys.create("tenant-c")
    for key, named in ((chosen, chosen), (generated, record.key_id)):
        assert api.get("/v1/models", headers={"x-api-key": key}).status_code == 200
        assert api.keys.revoke(named).tenant_id == "tenant-c"
        assert api.get("/v1/models", headers={"x-api-key": key}).status_code == 403
    with pytest.raises(LookupError, match="no API key with id or value nothing-like-it"):
        api.keys.revoke("nothing-like-it")
    # Registered again (make run with the same SLUICE_API_KEY on a kept table):
    # said plainly, not handed back as if it worked, to be answered 403.
    with pytest.raises(ValueError, match="revoked"):
        api.keys.create("tenant-c", "my-chosen-demo-key")


@pytest.mark.parametrize("key", ["clé-demo", " padded", "tab\tinside"])
def test_a_chosen_key_no_request_could_carry_is_refused_when_registered(api, key):
    # Stored by the hash of its UTF-8 bytes, read from a header as Latin-1 and
    # stripped: registered, it was answered 403 however it was sent.
    with pytest.raises(ValueError, match="printable ASCII"):
        api.keys.create("tenant-c", key)


def test_a_request_without_a_key_is_401_before_its_body_is_read(api):
    # Not 400 for the body, 413 for its size or 422 for its fields: the caller
    # is refused before the API buffers or parses anything it sent.
    for body, headers in ((b"{not json", {}), (b"{}", {"content-type": "application/json"}),
                          (b"x" * 10, {"content-length": str(10 ** 9)}), (b"{}", {"x-api-key": " "})):
        response = api.post("/v1/tasks", content=body, headers={"content-type": "application/json", **headers})
        assert response.status_code == 401, (headers, response.text)
        assert response.json()["error"]["code"] == "unauthenticated"
    assert api.get("/health").status_code == 200  # no key needed outside /v1/


def test_a_request_with_an_unknown_key_is_403_before_its_body_is_read(api, settings):
    # A made-up key is no key: its megabyte of JSON is never parsed, nor its
    # size held against it; API Gateway too answers 403 before the body.
    for body, headers in ((b"{not json", {}), (b"[" * 10**6, {}), (b"x" * 10, {"content-length": str(10 ** 9)})):
        response = api.post("/v1/tasks", content=body,
                            headers={"content-type": "application/json", "x-api-key": "sk_made_up", **headers})
        assert response.status_code == 403, (headers, response.text[:200])
        assert response.json()["error"]["code"] == "forbidden"
    assert nothing_recorded(settings)


def test_a_key_table_out_of_reach_is_503_with_retry_after(api, monkeypatch):
    from botocore.exceptions import EndpointConnectionError

    def cut(self, key):
        raise EndpointConnectionError(endpoint_url="http://cut")

    monkeypatch.setattr(ApiKeys, "authenticate", cut)
    response = submit(api, "sk_not_cached")
    assert response.status_code == 503 and response.headers["Retry-After"], response.text
    assert response.json()["error"]["code"] == "dependency_unavailable"


def test_a_key_is_read_from_the_table_once_then_answered_from_the_cache(settings):
    # The API answers cached keys on its event loop and reads only a miss in a thread.
    keys = ApiKeys(settings.model_copy(update={"key_cache_s": 60}))
    key, _ = keys.create("tenant-d")
    with pytest.raises(LookupError):
        keys.authenticate_cached(key)
    assert keys.authenticate(key).tenant_id == "tenant-d"
    assert keys.authenticate_cached(key).tenant_id == "tenant-d"
    assert keys.authenticate("sk_unknown") is None
    assert keys.authenticate_cached("sk_unknown") is None  # an unknown key is cached as unknown
    keys.revoke(key)
    with pytest.raises(LookupError):
        keys.authenticate_cached(key)



def test_unknown_keys_cannot_push_known_ones_out_of_the_cache(settings):
    # Guessed keys (a scanner on the LAN) used to fill the cache and clear it,
    # sending every valid key back to a thread and a table read.
    keys = ApiKeys(settings.model_copy(update={"key_cache_s": 60}), cache_size=20)
    key, _ = keys.create("tenant-e")
    assert keys.authenticate(key).tenant_id == "tenant-e"
    for i in range(50):
        assert keys.authenticate(f"sk_guess{i}") is None
    assert keys.authenticate_cached(key).tenant_id == "tenant-e"

def test_submit_returns_202_with_position_and_records_one_task(api, settings):
    response = submit(api, api.key_a, {"model": "synthetic", "inputs": ["a", "b"], "priority": "high"})
    assert response.status_code == 202
    body = response.json()
    assert body["status"] == "queued" and body["priority"] == "high"
    # Fresh queues: nothing ahead, nothing to wait for.
    assert body["queue_position"] == 0 and body["estimated_wait_s"] == 0
    low = submit(api, api.key_a, {"model": "synthetic", "inputs": ["c"], "priority": "low"}).json()
    # Behind the high task; no worker has taken a task yet, so no wait can be estimated.
    assert low["queue_position"] == 1 and low["estimated_wait_s"] is None
    view = api.get(f"/v1/tasks/{body['task_id']}", headers={"x-api-key": api.key_a}).json()
    assert view["status"] == "queued" and view["model"] == "synthetic" and view["model_version"] == "1"


@pytest.mark.parametrize("key", [None, "batch-1"])
def test_a_batchs_tasks_queue_one_behind_another(api, key):
    # On fresh queues: each task of a batch has the batch's earlier tasks of its
    # priority ahead of it (and those of higher ones), not the same position for
    # all; with an Idempotency-Key (its tasks are sent one by one) as without.
    tasks = [{"model": "synthetic", "inputs": [f"t{i}"], "priority": p}
             for i, p in enumerate(["normal", "normal", "high", "normal", "high"])]
    headers = {"x-api-key": api.key_a, **({"Idempotency-Key": key} if key else {})}
    response = api.post("/v1/tasks/batch", json={"tasks": tasks}, headers=headers)
    assert response.status_code == 202, response.text
    positions = [t["queue_position"] for t in response.json()["tasks"]]
    # high: 0, 1; normal: both high tasks ahead, then the normal ones before it.
    assert positions == [2, 3, 0, 4, 1], positions


def test_an_idempotent_retry_of_a_finished_task_has_nothing_ahead(api, runner, settings):
    first = submit(api, api.key_a, {"model": "synthetic", "inputs": ["x"], "priority": "low"},
                   **{"Idempotency-Key": "done-1"}).json()
    submit(api, api.key_a, {"model": "synthetic", "inputs": ["y"], "priority": "high"})  # one ahead of it
    batch = [m for p in Priority for m in PriorityQueues(settings).receive(p, 10, 1, 30)]
    prepared = runner.prepare(batch)
    runner.finish(prepared, runner.infer(prepared.jobs))
    again = submit(api, api.key_a, {"model": "synthetic", "inputs": ["x"], "priority": "low"},
                   **{"Idempotency-Key": "done-1"}).json()
    assert again["task_id"] == first["task_id"] and again["status"] == "succeeded"
    assert again["queue_position"] == 0 and again["estimated_wait_s"] == 0


def test_another_tenants_task_is_not_found(api):
    task_id = submit(api, api.key_a).json()["task_id"]
    for method in (api.get, api.delete):
        response = method(f"/v1/tasks/{task_id}", headers={"x-api-key": api.key_b})
        assert response.status_code == 404


@pytest.mark.parametrize(
    "body, status, field",
    [
        ({"model": "synthetic", "inputs": "not a list"}, 422, "inputs"),
        ({"model": "synthetic", "inputs": [1, 2]}, 422, "inputs.0"),
        ({"model": "no-such-model", "inputs": ["x"]}, 422, "model"),
        ({"model": "synthetic", "inputs": []}, 422, "inputs"),
        ({"model": "synthetic", "inputs": ["x"] * 65}, 422, "inputs"),
        ({"model": "synthetic", "inputs": ["x"], "priority": "urgent"}, 422, "priority"),
        ({"inputs": ["x"]}, 422, "model"),
        ({"model": "synthetic", "inputs": ["x"], "deadline_s": "10"}, 422, "deadline_s"),
        ({"model": "synthetic", "inputs": ["x"], "deadline_s": True}, 422, "deadline_s"),
        # A metadata key is the client's own string: one named "body" is not the body, an empty one is quoted.
        ({"model": "synthetic", "inputs": ["x"], "metadata": {"body": "v" * 257}}, 422, "metadata.body"),
        ({"model": "synthetic", "inputs": ["x"], "metadata": {"": "v"}}, 422, 'metadata."".[key]'),
    ],
)
def test_invalid_requests_name_the_field_and_leave_nothing_behind(api, settings, body, status, field):
    response = submit(api, api.key_a, body)
    assert response.status_code == status, response.text
    details = response.json()["error"]["details"]
    assert any(d["field"] == field for d in details), details
    assert all(d["rule"] for d in details)
    assert nothing_recorded(settings)


@pytest.mark.parametrize("body, where", [
    (b'{"model": "synthetic", "inputs": [', "at character"),  # where the body broke is said in the rule
    (b'\xff\xfe{"model": "synthetic", "inputs": ["x"]}', "unparseable"),  # not UTF-8, as JSON must be
    (b"[" * 100_000 + b"]" * 100_000, "unparseable"),  # nested past what a parser follows
], ids=["truncated", "not utf-8", "nested too deep"])
def test_malformed_json_is_400(api, settings, body, where):
    response = api.post("/v1/tasks", content=body,
                        headers={"x-api-key": api.key_a, "content-type": "application/json"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "malformed_json" and error["message"] == "the request body is not valid JSON"
    assert [d["field"] for d in error["details"]] == ["body"] and where in error["details"][0]["rule"]
    assert nothing_recorded(settings)


def test_oversized_body_is_413(api, settings):
    big = {"model": "synthetic", "inputs": ["x" * 8000] * 64, "metadata": {"k": "v"}}
    response = api.post("/v1/tasks", content=b" " * (settings.max_body_bytes + 1) + b"{}",
                        headers={"x-api-key": api.key_a, "content-type": "application/json"})
    assert response.status_code == 413
    assert response.json()["error"]["details"][0]["field"] == "body"
    assert submit(api, api.key_a, big).status_code == 202  # 512 KB is within the limit


def test_idempotency_key_returns_the_same_task_and_rejects_a_different_body(api, settings):
    first = submit(api, api.key_a, **{"Idempotency-Key": "order-42"})
    again = submit(api, api.key_a, **{"Idempotency-Key": "order-42"})
    assert first.status_code == again.status_code == 202
    assert first.json()["task_id"] == again.json()["task_id"]
    other_tenant = submit(api, api.key_b, **{"Idempotency-Key": "order-42"})
    assert other_tenant.json()["task_id"] != first.json()["task_id"]
    clash = submit(api, api.key_a, {"model": "synthetic", "inputs": ["different"]}, **{"Idempotency-Key": "order-42"})
    assert clash.status_code == 409


def test_the_submit_token_stays_in_the_table_and_out_of_the_answer(api, settings):
    store = TaskStore(settings)
    task_id = submit(api, api.key_a, **{"Idempotency-Key": "token-1"}).json()["task_id"]
    first = store.get(task_id).submit_token
    assert first
    submit(api, api.key_a, **{"Idempotency-Key": "token-1"})  # the retry claims the record with its own token
    assert store.get(task_id).submit_token not in (None, first)
    view = api.get(f"/v1/tasks/{task_id}", headers={"x-api-key": api.key_a})
    assert view.status_code == 200 and "submit_token" not in view.json()
    assert store.get(task_id).submit_token not in view.text


def test_a_refused_reuse_of_an_idempotency_key_leaves_the_first_tasks_inputs_alone(api, settings):
    # Over the inline limit, so both bodies' inputs go to the bucket.
    first_inputs, other_inputs = ["A" * 8000] * 10, ["B" * 8000] * 10
    first = submit(api, api.key_a, {"model": "synthetic", "inputs": first_inputs}, **{"Idempotency-Key": "big-1"})
    assert first.status_code == 202
    clash = submit(api, api.key_a, {"model": "synthetic", "inputs": other_inputs}, **{"Idempotency-Key": "big-1"})
    assert clash.status_code == 409
    (message,) = PriorityQueues(settings).receive(Priority.normal, 10, 1, 30)
    task = message.task()
    assert task.task_id == first.json()["task_id"] and task.inputs_key
    assert PayloadStore(settings).get_json(task.inputs_key) == first_inputs


def test_a_batch_idempotency_key_replays_its_batch_and_refuses_another_before_writing(api, settings):
    def batch(*inputs, key="batch-7"):
        tasks = [{"model": "synthetic", "inputs": [x]} for x in inputs]
        return api.post("/v1/tasks/batch", json={"tasks": tasks}, headers={"x-api-key": api.key_a, "Idempotency-Key": key})

    first = batch("a", "b")
    assert first.status_code == 202
    ids = [t["task_id"] for t in first.json()["tasks"]]
    assert [t["task_id"] for t in batch("a", "b").json()["tasks"]] == ids
    for changed in (("a", "b", "c"), ("a", "x"), ("a",)):
        response = batch(*changed)
        assert response.status_code == 409, changed
        assert response.json()["error"]["details"][0]["field"] == "header.Idempotency-Key"
    ddb = aws_client("dynamodb", settings)
    assert ddb.scan(TableName=settings.tasks_table, Select="COUNT")["Count"] == 2
    # A single submit's key never names a batch's task.
    single = submit(api, api.key_a, **{"Idempotency-Key": "batch-8#0"})
    other = batch("y", "z", key="batch-8")
    assert single.status_code == other.status_code == 202
    assert single.json()["task_id"] not in {t["task_id"] for t in other.json()["tasks"]}


def test_batch_submit_records_every_task(api, settings):
    tasks = [{"model": "synthetic", "inputs": [f"t{i}"], "priority": p}
             for i, p in enumerate(["high", "normal", "low"] * 10)]
    response = api.post("/v1/tasks/batch", json={"tasks": tasks}, headers={"x-api-key": api.key_a})
    assert response.status_code == 202
    ids = [t["task_id"] for t in response.json()["tasks"]]
    assert len(set(ids)) == 30
    assert len(TaskStore(settings).get_many(ids)) == 30
    too_many = api.post("/v1/tasks/batch", json={"tasks": tasks * 4}, headers={"x-api-key": api.key_a})
    assert too_many.status_code == 422 and too_many.json()["error"]["details"][0]["field"] == "tasks"


def test_batch_with_bad_models_names_each_and_records_nothing(api, settings):
    # Every task whose model is not served, in one answer, as a schema error names every field.
    tasks = [{"model": "synthetic", "inputs": ["ok"]}, {"model": "nope", "inputs": ["x"]},
             {"model": "synthetic", "inputs": ["ok"]}, {"model": "nope2", "inputs": ["x"]}]
    response = api.post("/v1/tasks/batch", json={"tasks": tasks}, headers={"x-api-key": api.key_a})
    assert response.status_code == 422
    error = response.json()["error"]
    assert [d["field"] for d in error["details"]] == ["tasks.1.model", "tasks.3.model"]
    assert error["message"] == "unknown model 'nope', 'nope2'"
    assert all(d["rule"] == "must be one of: synthetic" for d in error["details"]), error
    assert nothing_recorded(settings)


def test_cancel_a_queued_task_then_it_is_final(api):
    task_id = submit(api, api.key_a).json()["task_id"]
    cancelled = api.delete(f"/v1/tasks/{task_id}", headers={"x-api-key": api.key_a})
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "cancelled"
    assert api.delete(f"/v1/tasks/{task_id}", headers={"x-api-key": api.key_a}).json()["status"] == "cancelled"


def test_openapi_docs_are_served(api):
    assert api.get("/docs").status_code == 200
    schema = api.get("/openapi.json").json()
    # /ready answers its own shape, also when not ready, not the error body.
    ready = schema["paths"]["/ready"]["get"]["responses"]
    assert {ready[c]["content"]["application/json"]["schema"]["$ref"] for c in ("200", "503")} == {
        "#/components/schemas/Readiness"}
    assert "SubmitRequest" in schema["components"]["schemas"]
    assert "/v1/tasks/{task_id}" in schema["paths"]


def test_the_parameters_keep_the_contract_s_rules(api):
    headers = {"x-api-key": api.key_a}
    task_id = submit(api, api.key_a).json()["task_id"]
    assert api.get(f"/v1/tasks/{task_id}?wait_s=0.1", headers=headers).status_code == 200
    for path in ("x" * 65, "not.an.id", f"{task_id}?wait_s=20.5", f"{task_id}?wait_s=-1"):
        response = api.get(f"/v1/tasks/{path}", headers=headers)
        assert response.status_code == 422, path
    assert api.delete("/v1/tasks/" + "x" * 65, headers=headers).status_code == 422
    assert submit(api, api.key_a, **{"Idempotency-Key": "k" * 129}).status_code == 422
    assert submit(api, api.key_a, **{"Idempotency-Key": "k" * 128}).status_code == 202


@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "NaN"])
def test_a_wait_that_is_not_a_finite_number_says_so(api, value):
    # nan fails every comparison, so the bound rules named it "less_than_equal".
    task_id = submit(api, api.key_a).json()["task_id"]
    response = api.get(f"/v1/tasks/{task_id}?wait_s={value}", headers={"x-api-key": api.key_a})
    assert response.status_code == 422, response.text
    [detail] = response.json()["error"]["details"]
    assert detail["field"] == "query.wait_s" and detail["rule"].startswith("finite_number"), detail


def test_a_long_poll_that_times_out_answers_the_task_s_current_state(api, settings, entered_waiters):
    # A retry's error and attempt, recorded while the GET waits, are in its answer.
    import threading

    from sluice.contract import TaskStatus, now_ms
    from tests.reliability.harness import wait_until

    task_id = submit(api, api.key_a).json()["task_id"]
    waiters = entered_waiters
    answered = []
    waiting = threading.Thread(target=lambda: answered.append(api.get(
        f"/v1/tasks/{task_id}?wait_s=6", headers={"x-api-key": api.key_a})), daemon=True)  # room on a busy CI
    waiting.start()
    wait_until(lambda: waiters and waiters[-1]._waiting.get(task_id), 10, "the long poll to park")
    TaskStore(settings).apply(task_store.Change(
        task_id, {"error_code": "model_error", "error_message": "boom", "started_at": now_ms()},
        (TaskStatus.queued,), add_attempt=True))
    waiting.join(15)
    [response] = answered
    view = response.json()
    assert response.status_code == 200 and view["status"] == "queued", response.text
    assert view["attempts"] == 1 and view["error"] == {"code": "model_error", "message": "boom"}, view


def test_a_long_poll_reads_its_task_on_a_backed_off_schedule(api, monkeypatch):
    # DynamoDB bills each item a BatchGetItem reads. Reading the task every
    # 50 ms round, a 6 s wait read it 105-120 times (54 in a reviewer's 3.1 s);
    # on the waiter's schedule: the first look, about 40 reads in the first 2 s
    # (every round), 12 until 5 s (every 250 ms), then 1 or 2.
    task_id = submit(api, api.key_a).json()["task_id"]
    real = BaseClient._make_api_call
    reads = []

    def counted(client, operation, params):
        if operation == "BatchGetItem":
            reads.extend(k["task_id"]["S"] for t in params["RequestItems"].values() for k in t["Keys"])
        return real(client, operation, params)

    monkeypatch.setattr(BaseClient, "_make_api_call", counted)
    response = api.get(f"/v1/tasks/{task_id}?wait_s=6", headers={"x-api-key": api.key_a})
    assert response.status_code == 200 and response.json()["status"] == "queued", response.text
    assert 20 <= reads.count(task_id) <= 60, reads.count(task_id)


def test_a_number_too_long_to_parse_is_400_naming_the_body(api, settings):
    # Python refuses to parse an integer of over 4300 digits (CVE-2020-10735).
    body = b'{"model": "synthetic", "inputs": ["a"], "metadata": {"n": ' + b"9" * 5000 + b"}}"
    response = api.post("/v1/tasks", content=body,
                        headers={"x-api-key": api.key_a, "content-type": "application/json"})
    assert response.status_code == 400, response.text
    details = response.json()["error"]["details"]
    assert [d["field"] for d in details] == ["body"] and all(d["rule"] for d in details), details
    assert nothing_recorded(settings)


def test_a_body_not_sent_as_json_is_415_naming_the_header(api):
    # curl -d without -H 'Content-Type: application/json' sends a form type.
    body = '{"model": "synthetic", "inputs": ["a"]}'
    for content_type in ("application/x-www-form-urlencoded", "text/plain"):
        response = api.post("/v1/tasks", content=body, headers={"x-api-key": api.key_a, "content-type": content_type})
        assert response.status_code == 415, response.text
        error = response.json()["error"]
        assert error["code"] == "unsupported_media_type"
        assert error["details"] == [{"field": "header.Content-Type", "rule": f"must be application/json, not {content_type}"}]
    sent = api.post("/v1/tasks", content=body,
                    headers={"x-api-key": api.key_a, "content-type": "application/json; charset=utf-8"})
    assert sent.status_code == 202


def test_a_body_sent_without_a_content_type_is_415_naming_the_header(api, settings):
    # FastAPI leaves such a body unread, so the schema would blame the body for a missing header.
    for path, body in (("/v1/tasks", b'{"model": "synthetic", "inputs": ["a"]}'),
                       ("/v1/tasks/batch", b'{"tasks": [{"model": "synthetic", "inputs": ["a"]}]}')):
        response = api.post(path, content=body, headers={"x-api-key": api.key_a})
        assert "content-type" not in response.request.headers
        assert response.status_code == 415, response.text
        error = response.json()["error"]
        assert error["code"] == "unsupported_media_type"
        assert [d["field"] for d in error["details"]] == ["header.Content-Type"] and error["details"][0]["rule"]
    # Neither a header nor a body: it is the body that is missing.
    empty = api.post("/v1/tasks", headers={"x-api-key": api.key_a})
    assert empty.status_code == 422 and empty.json()["error"]["details"][0]["field"] == "body", empty.text
    assert nothing_recorded(settings)


def _put_finds_a_record_that_is_gone_when_read(settings, monkeypatch, times: int) -> list[str]:
    """What dynalite (`make run`) does when a submit's rollback deletes the
    record between a conditional put that found it and the read back of it:
    the put fails without returning the record, and the read finds none.
    Returns the task ids this happened to."""
    real, vanished = BaseClient._make_api_call, []

    def put(client, operation, params):
        if operation != "PutItem" or params["TableName"] != settings.tasks_table or len(vanished) >= times:
            return real(client, operation, params)
        key = {"task_id": params["Item"]["task_id"]}
        real(client, "DeleteItem", {"TableName": settings.tasks_table, "Key": key})
        vanished.append(key["task_id"]["S"])
        raise ClientError({"Error": {"Code": "ConditionalCheckFailedException", "Message": "found"}}, "PutItem")

    monkeypatch.setattr(BaseClient, "_make_api_call", put)
    return vanished


def test_an_idempotent_retry_whose_record_vanishes_before_it_is_read_creates_it_afresh(api, settings, monkeypatch):
    store = TaskStore(settings)
    first = submit(api, api.key_a, **{"Idempotency-Key": "gone-1"}).json()
    first_token = store.get(first["task_id"]).submit_token
    vanished = _put_finds_a_record_that_is_gone_when_read(settings, monkeypatch, times=1)
    again = submit(api, api.key_a, **{"Idempotency-Key": "gone-1"})
    assert vanished == [first["task_id"]]
    assert again.status_code == 202, again.text
    assert again.json()["task_id"] == first["task_id"] and again.json()["status"] == "queued"
    assert store.get(first["task_id"]).submit_token not in (None, first_token)


def test_an_idempotent_submit_whose_record_keeps_vanishing_is_503_and_leaves_nothing(api, settings, monkeypatch):
    vanished = _put_finds_a_record_that_is_gone_when_read(settings, monkeypatch, times=1000)
    response = submit(api, api.key_a, **{"Idempotency-Key": "gone-2"})
    assert response.status_code == 503 and response.headers["Retry-After"], response.text
    assert len(vanished) == 2  # the put was tried afresh once
    assert response.json()["error"]["code"] == "dependency_unavailable"
    assert nothing_recorded(settings)


def test_a_long_poll_the_table_keeps_throttling_is_503_with_retry_after(api, monkeypatch):
    task_id = submit(api, api.key_a).json()["task_id"]
    real = BaseClient._make_api_call

    def throttled(client, operation, params):
        if operation == "BatchGetItem":  # DynamoDB's answer to throttling: the keys back, unread
            return {"Responses": {}, "UnprocessedKeys": params["RequestItems"]}
        return real(client, operation, params)

    monkeypatch.setattr(BaseClient, "_make_api_call", throttled)
    monkeypatch.setattr(task_store, "time", SimpleNamespace(sleep=lambda _: None))  # no backoff between tries
    response = api.get(f"/v1/tasks/{task_id}?wait_s=2", headers={"x-api-key": api.key_a})
    assert response.status_code == 503 and response.headers["Retry-After"], response.text
    assert response.json()["error"]["code"] == "dependency_unavailable"


def test_the_openapi_document_lists_each_routes_own_errors(api):
    paths = api.get("/openapi.json").json()["paths"]

    def errors(path, method):
        return {int(s) for s in paths[path][method]["responses"] if int(s) >= 400}

    assert errors("/health", "get") == set()
    assert errors("/v1/models", "get") == {401, 403, 413, 429, 503}
    assert errors("/v1/tasks", "post") == {400, 401, 403, 409, 413, 415, 422, 429, 503}
    assert errors("/v1/tasks/{task_id}", "get") == {401, 403, 404, 413, 422, 429, 503}
    assert errors("/v1/tasks/{task_id}", "delete") == {401, 403, 404, 409, 413, 422, 429, 503}


@pytest.mark.parametrize("method, path", [("GET", "/v1/models"), ("GET", "/v1/tasks/t-1"),
                                          ("DELETE", "/v1/tasks/t-1")])
def test_a_route_that_takes_no_body_answers_an_oversized_one_with_a_413_it_declares(api, settings, method, path):
    response = api.request(method, path, content=b" " * (settings.max_body_bytes + 1),
                           headers={"x-api-key": api.key_a})
    assert response.status_code == 413 and response.json()["error"]["code"] == "payload_too_large"
    route = path.replace("t-1", "{task_id}")
    assert "413" in api.get("/openapi.json").json()["paths"][route][method.lower()]["responses"]


def test_a_path_with_a_trailing_slash_is_not_found_rather_than_redirected(api):
    # A redirect is in no route's contract, and clients that post (the CLI
    # among them) do not follow one.
    response = api.post("/v1/tasks/", json={"model": "synthetic", "inputs": ["x"]},
                        headers={"x-api-key": api.key_a}, follow_redirects=False)
    assert response.status_code == 404 and response.json()["error"]["code"] == "not_found"


@pytest.mark.parametrize("method, path, allowed", [
    ("PUT", "/v1/tasks/t-1", "DELETE, GET"),
    ("OPTIONS", "/v1/tasks/t-1", "DELETE, GET"),
    ("GET", "/v1/tasks", "POST"),
    ("PATCH", "/health", "GET"),
])
def test_a_method_not_served_is_a_405_naming_every_method_of_the_path(api, method, path, allowed):
    response = api.request(method, path, headers={"x-api-key": api.key_a})
    assert response.status_code == 405
    assert response.headers["allow"] == allowed  # Starlette named only the first route's: GET
    assert response.json()["error"]["code"] == "method_not_allowed"


def test_a_bug_answers_500_without_leaving_the_app(api, monkeypatch, caplog):
    """As tests/unit/test_lambda_api.py checks through Mangum: the exception ends
    in the app (the TestClient re-raises one that leaves it, as uvicorn logs it
    then, message and all), and its message, which may quote the payload, is in no log."""
    from sluice.api.service import TaskService

    def submit(self, tenant_id, request, idempotency_key):
        raise RuntimeError(f"could not handle {request.inputs[0]}")  # as a library error may quote its input

    monkeypatch.setattr(TaskService, "submit", submit)
    caplog.set_level(logging.DEBUG)
    strict = TestClient(api.app)  # raises what leaves the app (the fixture's client answers it 500)
    response = strict.post("/v1/tasks", json={"model": "synthetic", "inputs": ["SECRET-PAYLOAD"]},
                           headers={"x-api-key": api.key_a})
    assert response.status_code == 500 and response.json()["error"]["code"] == "internal_error"
    assert "unhandled RuntimeError" in caplog.text and "SECRET-PAYLOAD" not in caplog.text


def test_the_app_drains_pending_rollbacks_as_it_shuts_down(settings, monkeypatch):
    from sluice.api import app as api_app
    from sluice.api.service import Compensator

    drained = []
    monkeypatch.setattr(Compensator, "drain", lambda self, timeout_s: drained.append(timeout_s) or [])
    with TestClient(api_app.create_app(settings)) as api:
        assert api.get("/health").status_code == 200
        assert drained == []
    assert drained == [api_app.ROLLBACK_DRAIN_S]


def test_a_long_poll_stops_reading_once_its_client_has_gone(settings, entered_waiters):
    # Driven as uvicorn drives the app (ASGI), since only there can a client
    # leave mid-request: its receive() yields http.disconnect.
    import asyncio

    from sluice.api.app import create_app

    key = ApiKeys(settings).create("tenant-a")[0]
    app = create_app(settings)

    async def scenario():
        sent, gone = [], asyncio.Event()

        async def send(message):
            sent.append(message)

        async def call(method, path, query=b"", body=b""):
            delivered = False

            async def receive():
                nonlocal delivered
                if not delivered:
                    delivered = True
                    return {"type": "http.request", "body": body, "more_body": False}
                await gone.wait()
                return {"type": "http.disconnect"}

            await app(asgi_scope(method, path, query, [(b"x-api-key", key.encode())]), receive, send)

        await call("POST", "/v1/tasks", body=b'{"model": "synthetic", "inputs": ["left"]}')
        task_id = json.loads(sent[-1]["body"])["task_id"]
        polling = asyncio.create_task(call("GET", f"/v1/tasks/{task_id}", b"wait_s=20"))
        for _ in range(200):  # bounded: 10 s for the GET to park in the waiter
            if entered_waiters and entered_waiters[-1]._waiting.get(task_id):
                break
            await asyncio.sleep(0.05)
        else:
            raise AssertionError("the long poll never parked")
        gone.set()  # the client closes its connection
        await asyncio.wait_for(polling, 5)  # not the 20 s it asked to wait
        assert task_id not in entered_waiters[-1]._waiting  # nothing left to read for it

    asyncio.run(scenario())


@pytest.mark.parametrize("method, path", [("POST", "/health"), ("PUT", "/anything")])
def test_a_body_sent_where_no_route_takes_one_is_not_read(settings, method, path):
    # Outside /v1/ no key is asked: buffering the body there held up to 1 MiB
    # for a client that trickled it and stalled, before any answer.
    import asyncio

    from sluice.api.app import create_app

    app = create_app(settings)

    async def scenario():
        sent, chunks_read = [], []

        async def receive():
            if len(chunks_read) < 15:
                chunks_read.append(1)
                return {"type": "http.request", "body": b"x" * 65536, "more_body": True}
            await asyncio.Event().wait()  # the client stalls, its body unfinished

        async def send(message):
            sent.append(message)

        await asyncio.wait_for(app(asgi_scope(method, path), receive, send), 5)
        return sent[0]["status"], len(chunks_read)

    status, read = asyncio.run(scenario())
    assert status in (404, 405) and read <= 1, (status, read)


def test_a_submit_whose_records_the_table_keeps_leaving_unprocessed_is_503_and_sends_nothing(
        api, settings, monkeypatch):
    # DynamoDB answers a throttled BatchWriteItem with UnprocessedItems, not an
    # error. Taken as written, the message went out and the client got a 202
    # for a task with no record: a worker drops it as rolled back, a GET is 404.
    real = BaseClient._make_api_call

    def throttled(client, operation, params):
        if operation == "BatchWriteItem":
            return {"UnprocessedItems": params["RequestItems"]}
        return real(client, operation, params)

    monkeypatch.setattr(BaseClient, "_make_api_call", throttled)
    monkeypatch.setattr(task_store, "time", SimpleNamespace(sleep=lambda _: None, time=time.time))  # no backoff
    response = submit(api, api.key_a)
    assert response.status_code == 503 and response.headers["Retry-After"], response.text
    assert response.json()["error"]["code"] == "dependency_unavailable"
    assert nothing_recorded(settings)
