"""boto3 clients with one retry policy.

No endpoint is passed here on purpose: boto3 resolves ``AWS_ENDPOINT_URL`` and
``AWS_ENDPOINT_URL_<SERVICE>`` itself, which is how LocalStack, MinIO/SeaweedFS
and the embedded moto server are reached by the very same code.
"""

from __future__ import annotations

import os
import platform
import threading

import boto3
import botocore
from botocore.config import Config

from sluice import __version__
from sluice.settings import Settings

# A fixed User-Agent, built once: botocore otherwise rebuilds its standard one
# from about thirty parts twice per call. Together with client-side parameter
# validation off (requests are built from the validated contract models, and
# the service validates them again) that saves a quarter of the caller's CPU
# per DynamoDB call, and the hot paths make one per task (`python -m bench.sdk`).
# It also names Sluice as the caller in CloudTrail.
_USER_AGENT = f"sluice/{__version__} botocore/{botocore.__version__} python/{platform.python_version()}"

# A call that has not answered within this is retried (standard mode, 3 tries in
# all): a hung dependency costs a caller at most about 15 s (3 × 4 s, and the
# two backoffs between: under 0.2 s with this botocore, up to 1 s and 2 s with
# older ones, as a Lambda runtime's may be), not minutes, so the API answers 503
# well inside API Gateway's 29 s and its rollback runs (a submit the client gave
# up on must not land later). Every call Sluice makes answers in milliseconds
# but one: a receive's long poll, which gets its wait on top.
_READ_TIMEOUT_S = 4
# botocore's `max_attempts` counts the retries alone (3 made 4 requests: 16 s,
# and up to 23 s with the older backoff); `total_max_attempts` counts them all.
_TOTAL_ATTEMPTS = 3
LONG_POLL_MAX_S = 20  # SQS's longest WaitTimeSeconds

_lock = threading.Lock()
_clients: dict[tuple, object] = {}


def client_config(settings: Settings, endpoint_url: str | None = None, long_poll: bool = False) -> Config:
    custom_s3_endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    return Config(
        region_name=_region(settings),
        retries={"mode": "standard", "total_max_attempts": _TOTAL_ATTEMPTS},
        user_agent=_USER_AGENT,
        parameter_validation=False,
        connect_timeout=2,
        read_timeout=_READ_TIMEOUT_S + (LONG_POLL_MAX_S if long_poll else 0),
        max_pool_connections=32,
        # SigV4 everywhere: presigned S3 URLs must work on MinIO/SeaweedFS too.
        signature_version="s3v4",
        # Emulators serve buckets by path, not by virtual host.
        s3={"addressing_style": "path"} if custom_s3_endpoint else {},
    )


def _region(settings: Settings) -> str:
    """AWS_REGION, AWS_DEFAULT_REGION, SLUICE_REGION, the profile's region, then us-east-1."""
    chosen = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if chosen:
        return chosen
    if "region" in settings.model_fields_set:
        return settings.region
    # An operator running the CLI with a profile (~/.aws/config) means its region.
    return boto3.session.Session().region_name or settings.region


def _ask_keep_alive(request, **_) -> None:
    # HTTP/1.1 keeps connections by default, but LocalStack's hypercorn gateway
    # (the embedded profile's SQS) answers `Connection: close` unless the
    # request asks for keep-alive by name: every call then opened a TCP
    # connection, and LocalStack spent a fifth more CPU per call. Added after
    # signing: hop-by-hop headers are not signed.
    request.headers["Connection"] = "keep-alive"


def new_client(service: str, settings: Settings, endpoint_url: str | None = None, long_poll: bool = False):
    """A client of its own with Sluice's config; most callers want the shared one, `client()`.
    `endpoint_url` overrides the endpoint boto3 would resolve from the environment;
    `long_poll` gives it the time an SQS receive may wait."""
    made = boto3.session.Session().client(service, endpoint_url=endpoint_url,
                                          config=client_config(settings, endpoint_url, long_poll))
    made.meta.events.register("before-send", _ask_keep_alive)
    return made


def client(service: str, settings: Settings, long_poll: bool = False):
    """A shared, thread-safe client per (service, process, endpoint, region, long_poll)."""
    # The endpoint variables and the region are part of the key: a process that
    # talks to one emulator or region and then another (tests, the embedded
    # launcher) must not reuse a client bound to the first.
    endpoints = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_ENDPOINT_URL")))
    key = (service, str(os.getpid()), endpoints, _region(settings), long_poll)
    with _lock:
        if key not in _clients:
            _clients[key] = new_client(service, settings, long_poll=long_poll)
        return _clients[key]
