"""A platform team's own model behind the worker: what its first version is
likely to get wrong (a tensor or an array library's scalar in a result, outputs by column,
NaN scores) fails or shapes only its own tasks, never its batch."""

from __future__ import annotations

import json
import urllib.request

import pytest
import torch
from fastapi.testclient import TestClient

from models.synthetic import SyntheticModel
from sluice.adapters.api_keys import ApiKeys
from sluice.adapters.task_store import TaskStore
from sluice.api.app import create_app
from sluice.contract import TaskStatus
from sluice.worker.runner import BatchRunner
from tests.integration.test_worker_runner import receive_all


class Float32:
    """A scalar of an array library (numpy's float32, say), which JSON cannot hold.
    numpy itself is not installed with the worker: torch's CPU build does not need it."""

    def __init__(self, value: float):
        self.value = value


class Classifier:
    """Labels and scores, as a team would first write it. It stands in under a
    catalogue name the API accepts."""

    name, version, max_batch_size, description = "minilm-embed", "clf-1", 8, "a toy classifier"

    def __init__(self, answer):
        self.answer = answer

    def load(self):
        pass

    def predict_batch(self, inputs):
        return self.answer(inputs)

    def result_for_task(self, outputs):
        return {"predictions": outputs}


ANSWERS = {
    "a tensor": lambda inputs: torch.full((len(inputs), 3), 0.5),  # one row per input: the count matches
    "array-library scores": lambda inputs: [{"label": "pos", "score": Float32(0.9)} for _ in inputs],
    "0-d tensor scores": lambda inputs: [{"label": "pos", "score": torch.tensor(0.9)} for _ in inputs],
    "columns": lambda inputs: {"labels": ["pos"] * len(inputs), "scores": [0.9] * len(inputs)},
}


@pytest.fixture
def two_models(settings):
    return settings.model_copy(update={"models": "synthetic,minilm-embed"})


def make_api(settings) -> TestClient:
    client = TestClient(create_app(settings), raise_server_exceptions=False)
    client.key_a = ApiKeys(settings).create("tenant-a")[0]
    return client


def submit(api, model: str, text: str) -> str:
    reply = api.post("/v1/tasks", json={"model": model, "inputs": [text]}, headers={"x-api-key": api.key_a})
    assert reply.status_code == 202, reply.text
    return reply.json()["task_id"]


@pytest.mark.parametrize("answer", sorted(ANSWERS))
def test_an_answer_that_is_not_one_json_output_per_input_fails_its_own_tasks_only(two_models, answer):
    api = make_api(two_models)
    healthy = [submit(api, "synthetic", f"ok {i}") for i in range(3)]
    own = submit(api, "minilm-embed", "classify me")
    runner = BatchRunner(two_models, {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0),
                                      "minilm-embed": Classifier(ANSWERS[answer])})
    prepared = runner.prepare(receive_all(two_models, 4))
    assert len(prepared.jobs) == 4  # one batch, both models
    runner.finish(prepared, runner.infer(prepared.jobs))  # used to raise for the whole batch
    store = TaskStore(two_models)
    assert [store.get(t).status for t in healthy] == [TaskStatus.succeeded] * 3
    record = store.get(own)
    if answer in ("array-library scores", "0-d tensor scores"):  # every run would give it again: failed at once
        assert (record.status, record.error_code) == (TaskStatus.failed, "invalid_result")
        assert "not JSON" in record.error_message
    else:  # predict_batch broke its contract: a crash of this run, retried
        assert (record.status, record.error_code) == (TaskStatus.queued, "model_error")
        assert "predict_batch returns a list" in record.error_message


def test_nan_and_infinity_are_null_inline_and_in_the_bucket(two_models):
    """JSON has no NaN: written as the literal, a result in S3 was one that
    no strict parser (a browser's JSON.parse) reads."""
    scores = lambda inputs: [{"score": float("nan"), "odds": float("inf")} for _ in inputs]  # noqa: E731
    for inline_max, read in ((100_000, "result"), (10, "result_url")):
        settings = two_models.model_copy(update={"inline_result_max_bytes": inline_max})
        api = make_api(settings)
        task_id = submit(api, "minilm-embed", "x")
        runner = BatchRunner(settings, {"minilm-embed": Classifier(scores)})
        prepared = runner.prepare(receive_all(settings, 1))
        runner.finish(prepared, runner.infer(prepared.jobs))
        view = api.get(f"/v1/tasks/{task_id}", headers={"x-api-key": api.key_a}).json()
        body = json.dumps(view["result"]) if read == "result" else urllib.request.urlopen(view[read]).read().decode()
        strict = json.loads(body, parse_constant=lambda c: pytest.fail(f"{read} holds {c}, not JSON"))
        assert strict == {"predictions": [{"score": None, "odds": None}]}
