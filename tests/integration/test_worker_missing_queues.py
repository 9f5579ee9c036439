"""A worker whose queues are gone (an on-prem LocalStack restarted and lost them)
exits, so that its orchestrator restarts it and the restart's bootstrap
(SLUICE_BOOTSTRAP_ON_START) recreates them: retrying cannot bring a queue back.
Errors a retry can outlast (throttling, an endpoint that refuses connections)
are still retried for as long as they last."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
from urllib.parse import urlparse

import boto3
import pytest
from botocore.exceptions import ClientError

from models.synthetic import SyntheticModel
from onprem.embedded import emulator_env, free_port
from sluice.adapters.queues import PriorityQueues
from sluice.contract import Priority
from sluice.settings import Settings, SettingsError
from sluice.worker.main import EXIT_QUEUE_MISSING, Worker
from tests.conftest import ROOT
from tests.reliability.harness import wait_until

# The product waits Settings.queue_missing_exit_s (30 s); the process here is told 2 s.
EXIT_AFTER_S = 2


def worker_env(settings, moto_endpoint: str) -> dict[str, str]:
    """The environment of a worker process reaching the test emulator and this test's resources only."""
    return {
        **{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SLUICE_"))},
        **emulator_env(urlparse(moto_endpoint).port),
        "AWS_EC2_METADATA_DISABLED": "true",
        "SLUICE_QUEUE_PREFIX": settings.queue_prefix,
        "SLUICE_TASKS_TABLE": settings.tasks_table,
        "SLUICE_KEYS_TABLE": settings.keys_table,
        "SLUICE_BUCKET": settings.bucket,
        "SLUICE_MODELS": "synthetic",
        "SLUICE_QUEUE_MISSING_EXIT_S": str(EXIT_AFTER_S),
        "SLUICE_BOOTSTRAP_ON_START": "1",  # on-prem: its restart recreates the queues
    }


def test_a_worker_whose_queues_are_deleted_exits_non_zero(settings, moto_endpoint, tmp_path):
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen([sys.executable, "containers/worker/main.py"], cwd=ROOT,
                                  env=worker_env(settings, moto_endpoint), stdout=out, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_until(lambda: worker.poll() is not None or b"worker ready" in log.read_bytes(), 60,
                   "the worker's 'worker ready' line")
        assert worker.poll() is None, log.read_text(errors="replace")

        # What LocalStack's restart does to them: the queues are gone.
        sqs = boto3.client("sqs", endpoint_url=moto_endpoint)
        queues = PriorityQueues(settings)
        for priority in Priority:
            sqs.delete_queue(QueueUrl=queues.url(priority))

        # Found missing for EXIT_AFTER_S, plus a receive backoff (0.2 s doubling) and a clean stop.
        try:
            code = worker.wait(EXIT_AFTER_S + 20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker was still running {EXIT_AFTER_S + 20} s after its queues were deleted\n"
                        + log.read_text(errors="replace")[-3000:])
        text = log.read_text(errors="replace")
        assert code == EXIT_QUEUE_MISSING, text[-3000:]
        assert "queue have found it missing" in text and "SLUICE_BOOTSTRAP_ON_START" in text, text[-3000:]
        assert "Traceback" not in text, text[-3000:]
    finally:
        if worker.poll() is None:
            worker.kill()
            worker.wait(10)


def test_the_wait_before_exiting_is_a_setting_with_a_sensible_default(monkeypatch):
    monkeypatch.delenv("SLUICE_QUEUE_MISSING_EXIT_S", raising=False)
    assert Settings().queue_missing_exit_s == 30
    monkeypatch.setenv("SLUICE_QUEUE_MISSING_EXIT_S", "2.5")
    assert Settings().queue_missing_exit_s == 2.5
    for bad in ("abc", "0", "-1", "nan"):
        monkeypatch.setenv("SLUICE_QUEUE_MISSING_EXIT_S", bad)
        with pytest.raises(SettingsError, match="SLUICE_QUEUE_MISSING_EXIT_S"):
            Settings()


def receiving(worker: Worker, priority: Priority) -> threading.Thread:
    thread = threading.Thread(target=worker._receive_loop, args=(priority,), daemon=True)
    thread.start()
    return thread


def counting(receive, calls: list, enough: threading.Event, after: int):
    """`receive`, recording each call; `enough` is set once `after` calls have been made."""

    def counted(*args, **kwargs):
        calls.append(1)
        if len(calls) >= after:
            enough.set()
        return receive(*args, **kwargs)

    return counted


def assert_still_receiving_when(worker: Worker, enough: threading.Event, what: str) -> None:
    """Receive from `high` until `enough`; the receiver must still be going then, the worker not stopping."""
    thread = receiving(worker, Priority.high)
    try:
        wait_until(lambda: enough.is_set() or not thread.is_alive(), 60, f"{what}, or the receiver's end")
        assert thread.is_alive() and not worker.stopping.is_set() and not worker.queues_missing
    finally:
        worker.stopping.set()
        thread.join(30)
    assert not thread.is_alive()


@pytest.mark.parametrize("error", ["throttled", "connection refused"])
def test_errors_a_retry_can_outlast_are_retried_for_as_long_as_they_last(settings, monkeypatch, error):
    # A limit far shorter than the receives below span: were these errors taken
    # for a missing queue, the receiver would have stopped the worker by then.
    # With the bootstrap on, as on-prem: only then does a missing queue stop a worker.
    if error == "connection refused":
        monkeypatch.setenv("AWS_ENDPOINT_URL_SQS", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    worker = Worker(settings.model_copy(update={"queue_missing_exit_s": 0.1, "bootstrap_on_start": True}),
                    {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})
    calls, enough = [], threading.Event()
    if error == "throttled":
        def receive(*_):
            raise ClientError({"Error": {"Code": "ThrottlingException", "Message": "Rate exceeded"}}, "ReceiveMessage")
    else:
        receive = worker.queues.receive  # the real call, to a port that refuses connections
    monkeypatch.setattr(worker.queues, "receive", counting(receive, calls, enough, after=3))
    # At the third receive the receiver has judged two failures, the second at
    # least 0.2 s (its backoff, twice the limit) after the first.
    assert_still_receiving_when(worker, enough, "a third receive")


MISSING = ClientError({"Error": {"Code": "AWS.SimpleQueueService.NonExistentQueue", "QueryErrorCode":
                                 "QueueDoesNotExist", "Message": "The specified queue does not exist."}},
                      "ReceiveMessage")


def always_missing(*_):
    raise MISSING


def test_a_receive_that_finds_the_queue_again_starts_the_count_afresh(settings, monkeypatch):
    # Missing, missing, found (a bootstrap elsewhere recreated it), ...: no run of
    # "missing" lasts the limit, though together they last far longer.
    worker = Worker(settings.model_copy(update={"queue_missing_exit_s": 1.0, "bootstrap_on_start": True}),
                    {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})
    answers = iter(([MISSING, MISSING, []] * 100))

    def receive(*_):
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    calls, enough = [], threading.Event()
    monkeypatch.setattr(worker.queues, "receive", counting(receive, calls, enough, after=10))
    # At the tenth receive nine are judged: three runs of "missing" and "found",
    # 0.6 s of backoff each, so the first was over 1.8 s (the limit: 1 s) before.
    assert_still_receiving_when(worker, enough, "a tenth receive")

    # The queue never found again: the receiver stops the worker once the limit is past.
    worker = Worker(settings.model_copy(update={"queue_missing_exit_s": 1.0, "bootstrap_on_start": True}),
                    {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})

    monkeypatch.setattr(worker.queues, "receive", always_missing)
    thread = receiving(worker, Priority.high)
    thread.join(30)
    assert not thread.is_alive() and worker.stopping.is_set() and worker.queues_missing


def test_where_no_restart_recreates_queues_a_missing_one_is_said_not_exited_on(settings, monkeypatch, caplog):
    # On AWS the stack owns the queues, and SQS answers "does not exist" to a role
    # that may not use one too: a restart cannot help, an operator can.
    worker = Worker(settings.model_copy(update={"queue_missing_exit_s": 0.1, "bootstrap_on_start": False}),
                    {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})
    calls, enough = [], threading.Event()
    monkeypatch.setattr(worker.queues, "receive", counting(always_missing, calls, enough, after=4))
    with caplog.at_level(logging.ERROR, logger="sluice.worker"):
        # By the fourth receive three have failed over 0.6 s of backoff, six times the limit.
        assert_still_receiving_when(worker, enough, "a fourth receive")
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert said and all("not this role's to use" in m and "still trying" in m for m in said)
