"""Settings from the environment (prefix ``SLUICE_``).

Endpoints are deliberately absent: boto3 already reads ``AWS_ENDPOINT_URL`` and
``AWS_ENDPOINT_URL_<SERVICE>``, so AWS, LocalStack/MinIO and the embedded
emulator differ only in those standard variables.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache
from typing import Any, Literal
from urllib.parse import urlsplit

from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url
from pydantic import Field, ValidationError, field_validator
from pydantic_core import PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

# The catalogue's names only: models.registry never imports torch (the API's
# Lambda bundle carries it, and a model's code is imported only when a worker builds it).
from models.registry import CATALOGUE
from sluice.contract import MODEL_NAME_PATTERN, Priority


ENV_PREFIX = "SLUICE_"
# The operator's own AWS identity, set aside wherever Sluice talks to an
# emulator with its keys (the CLI beside `make run`, the launcher's stack): a
# profile named there (one that does not exist, say) must have no say.
OPERATOR_AWS_SETTINGS = frozenset({"AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN"})


class SettingsError(ValueError):
    """Settings refused at start-up, a line per variable: `SLUICE_X='value': why`."""


# SLUICE_LOG_LEVEL, in any case: the API's uvicorn takes `debug`, logging only `DEBUG`.
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
# Names one side takes and the other does not: compose gives the API and the
# workers one SLUICE_LOG_LEVEL, so neither may stop on the other's names.
LOG_LEVEL_ALIASES = {"TRACE": "DEBUG", "WARN": "WARNING", "FATAL": "CRITICAL"}


def log_level(environ=os.environ) -> str:
    """SLUICE_LOG_LEVEL as logging names it (unset or empty: INFO); SettingsError,
    in one line naming the variable and the values allowed, for anything else."""
    raw = environ.get("SLUICE_LOG_LEVEL") or "INFO"
    level = raw.strip().upper()
    level = LOG_LEVEL_ALIASES.get(level, level)
    if level not in LOG_LEVELS:
        raise SettingsError(f"SLUICE_LOG_LEVEL={raw!r}: should be one of {', '.join(LOG_LEVELS)} (any case)")
    return level


# DynamoDB refuses an item over 400 KB (409,600 bytes, names and values together),
# and an inline result shares its task's item with the rest of the record: ids,
# times, the metadata (16 keys of up to 64 characters with values of up to 256,
# at most ~20 KB in UTF-8), an error message of up to 1,000 characters. A result
# past what is left fails its outcome write on every attempt (ValidationException)
# and the task dead-letters; 300,000 leaves the rest over 100 KB.
INLINE_RESULT_LIMIT_BYTES = 300_000
# SQS refuses a message over 1 MiB, and a SendMessageBatch whose messages come to
# more than 1 MiB together (AWS since 2025, moto and LocalStack 4.13 alike; 256 KiB
# before). The API sends its messages ten to a SendMessageBatch
# (sluice.adapters.queues), and what it measures against the setting is the inputs
# alone, as json.dumps writes them (sluice.api.service): a message holds them in no
# more bytes, beside its other fields (ids, model, times: a few hundred bytes). Ten
# messages at this size leave each 2,457 bytes for those fields within 1 MiB.
INLINE_PAYLOAD_LIMIT_BYTES = 100 * 1024
# The worker's heartbeat (sluice.worker.main) extends its held messages every
# visibility/4 s, but at most once a second: a message is first extended up to two
# periods after its receive, and if that call fails the next tick still comes a
# period before the message reappears. Below 4 s the 1 s floor breaks this: at 1 a
# message reappears before its first extension, at 2 just as it comes, at 3 one
# failed call lets it lapse (each lapse is a receive, counted toward the DLQ). Small
# values are for tests (tests/reliability runs at 5 s so that the messages of a
# killed worker come back quickly); from about 10 s the first extension also
# outlasts a call retried after its read timeout (4 s, sluice.aws).
VISIBILITY_TIMEOUT_MIN_S = 4


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    def __init__(self, **values: Any):
        # pydantic names the field (max_batch_size); an operator sets SLUICE_MAX_BATCH_SIZE.
        try:
            super().__init__(**values)
        except ValidationError as exc:
            raise SettingsError("\n".join(
                f"{ENV_PREFIX}{'.'.join(map(str, e['loc'])).upper()}={_shown(e['input'])}: {e['msg']}"
                for e in exc.errors(include_url=False)
            )) from None

    region: str = Field(default="us-east-1", description="Used when AWS_REGION is not set.")
    tasks_table: str = "sluice-tasks"
    keys_table: str = "sluice-api-keys"
    bucket: str = "sluice-payloads"
    queue_prefix: str = "sluice"
    # Explicit queue URLs win over name lookup (the CDK stack sets these).
    queue_url_high: str | None = None
    queue_url_normal: str | None = None
    queue_url_low: str | None = None

    # "table": hashed keys in the keys table (embedded, on-prem).
    # "apigateway": API Gateway already checked the key; tenant = its key id.
    auth_mode: Literal["table", "apigateway"] = "table"
    key_cache_s: float = Field(default=10.0, ge=0, description="A revoked key stops working within this time.")

    # A value out of range fails at start-up, naming the variable, rather than
    # as every task failing later (a batch size of 0, a wait SQS refuses).
    inline_payload_max_bytes: int = Field(
        default=64 * 1024, ge=0, le=INLINE_PAYLOAD_LIMIT_BYTES,
        description="Inputs larger than this (as JSON) go to S3, the message carries their key.")
    inline_result_max_bytes: int = Field(
        default=32 * 1024, ge=0, le=INLINE_RESULT_LIMIT_BYTES,
        description="Results larger than this (as JSON) go to S3, the task record their key.")
    max_body_bytes: int = Field(default=1024 * 1024, ge=1)
    presign_expiry_s: int = Field(default=3600, ge=1, le=7 * 24 * 3600)  # SigV4's limit
    # Only presigned result URLs name this endpoint; every S3 call still goes to
    # AWS_ENDPOINT_URL_S3. On-prem the API reaches MinIO as http://minio:9000,
    # a name no client outside the Docker network can resolve. Unset (AWS): URLs
    # name the endpoint the API uses.
    s3_public_endpoint: str | None = Field(
        default=None, description="Endpoint that presigned result URLs name, e.g. http://10.0.0.5:9000.")
    result_ttl_days: int = Field(default=7, ge=1)
    backlog_cap: int = Field(default=100_000, ge=1, description="Per priority; past it submits get 429.")
    rate_limit_per_s: float = Field(default=0, ge=0, description="Per API key; 0 disables (AWS uses usage plans).")
    rate_limit_burst: int = Field(default=200, ge=1)

    # Worker
    models: str = Field(default="minilm-embed,synthetic", description="Comma-separated model names.")
    # Read by models/synthetic.py itself; here so that a bad value is refused
    # with the other settings, before the bootstrap and the models' load.
    synthetic_faults: bool = Field(default=False, description="The synthetic model obeys '!fail' and '!crash'.")
    max_batch_size: int = Field(default=32, ge=1)
    max_wait_ms: int = Field(default=10, ge=0)
    priority_weights: str = Field(default="high=6,normal=3,low=1", pattern=r"^(\s*(high|normal|low)\s*=\s*[0-9]+\s*(,|$))*$")
    visibility_timeout_s: int = Field(default=60, ge=VISIBILITY_TIMEOUT_MIN_S, le=12 * 3600)  # SQS's at most
    max_attempts: int = Field(default=3, ge=1, le=1000, description="Runs of a task before it is failed; also its queue's maxReceiveCount.")
    # At most SQS's long-poll limit; at least 1, since 0 (short polling) has an
    # idle worker's three receivers call SQS in a tight loop, each call billed.
    receive_wait_s: int = Field(default=1, ge=1, le=20)
    inference_timeout_s: int = Field(default=900, ge=1, description="A batch in inference longer than this ends "
                                     "the worker (exit 70), handing back what it holds: a hung GPU must not keep "
                                     "its messages hidden for ever behind the heartbeat.")
    # A typo ("gpu") must stop a worker, not run it on the CPU unnoticed.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    torch_threads: int = Field(default=0, ge=0)
    metrics_sink: Literal["stdout", "cloudwatch"] = Field(
        default="stdout", description="Worker metrics as EMF lines on stdout, or sent with CloudWatch "
                                      "PutMetricData (EKS, whose log agent does not turn EMF lines into metrics).")
    dlq_settle_s: float = Field(
        default=30.0, gt=0, allow_inf_nan=False,
        description="A worker settles the tasks dead-lettered without an outcome (sluice.dlq) about this often, "
                    "jittered by half either way.")
    queue_missing_exit_s: float = Field(
        default=30.0, gt=0, allow_inf_nan=False,
        description="A worker whose receives find a queue missing this long, none working in between, exits 75 "
                    "for its orchestrator to restart it (on-prem, the restart's bootstrap recreates the queues).")
    bootstrap_on_start: bool = Field(
        default=False,
        description="The API and the workers create the queues, tables and bucket that are missing as they start "
                    "(on-prem: LocalStack keeps them in memory); on AWS the stack owns them (sluice.bootstrap).")

    @field_validator("bootstrap_on_start", mode="before")
    @classmethod
    def _empty_is_off(cls, value: Any) -> Any:
        return False if value == "" else value

    @field_validator("models")
    @classmethod
    def _models_in_the_catalogue(cls, value: str) -> str:
        # An unknown name would leave the API serving none of them (every submit
        # 422) and fail the worker as it builds its models.
        problem = models_problem(value)
        if problem:
            raise problem
        return value

    @field_validator("s3_public_endpoint")
    @classmethod
    def _an_http_url(cls, value: str | None) -> str | None:
        # boto3 takes the endpoint only as a URL: `10.0.0.5:9000` would stop the
        # API at start with botocore's "Invalid endpoint", naming no variable.
        if not value:
            return None  # unset; an empty value too, as onprem/.env.example writes it
        parts = urlsplit(value)
        try:
            parts.port
        except ValueError:
            valid = False
        else:
            valid = parts.scheme in ("http", "https") and bool(
                is_valid_endpoint_url(value) or is_valid_ipv6_endpoint_url(value))
        if not valid:
            raise PydanticCustomError("url", "should be an http:// or https:// URL with a host, "
                                             "e.g. http://10.0.0.5:9000")
        return value

    def queue_url_override(self, priority: Priority) -> str | None:
        return getattr(self, f"queue_url_{priority.value}")

    def queue_name(self, priority: Priority, dlq: bool = False) -> str:
        return f"{self.queue_prefix}-{priority.value}{'-dlq' if dlq else ''}"

    def weights(self) -> dict[Priority, int]:
        parsed = dict(map(str.strip, part.split("=")) for part in self.priority_weights.split(",") if part.strip())
        return {p: max(1, int(parsed.get(p.value, 1))) for p in Priority}

    def model_names(self) -> list[str]:
        return model_names_of(self.models)


def model_names_of(models: str) -> list[str]:
    """The names in a SLUICE_MODELS value (comma-separated, blanks and repeats ignored)."""
    return list(dict.fromkeys(m.strip() for m in models.split(",") if m.strip()))


def models_problem(models: str) -> PydanticCustomError | None:
    """Why a SLUICE_MODELS value is refused (its `.message()` says it); None if
    every name is in the catalogue. The CDK app's configuration checks its
    `models` with this too, before a deploy."""
    names = model_names_of(models)
    known = ", ".join(CATALOGUE)
    if not names:
        return PydanticCustomError("no_model", "names no model; the catalogue has {known}", {"known": known})
    unknown = [n for n in names if n not in CATALOGUE]
    if unknown:
        return PydanticCustomError("unknown_model", "unknown model {unknown}; the catalogue has {known}",
                                   {"unknown": ", ".join(map(repr, unknown)), "known": known})
    # A catalogue entry (a team's own model) named outside the API's pattern
    # would be listed by GET /v1/models and refused on every submit.
    uncallable = [n for n in names if not re.fullmatch(MODEL_NAME_PATTERN, n)]
    if uncallable:
        return PydanticCustomError("model_name", "model name {names} is one no request can carry: names match {pattern}",
                                   {"names": ", ".join(map(repr, uncallable)), "pattern": MODEL_NAME_PATTERN})
    return None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@lru_cache
def get_settings() -> Settings:
    return Settings()
