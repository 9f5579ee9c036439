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
        """A list of one output per input, in order (not a tensor, not a dict
        of columns: predict_all refuses those). Raises on a bad batch."""

    def result_for_task(self, outputs: list[Any]) -> Any:
        """Shape the outputs of one task's inputs into its result: plain JSON
        values (dicts, lists, str, int, float, bool, None; `.tolist()` a tensor
        or a numpy value first). A result JSON cannot hold fails its task; NaN
        and infinities are stored as null."""


class ModelInputError(ValueError):
    """Raised by a model for an input it cannot handle (a poison input)."""


def predict_all(model: Model, inputs: list[str], limit: int) -> list[Any]:
    """The model's outputs for `inputs`, `limit` inputs per predict_batch call.
    Raises unless each call answers a list (or tuple) of one output per input:
    taken as it came, a short answer would shift every later task's outputs
    onto the wrong task, and a dict of columns would give out its keys as
    outputs."""
    outputs: list[Any] = []
    for start in range(0, len(inputs), limit):
        chunk = inputs[start : start + limit]
        answer = model.predict_batch(chunk)
        if not isinstance(answer, (list, tuple)) or len(answer) != len(chunk):
            got = f"{len(answer)} outputs" if isinstance(answer, (list, tuple)) else f"a {type(answer).__name__}"
            raise RuntimeError(f"model {model.name} returned {got} for {len(chunk)} inputs: predict_batch returns "
                               "a list of one output per input")
        outputs += answer
    return outputs
