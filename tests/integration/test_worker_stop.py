"""A worker told to stop (SIGTERM) finishes the batch in inference only: the
batches prepared behind it go back to the queue at once, rather than run past
the pod's grace period."""

from __future__ import annotations

import contextlib
import threading
import time

from models.synthetic import SyntheticModel
from sluice.adapters.queues import PriorityQueues
from sluice.adapters.task_store import TaskStore
from sluice.api.service import TaskService
from sluice.contract import Priority, SubmitRequest, TaskStatus
from sluice.worker.main import Worker


class GatedModel(SyntheticModel):
    """Holds its first batch in inference until the test lets it go."""

    def __init__(self):
        super().__init__(base_ms=0, per_item_ms=0)
        self.inferring, self.go = threading.Event(), threading.Event()

    def predict_batch(self, inputs):
        self.inferring.set()
        assert self.go.wait(20), "the test never released the model"
        return super().predict_batch(inputs)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)



def submit(settings, n: int) -> list[str]:
    service = TaskService(settings)
    return [service.submit("tenant-a", SubmitRequest(model="synthetic", inputs=[f"t{i}"]), None).task_id
            for i in range(n)]


def running(worker: Worker, exit_codes: list[int] | None = None) -> threading.Thread:
    """The worker's run() in a thread; what it returns is appended to exit_codes."""
    thread = threading.Thread(target=lambda: (exit_codes if exit_codes is not None else []).append(worker.run()),
                              daemon=True)
    thread.start()
    return thread


@contextlib.contextmanager
def held_in_inference(worker: Worker, model: GatedModel):
    """Runs the worker until its first batch is held in `model`; on leaving,
    releases the model, stops the worker and waits for it to end."""
    thread = running(worker)
    try:
        assert model.inferring.wait(15), "no batch reached the model within 15 s"
        yield
    finally:
        model.go.set()
        worker.stop()  # a no-op if the block stopped it
        thread.join(20)
    assert not thread.is_alive()


def visible_again(settings, wanted: set[str], what: str) -> set[str]:
    """Receive (and hold) the tasks visible in the normal queue until `wanted` are
    among them, within 10 s, far less than their 30 s visibility timeout."""
    queues, back = PriorityQueues(settings), set()
    wait_for(lambda: back.update(m.task().task_id for m in queues.receive(Priority.normal, 10, 1, 30))
             or wanted <= back, 10, what)
    return back


def test_stopping_runs_the_batch_in_inference_and_hands_back_the_rest(settings):
    settings = settings.model_copy(update={"max_batch_size": 2, "max_wait_ms": 0})
    ids = submit(settings, 8)
    model = GatedModel()
    worker = Worker(settings, {"synthetic": model})
    with held_in_inference(worker, model):
        # A second batch is prepared and waits behind the one in inference.
        wait_for(worker.pipeline._prepared.full, 15, "a prepared batch waiting for the model")
        worker.stop()

    records = TaskStore(settings).get_many(ids)
    done = [t for t in ids if records[t].status == TaskStatus.succeeded]
    assert len(done) == 2, {t: r.status for t, r in records.items()}
    assert all(records[t].status == TaskStatus.queued for t in ids if t not in done)
    # Everything else is back in the queue now, not after its visibility timeout (30 s).
    back = visible_again(settings, set(ids) - set(done), "the six other tasks visible again")
    assert back == set(ids) - set(done)


def wait_for_a_full_pipeline(worker: Worker) -> None:
    """Of 8 one-input tasks at batch size 2: 2 in inference, 2 prepared, 2 more
    prepared and waiting to be handed on, 2 in the buffer."""
    wait_for(lambda: worker.pipeline._prepared.full() and len(worker.buffer.snapshot()) == 2, 15,
             "batches prepared behind the model and two tasks left in the buffer")


def test_stopping_hands_back_the_prefetched_messages_while_the_model_still_runs(settings):
    # A slow batch must not keep the buffer's messages (a high task among them,
    # say) hidden until it ends, or past the pod's grace period.
    settings = settings.model_copy(update={"max_batch_size": 2, "max_wait_ms": 0})
    ids = submit(settings, 8)
    model = GatedModel()
    worker = Worker(settings, {"synthetic": model})
    with held_in_inference(worker, model):
        wait_for_a_full_pipeline(worker)
        buffered = {m.task().task_id for m in worker.buffer.snapshot()}
        worker.stop()
        visible_again(settings, buffered, "the buffered tasks visible again while the model is held")
        assert model.inferring.is_set() and not model.go.is_set()


def test_run_returns_only_once_the_prefetched_messages_are_handed_back(settings):
    # main() exits the process when run() returns, ending its daemon threads:
    # a hand-back still under way then never lands, and the prefetched messages
    # stay hidden for their visibility timeout (three minutes on EKS).
    settings = settings.model_copy(update={"max_batch_size": 2, "max_wait_ms": 0, "receive_wait_s": 2})
    service = TaskService(settings)
    for priority in Priority:  # messages of every priority in the buffer: the hand-back waits for every receiver
        for i in range(8):
            service.submit("tenant-a", SubmitRequest(model="synthetic", inputs=[f"t{i}"], priority=priority), None)
    model = GatedModel()
    worker = Worker(settings, {"synthetic": model})
    thread = running(worker)
    assert model.inferring.wait(15), "no batch reached the model within 15 s"
    wait_for(lambda: worker.pipeline._prepared.full()
             and {m.priority for m in worker.buffer.snapshot()} == set(Priority), 15,
             "batches prepared behind the model and tasks of every priority in the buffer")
    buffered = {m.task().task_id for m in worker.buffer.snapshot()}
    worker.stop()
    model.go.set()  # the batch in hand ends at once: run() and the hand-back finish together
    thread.join(20)
    assert not thread.is_alive()
    handing_back = [t for t in threading.enumerate() if t.name == "sluice-stop" and t.is_alive()]
    assert not handing_back, "run() returned while the prefetched messages were still being handed back"
    queues, back = PriorityQueues(settings), set()
    wait_for(lambda: back.update(m.task().task_id for p in Priority for m in queues.receive(p, 10, 0, 30))
             or buffered <= back, 10, "the buffered tasks visible again")


def test_stopping_hands_back_what_it_held_without_spending_a_receive_of_it(settings):
    # A receive still polling when messages go back would take them straight
    # back (SQS answers a long poll the moment a message is visible), then hand
    # them back again: a receive of each spent, on the way to the DLQ.
    settings = settings.model_copy(update={"max_batch_size": 2, "max_wait_ms": 0, "receive_wait_s": 10})
    ids = submit(settings, 8)
    model = GatedModel()
    worker = Worker(settings, {"synthetic": model})
    with held_in_inference(worker, model):
        wait_for_a_full_pipeline(worker)
        with worker._held_lock:
            received = {m.task().task_id: m.receive_count for m in worker._held.values()}
        worker.stop()
    assert set(received) == set(ids)
    done = {t for t, r in TaskStore(settings).get_many(ids).items() if r.status == TaskStatus.succeeded}
    # The worker has ended: only this test receives now.
    queues, seen = PriorityQueues(settings), {}
    wait_for(lambda: seen.update({m.task().task_id: m.receive_count for m in queues.receive(Priority.normal, 10, 1, 30)})
             or set(ids) - done <= set(seen), 10, "the six tasks handed back visible again")
    assert len(done) == 2 and set(seen) == set(ids) - done
    assert seen == {t: received[t] + 1 for t in seen}  # the worker's receive, then this test's


def test_a_batch_stuck_in_inference_ends_the_worker_and_every_message_it_held_comes_back(settings):
    # A hung GPU kernel: the heartbeat would keep the batch, and the batches and
    # messages behind it, hidden for as long as the process lived.
    settings = settings.model_copy(update={"max_batch_size": 2, "max_wait_ms": 0, "inference_timeout_s": 1})
    ids = submit(settings, 6)
    model = GatedModel()
    worker = Worker(settings, {"synthetic": model})
    exited = []
    worker.exit = exited.append  # stands in for os._exit
    with held_in_inference(worker, model):
        wait_for(lambda: exited, 15, "the worker giving up on the stuck batch")
        assert exited == [70]
        # Back now, not after their visibility timeout (30 s): the one in inference too.
        assert visible_again(settings, set(ids), "every task visible again") == set(ids)


class BrokenDevice(SyntheticModel):
    """Every forward pass fails, whatever the inputs: a GPU after a sticky CUDA error."""

    def __init__(self):
        super().__init__(base_ms=0, per_item_ms=0)

    def predict_batch(self, inputs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


def exit_code_of(worker: Worker, within_s: float) -> int | None:
    """What run() returns if the worker ends within `within_s`; else it is stopped first."""
    code = []
    thread = running(worker, code)
    thread.join(within_s)
    if thread.is_alive():
        worker.stop()
        thread.join(20)
    return code[0] if code else None


def test_a_model_that_fails_every_task_batch_after_batch_stops_the_worker_before_it_fails_the_queue(settings):
    settings = settings.model_copy(update={"max_batch_size": 2, "max_wait_ms": 200})
    ids = submit(settings, 12)
    assert exit_code_of(Worker(settings, {"synthetic": BrokenDevice()}), 60) == 1, \
        "the worker kept running on a model that fails everything"
    records = TaskStore(settings).get_many(ids)
    tried = [t for t in ids if records[t].attempts]
    # Three batches of two, each task failed alone after bisection; the rest untouched, and back in the queue.
    assert len(tried) == 6, {t: (r.status, r.attempts) for t, r in records.items()}
    assert all(records[t].error_code == "model_error" and records[t].status == TaskStatus.queued for t in tried)
    untouched = set(ids) - set(tried)
    visible_again(settings, untouched, "the untried tasks visible again")


def test_a_broken_model_stops_the_worker_however_well_another_model_works(settings):
    # A sticky CUDA error breaks the GPU model; a CPU model beside it keeps
    # succeeding, in the same batches, which must not reset the count.
    settings = settings.model_copy(update={"max_batch_size": 4, "max_wait_ms": 200,
                                           "models": "minilm-embed,synthetic"})
    service = TaskService(settings)
    for i in range(8):  # pairs of each: a batch of 4 holds both models
        for model in ("minilm-embed", "minilm-embed", "synthetic", "synthetic"):
            service.submit("tenant-a", SubmitRequest(model=model, inputs=[f"t{i}"]), None)
    worker = Worker(settings, {"minilm-embed": BrokenDevice(), "synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})
    assert exit_code_of(worker, 30) == 1, "the worker kept running on a model that fails everything"
