"""Shared fixtures: a real moto server over HTTP, and isolated resource names."""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from botocore.client import BaseClient

from onprem.embedded import SQS_HEALTH, emulator_env, fauxqs_command, free_port, wait_http

ROOT = Path(__file__).resolve().parent.parent

# The fault tests send the synthetic model its '!crash' and '!fail' markers,
# which a deployment ignores unless told (models/synthetic.py).
os.environ["SLUICE_SYNTHETIC_FAULTS"] = "1"


@contextlib.contextmanager
def sqs_server():
    """SQS on fauxqs (make run's) when SLUICE_TEST_SQS=fauxqs: `make test` runs
    the suites that use queues once more that way. Otherwise nothing: moto's."""
    choice = os.environ.get("SLUICE_TEST_SQS", "moto")
    if choice == "moto":
        yield None
        return
    if choice != "fauxqs":
        raise pytest.UsageError(f"SLUICE_TEST_SQS={choice!r}: moto or fauxqs")
    port = free_port()
    try:
        command = fauxqs_command(port)
    except RuntimeError as exc:
        raise pytest.UsageError(f"SLUICE_TEST_SQS=fauxqs: {exc}") from None
    proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_http(f"http://127.0.0.1:{port}{SQS_HEALTH['fauxqs']}", 30, alive=proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture(scope="session")
def moto_endpoint():
    """One moto server process for the session, the embedded profile's
    (onprem/moto_server.py: atomic DynamoDB writes); tests isolate by resource names."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "onprem.moto_server", "-H", "127.0.0.1", "-p", str(port)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        with sqs_server() as sqs_url:
            wait_http(f"http://127.0.0.1:{port}/moto-api/", 30)
            saved = dict(os.environ)
            os.environ.update(emulator_env(port, sqs_url=sqs_url))
            yield f"http://127.0.0.1:{port}"
            os.environ.clear()
            os.environ.update(saved)
    finally:
        proc.terminate()
        proc.wait(10)


@pytest.fixture
def settings(moto_endpoint):
    """Settings naming fresh queues, tables and bucket, created on the emulator."""
    from sluice.bootstrap import ensure_resources
    from sluice.settings import Settings

    tag = uuid.uuid4().hex[:8]
    s = Settings(
        queue_prefix=f"t{tag}",
        tasks_table=f"t{tag}-tasks",
        keys_table=f"t{tag}-keys",
        bucket=f"t{tag}-payloads",
        visibility_timeout_s=30,
        models="synthetic",
        key_cache_s=0,
    )
    ensure_resources(s)
    return s


@pytest.fixture
def aws_calls(monkeypatch):
    """Every AWS call made from here on, as (service, operation): a spy on
    botocore that lets each call through to the moto server."""
    calls: set[tuple[str, str]] = set()
    real = BaseClient._make_api_call

    def recording(client, operation, params):
        calls.add((client.meta.service_model.endpoint_prefix, operation))
        return real(client, operation, params)

    monkeypatch.setattr(BaseClient, "_make_api_call", recording)
    return calls


@pytest.fixture(autouse=True)
def sluice_logger_as_it_was():
    """A Lambda handler's import hands the `sluice` logger to Powertools' (its
    own handler, no propagation); later tests' caplog needs it as it was."""
    logger = logging.getLogger("sluice")
    saved = (logger.handlers[:], logger.propagate, logger.level)
    yield
    logger.handlers, logger.propagate, logger.level = saved[0], saved[1], saved[2]
