"""The prefetch buffer and the dynamic batcher.

Receiver threads fill one bounded deque per priority; the batcher takes messages
out by the priority policy until the batch holds `max_batch_size` inputs or
`max_wait_ms` has passed since its first message. A task with more inputs than
the batch has room left for does not end the batch: it keeps its turn and
starts the next batch, while smaller tasks fill this one.

A redelivered message (received before, no outcome written: a retry, or a
task whose worker died, hung or stopped) runs in a batch of its own. The
messages of a batch that killed or hung its worker come back together, at
the same visibility lapse or hand-back, and would be batched together again:
one input that takes its worker down would fail every task beside it, each
attempt, until all were dead-lettered. Alone, only that task spends its
attempts. Bisection (sluice.worker.runner) isolates a task whose model call
raises; a process that dies cannot bisect.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from sluice.adapters.queues import Received
from sluice.contract import Priority
from sluice.worker.policy import WeightedPriorityPolicy


def runs_alone(message: Received) -> bool:
    """A redelivery, or the first delivery of a task requeued after runs
    without an outcome (sluice.dlq): as suspect as any redelivery."""
    if message.receive_count > 1:
        return True
    if '"runs_before"' not in message.body:  # most messages: no parse on the batcher's hot path
        return False
    try:
        return bool(message.task().runs_before)
    except Exception:  # not a task this release reads: the runner hands it back
        return False


def input_count(message: Received) -> int:
    # The body is validated later, by the runner; a malformed one counts as one input.
    try:
        return max(1, int(message.task().input_count))
    except Exception:
        return 1


class PrefetchBuffer:
    def __init__(self, capacity_per_priority: int):
        # In messages and in inputs alike: 32 messages of 64 inputs each were
        # 64 batches held hidden per priority (handed back, each a receive
        # spent, when the worker stops), where one was meant. The receive that
        # crosses it may bring up to 10 messages, whatever their sizes.
        self.capacity = capacity_per_priority
        self._queues: dict[Priority, deque[tuple[Received, int]]] = {p: deque() for p in Priority}
        self._cond = threading.Condition()
        self.closed = False
        # The priority whose head task was picked but did not fit: it starts the next batch.
        self._deferred: Priority | None = None

    def room(self, priority: Priority) -> int:
        """How many more messages to fetch for this priority: none once it holds
        `capacity` inputs, however few its messages."""
        with self._cond:
            return self._room(priority)

    def _room(self, priority: Priority) -> int:
        held = self._queues[priority]
        if sum(n for _, n in held) >= self.capacity:
            return 0
        return self.capacity - len(held)

    def wait_for_room(self, priority: Priority, timeout_s: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.closed or self._room(priority) > 0, timeout_s)

    def put(self, messages: list[Received]) -> None:
        if not messages:
            return
        sized = [(m, input_count(m)) for m in messages]
        with self._cond:
            for m, n in sized:
                self._queues[m.priority].append((m, n))
            self._cond.notify_all()

    def close(self) -> list[Received]:
        """Stop batching; returns what was buffered but never taken."""
        with self._cond:
            self.closed = True
            self._deferred = None
            left = [m for q in self._queues.values() for m, _ in q]
            for q in self._queues.values():
                q.clear()
            self._cond.notify_all()
            return left

    def snapshot(self) -> list[Received]:
        with self._cond:
            return [m for q in self._queues.values() for m, _ in q]

    def take_batch(
        self, policy: WeightedPriorityPolicy, max_inputs: int, max_wait_s: float, idle_wait_s: float
    ) -> list[Received]:
        """Block up to idle_wait_s for a first message, then fill the batch for
        at most max_wait_s. Returns [] when nothing arrived (or on close)."""
        batch: list[Received] = []
        inputs = 0
        with self._cond:
            if not self._cond.wait_for(lambda: self.closed or self._ready(), idle_wait_s) or self.closed:
                return batch
            deadline = time.monotonic() + max_wait_s
            if self._deferred is not None and self._queues[self._deferred]:
                message, inputs = self._queues[self._deferred].popleft()  # it had its turn already
                batch.append(message)
            self._deferred = None
            passed: set[Priority] = set()  # their head task does not fit in this batch

            def is_full() -> bool:
                # A message that runs alone never joins a batch begun: only the first can.
                return inputs >= max_inputs or (bool(batch) and runs_alone(batch[0]))

            while True:
                full = is_full()
                while not full and (ready := [p for p in self._ready() if p not in passed]):
                    priority = policy.pick(ready, cost=lambda p: self._queues[p][0][1])  # in inputs
                    message, n = self._queues[priority][0]
                    if batch and (runs_alone(message) or inputs + n > max_inputs):
                        # Ending the batch here would starve a big task (its
                        # turn spent, the batch cut short, again and again).
                        if self._deferred is None:
                            self._deferred = priority
                        else:
                            policy.refund(priority, ready, n)
                        passed.add(priority)
                        continue
                    self._queues[priority].popleft()
                    batch.append(message)
                    inputs += n
                    full = is_full()
                self._cond.notify_all()  # receivers may have room again
                remaining = deadline - time.monotonic()
                if full or remaining <= 0 or self.closed or len(passed) == len(Priority):
                    return batch
                self._cond.wait(remaining)

    def _ready(self) -> list[Priority]:
        return [p for p in Priority if self._queues[p]]
