"""API Gateway's request models agree with the contract: whatever the app would
accept, the gateway lets through, and what the gateway refuses the app refuses too."""

from __future__ import annotations

import pytest
from jsonschema import Draft4Validator
from pydantic import ValidationError

from sluice.contract import BatchSubmitRequest, SubmitRequest

OK = {"model": "minilm-embed", "inputs": ["hello"]}
CASES = [
    OK,
    {**OK, "priority": "high", "deadline_s": 30, "metadata": {"order": "42"}},
    {**OK, "deadline_s": None, "metadata": None},
    {**OK, "inputs": ["x"] * 64},
    {**OK, "inputs": []},
    {**OK, "inputs": ["x"] * 65},
    {**OK, "inputs": ["x" * 8193]},
    {**OK, "inputs": [""]},
    {**OK, "priority": "urgent"},
    {**OK, "deadline_s": 0},
    {**OK, "deadline_s": 7 * 24 * 3600 + 1},
    {**OK, "model": "Not-A-Model"},
    {**OK, "unexpected": 1},
    {**OK, "metadata": {f"k{i}": "v" for i in range(17)}},
    {**OK, "metadata": {"k": "v" * 257}},
    {"inputs": ["x"]},
    {"model": "synthetic"},
]


def app_accepts(model, body) -> bool:
    try:
        model.model_validate(body)
        return True
    except ValidationError:
        return False


@pytest.fixture(scope="module")
def schemas(synth):
    raw = synth.raw["sagemaker"]
    return {
        r["Properties"]["Name"]: r["Properties"]["Schema"]
        for r in raw["Resources"].values()
        if r["Type"] == "AWS::ApiGateway::Model"
    }


@pytest.mark.parametrize("body", CASES)
def test_submit_model_matches_the_contract(schemas, body):
    validator = Draft4Validator(schemas["SubmitRequest"])
    Draft4Validator.check_schema(schemas["SubmitRequest"])
    assert validator.is_valid(body) == app_accepts(SubmitRequest, body)


@pytest.mark.parametrize("tasks", [[OK], [OK] * 100, [], [OK] * 101, [{**OK, "priority": "urgent"}]])
def test_batch_model_matches_the_contract(schemas, tasks):
    body = {"tasks": tasks}
    validator = Draft4Validator(schemas["BatchSubmitRequest"])
    assert validator.is_valid(body) == app_accepts(BatchSubmitRequest, body)
