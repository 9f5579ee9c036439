"""The SageMaker serving entrypoint (containers/sagemaker/serve.py): protocol in-process
against fake models, then the real entrypoint as a process with the real MiniLM."""

from __future__ import annotations

import http.client
import importlib.util
import json
import math
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from models.base import ModelInputError
from models.synthetic import SyntheticModel

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "containers" / "sagemaker" / "serve.py"

spec = importlib.util.spec_from_file_location("sluice_sagemaker_serve", SERVE)
serve = importlib.util.module_from_spec(spec)
spec.loader.exec_module(serve)


class Recording:
    """Echoes its inputs and records each batch it was given."""

    name, version, max_batch_size, description = "echo", "1", 4, "echo"

    def __init__(self):
        self.batches: list[list[str]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.broken = False  # fails every batch, as a GPU after a sticky CUDA error

    def predict_batch(self, inputs):
        self.entered.set()
        assert self.gate.wait(10), "test never released the model"
        if self.broken:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        if any("!bad" in t for t in inputs):
            raise ModelInputError("refuses '!bad'")
        if any("!crash" in t for t in inputs):
            raise RuntimeError("secret internal detail")
        self.batches.append(list(inputs))
        return [t.upper() for t in inputs]

    def result_for_task(self, outputs):
        return {"outputs": outputs}


@pytest.fixture()
def server():
    model = Recording()
    endpoint = serve.Endpoint({"echo": model}, default_model="echo", max_payload_bytes=16384)
    srv = serve.make_server(endpoint, "127.0.0.1", 0)
    # A short poll interval keeps shutdown() (and so each test's teardown) quick.
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    yield srv.server_address[1], model
    srv.shutdown()
    srv.server_close()
    thread.join(5)


def call(port, method, path, body=None, content_type="application/json", conn=None):
    conn = conn or http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    headers = {"Content-Type": content_type} if data is not None else {}
    conn.request(method, path, body=data, headers=headers)
    response = conn.getresponse()
    return response.status, json.loads(response.read())


def test_ping(server):
    port, _ = server
    assert call(port, "GET", "/ping") == (200, {"status": "ok", "models": ["echo"]})


def test_a_batch_runs_in_chunks_of_max_batch_size_in_order(server):
    port, model = server
    texts = [f"t{i}" for i in range(10)]
    status, body = call(port, "POST", "/invocations", {"inputs": texts})
    assert status == 200
    assert body == {"model": "echo", "model_version": "1", "result": {"outputs": [t.upper() for t in texts]}}
    assert [len(b) for b in model.batches] == [4, 4, 2]


def test_a_bare_list_is_the_batch_and_keep_alive_reuses_the_connection(server):
    port, _ = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    assert call(port, "POST", "/invocations", ["a", "b"], conn=conn)[1]["result"] == {"outputs": ["A", "B"]}
    assert call(port, "POST", "/invocations", {"model": "echo", "inputs": ["c"]}, conn=conn)[0] == 200
    assert call(port, "GET", "/ping", conn=conn)[0] == 200


@pytest.mark.parametrize(
    ("body", "content_type", "status", "code"),
    [
        (b"{not json", "application/json", 400, "malformed_json"),
        (b"[" * 16000, "application/json", 400, "malformed_json"),  # deeper than the parser recurses
        ({"inputs": []}, "application/json", 400, "validation_error"),
        ({"inputs": "one string"}, "application/json", 400, "validation_error"),
        ({"inputs": ["ok", 3]}, "application/json", 400, "validation_error"),
        ({"inputs": ["x" * 9000]}, "application/json", 400, "validation_error"),
        ("42", "application/json", 400, "validation_error"),
        ({"model": "nope", "inputs": ["a"]}, "application/json", 400, "unknown_model"),
        ({"inputs": ["a"]}, "text/csv", 415, "unsupported_media_type"),
        ({"inputs": ["y" * 20000]}, "application/json", 413, "payload_too_large"),
        ({"inputs": ["fine", "!bad"]}, "application/json", 400, "invalid_input"),
        ({"model": ["echo"], "inputs": ["a"]}, "application/json", 400, "validation_error"),
        ({"inputs": ["a"] * (1025)}, "application/json", 400, "validation_error"),
    ],
)
def test_bad_requests_get_json_errors(server, body, content_type, status, code):
    port, _ = server
    got_status, got = call(port, "POST", "/invocations", body, content_type)
    assert (got_status, got["error"]["code"]) == (status, code)


def test_a_content_length_of_other_than_ascii_digits_is_refused_with_411(server):
    # "²" passes str.isdigit() but not int(): the connection was dropped unanswered.
    port, _ = server
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("POST", "/invocations")
    conn.putheader("Content-Type", "application/json")
    conn.putheader("Content-Length", "\u00b2".encode("latin-1"))
    conn.endheaders()
    response = conn.getresponse()
    assert (response.status, json.loads(response.read())["error"]["code"]) == (411, "length_required")


def test_a_model_crash_is_500_without_internals(server):
    port, _ = server
    status, body = call(port, "POST", "/invocations", {"inputs": ["!crash"]})
    assert status == 500
    assert "secret" not in json.dumps(body)


def test_many_tasks_share_the_model_batches_and_keep_their_order(server):
    port, model = server
    tasks = [{"task_id": f"task-{i}", "inputs": [f"t{i}-{j}" for j in range(i + 1)]} for i in range(4)]
    status, body = call(port, "POST", "/invocations", {"model": "echo", "tasks": tasks})
    assert status == 200
    assert body == {
        "model": "echo",
        "model_version": "1",
        "tasks": [{"task_id": t["task_id"], "result": {"outputs": [x.upper() for x in t["inputs"]]}} for t in tasks],
    }
    # 10 inputs of 4 tasks packed together, not one model call per task.
    assert model.batches == [["t0-0", "t1-0", "t1-1", "t2-0"], ["t2-1", "t2-2", "t3-0", "t3-1"], ["t3-2", "t3-3"]]


def test_only_the_poison_task_fails_among_healthy_ones():
    endpoint = serve.Endpoint({"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)}, default_model="synthetic")
    tasks = [{"task_id": f"ok-{i}", "inputs": [f"text {i}", "more"]} for i in range(7)]
    tasks.insert(5, {"task_id": "poison", "inputs": ["fine", "boom !fail"]})
    body = json.loads(serve.body_of(endpoint.invoke(json.dumps({"model": "synthetic", "tasks": tasks}).encode(),
                                                    "application/json")))
    assert [a["task_id"] for a in body["tasks"]] == [t["task_id"] for t in tasks]
    for task, answer in zip(tasks, body["tasks"]):
        if task["task_id"] == "poison":
            assert "result" not in answer and answer["error"]["code"] == "invalid_input"
            assert "!fail" in answer["error"]["message"]
        else:
            assert "error" not in answer
            assert [o["length"] for o in answer["result"]["outputs"]] == [len(t) for t in task["inputs"]]


class ScoresJsonCannotHold(Recording):
    """A team's first classifier: a score JSON cannot hold (numpy's float32, say) for '!numpy' inputs."""

    def result_for_task(self, outputs):
        return {"outputs": outputs, "score": object() if any("!NUMPY" in o for o in outputs) else 0.5}


def test_a_result_json_cannot_hold_is_that_tasks_error_not_the_call_s():
    # It used to fail the whole reply's serialization: a 500, every task's attempt.
    endpoint = serve.Endpoint({"echo": ScoresJsonCannotHold()}, default_model="echo")
    tasks = [{"task_id": "ok", "inputs": ["a"]}, {"task_id": "numpy", "inputs": ["!numpy"]}]
    body = json.loads(serve.body_of(endpoint.invoke(json.dumps({"model": "echo", "tasks": tasks}).encode(),
                                                    "application/json")))
    ok, bad = body["tasks"]
    assert ok == {"task_id": "ok", "result": {"outputs": ["A"], "score": 0.5}}
    assert bad["error"]["code"] == "invalid_result" and "not JSON" in bad["error"]["message"]


@pytest.mark.parametrize("answer", [lambda inputs: {"labels": inputs}, lambda inputs: inputs[:-1]])
def test_an_answer_other_than_one_output_per_input_fails_the_call_s_tasks(answer):
    """A dict of columns used to give out its keys as outputs, one per task."""
    model = Recording()
    model.predict_batch = answer
    endpoint = serve.Endpoint({"echo": model}, default_model="echo")
    tasks = [{"task_id": "a", "inputs": ["x"]}, {"task_id": "b", "inputs": ["y"]}]
    body = json.loads(serve.body_of(endpoint.invoke(json.dumps({"model": "echo", "tasks": tasks}).encode(),
                                                    "application/json")))
    assert [a.get("error", {}).get("code") for a in body["tasks"]] == ["model_error", "model_error"]


def test_a_crash_in_the_many_task_form_is_that_tasks_error_without_internals(server):
    port, _ = server
    tasks = [{"task_id": "a", "inputs": ["x"]}, {"task_id": "b", "inputs": ["!crash"]}, {"task_id": "c", "inputs": ["y"]}]
    status, body = call(port, "POST", "/invocations", {"tasks": tasks})
    assert status == 200
    assert body["tasks"][0] == {"task_id": "a", "result": {"outputs": ["X"]}}
    assert body["tasks"][1]["error"]["code"] == "model_error"
    assert body["tasks"][2] == {"task_id": "c", "result": {"outputs": ["Y"]}}
    assert "secret" not in json.dumps(body)


def test_a_task_with_bad_inputs_fails_alone(server):
    port, _ = server
    tasks = [{"task_id": "a", "inputs": ["x"]}, {"task_id": "b", "inputs": []}, {"task_id": "c", "inputs": ["z" * 9000]}]
    status, body = call(port, "POST", "/invocations", {"tasks": tasks})
    assert status == 200
    assert body["tasks"][0] == {"task_id": "a", "result": {"outputs": ["X"]}}
    assert [a["error"]["code"] for a in body["tasks"][1:]] == ["validation_error", "validation_error"]


def test_requests_and_replies_are_the_contract_s_models(server):
    from sluice.contract import EndpointResult, EndpointTasksReply, ErrorResponse

    port, model = server
    status, body = call(port, "POST", "/invocations", {"inputs": ["a"]})
    assert status == 200 and EndpointResult.model_validate(body).result == {"outputs": ["A"]}
    tasks = [{"task_id": "a", "inputs": ["x"]}, {"task_id": "b", "inputs": ["y", ""]}, {"task_id": "c", "inputs": ["!bad"]}]
    status, body = call(port, "POST", "/invocations", {"tasks": tasks})
    reply = EndpointTasksReply.model_validate(body)
    assert status == 200 and [a.task_id for a in reply.tasks] == ["a", "b", "c"]
    assert [a.error.code if a.error else a.result for a in reply.tasks] == [
        {"outputs": ["X"]}, "validation_error", "invalid_input"]
    assert reply.tasks[1].error.message.startswith("tasks.1.inputs.1: ")  # named as the API names a field
    # Every task refused: answered without running the model.
    status, body = call(port, "POST", "/invocations", {"tasks": [{"task_id": "d", "inputs": []}]})
    assert status == 200 and EndpointTasksReply.model_validate(body).tasks[0].error.code == "validation_error"
    assert model.batches == [["a"], ["x"]]
    status, body = call(port, "POST", "/invocations", b"{not json")
    assert status == 400 and ErrorResponse.model_validate(body).error.code == "malformed_json"


@pytest.mark.parametrize(
    ("body", "status", "code"),
    [
        ({"tasks": []}, 400, "validation_error"),
        ({"tasks": "nope"}, 400, "validation_error"),
        ({"tasks": [{"inputs": ["a"]}]}, 400, "validation_error"),
        ({"tasks": ["a"]}, 400, "validation_error"),
        ({"model": "nope", "tasks": [{"task_id": "a", "inputs": ["a"]}]}, 400, "unknown_model"),
        ({"tasks": [{"task_id": f"t{i}", "inputs": ["y" * 4000]} for i in range(5)]}, 413, "payload_too_large"),
        ({"tasks": [{"task_id": f"t{i}", "inputs": ["a"]} for i in range(101)]}, 400, "validation_error"),
        ({"tasks": [{"task_id": f"t{i}", "inputs": ["a"] * 64} for i in range(17)]}, 400, "validation_error"),
    ],
)
def test_bad_many_task_requests_get_json_errors(server, body, status, code):
    port, _ = server
    got_status, got = call(port, "POST", "/invocations", body)
    assert (got_status, got["error"]["code"]) == (status, code)


def test_a_task_over_the_contract_s_inputs_fails_alone(server):
    port, _ = server
    tasks = [{"task_id": "ok", "inputs": ["a"]}, {"task_id": "big", "inputs": ["b"] * 65}]
    status, body = call(port, "POST", "/invocations", {"tasks": tasks})
    assert status == 200
    assert body["tasks"][0] == {"task_id": "ok", "result": {"outputs": ["A"]}}
    assert body["tasks"][1]["error"]["code"] == "validation_error" and "64" in body["tasks"][1]["error"]["message"]


def test_the_configured_batch_size_caps_the_model_s_own():
    model = Recording()  # its own limit is 4
    endpoint = serve.Endpoint({"echo": model}, default_model="echo", max_batch_size=3)
    answer = endpoint.invoke(json.dumps({"inputs": [f"t{i}" for i in range(7)]}).encode(), "application/json")
    assert answer.result["outputs"] == [f"T{i}" for i in range(7)]
    assert [len(b) for b in model.batches] == [3, 3, 1]


def test_the_payload_limit_holds_for_a_body_handed_over_directly():
    endpoint = serve.Endpoint({"echo": Recording()}, default_model="echo", max_payload_bytes=100)
    with pytest.raises(serve.RequestError) as err:
        endpoint.invoke(json.dumps({"tasks": [{"task_id": "a", "inputs": ["x" * 200]}]}).encode(), "application/json")
    assert err.value.code == "payload_too_large"


def test_unknown_routes_are_404(server):
    port, _ = server
    assert call(port, "GET", "/nope")[0] == 404
    assert call(port, "POST", "/ping", {"inputs": ["a"]})[0] == 404


def test_ping_answers_while_a_batch_is_running(server):
    port, model = server
    model.gate.clear()
    result = {}
    worker = threading.Thread(target=lambda: result.update(r=call(port, "POST", "/invocations", {"inputs": ["slow"]})))
    worker.start()
    assert model.entered.wait(10)
    started = time.monotonic()
    assert call(port, "GET", "/ping")[0] == 200
    assert time.monotonic() - started < 2  # SageMaker's health check deadline
    model.gate.set()
    worker.join(10)
    assert result["r"][0] == 200


def test_a_stop_answers_the_invocations_in_flight_before_the_process_exits():
    # The handler threads are daemons: at exit they were cut off mid-call, each
    # task of the call an attempt spent, its caller seeing the connection drop.
    model = Recording()
    endpoint = serve.Endpoint({"echo": model}, default_model="echo")
    srv = serve.make_server(endpoint, "127.0.0.1", 0)
    serving = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    serving.start()
    model.gate.clear()
    result = {}
    caller = threading.Thread(target=lambda: result.update(r=call(srv.server_address[1], "POST", "/invocations",
                                                                  {"inputs": ["slow"]})))
    caller.start()
    try:
        assert model.entered.wait(10)
        assert endpoint.wait_idle(0.05) == 1  # bounded: the call is still running
        stopping = threading.Thread(target=serve.stop_serving, args=(srv, endpoint, 10))
        stopping.start()
        serving.join(10)
        assert not serving.is_alive()  # no new calls are taken
        assert stopping.is_alive()  # but the one in flight is waited for
        model.gate.set()
        stopping.join(10)
        caller.join(10)
        assert not stopping.is_alive() and result["r"][0] == 200 and result["r"][1]["result"], result
    finally:
        model.gate.set()
        srv.server_close()


def tasks_of(*inputs):
    return {"tasks": [{"task_id": f"t{i}", "inputs": [text]} for i, text in enumerate(inputs)]}


def fail_every_task(port, calls, n_tasks=2):
    for _ in range(calls):
        status, body = call(port, "POST", "/invocations", tasks_of(*(["x"] * n_tasks)))
        assert status == 200 and {a["error"]["code"] for a in body["tasks"]} == {"model_error"}, body


def test_a_broken_model_is_found_however_well_another_model_of_the_endpoint_works():
    # A sticky CUDA error breaks the GPU model; a CPU model beside it (the
    # stack serves synthetic too) keeps answering, which must not reset the count.
    gpu, cpu = Recording(), Recording()
    gpu.broken = True
    endpoint = serve.Endpoint({"gpu": gpu, "cpu": cpu}, default_model="cpu")

    def invoke(model):
        return endpoint.invoke(json.dumps({"model": model, **tasks_of("x", "y")}).encode(), "application/json")

    for _ in range(serve.BROKEN_AFTER - 1):
        assert {a.error.code for a in invoke("gpu").tasks} == {"model_error"}
        assert not endpoint.broken
        assert all(a.result for a in invoke("cpu").tasks)
    assert {a.error.code for a in invoke("gpu").tasks} == {"model_error"}
    assert endpoint.broken


def test_ping_answers_503_once_the_model_failed_every_task_of_broken_after_calls(server):
    port, model = server
    model.broken = True
    fail_every_task(port, serve.BROKEN_AFTER - 1)
    assert call(port, "GET", "/ping")[0] == 200
    fail_every_task(port, 1)
    status, body = call(port, "GET", "/ping")
    assert status == 503 and body["status"] == "broken", body
    # For good: SageMaker replaces the instance; a sticky CUDA error does not heal.
    model.broken = False
    assert call(port, "POST", "/invocations", tasks_of("a", "b"))[0] == 503
    assert call(port, "GET", "/ping")[0] == 503


@pytest.mark.parametrize("request_body", [tasks_of("a", "b"), {"inputs": ["a"]}, b"{not json"],
                         ids=["many-task", "single-task", "unreadable"])
def test_once_broken_an_invocation_is_refused_with_503_model_broken_and_runs_nothing(server, request_body):
    # Answered, every task of every call would fail until the replacement lands,
    # spending an attempt of every task in the queues. The dispatcher reads this
    # 503 as a call that ran nothing, and hands its tasks back to SQS.
    from sluice.contract import ErrorResponse

    port, model = server
    model.broken = True
    fail_every_task(port, serve.BROKEN_AFTER)
    model.entered.clear()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    status, body = call(port, "POST", "/invocations", request_body, conn=conn)
    assert status == 503 and ErrorResponse.model_validate(body).error.code == serve.MODEL_BROKEN == "model_broken"
    assert not model.entered.is_set()  # the model was not called
    assert call(port, "GET", "/ping", conn=conn)[0] == 503  # the connection is still good


def post_with(port, body, **headers):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("POST", "/invocations", body=json.dumps(body).encode(),
                 headers={"Content-Type": "application/json", **headers})
    response = conn.getresponse()
    return response.status, json.loads(response.read())


@pytest.mark.parametrize("request_body", [tasks_of("a", "b"), {"inputs": ["a"]}], ids=["many-task", "single-task"])
def test_a_call_whose_caller_has_given_up_is_refused_when_its_turn_comes_and_runs_nothing(server, request_body):
    # Queued behind other calls past its caller's timeout, it would be run for
    # no one while the calls behind it waited longer still.
    port, model = server
    model.entered.clear()
    status, body = post_with(port, request_body, **{serve.CUSTOM_ATTRIBUTES: "sluice-give-up-s=0"})
    assert status == 429 and body["error"]["code"] == serve.CALLER_GONE, body
    assert not model.entered.is_set()
    assert call(port, "GET", "/ping")[0] == 200  # no verdict on the model
    status, body = post_with(port, request_body, **{serve.CUSTOM_ATTRIBUTES: "sluice-give-up-s=30"})
    assert status == 200 and model.batches, body


@pytest.mark.parametrize("request_body", [tasks_of("a", "b"), {"inputs": ["a"]}], ids=["many-task", "single-task"])
def test_a_call_waiting_behind_a_long_batch_is_refused_in_time_for_its_caller_to_read_it(server, request_body):
    # Refused only once the model came free, the answer reached no one: the
    # caller had timed out and counted a failed attempt of every task in the
    # call. Refused while the caller still waits, it is a call that ran nothing.
    port, model = server
    model.gate.clear()
    first = threading.Thread(target=call, args=(port, "POST", "/invocations", {"inputs": ["long"]}), daemon=True)
    first.start()
    try:
        assert model.entered.wait(10)
        give_up_s = serve.REFUSAL_MARGIN_S + 0.5
        started = time.monotonic()
        status, body = post_with(port, request_body, **{serve.CUSTOM_ATTRIBUTES: f"sluice-give-up-s={give_up_s:g}"})
        waited = time.monotonic() - started
        assert status == 429 and body["error"]["code"] == serve.CALLER_GONE, body
        assert waited < give_up_s, "refused only after its caller had given up"
        assert model.batches == []  # the long batch still runs; this call ran nothing
    finally:
        model.gate.set()
        first.join(10)


def test_a_caller_gives_up_at_sagemaker_s_timeout_or_at_its_own_if_shorter():
    assert serve.give_up_at(100.0, None) == 100.0 + serve.SAGEMAKER_INVOCATION_TIMEOUT_S == 160.0
    assert serve.give_up_at(100.0, "sluice-give-up-s=15") == 115.0
    assert serve.give_up_at(100.0, "trace=abc; sluice-give-up-s=12.5") == 112.5
    assert serve.give_up_at(100.0, "sluice-give-up-s=600") == 160.0  # SageMaker stops waiting at 60 s anyway
    assert serve.give_up_at(100.0, "sluice-give-up-s=soon") == 160.0


def test_a_caller_that_left_before_its_answer_is_no_error_of_the_model(caplog):
    # The dispatcher's read timed out: writing the answer fails. Before, that
    # was logged as "invocation failed" with a traceback, and a 500 was tried.
    endpoint = serve.Endpoint({"echo": Recording()}, default_model="echo")
    sends = []

    class CallerGone(serve.make_handler(endpoint)):
        def _send(self, status, data):
            sends.append(status)
            raise BrokenPipeError(32, "Broken pipe")

    srv = serve.ThreadingHTTPServer(("127.0.0.1", 0), CallerGone)
    thread = threading.Thread(target=srv.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        with caplog.at_level("INFO", logger="sluice.sagemaker"):
            with pytest.raises((http.client.RemoteDisconnected, ConnectionError)):
                post_with(srv.server_address[1], tasks_of("a"))
            deadline = time.monotonic() + 5
            while not any("left before its answer" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, caplog.text
                time.sleep(0.02)
    finally:
        srv.shutdown()
        srv.server_close()
    assert sends == [200]  # no 500 tried on the broken connection
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text


def test_one_failing_task_a_call_is_a_poison_input_and_never_turns_ping_unhealthy(server):
    port, model = server
    model.broken = True
    for _ in range(serve.BROKEN_AFTER * 2):
        fail_every_task(port, 1, n_tasks=1)
        assert call(port, "POST", "/invocations", {"inputs": ["x"]})[0] == 500  # the single-task form
    # Among healthy tasks, a poison one fails alone: the call is no failure of the model.
    model.broken = False
    for _ in range(serve.BROKEN_AFTER * 2):
        status, body = call(port, "POST", "/invocations", tasks_of("ok", "!crash", "fine"))
        assert [a.get("error", {}).get("code") for a in body["tasks"]] == [None, "model_error", None]
    assert call(port, "GET", "/ping")[0] == 200


def test_refused_tasks_are_not_failures_of_the_model(server):
    port, model = server
    for _ in range(serve.BROKEN_AFTER * 2):
        status, body = call(port, "POST", "/invocations", tasks_of("!bad", "!bad too"))
        assert [a["error"]["code"] for a in body["tasks"]] == ["invalid_input", "invalid_input"]
    model.broken = True
    for _ in range(serve.BROKEN_AFTER * 2):
        # A task that breaks the contract never reaches the model: one task ran, and failed.
        status, body = call(port, "POST", "/invocations", {"tasks": [{"task_id": "a", "inputs": []},
                                                                     {"task_id": "b", "inputs": ["x"]}]})
        assert [a["error"]["code"] for a in body["tasks"]] == ["validation_error", "model_error"]
    assert call(port, "GET", "/ping")[0] == 200


@pytest.mark.parametrize("success", [tasks_of("!crash", "ok"), {"inputs": ["ok"]}], ids=["many-task", "single-task"])
def test_a_call_in_which_a_task_succeeds_starts_the_count_again(server, success):
    port, model = server
    model.broken = True
    fail_every_task(port, serve.BROKEN_AFTER - 1)
    model.broken = False
    assert call(port, "POST", "/invocations", success)[0] == 200
    model.broken = True
    fail_every_task(port, serve.BROKEN_AFTER - 1)
    assert call(port, "GET", "/ping")[0] == 200
    fail_every_task(port, 1)
    assert call(port, "GET", "/ping")[0] == 503



def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_entrypoint_serves_minilm_without_any_web_framework(tmp_path):
    """Runs serve.py as the image does (`serve`), with FastAPI, Starlette and uvicorn made
    unimportable: the worker image does not ship them, so nothing here may need them."""
    port = free_port()
    blocker = (
        "import runpy, sys\n"
        "for m in ('fastapi', 'starlette', 'uvicorn', 'mangum'): sys.modules[m] = None\n"
        f"runpy.run_path({str(SERVE)!r}, run_name='__main__')\n"
    )
    env = {**os.environ, "SAGEMAKER_BIND_TO_PORT": str(port), "SLUICE_MODELS": "minilm-embed,synthetic",
           "SLUICE_TORCH_THREADS": "1"}
    log = open(tmp_path / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-c", blocker], env=env, cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if call(port, "GET", "/ping")[0] == 200:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "serve.py did not answer /ping within 60 s"
            time.sleep(0.1)

        texts = ["A cat sits on the mat.", "A kitten rests on a rug.", "Quarterly revenue grew by 4%."]
        status, body = call(port, "POST", "/invocations", {"inputs": texts})
        assert status == 200, body
        assert body["model"] == "minilm-embed"  # the first of SLUICE_MODELS is the default
        vectors = body["result"]["embeddings"]
        assert body["result"]["dim"] == 384 and [len(v) for v in vectors] == [384] * 3
        assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-3 for v in vectors)

        def cos(a, b):
            return sum(x * y for x, y in zip(a, b))

        assert cos(vectors[0], vectors[1]) > cos(vectors[0], vectors[2]) + 0.2

        status, body = call(port, "POST", "/invocations", {"model": "synthetic", "inputs": ["abc"]})
        assert status == 200 and body["result"]["outputs"][0]["length"] == 3

        tasks = [{"task_id": "t1", "inputs": texts[:2]}, {"task_id": "t2", "inputs": ["Another text."]},
                 {"task_id": "t3", "inputs": texts[2:]}]
        status, body = call(port, "POST", "/invocations", {"model": "minilm-embed", "tasks": tasks})
        assert status == 200 and [a["task_id"] for a in body["tasks"]] == ["t1", "t2", "t3"]
        # Packed with other tasks' inputs, a task still gets its own embeddings.
        packed = body["tasks"][0]["result"]["embeddings"] + body["tasks"][2]["result"]["embeddings"]
        assert all(abs(x - y) < 1e-4 for a, b in zip(packed, vectors, strict=True) for x, y in zip(a, b))

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


def test_the_entrypoint_loads_neither_the_worker_engine_nor_the_aws_adapters():
    """serve.py answers /invocations and touches no queue, table or bucket (the
    dispatcher Lambda does): importing the worker's engine and boto3 only cost it
    start-up time before SageMaker's first /ping."""
    check = (
        "import runpy, sys\n"
        f"runpy.run_path({str(SERVE)!r}, run_name='serve')\n"
        "loaded = sorted(m for m in sys.modules if m.split('.')[0] == 'boto3' or m.startswith(('sluice.worker', "
        "'sluice.adapters')))\n"
        "assert not loaded, loaded\n"
    )
    run = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
