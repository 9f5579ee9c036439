"""A claimed task that goes back without running spends no run: the start its
redelivery's claim recorded is taken back (sluice.lifecycle.unclaim), so that
dead-letter settling, which counts recorded starts as runs, requeues it rather
than failing it as one that kept killing its worker."""

from __future__ import annotations

import json
import threading

import pytest
from botocore.awsrequest import AWSResponse

from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.api.service import TaskService
from sluice.aws import new_client
from sluice.contract import Priority, SubmitRequest, now_ms
from sluice.dlq import dead_counts, settle_dead
from sluice.lifecycle import Job, claim, unclaim
from sluice.worker import runner as runner_module
from sluice.worker.main import Worker
from sluice.worker.runner import Pipeline, hand_back
from tests.integration.resent_writes import RESENDS
from tests.integration.test_worker_runner import run_once
from tests.integration.test_worker_stop import GatedModel, held_in_inference, visible_again, wait_for
from tests.reliability.harness import wait_until

# Hidden this long by each receive of the test, so that a message the pipeline
# only releases (it comes back after its visibility timeout) is soon back.
VISIBILITY_S = 3


def submit(settings, *texts: str) -> list[str]:
    service = TaskService(settings)
    return [service.submit("tenant-a", SubmitRequest(model="synthetic", inputs=[text]), None).task_id
            for text in texts]


def receive(settings, task_ids: list[str], timeout_s: float = 15) -> list:
    """The messages of `task_ids`, received (hidden for VISIBILITY_S) once all are visible."""
    queues, got = PriorityQueues(settings), {}

    def all_received():
        for m in queues.receive(Priority.normal, 10, 1, VISIBILITY_S):
            got[m.task().task_id] = m
        return set(task_ids) <= set(got)

    wait_until(all_received, timeout_s, f"the messages of {task_ids}")
    return [got[t] for t in task_ids]


def redeliver(settings, messages: list, task_ids: list[str]) -> list:
    """`messages`, those of `task_ids` handed back and received again: a
    redelivery (receive count 2), as after a receive that ended without an outcome."""
    again = [m for m in messages if m.task().task_id in task_ids]
    hand_back(PriorityQueues(settings), again, 0)
    received = receive(settings, task_ids)
    assert {m.receive_count for m in received} == {2}
    return received + [m for m in messages if m not in again]


class Stage:
    """How a prepared batch goes back unrun, for run_pipeline."""

    @staticmethod
    def stop(runner, pipeline):
        # SIGTERM lands while the batch waits behind the one in inference.
        def prepare_then_stop(batch, give_back=None):
            prepared = type(runner).prepare(runner, batch, give_back)
            pipeline.stopping.set()
            return prepared

        runner.prepare = prepare_then_stop

    @staticmethod
    def infer_fails(runner, pipeline):
        def broken(jobs):
            raise RuntimeError("the infer stage itself failed")

        runner.infer = broken

    @staticmethod
    def nothing(runner, pipeline):
        pass


def run_pipeline(runner, batch, breaks=Stage.nothing, events: list[str] | None = None) -> None:
    """One Pipeline.run over `batch` alone, the stage `breaks` names broken;
    it ends once the batch is handed back, released or finished. A hand-back
    is noted in `events`, if given."""
    queues = PriorityQueues(runner.settings)
    handled = threading.Event()
    batches = [batch]

    def take_batch():
        if batches:
            return batches.pop()
        assert handled.wait(15), "the batch was neither handed back nor released"
        pipeline.stopping.set()
        return []

    def on_done(messages):
        handled.set()

    def give_back(messages, delay_s=0):
        hand_back(queues, messages, delay_s)
        if events is not None:
            events.append("handed back")
        handled.set()

    pipeline = Pipeline(runner, take_batch, on_done, give_back)
    breaks(runner, pipeline)
    pipeline.run()


@pytest.mark.parametrize("breaks", [Stage.stop, Stage.infer_fails], ids=["stop", "infer_fails"])
def test_a_task_handed_back_unrun_at_every_receive_is_requeued_by_settling_not_failed(settings, runner, breaks):
    [task_id] = submit(settings, "never runs")
    queues, store = PriorityQueues(settings), TaskStore(settings)
    # Every receive that SQS allows (maxReceiveCount = max_attempts): claimed, then back unrun.
    for receive_count in range(1, settings.max_attempts + 1):
        [message] = receive(settings, [task_id])
        assert message.receive_count == receive_count
        run_pipeline(runner, [message], breaks)
    # The next receive moves the message to the dead-letter queue.
    wait_until(lambda: queues.receive(Priority.normal, 10, 1, 30) == [] and dead_counts(queues, [Priority.normal])[0],
               2 * VISIBILITY_S + 15, "the message dead-lettered")

    assert settle_dead(queues, store, [Priority.normal], settings.max_attempts) == {"failed": 0, "requeued": 1}
    record = store.get(task_id)
    assert (record.status.value, record.attempts, record.started_at, record.error_code) == ("queued", 0, None, None)
    [again] = receive(settings, [task_id])  # back in its queue with a fresh receive count
    assert again.receive_count == 1


def throttle(store: TaskStore, operation: str, task_id: str, naming: str = "") -> list[str]:
    """The table refuses this store's `operation` calls that name `task_id`
    (and `naming`), as after the SDK's retries (ProvisionedThroughputExceededException);
    returns the task ids of the calls refused."""
    return refuse(store, operation, task_id, naming, "ProvisionedThroughputExceededException", 400)


def refuse(store: TaskStore, operation: str, task_id: str, naming: str, code: str, status: int) -> list[str]:
    """The table answers this store's `operation` calls that name `task_id`
    (and `naming`) with the error `code` and HTTP `status`, as after the SDK's
    retries; returns the task ids of the calls refused."""
    refused = []

    def refusing(params, **_):
        body = params["body"].decode()
        if task_id not in body or naming not in body:
            return None
        refused.append(task_id)
        error = {"Code": code, "Message": f"refused by the test ({code})"}
        return (AWSResponse(params["url"], status, {}, None),
                {"Error": error, "ResponseMetadata": {"HTTPStatusCode": status}})

    store.ddb.meta.events.register(f"before-call.dynamodb.{operation}", refusing)
    return refused


@pytest.mark.parametrize("throttled", ["BatchGetItem", "UpdateItem"])
def test_a_preparation_that_fails_after_the_claim_takes_back_the_starts_it_recorded(settings, runner, throttled):
    # The batch: a redelivery (its claim records a start) and a sibling whose
    # call the table throttles: the read of a first delivery, or its own claim.
    target, sibling = submit(settings, "claimed", "throttled")
    first = receive(settings, [target, sibling])
    batch = redeliver(settings, first, [target] if throttled == "BatchGetItem" else [target, sibling])
    runner.store = TaskStore(settings, ddb=new_client("dynamodb", settings))  # the hook sees this store's calls only
    refused = throttle(runner.store, throttled, sibling)
    run_pipeline(runner, batch)  # prepare raises; the batch is released, to be received again

    assert refused, f"the sibling's {throttled} was never called"
    store = TaskStore(settings)
    for task_id in (target, sibling):
        record = store.get(task_id)
        assert (record.status.value, record.attempts, record.started_at) == ("queued", 0, None), record


def test_a_start_taken_back_puts_back_the_start_of_the_last_run(settings, runner):
    # A run that failed (retried) recorded its start; a redelivery's claim
    # replaced it, then the worker stopped and handed the batch back unrun.
    [task_id] = submit(settings, "x !crash")
    run_once(runner, receive(settings, [task_id]))
    store = TaskStore(settings)
    ran = store.get(task_id)
    assert (ran.status.value, ran.attempts, ran.error_code) == ("queued", 1, "model_error") and ran.started_at

    [message] = receive(settings, [task_id])  # after the retry's backoff
    assert message.receive_count == 2
    run_pipeline(runner, [message], Stage.stop)
    record = store.get(task_id)
    assert (record.attempts, record.started_at, record.error_code) == (1, ran.started_at, "model_error")
    assert record.to_view().timings.queue_ms == ran.started_at - ran.created_at


class RecordingGatedModel(GatedModel):
    """GatedModel that remembers the inputs of each batch it was given."""

    def __init__(self):
        super().__init__()
        self.batches: list[list[str]] = []

    def predict_batch(self, inputs):
        self.batches.append(list(inputs))
        return super().predict_batch(inputs)


def test_a_worker_giving_up_on_a_stuck_batch_takes_back_the_starts_of_the_batches_behind_it(settings):
    # A limit far off, so that every claim lands before it however busy the
    # machine; once they have, the test ages the stuck batch past it.
    settings = settings.model_copy(update={"max_batch_size": 2, "max_wait_ms": 0, "inference_timeout_s": 60})
    texts = [f"t{i}" for i in range(3)]
    ids = dict(zip(texts, submit(settings, *texts)))
    hand_back(PriorityQueues(settings), receive(settings, list(ids.values())), 0)  # each delivery a redelivery
    model = RecordingGatedModel()
    worker = Worker(settings, {"synthetic": model})
    exited = []
    worker.exit = exited.append  # stands in for os._exit
    store = TaskStore(settings)
    with held_in_inference(worker, model):
        # Every task claimed: two batches prepared behind the one held in the
        # model, each of one task (a redelivery runs alone: sluice.worker.batcher).
        wait_for(lambda: {r.attempts for r in store.get_many(ids.values()).values()} == {1}, 15,
                 "two batches prepared behind the stuck one")
        worker.pipeline.inferring_since -= settings.inference_timeout_s  # in inference past the limit
        wait_for(lambda: exited, 15, "the worker giving up on the stuck batch")
        assert exited == [70]
        records = store.get_many(ids.values())  # while the model still holds its batch
        stuck = {ids[text] for text in model.batches[0]}
        assert len(stuck) == 1
        # The stuck batch ran: its starts stand, so a task that hangs every worker reaches its limit.
        assert {t: records[t].attempts for t in ids.values()} == {t: int(t in stuck) for t in ids.values()}
        # It stopped receiving before its hand-back: every message is visible
        # again at once, none taken back into the worker's prefetch to stay
        # hidden until its visibility timeout (30 s) runs out.
        visible_again(settings, set(ids.values()), "every message visible again after the watchdog's hand-back")
        assert {t: r.attempts for t, r in store.get_many(ids.values()).items()} == {
            t: int(t in stuck) for t in ids.values()}  # and none claimed again


def test_a_take_back_leaves_alone_the_start_that_another_claim_recorded_since(settings):
    # The messages were handed back before the starts were taken back (a
    # stopping worker, its watchdog), or the task was delivered twice: another
    # claim of it recorded its own start meanwhile, which stands.
    [task_id] = submit(settings, "claimed twice")
    [message] = redeliver(settings, receive(settings, [task_id]), [task_id])
    store = TaskStore(settings)
    mine, theirs = Job(message.task(), [message]), Job(message.task(), [message])
    now = now_ms()
    assert claim(store, [mine], now, max_attempts=3).runnable == [mine]
    assert claim(store, [theirs], now + 1000, max_attempts=3).runnable == [theirs]

    unclaim(store, [mine])
    record = store.get(task_id)
    assert (record.attempts, record.started_at) == (2, now + 1000)
    # Theirs taken back in turn: the record is as after the first claim, whose
    # start is left counted (a run too many at worst, never one too few).
    unclaim(store, [theirs])
    record = store.get(task_id)
    assert (record.status.value, record.attempts, record.started_at) == ("queued", 1, now)


@pytest.mark.parametrize("resend", RESENDS, ids=lambda f: f.__name__)
def test_a_claim_resent_after_it_landed_records_one_start(settings, resend):
    # The SDK resends a claim whose answer was lost: the resend found the task
    # still queued and added a second attempt for one start (or, refused,
    # left the task unrun as if another run had finished it).
    [task_id] = submit(settings, "resent")
    [message] = redeliver(settings, receive(settings, [task_id]), [task_id])
    store = TaskStore(settings, ddb=new_client("dynamodb", settings))  # its own: the test hooks its calls
    landed = resend(store.ddb, "started_at")
    job, now = Job(message.task(), [message]), now_ms()
    assert claim(store, [job], now, max_attempts=3).runnable == [job]
    assert landed == [200]
    record = store.get(task_id)
    assert (record.status.value, record.attempts, record.started_at) == ("queued", 1, now)
    unclaim(store, [job])  # its start is still its own to take back
    record = store.get(task_id)
    assert (record.attempts, record.started_at) == (0, None)


def test_a_stopping_worker_hands_back_first_and_waits_on_the_take_back_a_bounded_time(settings, runner, monkeypatch):
    monkeypatch.setattr(runner_module, "UNCLAIM_ON_EXIT_S", 0.5, raising=False)
    [task_id] = submit(settings, "handed back on stop")
    [message] = redeliver(settings, receive(settings, [task_id]), [task_id])
    runner.store = TaskStore(settings, ddb=new_client("dynamodb", settings))  # the hook sees this store's calls only
    events, table_answers = [], threading.Event()

    def slow_take_back(params, **_):
        if '"-1"' in params["body"].decode():  # ADD attempts -1: the take-back of the claim's start
            events.append("take-back")
            assert table_answers.wait(10), "the test never let the take-back through"

    runner.store.ddb.meta.events.register("before-call.dynamodb.UpdateItem", slow_take_back)
    store = TaskStore(settings)
    try:
        run_pipeline(runner, [message], Stage.stop, events)  # returns with the take-back still held
        assert events[0] == "handed back"
        assert store.get(task_id).attempts == 1
        wait_for(lambda: "take-back" in events, 5, "the take-back tried after the hand-back")
    finally:
        table_answers.set()
    wait_for(lambda: store.get(task_id).attempts == 0, 10, "the start taken back once the table answers")


def stopped_with_a_prepared_batch(runner, batch: list) -> tuple[list, list]:
    """A worker's pipeline told to stop while `batch`, prepared, waits for
    inference; returns the messages it handed back and those it released."""
    given, released = [], []
    taken = iter([batch])
    pipeline = Pipeline(runner, lambda: next(taken, []), released.extend,
                        lambda messages, delay_s=0: given.extend(messages))
    prepare = runner.prepare

    def prepared_then_stopping(*args):
        prepared = prepare(*args)
        pipeline.stopping.set()  # the stop comes while the batch waits for inference
        return prepared

    runner.prepare = prepared_then_stopping
    worker = threading.Thread(target=pipeline.run, daemon=True)
    worker.start()
    worker.join(15)
    assert not worker.is_alive()
    return given, released


def test_a_stopping_worker_dead_letters_the_spent_task_of_a_prepared_batch(settings, runner):
    """A requeued task past max_attempts (lifecycle.claim) goes to the DLQ, not
    back to its queue, when the batch it was prepared in goes back unrun."""
    (spent,) = submit(settings, "spent")
    (delivery,) = receive(settings, [spent])
    delivery.body = json.dumps({**json.loads(delivery.body), "runs_before": settings.max_attempts})

    given, released = stopped_with_a_prepared_batch(runner, [delivery])
    assert given == [] and released == [delivery]
    assert dead_counts(PriorityQueues(settings), [Priority.normal]) == (1, 0)
    assert TaskStore(settings).get(spent).attempts == 0  # not run, no start recorded


def test_a_stopping_worker_hands_back_only_the_claimed_tasks_of_a_prepared_batch(settings, runner):
    """What prepare settled stays settled: the messages of a task that expired or
    was already final are deleted, not handed back for another receive."""
    service = TaskService(settings)
    ok, cancelled, late = submit(settings, "ok", "cancelled", "late")
    service.cancel("tenant-a", cancelled)
    batch = receive(settings, [ok, cancelled, late])
    body = json.loads(batch[2].body)
    body["deadline_at"] = 1  # its deadline passed, without waiting for it
    batch[2].body = json.dumps(body)

    given, released = stopped_with_a_prepared_batch(runner, batch)
    assert [m.task().task_id for m in given] == [ok]
    queue = PriorityQueues(settings)
    attributes = queue.sqs.get_queue_attributes(
        QueueUrl=queue.url(Priority.normal),
        AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
    assert sum(int(v) for v in attributes.values()) == 1, "the settled tasks' messages were not deleted"
    assert {m.receipt_handle for m in batch} <= {m.receipt_handle for m in released + given}


def test_a_preparation_whose_inputs_stage_fails_takes_back_the_starts_its_claim_recorded(
        settings, runner, monkeypatch):
    # Per-task read errors are outcomes; the stage itself failing (its pool shut
    # down, a defect) sends the whole batch back unrun, after the claim.
    [task_id] = submit(settings, "claimed, never loaded")
    batch = redeliver(settings, receive(settings, [task_id]), [task_id])  # its claim records a start

    def broken(*_):
        raise RuntimeError("the inputs stage itself failed")

    monkeypatch.setattr(runner_module, "load_inputs", broken)
    run_pipeline(runner, batch)  # prepare raises; the batch is released, to be received again
    record = TaskStore(settings).get(task_id)
    assert (record.status.value, record.attempts, record.started_at) == ("queued", 0, None), record


def test_a_finish_that_fails_outright_still_releases_its_batch(settings, runner):
    # finish releases the messages its queue calls settle; one that raises
    # before them (a defect) must not leave its batch held: the worker's
    # heartbeat extends a held message for as long as the worker lives.
    [task_id] = submit(settings, "finish fails")
    batches, released, finished = [receive(settings, [task_id])], [], threading.Event()

    def take_batch():
        if batches:
            return batches.pop()
        finished.wait(15)  # not stopping before the batch is through: a stopping pipeline releases it itself
        pipeline.stopping.set()
        return []

    def broken(prepared, outcomes, release=None):
        finished.set()
        raise RuntimeError("finish itself failed")

    runner.finish = broken
    pipeline = Pipeline(runner, take_batch, released.extend, lambda messages, delay_s=0: None)
    pipeline.run()
    assert finished.is_set()
    assert [m.task().task_id for m in released] == [task_id]
