"""Settings fail at start-up, naming the variable, on a value that would only
fail later: every task (a batch size of 0) or every call (a wait SQS refuses)."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from models.registry import CATALOGUE
from sluice.contract import MODEL_NAME_PATTERN, Priority
from sluice.settings import Settings, SettingsError

ROOT = Path(__file__).resolve().parents[2]
# A result's room in its DynamoDB item (400 KB) beside the rest of the record.
INLINE_RESULT_LIMIT_BYTES = 300_000
# Each of the ten messages of one SendMessageBatch (1 MiB together).
INLINE_PAYLOAD_LIMIT_BYTES = 100 * 1024
# The worker's heartbeat runs every visibility/4 s, at most once a second.
VISIBILITY_TIMEOUT_MIN_S = 4


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("SLUICE_MAX_BATCH_SIZE", "0"),
        ("SLUICE_MAX_WAIT_MS", "-1"),
        ("SLUICE_RECEIVE_WAIT_S", "21"),
        ("SLUICE_RECEIVE_WAIT_S", "0"),  # short polling: an idle worker calling SQS in a tight loop
        ("SLUICE_VISIBILITY_TIMEOUT_S", "0"),
        # The heartbeat's first extension would come after the message reappeared (1 s), or as it does (2 s).
        ("SLUICE_VISIBILITY_TIMEOUT_S", "1"),
        ("SLUICE_VISIBILITY_TIMEOUT_S", "3"),
        ("SLUICE_PRESIGN_EXPIRY_S", "604801"),
        ("SLUICE_RATE_LIMIT_BURST", "0"),
        ("SLUICE_PRIORITY_WEIGHTS", "high=6,normal=x"),
        ("SLUICE_PRIORITY_WEIGHTS", "hihg=6"),
        # An API serving none of them (every submit 422) and a worker failing as it builds them.
        ("SLUICE_MODELS", "minilm,synth"),
        ("SLUICE_MODELS", "synthetic,echo"),
        ("SLUICE_MODELS", " , "),
        # Past what a DynamoDB item (400 KB) leaves a result beside the rest of its record.
        ("SLUICE_INLINE_RESULT_MAX_BYTES", str(INLINE_RESULT_LIMIT_BYTES + 1)),
        ("SLUICE_INLINE_RESULT_MAX_BYTES", "409600"),
        # Past what ten messages of one SendMessageBatch (1 MiB together) leave each.
        ("SLUICE_INLINE_PAYLOAD_MAX_BYTES", str(INLINE_PAYLOAD_LIMIT_BYTES + 1)),
        ("SLUICE_INLINE_PAYLOAD_MAX_BYTES", "262144"),
        # botocore takes an endpoint only as a URL; it would stop the API naming no variable.
        ("SLUICE_S3_PUBLIC_ENDPOINT", "10.0.0.5:9000"),
        ("SLUICE_S3_PUBLIC_ENDPOINT", "minio:9000"),
        ("SLUICE_S3_PUBLIC_ENDPOINT", "ftp://10.0.0.5:9000"),
        ("SLUICE_S3_PUBLIC_ENDPOINT", "http://10.0.0.5:port"),
        ("SLUICE_S3_PUBLIC_ENDPOINT", "http://"),
        # A settling loop that spins (0, negative) or whose thread dies at its first read.
        ("SLUICE_DLQ_SETTLE_S", "0"),
        ("SLUICE_DLQ_SETTLE_S", "-5"),
        ("SLUICE_DLQ_SETTLE_S", "abc"),
        ("SLUICE_DLQ_SETTLE_S", "nan"),
        ("SLUICE_DLQ_SETTLE_S", "inf"),
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


def test_a_worker_stopped_while_it_starts_exits_before_loading_a_model(monkeypatch):
    # In a container the worker is PID 1, and the kernel drops a SIGTERM that
    # PID 1 has no handler for: a stop during the bootstrap was lost, and the
    # worker went on to receive messages until the grace period's SIGKILL.
    import os
    import signal

    from sluice.worker import main as worker_main

    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}

    def stopped_while_bootstrapping(settings):
        # Sent only where a handler would take it: the default would end this test's process.
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, signal.SIG_IGN)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(worker_main, "ensure_resources_on_start", stopped_while_bootstrapping)
    monkeypatch.setattr("models.registry.load_models", lambda *a: pytest.fail("went on to load the models"))
    try:
        with pytest.raises(SystemExit) as stopped:
            worker_main.main()
        assert stopped.value.code == 0
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_a_catalogue_model_no_request_could_name_is_refused_at_start(monkeypatch):
    """A team's own entry named outside the API's pattern used to start, be
    listed by GET /v1/models, and be refused (422) on every submit."""
    from models.registry import CATALOGUE, ModelSpec

    monkeypatch.setitem(CATALOGUE, "TextClassifier", ModelSpec("TextClassifier", "1", 8, "x", "models.x:X"))
    monkeypatch.setenv("SLUICE_MODELS", "synthetic,TextClassifier")
    with pytest.raises(SettingsError, match=r"model name 'TextClassifier' is one no request can carry"):
        Settings()


def test_every_catalogue_name_is_one_a_request_can_carry():
    assert all(re.fullmatch(MODEL_NAME_PATTERN, name) for name in CATALOGUE)


def test_an_unknown_model_is_named_beside_the_catalogue(monkeypatch):
    monkeypatch.setenv("SLUICE_MODELS", "minilm,synthetic,synth")
    with pytest.raises(SettingsError) as refused:
        Settings()
    assert str(refused.value) == ("SLUICE_MODELS='minilm,synthetic,synth': unknown model 'minilm', 'synth'; "
                                  "the catalogue has minilm-embed, synthetic")
    monkeypatch.setenv("SLUICE_MODELS", " synthetic , minilm-embed ")
    assert Settings().model_names() == ["synthetic", "minilm-embed"]
    # Named twice, loaded once: a second copy would double the load's time and peak memory.
    monkeypatch.setenv("SLUICE_MODELS", "minilm-embed,synthetic,minilm-embed")
    assert Settings().model_names() == ["minilm-embed", "synthetic"]


def test_checking_the_models_never_imports_torch():
    # The API's Lambda bundle has no torch; settings read the catalogue's names only.
    code = ("import sys; from sluice.settings import Settings; Settings(models='minilm-embed,synthetic'); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_the_ceilings_themselves_are_taken(monkeypatch):
    monkeypatch.setenv("SLUICE_INLINE_RESULT_MAX_BYTES", str(INLINE_RESULT_LIMIT_BYTES))
    monkeypatch.setenv("SLUICE_INLINE_PAYLOAD_MAX_BYTES", str(INLINE_PAYLOAD_LIMIT_BYTES))
    monkeypatch.setenv("SLUICE_VISIBILITY_TIMEOUT_S", str(VISIBILITY_TIMEOUT_MIN_S))
    taken = Settings()
    assert (taken.inline_result_max_bytes, taken.inline_payload_max_bytes, taken.visibility_timeout_s) == (
        INLINE_RESULT_LIMIT_BYTES, INLINE_PAYLOAD_LIMIT_BYTES, VISIBILITY_TIMEOUT_MIN_S)
    # What the reliability harness runs at, so that a killed worker's messages come back quickly.
    monkeypatch.setenv("SLUICE_VISIBILITY_TIMEOUT_S", "5")
    assert Settings().visibility_timeout_s == 5


@pytest.mark.parametrize("url", ["http://10.0.0.5:9000", "https://minio.example.internal:9000",
                                 "http://localhost:9000/", "http://[::1]:9000"])
def test_a_public_s3_endpoint_is_an_http_url_that_boto3_takes(monkeypatch, url):
    from sluice.aws import new_client

    monkeypatch.setenv("SLUICE_S3_PUBLIC_ENDPOINT", url)
    settings = Settings()
    assert settings.s3_public_endpoint == url
    assert new_client("s3", settings, endpoint_url=settings.s3_public_endpoint).meta.endpoint_url


def test_an_empty_public_s3_endpoint_is_unset(monkeypatch):
    monkeypatch.setenv("SLUICE_S3_PUBLIC_ENDPOINT", "")  # onprem/.env.example's empty value
    assert Settings().s3_public_endpoint is None


def test_the_dead_letter_settling_interval_is_a_setting(monkeypatch):
    monkeypatch.delenv("SLUICE_DLQ_SETTLE_S", raising=False)
    assert Settings().dlq_settle_s == 30.0
    assert Settings.model_fields["dlq_settle_s"].description
    monkeypatch.setenv("SLUICE_DLQ_SETTLE_S", "0.2")  # what the tests run at
    assert Settings().dlq_settle_s == 0.2


class _Mute:
    """A TCP server that takes requests and never answers: a hung dependency.
    Counts the requests it was sent."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.requests = 0
        self.seen = threading.Condition()
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)
            threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn):
        while True:
            try:
                data = conn.recv(65536)
            except OSError:
                return
            if not data:
                return
            with self.seen:
                self.requests += data.count(b" HTTP/1.1\r\n")
                self.seen.notify_all()

    def close(self):
        self.sock.close()
        for conn in self.conns:
            conn.close()


def test_a_hung_dependency_gets_three_tries_in_all(monkeypatch):
    # botocore's `max_attempts` counts retries: 3 made 4 requests, 16 s of a hung
    # dependency where the API promises an answer within about 15 s.
    import boto3
    from botocore.config import Config
    from botocore.exceptions import ReadTimeoutError

    from sluice.aws import _READ_TIMEOUT_S, client_config

    for name, value in (("AWS_ACCESS_KEY_ID", "x"), ("AWS_SECRET_ACCESS_KEY", "x"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    tries = 3
    assert tries * _READ_TIMEOUT_S + 1 + 2 <= 15  # with the backoffs between: under 1 s and 2 s with any botocore
    mute = _Mute()
    try:
        ddb = boto3.session.Session().client(
            "dynamodb", endpoint_url=f"http://127.0.0.1:{mute.port}",
            config=client_config(Settings()).merge(Config(read_timeout=0.2)))  # Sluice's retries, less waiting
        with pytest.raises(ReadTimeoutError):
            ddb.describe_table(TableName="hung")
        with mute.seen:  # each was sent before its timeout ran out; give the reader a moment to count it
            mute.seen.wait_for(lambda: mute.requests >= tries, timeout=5)
        assert mute.requests == tries
    finally:
        mute.close()


@pytest.mark.parametrize("raw, on", [("1", True), ("true", True), ("yes", True), ("ON", True),
                                     ("0", False), ("off", False), ("", False)])
def test_bootstrap_on_start_takes_the_booleans_other_settings_take(monkeypatch, raw, on):
    # "yes" and "on" were read as off without a word.
    monkeypatch.setenv("SLUICE_BOOTSTRAP_ON_START", raw)
    assert Settings().bootstrap_on_start is on


def test_a_bootstrap_on_start_that_is_no_boolean_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv("SLUICE_BOOTSTRAP_ON_START", "sometimes")
    with pytest.raises(SettingsError, match="SLUICE_BOOTSTRAP_ON_START='sometimes'"):
        Settings()
