"""Bisect a failing batch so that only the items that fail are lost, and tell
a broken model from poison inputs.

Shared by the EKS worker (sluice.worker.runner) and the SageMaker server
(containers/sagemaker/serve.py). Kept free of any dependency so that both can
import it: the worker image has no web framework and the server must not pull
torch in except through the models.
"""

from __future__ import annotations

import threading
from typing import Callable, TypeVar

# A task's error code when the model raised on it (sluice.lifecycle): retried.
MODEL_ERROR = "model_error"
# The model gave a result JSON cannot hold (a tensor, a numpy value): every
# run would give it again, and it says nothing of the device.
INVALID_RESULT = "invalid_result"
# Runs of two or more tasks in a row in which the model failed every task:
# past this the model is taken for broken. One failing task is a poison input
# (bisection isolates it); all of them, run after run, is the device or the
# model: a worker that kept going would spend an attempt of every task in its
# queues within seconds.
BROKEN_AFTER = 3

T = TypeVar("T")
R = TypeVar("R")


def run_isolating(run: Callable[[list[T]], list[R]], items: list[T], on_error: Callable[[T, Exception], R]) -> list[R]:
    """run(items) -> one result per item; if it raises, split the items in
    halves until the failing item stands alone, so that healthy items still
    succeed, and answer on_error(item, exc) for it. A batch with one poison
    item costs about 2*log2(n) extra runs rather than n."""
    try:
        return run(items)
    except Exception as exc:  # the model's failure is data here, not a crash
        if len(items) == 1:
            return [on_error(items[0], exc)]
        middle = len(items) // 2
        return run_isolating(run, items[:middle], on_error) + run_isolating(run, items[middle:], on_error)


class BrokenModelWatch:
    """Whether a model is broken (a GPU after a sticky CUDA error), from the
    runs it makes: it failed every task of BROKEN_AFTER runs of two or more
    tasks in a row. A run in which any task succeeded shows the model works
    and starts its count again; a run that says nothing about the device (one
    failing task alone is a poison input, a refusal among the failures, nothing
    run) leaves the count as it is. Counted per model: a CPU model that works
    says nothing of a GPU model beside it. Thread-safe: runs for different
    models may be told at once."""

    def __init__(self):
        self._failed_in_a_row: dict[str, int] = {}
        self._lock = threading.Lock()

    def saw(self, model: str, codes: list[str | None]) -> bool:
        """Told each task's error code in one run of `model` (None: a
        result); True from the run that makes the model broken on."""
        with self._lock:
            if None in codes:
                self._failed_in_a_row[model] = 0
            elif len(codes) >= 2 and all(code == MODEL_ERROR for code in codes):
                self._failed_in_a_row[model] = self._failed_in_a_row.get(model, 0) + 1
            return self._failed_in_a_row.get(model, 0) >= BROKEN_AFTER
