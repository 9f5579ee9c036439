"""The API against its own OpenAPI schema, fuzzed by schemathesis.

A running embedded stack (real uvicorn, real emulator) with a valid key; every
operation gets valid (positive) and invalid (negative) generated requests. Each
response must not be a 5xx and must conform to the schema: declared status
code, content type, headers and body. Bounded in cases and in time.
"""

from __future__ import annotations

import time

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.reliability.harness import running_stack, wait_until

pytestmark = pytest.mark.slow

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance, negative_data_rejection]
# An invalid request may also be refused for its size (413) or rate (429).
CONFIG = schemathesis.Config.from_dict(
    {"checks": {"negative_data_rejection": {"expected-statuses": ["400", "401", "403", "404", "409", "413", "422"]}}})
EXAMPLES_PER_OPERATION_AND_MODE = 120


def query_params(op) -> set[str]:
    return {p.get("name") for p in op.definition.raw.get("parameters", []) if p.get("in") == "query"}


def test_generated_requests_get_no_5xx_and_conforming_responses(tmp_path):
    with running_stack(tmp_path / "logs", workers=1) as env:
        schema = schemathesis.openapi.from_url(f"{env.stack.url}/openapi.json", config=CONFIG)
        session = requests.Session()
        auth = {"x-api-key": env.client.key}
        counts: dict[str, int] = {}
        started = time.monotonic()
        operations = [result.ok() for result in schema.get_all_operations()]
        # Random ids only ever find nothing: half of the task lookups and cancels
        # name real tasks instead, some finished, some still queued.
        real_ids = env.client.submit_many([f"contract {i}" for i in range(10)])
        wait_until(lambda: all(r.status.is_terminal for r in env.inspector.records(real_ids).values()), 30,
                   "the first tasks to finish")
        env.stack.stop_process("worker-0")
        real_ids += env.client.submit_many([f"contract queued {i}" for i in range(30)])
        assert len(operations) >= 7, [op.label for op in operations]
        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

                fixed: dict = {}
                if mode == GenerationMode.POSITIVE and "wait_s" in query_params(op):
                    # A valid long poll waits up to its full wait on a queued task:
                    # short ones keep the run short (pytest-timeout bounds it).
                    fixed["query"] = {"wait_s": 0.2}
                strategy = op.as_strategy(generation_mode=mode, **fixed)
                if mode == GenerationMode.POSITIVE and "{task_id}" in op.path:
                    strategy = st.one_of(strategy, st.sampled_from(real_ids).flatmap(
                        lambda t, op=op: op.as_strategy(path_parameters={"task_id": t}, **fixed)))

                @settings(max_examples=EXAMPLES_PER_OPERATION_AND_MODE, deadline=None, derandomize=True,
                          database=None, phases=[Phase.explicit, Phase.generate],
                          suppress_health_check=list(HealthCheck))
                @given(case=strategy)
                def run(case):
                    # A valid long poll on a task that cannot finish (its worker is
                    # stopped) waits out all of wait_s: keep those waits short so
                    # the run's time buys breadth. Invalid values stay as generated.
                    wait = (case.query or {}).get("wait_s")
                    if isinstance(wait, (int, float)) and not isinstance(wait, bool) and 0 < wait <= 20:
                        case.query["wait_s"] = min(wait, 0.2)
                    # The valid key on every call: auth failures are not what is fuzzed here.
                    case.call_and_validate(session=session, headers=auth, checks=CHECKS, timeout=30)
                    counts[op.label] = counts.get(op.label, 0) + 1

                try:
                    run()
                except Unsatisfiable:
                    # An operation without parameters or body has no invalid request.
                    assert mode == GenerationMode.NEGATIVE, op.label
        total = sum(counts.values())
        elapsed = time.monotonic() - started
        print(f"\nschemathesis cases={total} operations={len(operations)} seconds={elapsed:.1f} "
              + " ".join(f"{k.replace(' ', '')}={v}" for k, v in sorted(counts.items())), flush=True)
        assert total >= 1000, counts
        api_log = (tmp_path / "logs" / "api.log").read_text(errors="replace")
        assert "Traceback" not in api_log and "unhandled" not in api_log, api_log[-3000:]
