"""The prefetch buffer and the dynamic batcher.

Receiver threads fill one bounded deque per priority; the batcher takes messages
out by the priority policy until the batch holds `max_batch_size` inputs or
`max_wait_ms` has passed since its first message.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from sluice.adapters.queues import Received
from sluice.contract import Priority
from sluice.worker.policy import WeightedPriorityPolicy


def input_count(message: Received) -> int:
    # The body is validated later, by the runner; a malformed one counts as one input.
    try:
        return max(1, int(message.task().input_count))
    except Exception:
        return 1


class PrefetchBuffer:
    def __init__(self, capacity_per_priority: int):
        self.capacity = capacity_per_priority
        self._queues: dict[Priority, deque[tuple[Received, int]]] = {p: deque() for p in Priority}
        self._cond = threading.Condition()
        self.closed = False

    def room(self, priority: Priority) -> int:
        with self._cond:
            return self.capacity - len(self._queues[priority])

    def wait_for_room(self, priority: Priority, timeout_s: float) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self.closed or len(self._queues[priority]) < self.capacity, timeout_s)

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
            while True:
                full = False
                while self._ready():
                    priority = policy.pick(self._ready())
                    message, n = self._queues[priority][0]
                    if batch and inputs + n > max_inputs:
                        full = True
                        break
                    self._queues[priority].popleft()
                    batch.append(message)
                    inputs += n
                    if inputs >= max_inputs:
                        full = True
                        break
                self._cond.notify_all()  # receivers may have room again
                remaining = deadline - time.monotonic()
                if full or remaining <= 0 or self.closed:
                    return batch
                self._cond.wait(remaining)

    def _ready(self) -> list[Priority]:
        return [p for p in Priority if self._queues[p]]
