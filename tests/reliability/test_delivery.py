"""Promises 1, 2 and 7: at-least-once delivery with exactly one outcome, a
SIGKILLed worker loses nothing, and rolling SIGTERM restarts under load fail
no task. One stack of real processes (moto, API, two workers, synthetic model).
"""

from __future__ import annotations

import signal
import threading

import pytest

from sluice.contract import TaskMessage
from tests.reliability.harness import CANARY, Ledger, running_stack, wait_until, wait_worker_ready

pytestmark = pytest.mark.slow

# Batches of 8 that cost ~0.35 s: two workers do ~45 tasks/s, slow enough that
# a backlog builds and a signal lands mid-batch, fast enough for the suite.
ENV = {"SLUICE_SYNTHETIC_BASE_MS": "300", "SLUICE_SYNTHETIC_PER_ITEM_MS": "5", "SLUICE_MAX_BATCH_SIZE": "8"}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("delivery-logs"), workers=2, env=ENV) as running:
        yield running


def texts(prefix: str, n: int) -> list[str]:
    return [f"{CANARY} {prefix} {i}" for i in range(n)]


def message_for(env, task_id: str, text: str) -> str:
    """A copy of the task's message, as SQS's at-least-once delivery may hand out."""
    created_at = env.inspector.records([task_id])[task_id].created_at
    return TaskMessage(task_id=task_id, tenant_id=env.tenant, model="synthetic", priority="normal", input_count=1,
                       inputs=[text], enqueued_at=created_at).model_dump_json(exclude_none=True)


def restart_worker(env, index: int) -> None:
    env.stack.start_worker(index)
    wait_worker_ready(env.stack, index)


def test_duplicated_and_redelivered_messages_leave_exactly_one_outcome(env):
    ledger = Ledger("at_least_once_exactly_once", env.inspector)
    words = texts("dup", 150)
    ids = env.client.submit_many(words)
    ledger.add(ids)
    # Copies of 50 messages while their tasks are queued or running ...
    for task_id, text in list(zip(ids, words))[:50]:
        env.inspector.send_raw("normal", message_for(env, task_id, text))
    # ... and an idempotent retry, which must name the task the first call created.
    first = env.client.submit([f"{CANARY} idem"], idempotency_key="retry-me")
    again = env.client.submit([f"{CANARY} idem"], idempotency_key="retry-me")
    assert first.status == again.status == 202 and first.body["task_id"] == again.body["task_id"]
    ledger.add([first.body["task_id"]])
    records = ledger.settle(60)
    # Copies of 50 finished tasks: each must be acknowledged without running again.
    for task_id, text in list(zip(ids, words))[50:100]:
        env.inspector.send_raw("normal", message_for(env, task_id, text))
    figures = ledger.report(records)
    assert figures["lost"] == 0, ledger.lost_examples()
    assert figures["duplicated"] == 0
    assert figures["succeeded"] == 151
    final = env.inspector.records(ids[50:100])
    assert all(r.attempts == 1 for r in final.values()), "a finished task ran again"


def test_a_worker_killed_mid_batch_loses_nothing(env):
    ledger = Ledger("worker_sigkill_mid_batch", env.inspector)
    workers = [env.stack.procs[f"worker-{i}"] for i in (0, 1)]
    # The whole backlog is in the queue before the workers go at it, so the
    # kill below finds most of the work still ahead.
    for w in workers:
        w.send_signal(signal.SIGSTOP)
    try:
        ids = env.client.submit_many(texts("kill", 300))
    finally:
        for w in workers:
            w.send_signal(signal.SIGCONT)
    ledger.add(ids)
    # Kill once processing is under way, while a backlog remains: the worker
    # then holds a batch in the model and a prefetched one.
    # (Polls the first tasks only: the emulator serves every process, and a
    # cheap poll catches the moment while most of the work is still ahead.)
    wait_until(lambda: env.inspector.statuses(ids[:40]).get("succeeded", 0) >= 20, 30,
               "processing to be under way", state=lambda: env.inspector.statuses(ids))
    victim = env.stack.procs["worker-0"]
    victim.send_signal(signal.SIGKILL)
    assert victim.wait(10) == -signal.SIGKILL
    at_kill = env.inspector.statuses(ids)
    print(f"scenario=worker_sigkill_mid_batch at_kill={at_kill}")
    assert at_kill.get("queued", 0) > 0, "the kill came after all the work"
    records = ledger.settle(90)
    redelivered = sum(1 for r in records.values() if r.attempts > 1)
    figures = ledger.report(records)
    print(f"scenario=worker_sigkill_mid_batch redelivered={redelivered}")
    assert figures["lost"] == 0, ledger.lost_examples()
    assert figures["duplicated"] == 0 and figures["succeeded"] == 300
    # The kill hit messages in flight (else this proved nothing), and another
    # worker finished them after their visibility timeout.
    assert redelivered > 0
    restart_worker(env, 0)


def test_rolling_sigterm_restarts_under_load_fail_no_task(env):
    ledger = Ledger("rolling_sigterm_restart", env.inspector)
    stop = threading.Event()
    errors: list[str] = []

    def load():
        n = 0
        while not stop.is_set():
            try:
                ledger.add(env.client.submit_many(texts(f"roll{n}", 10)))
            except AssertionError as exc:  # a refused submit is a failure of this scenario
                errors.append(str(exc))
            n += 1
            stop.wait(0.25)

    submitter = threading.Thread(target=load, daemon=True)
    submitter.start()
    exit_codes = []
    try:
        wait_until(lambda: len(ledger.submitted) >= 100, 30, "load to build up")
        for index in (0, 1):
            exit_codes.append(env.stack.stop_process(f"worker-{index}", timeout_s=30))
            restart_worker(env, index)
        wait_until(lambda: len(ledger.submitted) >= 400, 60, "load to go on after the restarts")
    finally:
        stop.set()
        submitter.join(30)
    assert not errors, errors[:3]
    assert exit_codes == [0, 0], exit_codes
    records = ledger.settle(90)
    figures = ledger.report(records)
    assert figures["lost"] == 0, ledger.lost_examples()
    assert figures["duplicated"] == 0
    assert figures["succeeded"] == len(set(ledger.submitted))
    assert not any(r.status.value == "failed" for r in records.values())
