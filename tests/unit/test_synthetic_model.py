"""The synthetic model's fault markers are a test switch, never a tenant's."""

import pytest

from models.base import ModelInputError
from models.synthetic import CRASH_MARKER, FAIL_MARKER, FAULTS_ENV, SyntheticModel
from sluice.isolation import BROKEN_AFTER, MODEL_ERROR, BrokenModelWatch, run_isolating


def test_without_the_switch_the_markers_are_ordinary_text(monkeypatch):
    # Served in every deployment by default: were the markers obeyed there, any
    # tenant could send BROKEN_AFTER batches that all crash and stop a worker.
    monkeypatch.delenv(FAULTS_ENV, raising=False)
    model = SyntheticModel(base_ms=0, per_item_ms=0)
    texts = [f"a {CRASH_MARKER}", f"b {FAIL_MARKER}"]
    assert [o["length"] for o in model.predict_batch(texts)] == [len(t) for t in texts]
    watch, broken = BrokenModelWatch(), False
    for _ in range(BROKEN_AFTER):
        codes = run_isolating(lambda items: [None] * len(model.predict_batch(items)),
                              [f"{i} {CRASH_MARKER}" for i in range(4)], lambda _item, _exc: MODEL_ERROR)
        broken = watch.saw(model.name, codes)
    assert not broken


@pytest.mark.parametrize("raw, faults", [("1", True), ("true", True), ("0", False), ("off", False), ("", False)])
def test_the_switch_takes_1_or_0(monkeypatch, raw, faults):
    monkeypatch.setenv(FAULTS_ENV, raw)
    model = SyntheticModel(base_ms=0, per_item_ms=0)
    assert model.faults is faults
    if faults:
        with pytest.raises(RuntimeError):
            model.predict_batch([f"x {CRASH_MARKER}"])
        with pytest.raises(ModelInputError):
            model.predict_batch([f"x {FAIL_MARKER}"])


def test_any_other_value_of_the_switch_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(FAULTS_ENV, "sometimes")
    with pytest.raises(ValueError, match=f"{FAULTS_ENV}='sometimes'"):
        SyntheticModel()
