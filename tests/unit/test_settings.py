"""Settings fail at start-up, naming the variable, on a value that would only
fail later: every task (a batch size of 0) or every call (a wait SQS refuses)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from sluice.contract import Priority
from sluice.settings import Settings


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SLUICE_MAX_BATCH_SIZE", "0"),
        ("SLUICE_MAX_WAIT_MS", "-1"),
        ("SLUICE_RECEIVE_WAIT_S", "21"),
        ("SLUICE_VISIBILITY_TIMEOUT_S", "0"),
        ("SLUICE_PRESIGN_EXPIRY_S", "604801"),
        ("SLUICE_RATE_LIMIT_BURST", "0"),
        ("SLUICE_PRIORITY_WEIGHTS", "high=6,normal=x"),
        ("SLUICE_PRIORITY_WEIGHTS", "hihg=6"),
    ],
)
def test_a_value_out_of_range_is_refused_naming_it(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError) as refused:
        Settings()
    assert name.removeprefix("SLUICE_").lower() in str(refused.value)


def test_priority_weights_may_be_spaced_and_partial(monkeypatch):
    monkeypatch.setenv("SLUICE_PRIORITY_WEIGHTS", "high = 8, low=2")
    assert Settings().weights() == {Priority.high: 8, Priority.normal: 1, Priority.low: 2}
