"""The FastAPI app. Routes stay thin: auth and parsing here, logic in service.py."""
# No `from __future__ import annotations`: FastAPI must resolve the local
# `Tenant` dependency annotation at definition time.

import asyncio
import json
import logging
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from functools import partial
from typing import Annotated

import anyio.to_thread
from botocore.exceptions import BotoCoreError, ClientError
from fastapi import Depends, FastAPI, Header, Path, Query, Request, Security
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import APIKeyHeader
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from sluice import __version__
from sluice.adapters.api_keys import ApiKeys
from sluice.adapters.task_store import Unprocessed, UnreadableRecord
from sluice.api.errors import ApiError, newer_record, unavailable
from sluice.api.service import TaskService
from sluice.api.waiter import CompletionWaiter
from sluice.aws import client
from sluice.contract import (
    BatchAccepted,
    BatchSubmitRequest,
    ErrorDetail,
    ErrorResponse,
    Health,
    IdempotencyKey,
    ModelList,
    Priority,
    Readiness,
    SubmitRequest,
    TaskAccepted,
    TaskId,
    TaskView,
    WaitSeconds,
)
from sluice.settings import Settings

READY_BUDGET_S = 3.0  # within a load balancer's or kubelet's usual probe timeout
# Submits wait in their threads while a group commit writes, for as long as the
# table or the queue takes to answer (12 s at worst: one hung call, whose
# rollback waits in the background; tests/reliability/test_dependencies.py). From AnyIO's default
# pool (40) they could take every thread while a dependency stalls, and reads
# and cancels would queue behind them: submits get threads of their own.
SUBMIT_THREADS = 32
# At shutdown, how long rollbacks still retrying in the background get to land:
# well inside the 30 s stop grace the compose file and a Kubernetes pod give.
ROLLBACK_DRAIN_S = 5.0

log = logging.getLogger("sluice.api")

# What a 429 or 503 carries, so that generated clients expose it (a daily quota
# spent on AWS answers 429 without one: it lasts until the plan's period ends).
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.",
                                "schema": {"type": "string", "pattern": "^[0-9]+$"}}}


def _errors(*statuses: int) -> dict:
    """The error answers a route can give, each an ErrorResponse: what the
    OpenAPI document lists per route (the contract test holds the app to it)."""
    return {s: {"model": ErrorResponse, **({"headers": _RETRY_AFTER} if s in (429, 503) else {})}
            for s in statuses}


# Every route behind the key check: no key, a bad key, a body over the limit
# (BodyLimit reads it whatever the route), the rate limit, a table that does not answer.
_AUTHED = (401, 403, 413, 429, 503)
_FIRST_LOOK_MIN_S = 3.0  # a long poll's first read of its task, at the least
_SUBMIT_ERRORS = _errors(400, *_AUTHED, 409, 415, 422)
_HTTP_CODES = {400: "malformed_json", 404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}
# The parameters' rules are the contract's types; only where each is read is said here.
TaskIdParam = Annotated[TaskId, Path()]
IdempotencyKeyHeader = Annotated[
    IdempotencyKey | None,
    Header(alias="Idempotency-Key", description="Makes a retried submit return the task the first call created."),
]
WaitParam = Annotated[
    WaitSeconds, Query(description="Long poll: wait up to this many seconds for the task to be final.")
]


# A security scheme rather than a plain header parameter, so that the OpenAPI
# document tells clients (and schemathesis) how to authenticate.
API_KEY = APIKeyHeader(name="x-api-key", auto_error=False, description="A key from `sluice keys create`.")


class TokenBucket:
    """Per-key rate limit for the embedded/on-prem profiles (usage plans do it on AWS)."""

    def __init__(self, rate_per_s: float, burst: int, max_keys: int = 10_000):
        self.rate, self.burst, self.max_keys = rate_per_s, burst, max_keys
        self._buckets: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def take(self, key: str) -> float:
        """0 if allowed, else seconds until a token is available."""
        now = time.monotonic()
        with self._lock:
            tokens, last = self._buckets.get(key, (float(self.burst), now))
            tokens = min(self.burst, tokens + (now - last) * self.rate)
            if tokens >= 1:
                if len(self._buckets) >= self.max_keys and key not in self._buckets:
                    self._buckets.clear()
                self._buckets[key] = (tokens - 1, now)
                return 0.0
            self._buckets[key] = (tokens, now)
            return (1 - tokens) / self.rate


class BodyLimit:
    """Refuse bodies over the limit (413) before the app sees them.

    A declared Content-Length over the limit is refused unread; a body without
    one (chunked) is read up to the limit and refused as soon as it passes it.
    The body is then handed to the app from memory: an exception raised inside
    the app's own read would surface as the framework's 400, not a 413. Only
    under /v1/, where the routes that take bodies are (and where the key was
    checked first): elsewhere (/health, an unknown path) nothing reads a body,
    and buffering one would hold a megabyte for a request with no key at all."""

    def __init__(self, app, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._too_large(send)
        chunks, seen = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body = message.get("body", b"")
            seen += len(body)
            if seen > self.max_bytes:
                return await self._too_large(send)
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: only a disconnect can come

        await self.app(scope, replay, send)

    async def _too_large(self, send):
        err = ApiError(413, "payload_too_large", f"request body is over {self.max_bytes} bytes",
                       [ErrorDetail(field="body", rule=f"at most {self.max_bytes} bytes")])
        response = JSONResponse(err.body(), status_code=413)
        await response({"type": "http"}, None, send)


class ContainUnexpected:
    """A bug's exception ends here, not a client error. The client gets the
    error contract (500), never a stack trace; the log gets where it happened
    but not the exception's message, which may quote the request's payload.
    An exception handler cannot do this: Starlette's ServerErrorMiddleware
    re-raises after its handler answers, and the server (uvicorn's "Exception
    in ASGI application", Mangum's "An error occurred running the
    application") then logs the whole traceback, message and all."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def watched(message):
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as exc:  # noqa: BLE001 - answered and logged here, never re-raised
            where = "".join(traceback.format_list(traceback.extract_tb(exc.__traceback__)[-5:]))
            log.error("unhandled %s\n%s", type(exc).__name__, where)
            if not started:  # else the response is cut short: the client sees the connection end
                err = ApiError(500, "internal_error", "the request failed unexpectedly; it is safe to retry")
                await JSONResponse(err.body(), status_code=500)(scope, receive, send)


class KeyCheck:
    """Where the app checks keys itself (on AWS the gateway does, before the
    app): a request to /v1/ is authenticated and rate limited before its body
    is read. Otherwise anyone with a made-up key could make the API buffer and
    parse a megabyte of JSON on its event loop, and a bad key with a bad body
    was answered 400 for the body where API Gateway answers 403 first. The
    routes get the tenant from scope["state"]."""

    def __init__(self, app, keys: ApiKeys, limiter: TokenBucket | None):
        self.app, self.keys, self.limiter = app, keys, limiter

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        try:
            tenant_id = await self._tenant(dict(scope.get("headers") or []).get(b"x-api-key", b"").decode("latin-1"))
        except ApiError as err:
            return await JSONResponse(err.body(), status_code=err.status, headers=err.headers)(
                {"type": "http"}, None, send)
        except (BotoCoreError, ClientError) as exc:
            return await _dependency_unavailable(exc)({"type": "http"}, None, send)
        scope.setdefault("state", {})[_TENANT] = tenant_id
        return await self.app(scope, receive, send)

    async def _tenant(self, key: str) -> str:
        if not key.strip():
            raise ApiError(401, "unauthenticated", "missing x-api-key header")
        # On the event loop while the key is cached: a thread hop per request
        # costs more than the lookup itself.
        try:
            record = self.keys.authenticate_cached(key)
        except LookupError:
            record = await run_in_threadpool(self.keys.authenticate, key)
        if record is None:
            raise ApiError(403, "forbidden", "unknown or revoked API key")
        if self.limiter:
            wait = self.limiter.take(record.key_id)
            if wait:
                raise ApiError(429, "rate_limited", "too many requests for this key",
                               headers={"Retry-After": str(max(1, round(wait + 0.5)))})
        return record.tenant_id


_TENANT = "sluice.tenant_id"


def _dependency_unavailable(exc: Exception) -> JSONResponse:
    # Never a stack trace to the client: the cause goes to the log only.
    log.warning("dependency call failed: %s", type(exc).__name__)
    err = unavailable("a dependency")
    return JSONResponse(err.body(), status_code=503, headers=err.headers)


async def _until_disconnected(request: Request) -> None:
    # After its (empty) body a GET's receive yields only the disconnect: uvicorn's
    # when the client goes, Mangum's when the invocation has answered.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, waiting):
    """What `waiting` returns; or, once the client has gone, cancels it and
    returns `_GONE`. A long poll otherwise reads its task for a client that
    stopped listening until its wait_s runs out (up to 20 s of reads each)."""
    work = asyncio.ensure_future(waiting)
    gone = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, gone):
            task.cancel()
        await asyncio.wait({work, gone})  # their cleanup (the waiter's registry) done as the request ends
    return work.result() if work.done() and not work.cancelled() else _GONE


_GONE = object()


def _allowed_methods(app: FastAPI, scope) -> set[str]:
    """Every method some route serves on the request's path."""
    methods: set[str] = set()
    for route in app.router.routes:
        # PARTIAL: the path matches and the method does not.
        if getattr(route, "methods", None) and route.matches(scope)[0] != Match.NONE:
            methods |= route.methods
    return methods


def _is_json(content_type: str) -> bool:
    media = content_type.split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def _field_part(part) -> str:
    # A key that would vanish from the dotted path (empty) or split it (holding
    # a dot) is quoted; metadata keys are the client's own strings.
    text = str(part)
    return json.dumps(text) if text == "" or "." in text else text


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    details = []
    malformed = False
    for e in exc.errors():
        loc = [_field_part(p) for p in e.get("loc", ())]
        if loc[:1] == ["body"]:  # where FastAPI says the body starts; a field named "body" stays
            loc = loc[1:]
        if e.get("type") == "json_invalid":
            # Its location is a character offset into the body, not a field.
            malformed = True
            where = f" at character {loc[0]}" if loc else ""
            error = (e.get("ctx") or {}).get("error", "")
            details.append(ErrorDetail(field="body", rule=f"json_invalid{where}: {e.get('msg')}" + (f" ({error})" if error else "")))
            continue
        details.append(ErrorDetail(field=".".join(loc) or "body", rule=f"{e.get('type')}: {e.get('msg')}"))
    if malformed:
        err = ApiError(400, "malformed_json", "the request body is not valid JSON", details)
    else:
        err = ApiError(422, "validation_error", "the request does not match the schema", details)
    return JSONResponse(err.body(), status_code=err.status)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()
    service = TaskService(settings)
    waiter = CompletionWaiter(service.store)
    ready_probes = ThreadPoolExecutor(max_workers=3, thread_name_prefix="sluice-ready")
    keys = ApiKeys(settings) if settings.auth_mode == "table" else None
    limiter = TokenBucket(settings.rate_limit_per_s, settings.rate_limit_burst) if settings.rate_limit_per_s > 0 else None

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        # Requests have finished (uvicorn waits for them before this); a rollback
        # still retrying lives in a daemon thread that would die with the process.
        await anyio.to_thread.run_sync(service.compensator.drain, ROLLBACK_DRAIN_S)

    app = FastAPI(
        title="Sluice",
        version=__version__,
        description="Asynchronous inference for PyTorch models. Authenticate with the `x-api-key` header.",
        lifespan=lifespan,
        # A path with a trailing slash is unknown (404): a redirect is in no
        # route's contract, and clients that post do not follow one.
        redirect_slashes=False,
    )
    app.add_middleware(BodyLimit, max_bytes=settings.max_body_bytes)
    if settings.auth_mode == "table":
        app.add_middleware(KeyCheck, keys=keys, limiter=limiter)  # before the body is read
    app.add_middleware(ContainUnexpected)  # outermost of ours: around every other

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException):
        # The framework's own errors (a body that is not UTF-8, an unknown
        # route, a wrong method) in the same error contract as ours.
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        message = str(exc.detail)
        details = []
        if exc.status_code == 400:
            # Bodies that could not be parsed at all (not UTF-8, nested too
            # deep, a number too long to convert): to a client the same as
            # JSON that breaks off, so the same code; the body is at fault.
            message = "the request body is not valid JSON"
            details = [ErrorDetail(field="body", rule=f"unparseable: {exc.detail}")]
        err = ApiError(exc.status_code, code, message, details)
        headers = dict(getattr(exc, "headers", None) or {})
        if exc.status_code == 405:
            # Starlette's Allow names the first route that matched the path
            # only: GET /v1/tasks/{id} but not DELETE on the same path.
            headers["Allow"] = ", ".join(sorted(_allowed_methods(app, request.scope)))
        return JSONResponse(err.body(), status_code=exc.status_code, headers=headers or None)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        # FastAPI reads a body as JSON only when it says it is; any other body,
        # or one sent with no Content-Type at all, fails the schema, which would
        # blame the fields for a missing header (curl -d sends
        # application/x-www-form-urlencoded). No header and no body: the body is missing (422).
        content_type = request.headers.get("content-type", "")
        if request.method == "POST" and not _is_json(content_type) and (content_type or exc.body):
            rule = f"must be application/json, not {content_type}" if content_type else \
                "must be application/json; the request has none"
            err = ApiError(415, "unsupported_media_type", "send the body as JSON: Content-Type: application/json",
                           [ErrorDetail(field="header.Content-Type", rule=rule)])
            return JSONResponse(err.body(), status_code=415)
        return _validation_error(exc)

    @app.exception_handler(UnreadableRecord)
    async def _newer_record(_: Request, exc: UnreadableRecord):
        # Reached only on a tenant's own task (a keyed submit's record, a race
        # after the read): GET and DELETE answer another tenant's with a 404.
        error = newer_record(exc.task_id)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(BotoCoreError)
    @app.exception_handler(ClientError)
    @app.exception_handler(Unprocessed)  # the table throttled a batch read past its retries
    async def _dependency(_: Request, exc: Exception):
        return _dependency_unavailable(exc)

    async def tenant(request: Request, _: Annotated[str | None, Security(API_KEY)] = None) -> str:
        if settings.auth_mode == "apigateway":
            event = request.scope.get("aws.event") or {}
            key_id = (event.get("requestContext") or {}).get("identity", {}).get("apiKeyId")
            if not key_id:
                raise ApiError(401, "unauthenticated", "missing API key")
            return key_id
        return request.scope["state"][_TENANT]  # KeyCheck's, before the body was read

    Tenant = Annotated[str, Depends(tenant)]

    # Both probes run on the event loop: a plain `def` route waits for a request
    # thread, and submits waiting on a slow table can hold all of them; the
    # probes would then miss their timeouts and an orchestrator restart a healthy API.
    @app.get("/health", tags=["ops"], response_model=Health)
    async def health() -> Health:
        """Liveness: the process answers. Touches no dependency."""
        return Health(status="ok")

    @app.get("/ready", tags=["ops"], response_model=Readiness,
             responses={503: {"model": Readiness, "description": "A dependency does not answer."}})
    async def ready() -> JSONResponse:
        """Readiness: the table, the queues and the bucket answer, within READY_BUDGET_S."""
        probes = {
            "tasks_table": lambda: client("dynamodb", settings).describe_table(TableName=settings.tasks_table),
            # A call to each queue: its URL is cached after the first lookup.
            "queues": lambda: [service.queues.depth(p) for p in Priority],
            "bucket": lambda: client("s3", settings).head_bucket(Bucket=settings.bucket),
        }
        running = {name: asyncio.wrap_future(ready_probes.submit(probe)) for name, probe in probes.items()}
        # A hung dependency answers nothing until the SDK gives up (about 15 s);
        # a probe that has not answered by then is not ready, and is left to end
        # on its own in the small pool (so repeated probes cannot pile up threads).
        await asyncio.wait(running.values(), timeout=READY_BUDGET_S)
        checks = {}
        for name, future in running.items():
            if not future.done():
                # Drops a probe still queued behind hung ones; one running ends on its own.
                future.cancel()
                checks[name] = "no_answer"
            else:
                error = future.exception()
                checks[name] = "ok" if error is None else type(error).__name__
        ok = all(v == "ok" for v in checks.values())
        readiness = Readiness(status="ready" if ok else "not_ready", checks=checks)
        return JSONResponse(readiness.model_dump(mode="json"), status_code=200 if ok else 503)

    # The routes are `async` and hand only the blocking AWS calls to a thread:
    # for a plain `def` route FastAPI also validates the response in a thread,
    # a second hop per request.
    @app.get("/v1/models", response_model=ModelList, tags=["models"], responses=_errors(*_AUTHED))
    async def list_models(_: Tenant) -> ModelList:
        return ModelList(models=service.list_models())

    submit_threads = anyio.CapacityLimiter(SUBMIT_THREADS)

    @app.post("/v1/tasks", status_code=202, response_model=TaskAccepted, tags=["tasks"], responses=_SUBMIT_ERRORS)
    async def submit(body: SubmitRequest, tenant_id: Tenant, idempotency_key: IdempotencyKeyHeader = None) -> TaskAccepted:
        return await anyio.to_thread.run_sync(partial(service.submit, tenant_id, body, idempotency_key),
                                              limiter=submit_threads)

    @app.post("/v1/tasks/batch", status_code=202, response_model=BatchAccepted, tags=["tasks"],
              responses=_SUBMIT_ERRORS)
    async def submit_batch(
        body: BatchSubmitRequest, tenant_id: Tenant, idempotency_key: IdempotencyKeyHeader = None
    ) -> BatchAccepted:
        return await anyio.to_thread.run_sync(partial(service.submit_batch, tenant_id, body, idempotency_key),
                                              limiter=submit_threads)

    @app.get("/v1/tasks/{task_id}", response_model=TaskView, tags=["tasks"], responses=_errors(*_AUTHED, 404, 422))
    async def get_task(request: Request, task_id: TaskIdParam, tenant_id: Tenant, wait_s: WaitParam = 0) -> TaskView:
        # The wait counts from the request, its first look included: behind API
        # Gateway's 29 s a slow first read plus a whole wait_s would be a 504.
        started = time.monotonic()
        if wait_s:
            # The first look joins the waiter's shared read round instead of a GetItem of its own.
            # A table that does not answer is a 503 within the wait the client
            # gave (3 s at the least, as /ready waits), not after the SDK's retries.
            try:
                seen = await asyncio.wait_for(waiter.read(task_id), max(wait_s, _FIRST_LOOK_MIN_S))
            except asyncio.TimeoutError:
                raise unavailable("the task store") from None
            except UnreadableRecord as exc:
                raise service.unreadable(tenant_id, exc) from None
            view = await run_in_threadpool(service.get, tenant_id, task_id, seen)
        else:
            view = await run_in_threadpool(service.get, tenant_id, task_id)
        left_s = wait_s - (time.monotonic() - started)
        if left_s > 0 and not view.status.is_terminal:
            # The final record; or, when the wait ran out first, the latest one the
            # waiter read (a retry's error, an attempt), so a timed-out wait answers
            # the task's current state without a read of its own. None: it read none.
            record = await _unless_disconnected(request, waiter.wait(task_id, left_s))
            if record is _GONE:
                return view  # to no one: it only ends the request
            if record is not None:
                final = record.status.is_terminal
                view = await run_in_threadpool(service.view, record) if final else \
                    await run_in_threadpool(service.get, tenant_id, task_id, record)  # expires it if overdue
        return view

    @app.delete("/v1/tasks/{task_id}", response_model=TaskView, tags=["tasks"],
                responses=_errors(*_AUTHED, 404, 409, 422))
    async def cancel_task(task_id: TaskIdParam, tenant_id: Tenant) -> TaskView:
        return await run_in_threadpool(service.cancel, tenant_id, task_id)

    return app
