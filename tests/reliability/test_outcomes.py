"""Promises 3 and 6: a poison input fails only itself (an input the model
refuses fails at once; one the model crashes on is retried and ends in the DLQ,
which `sluice dlq` lists and redrives), and expired or cancelled tasks never
run. One stack of real processes (moto, API, two workers, synthetic model).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from models.synthetic import CRASH_MARKER, FAIL_MARKER
from tests.reliability.harness import CANARY, Ledger, running_stack, wait_until

pytestmark = pytest.mark.slow

MAX_ATTEMPTS = 3


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    # Workers look for dead-lettered tasks without an outcome every ~second.
    with running_stack(tmp_path_factory.mktemp("outcome-logs"), workers=2, env={"SLUICE_DLQ_SETTLE_S": "1"}) as running:
        yield running


def stop_workers(env) -> None:
    for name in [n for n in env.stack.procs if n.startswith("worker")]:
        assert env.stack.stop_process(name) == 0


def start_workers(env, n: int = 2) -> None:
    for i in range(n):
        env.stack.start_worker(i)


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
    poison_at = {5, 17, 33}  # the model crashes on these: retried, then dead-lettered
    refused_at = {9, 26}  # the model refuses these (ModelInputError): failed at once

    def text(i):
        marker = CRASH_MARKER if i in poison_at else FAIL_MARKER if i in refused_at else "healthy"
        return f"{CANARY} {marker} {i}"

    tasks = [{"model": "synthetic", "priority": "normal", "inputs": [text(i)]} for i in range(40)]
    # One request, so the poison tasks share batches with healthy ones.
    reply = env.client.call("POST", "/v1/tasks/batch", {"tasks": tasks})
    assert reply.status == 202, reply.text
    ids = [t["task_id"] for t in reply.body["tasks"]]
    poison = {ids[i] for i in poison_at}
    refused = {ids[i] for i in refused_at}
    ledger.add([t for t in ids if t not in poison | refused])
    ledger.add(sorted(poison | refused), intended="failed")
    records = ledger.settle(90)

    for task_id in poison:
        view = env.client.call("GET", f"/v1/tasks/{task_id}").body
        assert view["status"] == "failed"
        assert view["error"]["code"] == "model_error"
        assert "RuntimeError" in view["error"]["message"] and CRASH_MARKER in view["error"]["message"]
        assert 1 <= view["attempts"] <= MAX_ATTEMPTS, view
    for task_id in refused:
        view = env.client.call("GET", f"/v1/tasks/{task_id}").body
        assert view["status"] == "failed" and view["attempts"] == 1, view
        assert view["error"]["code"] == "invalid_input" and FAIL_MARKER in view["error"]["message"]
    assert all(records[t].status.value == "succeeded" and records[t].result_json
               for t in ids if t not in poison | refused)

    # Failed on its last attempt, the message is not deleted: its next receive
    # moves it to the dead-letter queue.
    def dead_ids():
        return {json.loads(m["Body"])["task_id"] for m in env.inspector.peek_dlq("normal")}

    wait_until(lambda: dead_ids() == poison, 60, "the poison messages to reach the DLQ", state=dead_ids)

    # A worker's settle round hides DLQ messages for a moment while it reads
    # them (as any SQS reader does), so a listing may briefly miss some.
    def listing():
        out = sluice_cli(env, tmp_path, "dlq", "list", "--priority", "normal")
        items = [json.loads(line) for line in out.splitlines() if line.strip()]
        return items if {i["task_id"] for i in items} == poison else None

    listed = wait_until(listing, 20, "`sluice dlq list` to show the poison tasks")
    assert {item["task_status"] for item in listed} == {"failed"}
    assert all(int(item["attributes"]["ApproximateReceiveCount"]) >= MAX_ATTEMPTS for item in listed)

    # The same settle rounds can hold a message out of one redrive's sight, so
    # redrive until every poison message has moved, never more than there are.
    moved = []

    def redrive_all():
        out = sluice_cli(env, tmp_path, "dlq", "redrive", "--priority", "normal").strip()
        assert out.startswith("redrove ") and out.endswith(" messages"), out
        moved.append(int(out.split()[1]))
        return sum(moved) >= len(poison)

    wait_until(redrive_all, 20, "`sluice dlq redrive` to move every poison message", state=lambda: moved)
    assert sum(moved) == len(poison), moved
    # Redriven, each message is received again and acknowledged: its task is
    # final, so it neither runs again nor gets a second outcome.
    wait_until(lambda: env.inspector.depth("normal", dlq=True) == (0, 0) and env.inspector.drained(), 60,
               "the redriven messages to be consumed")
    figures = ledger.report()
    assert figures["lost"] == 0, ledger.lost_examples()
    assert figures["duplicated"] == 0
    assert figures["succeeded"] == 35 and figures["failed_as_intended"] == 5


def test_expired_and_cancelled_tasks_never_run(env):
    ledger = Ledger("deadlines_and_cancellation", env.inspector)
    # No worker while the tasks wait: their deadlines pass, their cancels land.
    stop_workers(env)
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

    start_workers(env)
    records = ledger.settle(60)
    figures = ledger.report(records)
    assert figures["lost"] == 0, ledger.lost_examples()
    assert figures["duplicated"] == 0
    assert figures["succeeded"] == 15 and figures["failed_as_intended"] == 30
    for task_id in expiring + cancelled:
        r = records[task_id]
        assert r.started_at is None and r.attempts == 0 and r.result_json is None and r.inference_ms is None, r
    assert env.client.call("DELETE", f"/v1/tasks/{control[0]}").status == 409


def test_a_task_dead_lettered_without_an_outcome_gets_one(env):
    """Every receive counts towards the DLQ, also those that end without an
    outcome (a killed worker, a SIGTERM hand-back). Two tasks whose messages got
    there that way: one never ran (handed back each time), one started three
    times and took its worker down each time."""
    ledger = Ledger("dead_lettered_without_outcome", env.inspector)
    stop_workers(env)
    handed_back = env.client.submit([f"{CANARY} handed back"]).body["task_id"]
    crashed = env.client.submit([f"{CANARY} crashed"]).body["task_id"]
    ledger.add([handed_back])
    ledger.add([crashed], intended="failed")
    sqs, source, dlq = env.inspector.sqs, env.inspector.queue_url("normal"), env.inspector.queue_url("normal", True)
    moved = set()

    def move_to_dlq() -> bool:
        for m in sqs.receive_message(QueueUrl=source, MaxNumberOfMessages=10, VisibilityTimeout=60).get("Messages", []):
            sqs.send_message(QueueUrl=dlq, MessageBody=m["Body"])
            sqs.delete_message(QueueUrl=source, ReceiptHandle=m["ReceiptHandle"])
            moved.add(json.loads(m["Body"])["task_id"])
        return len(moved) >= 2

    wait_until(move_to_dlq, 20, "both tasks' messages to be received and moved to the dead-letter queue",
               state=lambda: moved)
    assert moved == {handed_back, crashed}
    env.inspector.ddb.update_item(
        TableName="sluice-tasks", Key={"task_id": {"S": crashed}},
        # What its three starts left behind: the first delivery's start is not
        # recorded, each redelivery's is (sluice.lifecycle).
        UpdateExpression="SET attempts = :n, started_at = :t",
        ExpressionAttributeValues={":n": {"N": "2"}, ":t": {"N": str(int(time.time() * 1000))}})
    start_workers(env)
    records = ledger.settle(60)
    # Settling requeued it as one run so far: a first delivery's start is never
    # recorded (its outcome is its one write), so whether it ran cannot be
    # told, and it is counted (a run too many fails a task one run early at
    # worst; too few would let one that kills its workers run once more).
    assert records[handed_back].status.value == "succeeded" and records[handed_back].attempts == 2
    view = env.client.call("GET", f"/v1/tasks/{crashed}").body
    assert view["status"] == "failed" and view["error"]["code"] == "dead_lettered", view
    assert "dead-letter queue" in view["error"]["message"]
    # The crashed task's message stays in the DLQ for an operator; the other left it.
    wait_until(lambda: {json.loads(m["Body"])["task_id"] for m in env.inspector.peek_dlq("normal")} == {crashed},
               20, "the DLQ to hold the crashed task's message only")
    figures = ledger.report(records)
    assert figures["lost"] == 0 and figures["duplicated"] == 0
    assert figures["succeeded"] == 1 and figures["failed_as_intended"] == 1
