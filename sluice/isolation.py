"""Bisect a failing batch so that only the items that fail are lost.

Shared by the EKS worker (sluice.worker.runner) and the SageMaker server
(containers/sagemaker/serve.py). Kept free of any dependency so that both can
import it: the worker image has no web framework and the server must not pull
torch in except through the models.
"""

from __future__ import annotations

from typing import Callable, TypeVar

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
