"""Errors the API turns into clear 4xx/5xx bodies (contract.ErrorResponse)."""

from __future__ import annotations

from sluice.contract import ErrorBody, ErrorDetail, ErrorResponse


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        details: list[ErrorDetail] | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.details = details or []
        self.headers = headers or {}

    def body(self) -> dict:
        return ErrorResponse(error=ErrorBody(code=self.code, message=self.message, details=self.details)).model_dump()


def not_found(task_id: str) -> ApiError:
    return ApiError(404, "not_found", f"no task {task_id}")


def unavailable(what: str, retry_after_s: int = 5) -> ApiError:
    # It does not say whether anything was recorded: a submit with an
    # Idempotency-Key may have been (a batch cut mid-way, a replay), and its
    # retry with the same key resumes it exactly.
    return ApiError(
        503,
        "dependency_unavailable",
        f"{what} is unavailable; retry later, with the same Idempotency-Key if the request had one",
        headers={"Retry-After": str(retry_after_s)},
    )


def newer_record(task_id: str) -> ApiError:
    # A deploy is rolling: the retry most likely reaches a release that reads it.
    return ApiError(503, "record_unreadable",
                    f"task {task_id} was last written by a newer release of the service; retry shortly",
                    headers={"Retry-After": "5"})


# The header as a 422 names it (FastAPI's location of a header parameter:
# "header", then its name), so a client finds it under one name in both.
IDEMPOTENCY_KEY_FIELD = "header.Idempotency-Key"


def idempotency_conflict() -> ApiError:
    return ApiError(
        409,
        "idempotency_conflict",
        "this Idempotency-Key was used with a different request body",
        [ErrorDetail(field=IDEMPOTENCY_KEY_FIELD, rule="must not be reused for a different request")],
    )
