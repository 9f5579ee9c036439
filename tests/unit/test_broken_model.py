"""When a worker (or the SageMaker endpoint) gives up on its model: it failed
every task of BROKEN_AFTER runs of two or more tasks in a row. A single failing
task is a poison input and says nothing about the device; a run in which any
task succeeded shows that the model works."""

from types import SimpleNamespace

import pytest

from sluice.lifecycle import MODEL_ERROR, Outcome
from sluice.worker.runner import BROKEN_AFTER, Pipeline


def ran(*codes, model="minilm-embed"):
    """One batch's outcomes of `model`: each task's error code, None for a result."""
    job = SimpleNamespace(message=SimpleNamespace(model=model))
    return [Outcome(job=job, error=None if c is None else "RuntimeError: CUDA error",
                    error_code=c or MODEL_ERROR) for c in codes]


def pipeline():
    return Pipeline(runner=None, take_batch=None, on_done=None, give_back=None)


def watch(batches) -> bool:
    watched = pipeline()
    for outcomes in batches:
        watched._watch_the_model(outcomes)
    return watched.broken


def test_every_task_of_broken_after_batches_failing_stops_the_worker():
    assert not watch([ran(MODEL_ERROR, MODEL_ERROR)] * (BROKEN_AFTER - 1))
    assert watch([ran(MODEL_ERROR, MODEL_ERROR)] * BROKEN_AFTER)


@pytest.mark.parametrize("between", [ran(MODEL_ERROR), [], ran("invalid_input", MODEL_ERROR)],
                         ids=["one failing task", "a batch with nothing run", "a refusal among the failures"])
def test_a_batch_that_says_nothing_about_the_device_does_not_start_the_count_again(between):
    # A sticky CUDA error under light, mixed traffic: batches of one and of two, every task failing.
    assert watch([ran(MODEL_ERROR, MODEL_ERROR), between] * BROKEN_AFTER)


@pytest.mark.parametrize("success", [ran(None), ran(MODEL_ERROR, None)], ids=["one task", "two tasks"])
def test_a_batch_in_which_a_task_succeeds_starts_the_count_again(success):
    assert not watch([ran(MODEL_ERROR, MODEL_ERROR)] * (BROKEN_AFTER - 1) + [success]
                     + [ran(MODEL_ERROR, MODEL_ERROR)] * (BROKEN_AFTER - 1))


def test_a_model_that_works_does_not_start_the_count_of_another_again():
    # A GPU model after a sticky CUDA error, a CPU model beside it in the same batches.
    assert watch([ran(MODEL_ERROR, MODEL_ERROR) + ran(None, None, model="synthetic")] * BROKEN_AFTER)
