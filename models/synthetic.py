"""A model whose batch costs a + b*n milliseconds, for load and failure tests."""

from __future__ import annotations

import hashlib
import os
import time

from models.base import ModelInputError

FAIL_MARKER = "!fail"  # refused as an input (ModelInputError): the task fails at once
CRASH_MARKER = "!crash"  # the model itself fails (RuntimeError): retried, then dead-lettered


class SyntheticModel:
    name = "synthetic"
    version = "1"
    max_batch_size = 256
    description = "synthetic"

    def __init__(self, base_ms: float | None = None, per_item_ms: float | None = None):
        self.base_ms = float(base_ms if base_ms is not None else os.environ.get("SLUICE_SYNTHETIC_BASE_MS", 5))
        self.per_item_ms = float(
            per_item_ms if per_item_ms is not None else os.environ.get("SLUICE_SYNTHETIC_PER_ITEM_MS", 1)
        )

    def load(self) -> None:
        pass

    def predict_batch(self, inputs: list[str]) -> list[dict]:
        time.sleep((self.base_ms + self.per_item_ms * len(inputs)) / 1000)
        for text in inputs:
            if FAIL_MARKER in text:
                raise ModelInputError(f"synthetic model refuses inputs containing {FAIL_MARKER!r}")
            if CRASH_MARKER in text:
                raise RuntimeError(f"synthetic model crashes on inputs containing {CRASH_MARKER!r}")
        return [{"length": len(t), "sha256": hashlib.sha256(t.encode()).hexdigest()[:16]} for t in inputs]

    def result_for_task(self, outputs: list[dict]) -> dict:
        return {"outputs": outputs}
