"""A model whose batch costs a + b*n milliseconds, for load and failure tests."""

from __future__ import annotations

import hashlib
import os
import time

from pydantic import TypeAdapter, ValidationError

from models.base import ModelInputError

FAIL_MARKER = "!fail"  # refused as an input (ModelInputError): the task fails at once
CRASH_MARKER = "!crash"  # the model itself fails (RuntimeError): retried, then dead-lettered
# The markers work only where this is 1. Any tenant can send them, and three
# batches that all crash stop a worker (sluice.isolation), so a deployment that
# serves this model for smoke and load tests must not obey them by default.
FAULTS_ENV = "SLUICE_SYNTHETIC_FAULTS"


class SyntheticModel:
    name = "synthetic"
    version = "1"
    max_batch_size = 256
    description = "synthetic"

    def __init__(self, base_ms: float | None = None, per_item_ms: float | None = None, faults: bool | None = None):
        self.base_ms = float(base_ms if base_ms is not None else os.environ.get("SLUICE_SYNTHETIC_BASE_MS", 5))
        self.per_item_ms = float(
            per_item_ms if per_item_ms is not None else os.environ.get("SLUICE_SYNTHETIC_PER_ITEM_MS", 1)
        )
        if faults is None:
            # As Settings.synthetic_faults reads it (1/true/yes/on, 0/false/no/off),
            # which entrypoints check first.
            raw = os.environ.get(FAULTS_ENV) or "0"
            try:
                faults = TypeAdapter(bool).validate_python(raw)
            except ValidationError:
                raise ValueError(f"{FAULTS_ENV}={raw!r}: use 1 (obey {FAIL_MARKER!r} and {CRASH_MARKER!r}) "
                                 "or 0") from None
        self.faults = faults

    def load(self) -> None:
        pass

    def predict_batch(self, inputs: list[str]) -> list[dict]:
        time.sleep((self.base_ms + self.per_item_ms * len(inputs)) / 1000)
        for text in inputs if self.faults else ():
            if FAIL_MARKER in text:
                raise ModelInputError(f"synthetic model refuses inputs containing {FAIL_MARKER!r}")
            if CRASH_MARKER in text:
                raise RuntimeError(f"synthetic model crashes on inputs containing {CRASH_MARKER!r}")
        return [{"length": len(t), "sha256": hashlib.sha256(t.encode()).hexdigest()[:16]} for t in inputs]

    def result_for_task(self, outputs: list[dict]) -> dict:
        return {"outputs": outputs}
