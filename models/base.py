"""The one interface every model implements."""

from __future__ import annotations

from typing import Any, Protocol


class Model(Protocol):
    name: str
    version: str
    max_batch_size: int
    description: str

    def load(self) -> None:
        """Load weights once per worker process."""

    def predict_batch(self, inputs: list[str]) -> list[Any]:
        """One output per input, in order. Raises on a bad batch."""

    def result_for_task(self, outputs: list[Any]) -> Any:
        """Shape the outputs of one task's inputs into its result."""


class ModelInputError(ValueError):
    """Raised by a model for an input it cannot handle (a poison input)."""
