import threading
import time

from sluice.adapters.queues import Received
from sluice.contract import Priority, TaskMessage
from sluice.worker.batcher import PrefetchBuffer
from sluice.worker.policy import WeightedPriorityPolicy

WEIGHTS = {Priority.high: 6, Priority.normal: 3, Priority.low: 1}


def message(priority: Priority, inputs: int = 1, n: int = 0, receive_count: int = 1,
            runs_before: int | None = None) -> Received:
    body = TaskMessage(task_id=f"{priority.value}-{n}", tenant_id="t", model="m", priority=priority,
                       input_count=inputs, inputs=["x"] * inputs, enqueued_at=0,
                       runs_before=runs_before).model_dump_json(exclude_none=True)
    return Received(priority, f"id-{n}", f"rh-{priority.value}-{n}", body, receive_count, time.monotonic())


def batches(buffer: PrefetchBuffer, max_inputs: int = 32) -> list[list[str]]:
    """Every batch the buffer gives until it is empty, as task ids."""
    taken = []
    while batch := buffer.take_batch(WeightedPriorityPolicy(WEIGHTS), max_inputs, max_wait_s=0, idle_wait_s=0):
        taken.append([m.task().task_id for m in batch])
    return taken


def test_redelivered_messages_run_each_in_a_batch_of_its_own():
    # A batch whose worker died comes back together: batched together again,
    # one input that kills its worker would take the others down each time.
    buffer = PrefetchBuffer(100)
    buffer.put([message(Priority.normal, n=0), message(Priority.normal, n=1, receive_count=2),
                message(Priority.normal, n=2, receive_count=2), message(Priority.normal, n=3),
                message(Priority.normal, n=4)])
    assert batches(buffer) == [["normal-0"], ["normal-1"], ["normal-2"], ["normal-3", "normal-4"]]


def test_a_task_requeued_by_settling_runs_alone_on_its_first_receive():
    # Its message is new (receive count 1), but its task ran before without
    # an outcome: as suspect as any redelivery (sluice.dlq.settle_dead).
    buffer = PrefetchBuffer(100)
    buffer.put([message(Priority.normal, n=0), message(Priority.normal, n=1, runs_before=1),
                message(Priority.normal, n=2), message(Priority.normal, n=3)])
    assert batches(buffer) == [["normal-0"], ["normal-1"], ["normal-2", "normal-3"]]


def test_a_redelivery_at_the_head_of_one_priority_leaves_the_others_batched():
    buffer = PrefetchBuffer(100)
    buffer.put([message(Priority.high, n=0, receive_count=3)] + [message(Priority.low, n=i) for i in range(1, 4)])
    assert sorted(batches(buffer)) == [["high-0"], ["low-1", "low-2", "low-3"]]


def test_full_batch_returns_without_waiting_for_the_timer():
    buffer = PrefetchBuffer(100)
    buffer.put([message(Priority.normal, n=i) for i in range(10)])
    result = []
    # The timer (300 s) outlasts the join by far: only a batch that returns
    # because it is full comes back in time.
    taker = threading.Thread(target=lambda: result.extend(
        buffer.take_batch(WeightedPriorityPolicy(WEIGHTS), max_inputs=4, max_wait_s=300, idle_wait_s=1)), daemon=True)
    taker.start()
    taker.join(10)
    alive = taker.is_alive()
    buffer.close()  # lets a take_batch that waits for the timer go
    assert not alive, "a full batch waited for max_wait instead of returning"
    assert len(result) == 4


def test_partial_batch_is_released_when_the_wait_expires():
    buffer = PrefetchBuffer(100)
    buffer.put([message(Priority.normal, n=1)])
    done = threading.Event()
    result = []
    threading.Thread(target=lambda: (result.extend(
        buffer.take_batch(WeightedPriorityPolicy(WEIGHTS), max_inputs=32, max_wait_s=0.05, idle_wait_s=1)),
        done.set())).start()
    assert done.wait(5), "take_batch did not honour max_wait"
    assert len(result) == 1


def test_late_arrivals_join_the_open_batch():
    buffer = PrefetchBuffer(100)
    buffer.put([message(Priority.normal, n=0)])
    result = []
    t = threading.Thread(target=lambda: result.extend(
        buffer.take_batch(WeightedPriorityPolicy(WEIGHTS), max_inputs=2, max_wait_s=30, idle_wait_s=1)))
    t.start()
    buffer.put([message(Priority.low, n=1)])
    t.join(5)
    assert not t.is_alive(), "the second message should have completed the batch"
    assert [m.priority for m in result] == [Priority.normal, Priority.low]


def test_inputs_not_messages_fill_the_batch():
    buffer = PrefetchBuffer(100)
    buffer.put([message(Priority.high, inputs=3, n=i) for i in range(3)])
    batch = buffer.take_batch(WeightedPriorityPolicy(WEIGHTS), max_inputs=7, max_wait_s=0, idle_wait_s=1)
    assert len(batch) == 2  # a third message would make 9 inputs > 7


def test_an_oversized_task_still_runs_alone():
    buffer = PrefetchBuffer(100)
    buffer.put([message(Priority.high, inputs=50)])
    batch = buffer.take_batch(WeightedPriorityPolicy(WEIGHTS), max_inputs=8, max_wait_s=0, idle_wait_s=1)
    assert len(batch) == 1


def test_priorities_mix_by_weight():
    buffer = PrefetchBuffer(100)
    for p in Priority:
        buffer.put([message(p, n=i) for i in range(20)])
    batch = buffer.take_batch(WeightedPriorityPolicy(WEIGHTS), max_inputs=10, max_wait_s=0, idle_wait_s=1)
    counts = {p: sum(m.priority is p for m in batch) for p in Priority}
    assert counts == {Priority.high: 6, Priority.normal: 3, Priority.low: 1}


def test_idle_returns_empty_and_close_hands_back_the_rest():
    buffer = PrefetchBuffer(100)
    assert buffer.take_batch(WeightedPriorityPolicy(WEIGHTS), 4, 0, idle_wait_s=0.01) == []
    buffer.put([message(Priority.low, n=i) for i in range(3)])
    assert len(buffer.close()) == 3
    assert buffer.take_batch(WeightedPriorityPolicy(WEIGHTS), 4, 0, idle_wait_s=0.01) == []


def test_room_shrinks_as_messages_arrive():
    buffer = PrefetchBuffer(5)
    buffer.put([message(Priority.high, n=i) for i in range(3)])
    assert buffer.room(Priority.high) == 2
    assert buffer.room(Priority.low) == 5


def test_a_task_too_big_for_the_rest_of_a_batch_starts_the_next_one_and_batches_stay_full():
    # high and normal always hold one-input tasks; low holds one task of 30.
    # Each time low's turn came up mid-batch, its task did not fit and the batch
    # ended there: it was never served, and batches averaged 9 inputs of 32.
    buffer, policy = PrefetchBuffer(32), WeightedPriorityPolicy(WEIGHTS)
    buffer.put([message(Priority.low, inputs=30, n=-1)])
    sizes, served_in = [], None
    for b in range(50):
        for p in (Priority.high, Priority.normal):
            buffer.put([message(p, n=1000 * b + i) for i in range(buffer.room(p))])
        batch = buffer.take_batch(policy, max_inputs=32, max_wait_s=0, idle_wait_s=1)
        sizes.append(sum(m.task().input_count for m in batch))
        if any(m.task().task_id == "low--1" for m in batch):
            served_in = b
            break
    assert served_in is not None and served_in < 10, f"the 30-input task waited {len(sizes)} batches"
    assert set(sizes) == {32}, sizes


def test_two_tasks_too_big_for_the_same_batch_are_each_served():
    buffer, policy = PrefetchBuffer(64), WeightedPriorityPolicy(WEIGHTS)
    buffer.put([message(Priority.normal, inputs=20, n=-1)])
    buffer.put([message(Priority.low, inputs=20, n=-2)])
    served = set()
    for b in range(40):
        buffer.put([message(Priority.high, n=1000 * b + i) for i in range(buffer.room(Priority.high))])
        served |= {m.task().task_id for m in buffer.take_batch(policy, max_inputs=32, max_wait_s=0, idle_wait_s=1)}
    assert {"normal--1", "low--2"} <= served


def test_priorities_share_the_models_inputs_whatever_their_tasks_sizes():
    # 1-input high tasks beside 16-input low ones, both queues always full:
    # counted in messages, low took about 16/(6+16) of the inputs, not 1/7.
    buffer, policy = PrefetchBuffer(10_000), WeightedPriorityPolicy(WEIGHTS)
    buffer.put([message(Priority.high, 1, n=i) for i in range(3000)])
    buffer.put([message(Priority.low, 16, n=10_000 + i) for i in range(500)])
    taken = {Priority.high: 0, Priority.low: 0}
    for _ in range(60):
        for m in buffer.take_batch(policy, max_inputs=32, max_wait_s=0, idle_wait_s=1):
            taken[m.priority] += 16 if m.priority is Priority.low else 1
    low_share = taken[Priority.low] / sum(taken.values())
    assert 0.1 <= low_share <= 0.2, taken  # its weight, 1 of 7: 0.14


def test_prefetch_stops_at_a_batch_of_inputs_not_of_messages():
    # 32 messages of 64 inputs were 64 batches held hidden per priority.
    buffer = PrefetchBuffer(32)
    buffer.put([message(Priority.low, 10, n=i) for i in range(3)])
    assert buffer.room(Priority.low) == 29  # 30 inputs held: room for more messages
    buffer.put([message(Priority.low, 10, n=3)])
    assert buffer.room(Priority.low) == 0  # 40 inputs: a batch's worth
    buffer.put([message(Priority.high, 64, n=4)])
    assert buffer.room(Priority.high) == 0
    assert buffer.room(Priority.normal) == 32
