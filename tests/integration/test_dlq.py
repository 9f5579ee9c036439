"""Dead-letter tooling (sluice.dlq and `sluice dlq`) on the emulator, over HTTP."""

from __future__ import annotations

import pytest

from sluice import cli
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.contract import Priority, TaskMessage, TaskRecord, TaskStatus
from sluice.dlq import list_dead, redrive, settle_dead


def dead_letter(queues: PriorityQueues, store: TaskStore, task_id: str, status=TaskStatus.queued, **recorded) -> None:
    """A task whose message is in the normal DLQ; `recorded`: what its attempts left on its record."""
    store.create(TaskRecord(task_id=task_id, tenant_id="t", model="synthetic", priority=Priority.normal,
                            status=status, input_count=1, created_at=0, **recorded))
    body = TaskMessage(task_id=task_id, tenant_id="t", model="synthetic", priority=Priority.normal, input_count=1,
                       inputs=["x"], enqueued_at=0).model_dump_json(exclude_none=True)
    queues.sqs.send_message(QueueUrl=queues.dlq_url(Priority.normal), MessageBody=body)


@pytest.mark.parametrize("max_attempts, recorded, runs, why", [
    # Killed its worker each time: the first delivery's start is not recorded (sluice.lifecycle).
    (3, {"attempts": 2}, 3, "no outcome after 3 attempts (the worker running it stopped each time)"),
    (1, {"attempts": 0}, 1, "no outcome after 1 attempt (the worker running it stopped each time)"),
    # A retried error wrote the receive count, then two redeliveries killed their worker.
    (3, {"attempts": 3, "error_code": "model_error", "error_message": "RuntimeError: boom"}, 3,
     "no outcome after 3 attempts (the last error recorded: model_error: RuntimeError: boom)"),
])
def test_a_task_failed_by_settling_shows_how_often_it_ran(settings, max_attempts, recorded, runs, why):
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "crashed", **recorded)
    assert settle_dead(queues, store, [Priority.normal], max_attempts) == {"failed": 1, "requeued": 0}
    record = store.get("crashed")
    assert (record.status, record.error_code, record.attempts) == (TaskStatus.failed, "dead_lettered", runs)
    assert record.error_message.startswith(why), record.error_message


def test_a_task_that_ran_fewer_times_than_allowed_is_requeued(settings):
    queues, store = PriorityQueues(settings), TaskStore(settings)
    # Ran twice (a retried error, a kill); its third receive ended unrun.
    dead_letter(queues, store, "ran-twice", attempts=2, error_code="model_error", error_message="RuntimeError: boom")
    assert settle_dead(queues, store, [Priority.normal], 3) == {"failed": 0, "requeued": 1}
    assert store.get("ran-twice").status is TaskStatus.queued


class ShortPollsAnswerEmpty:
    """Test seam over the real client: a receive that does not long-poll answers
    empty, as an SQS short poll can (it asks a sample of the servers)."""

    def __init__(self, sqs):
        self.sqs = sqs

    def __getattr__(self, name):
        return getattr(self.sqs, name)

    def receive_message(self, **params):
        return self.sqs.receive_message(**params) if params.get("WaitTimeSeconds") else {"Messages": []}


def test_an_empty_short_poll_does_not_end_a_listing_redrive_or_settling(settings):
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "handed-back")
    queues.sqs = ShortPollsAnswerEmpty(queues.sqs)
    assert [d["task_id"] for d in list_dead(queues, [Priority.normal])] == ["handed-back"]
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts) == {"failed": 0, "requeued": 1}
    dead_letter(queues, store, "redriven")
    assert redrive(queues, [Priority.normal]) == 1


@pytest.fixture
def operator_env(settings, monkeypatch):
    """`sluice dlq` pointed at these queues and table, as docs/deploy.md says."""
    monkeypatch.setenv("SLUICE_QUEUE_PREFIX", settings.queue_prefix)
    monkeypatch.setenv("SLUICE_TASKS_TABLE", settings.tasks_table)
    return settings


@pytest.mark.parametrize("action, done", [
    ("redrive", "redrove 1 messages"),
    ("settle", "failed 0 tasks, requeued 1 messages"),
])
def test_redrive_and_settle_say_how_many_dead_letters_are_left(operator_env, capsys, action, done):
    queues, store = PriorityQueues(operator_env), TaskStore(operator_env)
    dead_letter(queues, store, "first")
    dead_letter(queues, store, "second")
    assert cli.main(["dlq", action, "--priority", "normal", "--limit", "1"]) == 0
    assert capsys.readouterr().out.strip() == f"{done}; the normal dead-letter queue still holds about 1 messages"
    assert cli.main(["dlq", action]) == 0
    assert capsys.readouterr().out.strip().endswith("; the dead-letter queues still hold about 0 messages")
