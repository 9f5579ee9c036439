"""Settings fail at start-up, naming the variable, on a value that would only
fail later: every task (a batch size of 0) or every call (a wait SQS refuses)."""

from __future__ import annotations

import pytest
from sluice.contract import Priority
from sluice.settings import Settings, SettingsError


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
    with pytest.raises(SettingsError) as refused:
        Settings()
    # The variable an operator sets, and what was wrong with its value; not the field's name alone.
    assert str(refused.value).startswith(f"{name}={value!r}: "), refused.value
    assert "\n" not in str(refused.value)


def test_every_refused_variable_is_named_on_its_own_line(monkeypatch):
    monkeypatch.setenv("SLUICE_MAX_BATCH_SIZE", "abc")
    monkeypatch.setenv("SLUICE_DEVICE", "gpu")
    with pytest.raises(SettingsError) as refused:
        Settings()
    lines = str(refused.value).splitlines()
    assert [line.split("=")[0] for line in lines] == ["SLUICE_MAX_BATCH_SIZE", "SLUICE_DEVICE"]
    assert "valid integer" in lines[0] and "'cuda'" in lines[1]
    assert isinstance(refused.value, ValueError)


def test_priority_weights_may_be_spaced_and_partial(monkeypatch):
    monkeypatch.setenv("SLUICE_PRIORITY_WEIGHTS", "high = 8, low=2")
    assert Settings().weights() == {Priority.high: 8, Priority.normal: 1, Priority.low: 2}


@pytest.mark.parametrize(
    ("env", "region"),
    [
        ({"AWS_REGION": "eu-west-1", "SLUICE_REGION": "ap-south-1"}, "eu-west-1"),
        ({"SLUICE_REGION": "ap-south-1"}, "ap-south-1"),
        ({}, "eu-north-1"),  # the profile's, as any AWS tool would use
    ],
)
def test_the_region_follows_aws_conventions(monkeypatch, tmp_path, env, region):
    from sluice.aws import client_config

    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "SLUICE_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    config = tmp_path / "config"
    config.write_text("[default]\nregion = eu-north-1\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert client_config(Settings()).region_name == region


def test_without_any_region_it_is_us_east_1(monkeypatch, tmp_path):
    from sluice.aws import client_config

    for name in ("AWS_REGION", "AWS_DEFAULT_REGION", "SLUICE_REGION", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    assert client_config(Settings()).region_name == "us-east-1"


def test_an_unknown_device_is_refused_at_start_up(monkeypatch):
    monkeypatch.setenv("SLUICE_DEVICE", "gpu")
    with pytest.raises(SettingsError, match="SLUICE_DEVICE"):
        Settings()


def test_a_refused_setting_is_named_by_its_variable_not_a_traceback(monkeypatch, capsys):
    monkeypatch.setenv("SLUICE_MAX_BATCH_SIZE", "abc")
    from sluice import cli

    assert cli.main(["dlq", "list"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err and "SLUICE_MAX_BATCH_SIZE='abc': Input should be a valid integer" in err, err


def test_a_worker_with_a_refused_setting_exits_2_before_loading_a_model(monkeypatch, caplog):
    from sluice.worker import main as worker_main

    monkeypatch.setenv("SLUICE_MAX_BATCH_SIZE", "0")
    monkeypatch.setattr("models.registry.load_models", lambda *a: pytest.fail("loaded models with refused settings"))
    assert worker_main.main() == 2
    assert "SLUICE_MAX_BATCH_SIZE='0': Input should be greater than or equal to 1" in caplog.text
