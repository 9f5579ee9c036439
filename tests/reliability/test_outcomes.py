"""Promises 3 and 6: a poison input fails only itself (and ends in the DLQ,
which `sluice dlq` lists and redrives), and expired or cancelled tasks never
run. One stack of real processes (moto, API, two workers, synthetic model).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from models.synthetic import FAIL_MARKER
from tests.reliability.harness import CANARY, Ledger, running_stack, wait_until

pytestmark = pytest.mark.slow

MAX_ATTEMPTS = 3


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("outcome-logs"), workers=2) as running:
        yield running


def sluice_cli(env, tmp_path, *args: str) -> str:
    """The operator's CLI, pointed at the stack's emulator as an operator would."""
    cli_env = {**env.stack.env(), "AWS_ENDPOINT_URL": env.inspector.sqs.meta.endpoint_url,
               "SLUICE_STATE_DIR": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "sluice.cli", *args], env=cli_env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_a_poison_input_fails_only_itself_and_is_dead_lettered(env, tmp_path):
    ledger = Ledger("poison_input", env.inspector)
    poison_at = {5, 17, 33}
    tasks = [{"model": "synthetic", "priority": "normal",
              "inputs": [f"{CANARY} {FAIL_MARKER} {i}" if i in poison_at else f"{CANARY} healthy {i}"]}
             for i in range(40)]
    # One request, so the poison tasks share batches with healthy ones.
    reply = env.client.call("POST", "/v1/tasks/batch", {"tasks": tasks})
    assert reply.status == 202, reply.text
    ids = [t["task_id"] for t in reply.body["tasks"]]
    poison = {ids[i] for i in poison_at}
    ledger.add([t for t in ids if t not in poison])
    ledger.add(sorted(poison), intended="failed")
    records = ledger.settle(90)

    for task_id in poison:
        view = env.client.call("GET", f"/v1/tasks/{task_id}").body
        assert view["status"] == "failed"
        assert view["error"]["code"] == "model_error"
        assert "ModelInputError" in view["error"]["message"] and FAIL_MARKER in view["error"]["message"]
        assert 1 <= view["attempts"] <= MAX_ATTEMPTS, view
    assert all(records[t].status.value == "succeeded" and records[t].result_json for t in ids if t not in poison)

    # Failed on its last attempt, the message is not deleted: its next receive
    # moves it to the dead-letter queue.
    def dead_ids():
        return {json.loads(m["Body"])["task_id"] for m in env.inspector.peek_dlq("normal")}

    wait_until(lambda: dead_ids() == poison, 60, "the poison messages to reach the DLQ", state=dead_ids)

    listed = [json.loads(line) for line in sluice_cli(env, tmp_path, "dlq", "list", "--priority", "normal")
              .splitlines() if line.strip()]
    assert {item["task_id"] for item in listed} == poison
    assert {item["task_status"] for item in listed} == {"failed"}
    assert all(int(item["attributes"]["ApproximateReceiveCount"]) >= MAX_ATTEMPTS for item in listed)

    out = sluice_cli(env, tmp_path, "dlq", "redrive", "--priority", "normal")
    assert out.strip() == f"redrove {len(poison)} messages"
    # Redriven, each message is received again and acknowledged: its task is
    # final, so it neither runs again nor gets a second outcome.
    wait_until(lambda: not env.inspector.peek_dlq("normal") and env.inspector.drained(), 60,
               "the redriven messages to be consumed")
    figures = ledger.report()
    assert figures["lost"] == 0, ledger.lost_examples()
    assert figures["duplicated"] == 0
    assert figures["succeeded"] == 37 and figures["failed_as_intended"] == 3


def test_expired_and_cancelled_tasks_never_run(env):
    ledger = Ledger("deadlines_and_cancellation", env.inspector)
    # No worker while the tasks wait: their deadlines pass, their cancels land.
    for name in [n for n in env.stack.procs if n.startswith("worker")]:
        assert env.stack.stop_process(name) == 0
    expiring = [env.client.submit([f"{CANARY} expiring {i}"], deadline_s=1).body["task_id"] for i in range(15)]
    cancelled = [env.client.submit([f"{CANARY} cancelled {i}"]).body["task_id"] for i in range(15)]
    control = env.client.submit_many([f"{CANARY} control {i}" for i in range(15)])
    ledger.add(expiring, intended="expired")
    ledger.add(cancelled, intended="cancelled")
    ledger.add(control)

    for task_id in cancelled:
        reply = env.client.call("DELETE", f"/v1/tasks/{task_id}")
        assert reply.status == 200 and reply.body["status"] == "cancelled", reply.text
    deadline_ms = max(r.deadline_at for r in env.inspector.records(expiring).values())
    wait_until(lambda: time.time() * 1000 > deadline_ms + 50, 5, "the deadlines to pass")
    # Shown as expired at once, before any worker has seen the message ...
    for task_id in expiring[:5]:
        view = env.client.call("GET", f"/v1/tasks/{task_id}").body
        assert view["status"] == "expired", view
    # ... and a task that is final cannot be cancelled any more.
    assert env.client.call("DELETE", f"/v1/tasks/{expiring[0]}").status == 409

    for i in range(2):
        env.stack.start_worker(i)
    records = ledger.settle(60)
    figures = ledger.report(records)
    assert figures["lost"] == 0, ledger.lost_examples()
    assert figures["duplicated"] == 0
    assert figures["succeeded"] == 15 and figures["failed_as_intended"] == 30
    for task_id in expiring + cancelled:
        r = records[task_id]
        assert r.started_at is None and r.attempts == 0 and r.result_json is None and r.inference_ms is None, r
    assert env.client.call("DELETE", f"/v1/tasks/{control[0]}").status == 409
