"""A claimed task that goes back without running spends no run: the start its
redelivery's claim recorded is taken back (sluice.lifecycle.unclaim), so that
dead-letter settling, which counts recorded starts as runs, requeues it rather
than failing it as one that kept killing its worker."""

from __future__ import annotations

import threading

import pytest
from botocore.awsrequest import AWSResponse

from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.api.service import TaskService
from sluice.aws import new_client
from sluice.contract import Priority, SubmitRequest
from sluice.dlq import dead_counts, settle_dead
from sluice.worker.main import Worker
from sluice.worker.runner import Pipeline, hand_back
from tests.integration.test_worker_runner import run_once
from tests.integration.test_worker_stop import GatedModel, held_in_inference, wait_for
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


def run_pipeline(runner, batch, breaks=Stage.nothing) -> None:
    """One Pipeline.run over `batch` alone, the stage `breaks` names broken;
    it ends once the batch is handed back, released or finished."""
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
    refused = []

    def refuse(params, **_):
        body = params["body"].decode()
        if task_id not in body or naming not in body:
            return None
        refused.append(task_id)
        error = {"Code": "ProvisionedThroughputExceededException", "Message": "Rate of requests exceeds capacity"}
        return (AWSResponse(params["url"], 400, {}, None),
                {"Error": error, "ResponseMetadata": {"HTTPStatusCode": 400}})

    store.ddb.meta.events.register(f"before-call.dynamodb.{operation}", refuse)
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
    settings = settings.model_copy(update={"max_batch_size": 2, "max_wait_ms": 0, "inference_timeout_s": 3})
    texts = [f"t{i}" for i in range(6)]
    ids = dict(zip(texts, submit(settings, *texts)))
    hand_back(PriorityQueues(settings), receive(settings, list(ids.values())), 0)  # each delivery a redelivery
    model = RecordingGatedModel()
    worker = Worker(settings, {"synthetic": model})
    exited = []
    worker.exit = exited.append  # stands in for os._exit
    store = TaskStore(settings)
    with held_in_inference(worker, model):
        # Every task claimed, before the watchdog fires: two batches of two
        # prepared behind the one held in the model.
        wait_for(lambda: {r.attempts for r in store.get_many(ids.values()).values()} == {1}, 2.5,
                 "two batches prepared behind the stuck one")
        wait_for(lambda: exited, 15, "the worker giving up on the stuck batch")
        assert exited == [70]
        records = store.get_many(ids.values())  # while the model still holds its batch
        stuck = {ids[text] for text in model.batches[0]}
        assert len(stuck) == 2
        # The stuck batch ran: its starts stand, so a task that hangs every worker reaches its limit.
        assert {t: records[t].attempts for t in ids.values()} == {t: int(t in stuck) for t in ids.values()}
