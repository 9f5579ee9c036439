"""Settings from the environment (prefix ``SLUICE_``).

Endpoints are deliberately absent: boto3 already reads ``AWS_ENDPOINT_URL`` and
``AWS_ENDPOINT_URL_<SERVICE>``, so AWS, LocalStack/MinIO and the embedded
emulator differ only in those standard variables.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from sluice.contract import Priority


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SLUICE_", extra="ignore")

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
    key_cache_s: float = Field(default=10.0, description="A revoked key stops working within this time.")

    inline_payload_max_bytes: int = 64 * 1024
    inline_result_max_bytes: int = 32 * 1024
    max_body_bytes: int = 1024 * 1024
    presign_expiry_s: int = 3600
    result_ttl_days: int = 7
    backlog_cap: int = Field(default=100_000, description="Per priority; past it submits get 429.")
    rate_limit_per_s: float = Field(default=0, description="Per API key; 0 disables (AWS uses usage plans).")
    rate_limit_burst: int = 200

    # Worker
    models: str = Field(default="minilm-embed,synthetic", description="Comma-separated model names.")
    max_batch_size: int = 32
    max_wait_ms: int = 10
    priority_weights: str = Field(default="high=6,normal=3,low=1")
    visibility_timeout_s: int = 60
    max_attempts: int = Field(default=3, ge=1, le=1000, description="Runs of a task before it is failed; also its queue's maxReceiveCount.")
    receive_wait_s: int = 1
    device: str = Field(default="auto", description="auto | cpu | cuda")
    torch_threads: int = 0

    def queue_url_override(self, priority: Priority) -> str | None:
        return getattr(self, f"queue_url_{priority.value}")

    def queue_name(self, priority: Priority, dlq: bool = False) -> str:
        return f"{self.queue_prefix}-{priority.value}{'-dlq' if dlq else ''}"

    def weights(self) -> dict[Priority, int]:
        parsed = dict(part.split("=") for part in self.priority_weights.split(",") if part)
        return {p: max(1, int(parsed.get(p.value, 1))) for p in Priority}

    def model_names(self) -> list[str]:
        return [m.strip() for m in self.models.split(",") if m.strip()]


@lru_cache
def get_settings() -> Settings:
    return Settings()
