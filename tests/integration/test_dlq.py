"""Dead-letter tooling (sluice.dlq and `sluice dlq`) on the emulator, over HTTP."""

from __future__ import annotations

import json
import time
import threading

import pytest

from sluice import cli, dlq
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import Change, TaskStore
from sluice.contract import Priority, TaskMessage, TaskRecord, TaskStatus
from sluice.dlq import list_dead, redrive, settle_dead
from tests.integration.test_worker_runner import messages_left, receive_all
from tests.reliability.harness import wait_until


def dead_letter(queues: PriorityQueues, store: TaskStore, task_id: str, status=TaskStatus.queued, text: str = "x",
                **recorded) -> None:
    """A task whose message is in the normal DLQ; `recorded`: what its attempts left on its record."""
    store.create(TaskRecord(task_id=task_id, tenant_id="t", model="synthetic", priority=Priority.normal,
                            status=status, input_count=1, created_at=0, **recorded))
    body = TaskMessage(task_id=task_id, tenant_id="t", model="synthetic", priority=Priority.normal, input_count=1,
                       inputs=[text], enqueued_at=0).model_dump_json(exclude_none=True)
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


@pytest.mark.parametrize("recorded, runs_left", [
    # Ran twice (two model errors); its third receive ended unrun.
    ({"attempts": 2, "error_code": "model_error", "error_message": "RuntimeError: boom"}, 1),
    # Ran once (killed its worker: the first delivery's start is not recorded);
    # its second and third receives ended unrun, their starts taken back.
    ({"attempts": 0}, 2),
])
def test_a_requeued_task_runs_only_the_attempts_it_has_left(settings, runner, recorded, runs_left):
    # Requeued, its message is new and SQS counts its receives from 1 again:
    # the runs before count all the same, and its last run's failure is
    # dead-lettered at once, where SQS's maxReceiveCount would not move it.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "requeued", text="x !crash", **recorded)
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts) == {"failed": 0, "requeued": 1}
    for run in range(settings.max_attempts - runs_left + 1, settings.max_attempts + 1):
        [delivery] = receive_all(settings, 1)
        prepared = runner.prepare([delivery])
        assert len(prepared.jobs) == 1
        runner.finish(prepared, runner.infer(prepared.jobs))
        record = store.get("requeued")
        assert (record.attempts, record.error_code) == (run, "model_error")
        if run < settings.max_attempts:
            assert record.status is TaskStatus.queued
            queues.sqs.change_message_visibility(QueueUrl=queues.url(Priority.normal),
                                                 ReceiptHandle=delivery.receipt_handle, VisibilityTimeout=0)
    assert record.status is TaskStatus.failed
    assert messages_left(settings) == 0
    [dead] = list_dead(queues, [Priority.normal])
    assert dead["task_id"] == "requeued"


@pytest.mark.parametrize("recorded, runs_left", [
    # Ran once and took its worker down (its first delivery's start is not
    # recorded); its second and third receives were handed back unrun.
    ({"attempts": 0}, 2),
    # Ran twice, taking its worker down each time; its third receive was handed back.
    ({"attempts": 1}, 1),
])
def test_a_requeued_task_that_kills_its_worker_runs_only_the_attempts_it_has_left(settings, runner, recorded,
                                                                                    runs_left):
    # No run writes an outcome, so no failure stops it: its new message is not
    # dead-lettered by SQS before three receives of its own, and once past
    # max_attempts it goes to the DLQ unrun, where settling fails the task.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "killer", **recorded)
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts) == {"failed": 0, "requeued": 1}
    ran = 0
    while batch := receive_all(settings, 1):
        prepared = runner.prepare(batch)
        if prepared.jobs:  # it runs, and takes its worker down: no outcome, the message comes back
            ran += 1
            assert ran <= runs_left
            queues.sqs.change_message_visibility(QueueUrl=queues.url(Priority.normal),
                                                 ReceiptHandle=batch[0].receipt_handle, VisibilityTimeout=0)
        else:
            runner.finish(prepared, [])
    assert ran == runs_left
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts) == {"failed": 1, "requeued": 0}
    record = store.get("killer")
    assert (record.status, record.error_code, record.attempts) == (TaskStatus.failed, "dead_lettered", 3)


def test_a_requeued_task_s_redelivery_after_it_finished_is_acknowledged_not_dead_lettered(settings, runner):
    # Past max_attempts by its count, but final (its outcome was written, its
    # delete failed; or cancelled meanwhile): nothing left for settling.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "finished", attempts=1)
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts) == {"failed": 0, "requeued": 1}
    [first] = receive_all(settings, 1)
    queues.sqs.change_message_visibility(QueueUrl=queues.url(Priority.normal), ReceiptHandle=first.receipt_handle,
                                         VisibilityTimeout=0)
    store.apply(Change("finished", {"status": TaskStatus.cancelled.value, "finished_at": 1}, (TaskStatus.queued,)))
    [again] = receive_all(settings, 1)
    assert again.receive_count == 2  # its run's number would be 4
    prepared = runner.prepare([again])
    assert (prepared.jobs, prepared.spent, prepared.ack) == ([], [], [again])
    runner.finish(prepared, [])
    assert messages_left(settings) == 0 and list_dead(queues, [Priority.normal]) == []


def test_a_requeued_message_keeps_the_fields_a_newer_release_wrote(settings):
    # A worker of this release settles a message of a newer one while a deploy
    # rolls: its model ignores the field, and the requeue must not drop it.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "newer", attempts=1)
    [dead] = list_dead(queues, [Priority.normal])
    body = {**json.loads(dead["body"]), "trace_parent": "00-abc-def-01"}
    queues.sqs.purge_queue(QueueUrl=queues.dlq_url(Priority.normal))
    queues.sqs.send_message(QueueUrl=queues.dlq_url(Priority.normal), MessageBody=json.dumps(body))
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts) == {"failed": 0, "requeued": 1}
    [requeued] = receive_all(settings, 1)
    assert json.loads(requeued.body) == {**body, "runs_before": 2}


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


def test_listing_says_how_many_dead_letters_another_reader_holds_hidden(operator_env, capsys):
    queues, store = PriorityQueues(operator_env), TaskStore(operator_env)
    dead_letter(queues, store, "being-settled")
    # What a worker's settling round does: receive it, keeping it hidden meanwhile.
    got = queues.sqs.receive_message(QueueUrl=queues.dlq_url(Priority.normal), VisibilityTimeout=60, WaitTimeSeconds=1)
    assert len(got["Messages"]) == 1
    assert cli.main(["dlq", "list"]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and "empty" not in captured.err, captured.err
    assert captured.err.strip() == ("listed 0; the dead-letter queues hold about 1 messages, 1 of them hidden by "
                                    "another reader (a worker's settling round): list again in 30 s; in a queue "
                                    "longer than a round reads (1000), settling keeps the dead letters of finished "
                                    "tasks hidden in turns of 10 minutes")


def test_listing_says_when_it_stopped_at_the_limit(operator_env, capsys):
    queues, store = PriorityQueues(operator_env), TaskStore(operator_env)
    dead_letter(queues, store, "first")
    dead_letter(queues, store, "second")
    assert cli.main(["dlq", "list", "--limit", "1"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 1
    assert captured.err.strip() == "listed 1, stopped at --limit 1; the dead-letter queues hold about 2 messages"
    assert cli.main(["dlq", "list", "--priority", "normal"]) == 0
    captured = capsys.readouterr()
    assert len(captured.out.splitlines()) == 2
    assert captured.err.strip() == "listed 2; the normal dead-letter queue holds about 2 messages"


@pytest.mark.parametrize("action", ["list", "redrive", "settle"])
@pytest.mark.parametrize("limit", ["0", "-1", "x"])
def test_a_limit_below_1_is_a_usage_error(capsys, action, limit):
    with pytest.raises(SystemExit) as stopped:
        cli.main(["dlq", action, f"--limit={limit}"])
    assert stopped.value.code == 2
    assert f"argument --limit: must be a whole number of at least 1, not '{limit}'" in capsys.readouterr().err


def _max_receive_count(queues: PriorityQueues, priority: Priority, count: int | None) -> None:
    """Sets (or with None removes) the main queue's RedrivePolicy, as a deployment's own would be."""
    dlq_arn = queues.sqs.get_queue_attributes(QueueUrl=queues.dlq_url(priority),
                                              AttributeNames=["QueueArn"])["Attributes"]["QueueArn"]
    policy = "" if count is None else json.dumps({"deadLetterTargetArn": dlq_arn, "maxReceiveCount": str(count)})
    queues.sqs.set_queue_attributes(QueueUrl=queues.url(priority), Attributes={"RedrivePolicy": policy})


def test_settle_counts_runs_against_the_queues_max_receive_count(operator_env, monkeypatch, capsys):
    # A deployment with max_attempts 5; the operator's shell does not say so (SLUICE_MAX_ATTEMPTS: 3).
    monkeypatch.delenv("SLUICE_MAX_ATTEMPTS", raising=False)
    queues, store = PriorityQueues(operator_env), TaskStore(operator_env)
    _max_receive_count(queues, Priority.normal, 5)
    dead_letter(queues, store, "ran-3-of-5", attempts=2)  # started 3 times (sluice.dlq._runs)
    assert cli.main(["dlq", "settle"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("failed 0 tasks, requeued 1 messages"), captured.out
    assert captured.err == ""
    assert store.get("ran-3-of-5").status is TaskStatus.queued


def test_settle_without_a_redrive_policy_counts_the_setting_and_says_so(operator_env, monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_MAX_ATTEMPTS", "3")
    queues, store = PriorityQueues(operator_env), TaskStore(operator_env)
    _max_receive_count(queues, Priority.normal, None)
    dead_letter(queues, store, "ran-3", attempts=2)
    assert cli.main(["dlq", "settle", "--priority", "normal"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("failed 1 tasks, requeued 0 messages"), captured.out
    assert captured.err.strip() == ("sluice dlq settle: the normal queue has no RedrivePolicy; "
                                    "counting SLUICE_MAX_ATTEMPTS=3 runs as its maxReceiveCount")


def test_settle_limit_is_for_all_priorities_together(operator_env, capsys):
    queues, store = PriorityQueues(operator_env), TaskStore(operator_env)
    dead_letter(queues, store, "normal-one")
    store.create(TaskRecord(task_id="high-one", tenant_id="t", model="synthetic", priority=Priority.high,
                            status=TaskStatus.queued, input_count=1, created_at=0))
    queues.sqs.send_message(QueueUrl=queues.dlq_url(Priority.high), MessageBody=TaskMessage(
        task_id="high-one", tenant_id="t", model="synthetic", priority=Priority.high, input_count=1, inputs=["x"],
        enqueued_at=0).model_dump_json(exclude_none=True))
    assert cli.main(["dlq", "settle", "--limit", "1"]) == 0
    assert capsys.readouterr().out.strip() == ("failed 0 tasks, requeued 1 messages; "
                                               "the dead-letter queues still hold about 1 messages")


def test_a_dead_letter_of_an_earlier_task_under_the_same_id_leaves_the_new_task_alone(settings):
    # Its Idempotency-Key was reused once the task outlived its TTL, while this
    # message waited out its 14 days in the DLQ: the record is another task's.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "reused", attempts=settings.max_attempts)
    store.ddb.update_item(TableName=store.table, Key={"task_id": {"S": "reused"}},
                          UpdateExpression="SET created_at = :later", ExpressionAttributeValues={":later": {"N": "5"}})
    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts) == {"failed": 0, "requeued": 0}
    assert store.get("reused").status is TaskStatus.queued
    [listed] = list_dead(queues, [Priority.normal], store=store)
    assert listed["task_id"] == "reused" and listed["task_status"] is None


def test_a_worker_that_saw_an_earlier_task_final_still_settles_a_new_one_under_its_id(settings):
    # A worker's settling remembers final tasks across rounds; a later task
    # under the same id (its Idempotency-Key reused past the TTL) is not final.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "reused-later", attempts=1)
    store.ddb.update_item(TableName=store.table, Key={"task_id": {"S": "reused-later"}},
                          UpdateExpression="SET #s = :c", ExpressionAttributeNames={"#s": "status"},
                          ExpressionAttributeValues={":c": {"S": TaskStatus.cancelled.value}})
    known_final: set = set()
    assert settle_dead(queues, store, [Priority.normal], 3, known_final=known_final) == {"failed": 0, "requeued": 0}
    assert known_final
    store.ddb.delete_item(TableName=store.table, Key={"task_id": {"S": "reused-later"}})  # past its TTL
    store.create(TaskRecord(task_id="reused-later", tenant_id="t", model="synthetic", priority=Priority.normal,
                            status=TaskStatus.queued, input_count=1, created_at=5, attempts=1))
    body = TaskMessage(task_id="reused-later", tenant_id="t", model="synthetic", priority=Priority.normal,
                       input_count=1, inputs=["y"], enqueued_at=5).model_dump_json(exclude_none=True)
    queues.sqs.send_message(QueueUrl=queues.dlq_url(Priority.normal), MessageBody=body)
    assert settle_dead(queues, store, [Priority.normal], 3, known_final=known_final) == {"failed": 0, "requeued": 1}


def test_the_workers_settling_goes_on_after_a_round_that_failed(settings, monkeypatch):
    # The worker's thread: one transient error (the table throttled, SQS away) must
    # not end it, or dead-lettered tasks without an outcome stay queued for ever.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "settled-late", attempts=2)
    real, rounds = dlq.settle_dead, []

    def fails_first(*args, **kwargs):
        rounds.append(1)
        if len(rounds) == 1:
            raise ConnectionError("the table went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(dlq, "settle_dead", fails_first)
    done = threading.Event()
    thread = threading.Thread(target=dlq.settle_loop, args=(queues, store, 3, done, 0.05), daemon=True)
    thread.start()
    try:
        wait_until(lambda: store.get("settled-late").status is TaskStatus.failed, 30,
                   "the task settled by a round after the failed one")
        assert thread.is_alive() and len(rounds) >= 2
    finally:
        done.set()
        thread.join(10)
    assert not thread.is_alive()


def test_settling_reaches_a_task_behind_more_finished_dead_letters_than_a_round_scans(settings):
    # moto and LocalStack receive in queue order: a round that stops at its scan
    # limit hides the dead letters of finished tasks it passed, so the next
    # round starts past them instead of at the same head.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    for i in range(25):
        dead_letter(queues, store, f"done-{i}", status=TaskStatus.failed, finished_at=1)
    dead_letter(queues, store, "stuck", attempts=2)  # killed its worker each time
    rounds = [settle_dead(queues, store, [Priority.normal], 3, scan=10) for _ in range(4)]
    assert rounds == [{"failed": 0, "requeued": 0}] * 2 + [{"failed": 1, "requeued": 0}] + [{"failed": 0, "requeued": 0}]
    assert store.get("stuck").status is TaskStatus.failed


def test_a_round_that_reaches_the_end_of_its_queue_shows_every_dead_letter_again(settings):
    queues, store = PriorityQueues(settings), TaskStore(settings)
    for i in range(3):
        dead_letter(queues, store, f"done-{i}", status=TaskStatus.failed, finished_at=1)
    assert settle_dead(queues, store, [Priority.normal], 3) == {"failed": 0, "requeued": 0}
    assert sorted(item["task_id"] for item in list_dead(queues, [Priority.normal])) == ["done-0", "done-1", "done-2"]


def test_a_round_that_stops_at_its_limit_shows_every_dead_letter_it_kept_again(settings):
    # Only a round cut short of its queue (at `scan`, or out of time) hides what
    # it passed: `sluice dlq settle --limit 1` on a short queue is not one.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    for name in ("done-0", "done-1", "stuck-0", "stuck-1", "done-2", "done-3"):
        recorded = {"attempts": 2} if name.startswith("stuck") else {"status": TaskStatus.failed, "finished_at": 1}
        dead_letter(queues, store, name, **recorded)
    # Its first receive fills its scan (4), and it settles its one task in it.
    assert settle_dead(queues, store, [Priority.normal], 3, limit=1, scan=4) == {"failed": 1, "requeued": 0}
    listed = {item["task_id"] for item in list_dead(queues, [Priority.normal])}
    assert listed == {"done-0", "done-1", "stuck-0", "stuck-1", "done-2", "done-3"}


def test_copies_of_one_task_s_dead_letter_requeue_it_once(settings):
    # Two dead letters of one task (a send-then-delete that failed between, an
    # idempotent retry's re-send): each requeued copy ran the task's last run,
    # so a task that kills its worker ran past max_attempts.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "twice", attempts=1)
    queues.sqs.send_message(QueueUrl=queues.dlq_url(Priority.normal), MessageBody=_dead_body("twice"))
    assert settle_dead(queues, store, [Priority.normal], 3) == {"failed": 0, "requeued": 1}
    [message] = receive_all(settings, 1)
    assert message.task().runs_before == 2
    assert receive_all(settings, 0) == []  # no second copy in the queue...
    assert list_dead(queues, [Priority.normal]) == []  # ...nor left in the dead-letter queue


def _dead_body(task_id: str) -> str:
    return TaskMessage(task_id=task_id, tenant_id="t", model="synthetic", priority=Priority.normal, input_count=1,
                       inputs=["x"], enqueued_at=0).model_dump_json(exclude_none=True)


def test_a_redriven_task_gets_its_runs_anew(settings):
    # A settling requeue or a worker's dead letter carries the runs so far
    # (runs_before): redriven as it was, a task at its last run was spent at
    # its first receive, where the operator who fixed the cause meant to rerun it.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    store.create(TaskRecord(task_id="fixed", tenant_id="t", model="synthetic", priority=Priority.normal,
                            status=TaskStatus.queued, input_count=1, created_at=0, attempts=2))
    body = json.loads(_dead_body("fixed"))
    queues.sqs.send_message(QueueUrl=queues.dlq_url(Priority.normal),
                            MessageBody=json.dumps({**body, "runs_before": 2}))
    assert redrive(queues, [Priority.normal]) == 1
    [message] = receive_all(settings, 1)
    assert message.task().runs_before is None and message.receive_count == 1


def test_a_round_past_its_deadline_receives_nothing(settings):
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "later")
    assert settle_dead(queues, store, [Priority.normal], 3, until=time.monotonic()) == {"failed": 0, "requeued": 0}
    assert [d["task_id"] for d in list_dead(queues, [Priority.normal])] == ["later"]  # left for the next round


def test_a_round_requeues_before_it_writes_its_failures(settings, monkeypatch):
    # A failure's write takes a call each, and on a throttled table many such
    # calls can outlast the round's hide of what it received: a requeue sent
    # after them could follow another worker's requeue of the same task.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "to-fail", attempts=3)
    dead_letter(queues, store, "to-requeue", attempts=1)
    dead_letters_at_failure = []
    fail = dlq._fail_dead_lettered

    def failing(store_, record):
        dead_letters_at_failure.append(sum(dlq.dead_counts(queues, [Priority.normal])))
        return fail(store_, record)

    monkeypatch.setattr(dlq, "_fail_dead_lettered", failing)
    assert settle_dead(queues, store, [Priority.normal], 3) == {"failed": 1, "requeued": 1}
    assert dead_letters_at_failure == [1]  # the requeued task's dead letter was gone by then


def test_a_pass_slowed_past_half_its_hide_leaves_its_requeues_to_the_next_round(settings, monkeypatch):
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "slow-read", attempts=1)
    # A pass's receives take a second at least (their last long poll comes back empty).
    monkeypatch.setattr(dlq, "_HIDE_S", 4)
    read = store.get_many

    def slow_read(*args, **kwargs):
        time.sleep(1.5)  # a throttled table: the pass takes longer than half the hide
        return read(*args, **kwargs)

    monkeypatch.setattr(store, "get_many", slow_read)
    assert settle_dead(queues, store, [Priority.normal], 3) == {"failed": 0, "requeued": 0}
    assert receive_all(settings, 0) == []
    assert [d["task_id"] for d in list_dead(queues, [Priority.normal])] == ["slow-read"]  # shown again at once
    monkeypatch.setattr(store, "get_many", read)
    assert settle_dead(queues, store, [Priority.normal], 3) == {"failed": 0, "requeued": 1}
    [message] = receive_all(settings, 1)
    assert message.task().task_id == "slow-read"


def test_a_worker_that_requeued_a_task_settles_it_again_when_it_is_dead_lettered_again(settings):
    # A worker's settling remembers only final tasks across rounds. One it
    # requeued, whose next run took its worker down too, comes back to the DLQ:
    # taken for final, it would never be read again, and stay queued for ever.
    queues, store = PriorityQueues(settings), TaskStore(settings)
    dead_letter(queues, store, "requeued-twice", attempts=1)  # ran twice, no outcome
    known_final: set = set()
    assert settle_dead(queues, store, [Priority.normal], 3, known_final=known_final) == {"failed": 0, "requeued": 1}
    # Its requeued message's run killed its worker (the claim recorded its start), and it is dead-lettered again.
    [again] = receive_all(settings, 1)
    store.apply(Change("requeued-twice", {"started_at": 1}, (TaskStatus.queued,), add_attempt=True))
    queues.sqs.send_message(QueueUrl=queues.dlq_url(Priority.normal), MessageBody=again.body)
    queues.delete_many([again])
    assert settle_dead(queues, store, [Priority.normal], 3, known_final=known_final) == {"failed": 1, "requeued": 0}
    record = store.get("requeued-twice")
    assert (record.status, record.error_code, record.attempts) == (TaskStatus.failed, "dead_lettered", 3)
