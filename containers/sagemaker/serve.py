"""SageMaker serving entrypoint: the worker image started as `docker run IMAGE serve`.

SageMaker's container contract: GET /ping answers 200 once the model is ready,
POST /invocations runs one request, both on port 8080. A request takes one of
two forms:

- one task: {"model", "inputs": [...]} -> {"model", "model_version", "result"},
  the result shaped as an async task's result, so clients read both the same way;
- many tasks: {"model", "tasks": [{"task_id", "inputs": [...]}, ...]} ->
  {"model", "model_version", "tasks": [{"task_id", "result"} | {"task_id", "error"}]},
  in request order. The dispatcher Lambda sends a whole SQS batch this way so
  that its tasks share the model's batches on the GPU.

Both forms, their replies and the error body are models of sluice.contract
(EndpointRequest -> EndpointResult, EndpointTasksRequest -> EndpointTasksReply,
ErrorResponse), with the contract's limits: a request holds at most
ENDPOINT_MAX_INPUTS_PER_REQUEST inputs; in the many-task form, at most
ENDPOINT_MAX_TASKS_PER_REQUEST tasks, each with inputs as the API allows them.
A task whose inputs break the rules gets a `validation_error` answer; the
others still run.

Either way the inputs run through the model in chunks of SLUICE_MAX_BATCH_SIZE
(or the model's own max_batch_size, if smaller). In the many-task form a model
failure is bisected (sluice.isolation) until the task that causes it stands
alone, and only that task gets an error.

A model that fails every task it ran in BROKEN_AFTER calls of two or more
tasks in a row (a GPU after a sticky CUDA error, a broken model) makes /ping
answer 503 from then on, so that SageMaker takes the instance out of service
and replaces it: the EKS worker's rule (sluice.isolation.BrokenModelWatch), which stops the
worker. One failing task is a poison input and does not count; a call in
which any task succeeds starts the count again. From then on invocations are
refused too, before anything is read or run: HTTP 503 with the error body's
code `model_broken` (MODEL_BROKEN). Until the replacement lands, answering
them would fail every task of every call, spending an attempt of every task in
the queues; the dispatcher reads this refusal (a ModelError whose
OriginalStatusCode is 503 and whose body's code is `model_broken`) as a call
that ran nothing, and hands its tasks back to SQS without spending an attempt,
as the EKS worker that stops hands back its messages.

A call still waiting for the model REFUSAL_MARGIN_S (5 s) before its caller
gives up on it (SageMaker's 60 s, or less where the dispatcher's
CustomAttributes say `sluice-give-up-s=N`) is refused unrun then, with a 429
whose code is `caller_gone` (CALLER_GONE; not a 5xx: SageMaker counts those in
Invocation5XXErrors, which pages, and this is load shed by design), while its caller still waits to read
it as a call that ran nothing: its answer would come too late to be read, and
running it would make the calls queued behind it wait longer still and time
out too. A caller that left before its answer is logged, not an error of the model.

At SIGTERM the server stops taking calls and answers those in flight (up to
STOP_GRACE_S) before it exits.

Standard-library HTTP on purpose: the worker image has torch but no web framework.
The server is threaded so /ping keeps answering while a long batch runs; the
model itself runs one batch at a time behind a lock.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from contextlib import contextmanager
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticSerializationError, to_json

from models.base import ModelInputError, predict_all
from models.registry import load_models
from sluice.contract import (
    EndpointRequest,
    EndpointResult,
    EndpointTask,
    EndpointTaskAnswer,
    EndpointTasksReply,
    EndpointTasksRequest,
    ErrorBody,
    ErrorResponse,
    TaskError,
)
from sluice.isolation import BROKEN_AFTER, INVALID_RESULT, MODEL_ERROR, BrokenModelWatch, run_isolating
from sluice.settings import Settings, SettingsError, log_level
from sluice.starting import stop_at_once_until_ready


log = logging.getLogger("sluice.sagemaker")

JSON = "application/json"

# The error code of the 503 that refuses every invocation once the model is
# broken: the dispatcher Lambda (lambdas/dispatcher/dispatch.py, _MODEL_BROKEN,
# kept equal by a test) reads it as a call that ran nothing. Defined on both
# sides, not shared: sluice.contract leaves error codes free-form strings.
MODEL_BROKEN = "model_broken"
# The code of the 503 for a call whose caller gave up while it waited for the
# model (kept equal to the dispatcher's, as MODEL_BROKEN is).
CALLER_GONE = "caller_gone"
# A real-time endpoint's invocation ends after 60 s, whatever the container does.
SAGEMAKER_INVOCATION_TIMEOUT_S = 60.0
# A call still waiting for the model this long before its caller gives up is
# refused then: the refusal must reach the caller while it still waits
# (SageMaker's clock started before the call arrived here, and the answer has
# its way back). One refused later reaches no one, and its caller counts a
# failed attempt of every task in it.
REFUSAL_MARGIN_S = 5.0
# The header SageMaker passes an InvokeEndpoint's CustomAttributes in.
CUSTOM_ATTRIBUTES = "X-Amzn-SageMaker-Custom-Attributes"


def give_up_at(arrived: float, custom_attributes: str | None) -> float:
    """When (time.monotonic()) the caller of a call that arrived then has given
    up on it: SageMaker's timeout, or the caller's own if it named a shorter one."""
    budget = SAGEMAKER_INVOCATION_TIMEOUT_S
    for part in (custom_attributes or "").replace(";", ",").split(","):
        name, _, value = part.partition("=")
        if name.strip() == "sluice-give-up-s":
            try:
                budget = min(budget, max(0.0, float(value)))
            except ValueError:
                pass
    return arrived + budget


class RequestError(Exception):
    def __init__(self, status: HTTPStatus, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def reply(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(code=self.code, message=self.message))


def body_of(reply: BaseModel) -> bytes:
    """A reply as JSON: only the fields it was given (a task's answer holds a result or an error)."""
    return reply.model_dump_json(exclude_unset=True).encode()


class Endpoint:
    """Loaded models and the logic of one invocation, free of HTTP."""

    def __init__(self, models: dict, default_model: str, max_payload_bytes: int = 6 * 2**20,
                 max_batch_size: int | None = None):
        self.models = models
        self.default_model = default_model
        self.max_payload_bytes = max_payload_bytes
        self.max_batch_size = max_batch_size  # SLUICE_MAX_BATCH_SIZE; each model's own limit applies too
        self._locks = {name: threading.Lock() for name in models}
        self.broken = False  # for good: /ping and invocations answer 503 until SageMaker replaces the instance
        self._watch = BrokenModelWatch()  # the EKS worker's rule (sluice.isolation)
        self._in_flight = 0  # invocations read and not yet answered
        self._idle = threading.Condition()

    def began(self) -> None:
        with self._idle:
            self._in_flight += 1

    def answered(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def wait_idle(self, timeout_s: float) -> int:
        """Waits until no invocation is in flight, or timeout_s; returns how many still are."""
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=timeout_s)
            return self._in_flight

    def invoke(self, body: bytes, content_type: str | None,
               give_up_at: float | None = None) -> EndpointResult | EndpointTasksReply:
        """`give_up_at`: when the caller stops waiting (give_up_at()); None: never."""
        if self.broken:  # nothing is read or run: the caller hands the tasks back
            raise RequestError(HTTPStatus.SERVICE_UNAVAILABLE, MODEL_BROKEN,
                               f"the model failed every task of {BROKEN_AFTER} calls in a row; this instance "
                               "takes no more calls and waits to be replaced")
        if content_type and content_type.split(";")[0].strip().lower() not in (JSON, "application/x-json"):
            raise RequestError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE, "unsupported_media_type",
                               f"send {JSON}, not {content_type}")
        # The HTTP handler checks Content-Length first; this covers callers that
        # hand a body over directly.
        if len(body) > self.max_payload_bytes:
            raise RequestError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "payload_too_large",
                               f"request body is over {self.max_payload_bytes} bytes")
        try:
            request = json.loads(body)
        except (ValueError, RecursionError):  # nested deeper than the parser goes: no request of ours
            raise RequestError(HTTPStatus.BAD_REQUEST, "malformed_json", "the request body is not valid JSON") from None
        # A bare list is the batch itself; an object names the model too.
        if isinstance(request, list):
            request = {"inputs": request}
        if not isinstance(request, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, "validation_error", 'send {"inputs": [...]} or a JSON list')
        if "tasks" in request:
            return self._invoke_tasks(request, give_up_at)
        try:
            single = EndpointRequest.model_validate(request)
        except ValidationError as exc:
            raise _invalid(exc) from None
        name, model = self._model(single.model)
        try:
            with _turn(self._locks[name], give_up_at):
                outputs = self._predict(model, single.inputs)
        except ModelInputError as exc:
            raise RequestError(HTTPStatus.BAD_REQUEST, "invalid_input", str(exc)) from None
        self._watch_the_model(name, [None])
        return EndpointResult(model=name, model_version=model.version, result=model.result_for_task(outputs))

    def _model(self, name: str | None):
        name = name or self.default_model
        model = self.models.get(name)
        if model is None:
            raise RequestError(HTTPStatus.BAD_REQUEST, "unknown_model",
                               f"unknown model {name!r}; served: {', '.join(sorted(self.models))}")
        return name, model

    def _invoke_tasks(self, request: dict, give_up_at: float | None) -> EndpointTasksReply:
        # A bad task is that task's error, not the request's: the others still run.
        tasks, answers = _read_tasks(request)
        name, model = self._model(request.get("model"))

        def run(group: list[tuple[int, EndpointTask]]) -> list[EndpointTaskAnswer]:
            outputs = self._predict(model, [text for _, task in group for text in task.inputs])
            answered, offset = [], 0
            for _, task in group:
                result = model.result_for_task(outputs[offset : offset + len(task.inputs)])
                try:
                    to_json(result)
                except PydanticSerializationError as exc:
                    # This task's failure, not the call's (the whole reply would
                    # not serialize: a 500, an attempt of every task in it).
                    answered.append(EndpointTaskAnswer(task_id=task.task_id, error=TaskError(
                        code=INVALID_RESULT, message=f"the model's result is not JSON: {exc}")))
                else:
                    answered.append(EndpointTaskAnswer(task_id=task.task_id, result=result))
                offset += len(task.inputs)
            return answered

        def failed(item: tuple[int, EndpointTask], exc: Exception) -> EndpointTaskAnswer:
            task_id = item[1].task_id
            if isinstance(exc, ModelInputError):
                return EndpointTaskAnswer(task_id=task_id, error=TaskError(code="invalid_input", message=str(exc)))
            # Logged here in full; the caller gets no internals, as with a 500.
            log.error("the model failed on task %s", task_id, exc_info=exc)
            return EndpointTaskAnswer(task_id=task_id, error=TaskError(
                code=MODEL_ERROR, message=f"the model failed on this task ({type(exc).__name__})"))

        if tasks:
            with _turn(self._locks[name], give_up_at):
                results = run_isolating(run, tasks, failed)
            for (i, _), answer in zip(tasks, results):
                answers[i] = answer
            # The tasks the model ran: a `validation_error` never reached it.
            self._watch_the_model(name, [a.error.code if a.error else None for a in results])
        return EndpointTasksReply(model=name, model_version=model.version, tasks=answers)

    def _watch_the_model(self, name: str, codes: list[str | None]) -> None:
        """Told the error code (None: a result) of each task one call ran through the model."""
        if self._watch.saw(name, codes) and not self.broken:
            self.broken = True
            log.error("model %s failed every task of %d calls in a row: /ping and invocations answer 503 from now "
                      "on, for SageMaker to replace this instance", name, BROKEN_AFTER)

    def _predict(self, model, inputs: list[str]) -> list:
        return predict_all(model, inputs, min(model.max_batch_size, self.max_batch_size or model.max_batch_size))


@contextmanager
def _turn(lock: threading.Lock, give_up_at: float | None):
    """The model's turn, waited for until REFUSAL_MARGIN_S before the caller
    gives up (None: for ever); a call whose turn has not come by then raises
    CALLER_GONE, before anything runs."""
    refuse_at = None if give_up_at is None else give_up_at - REFUSAL_MARGIN_S
    if not lock.acquire(timeout=-1 if refuse_at is None else max(0.0, refuse_at - time.monotonic())):
        raise _caller_gone()
    try:
        if refuse_at is not None and time.monotonic() > refuse_at:
            raise _caller_gone()
        yield
    finally:
        lock.release()


def _caller_gone() -> RequestError:
    return RequestError(HTTPStatus.TOO_MANY_REQUESTS, CALLER_GONE,
                        "the call waited for the model until its caller was about to give up: not run")


def _read_tasks(request: dict) -> tuple[list[tuple[int, EndpointTask]], list[EndpointTaskAnswer | None]]:
    """The tasks to run, by position, and an answer slot per task: filled
    with a `validation_error` for each task whose inputs break the contract.
    A fault anywhere else (the task list, a task_id, the model's name, the
    inputs of the whole request) refuses the request."""
    raw = request.get("tasks")
    try:
        parsed = EndpointTasksRequest.model_validate(request)
        return list(enumerate(parsed.tasks)), [None] * len(parsed.tasks)
    except ValidationError as exc:
        refused: dict[int, str] = {}
        for error in exc.errors(include_url=False):
            loc = error["loc"]
            if len(loc) < 3 or loc[0] != "tasks" or loc[2] != "inputs":
                raise RequestError(HTTPStatus.BAD_REQUEST, "validation_error", _describe(error)) from None
            refused.setdefault(loc[1], _describe(error))
    answers: list[EndpointTaskAnswer | None] = [
        EndpointTaskAnswer(task_id=task["task_id"], error=TaskError(code="validation_error", message=refused[i]))
        if i in refused else None
        for i, task in enumerate(raw)
    ]
    kept = [i for i in range(len(raw)) if i not in refused]
    if not kept:
        return [], answers
    try:  # the others, with the request's own rules (its inputs in all) over them
        parsed = EndpointTasksRequest.model_validate({**request, "tasks": [raw[i] for i in kept]})
    except ValidationError as exc:
        raise _invalid(exc) from None
    return list(zip(kept, parsed.tasks)), answers


def _describe(error) -> str:
    where = ".".join(str(part) for part in error["loc"])
    return f"{where}: {error['msg']}" if where else error["msg"]


def _invalid(exc: ValidationError) -> RequestError:
    return RequestError(HTTPStatus.BAD_REQUEST, "validation_error", _describe(exc.errors(include_url=False)[0]))


def make_handler(endpoint: Endpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # Keep-alive: SageMaker reuses connections to the container.
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            if self.path.split("?")[0] != "/ping":
                self._error(HTTPStatus.NOT_FOUND, "not_found", f"no route {self.path}")
            elif endpoint.broken:
                self._send(HTTPStatus.SERVICE_UNAVAILABLE, json.dumps({
                    "status": "broken", "models": sorted(endpoint.models),
                    "reason": f"the model failed every task of {BROKEN_AFTER} calls in a row"}).encode())
            else:
                self._send(HTTPStatus.OK, json.dumps({"status": "ok", "models": sorted(endpoint.models)}).encode())

        def do_POST(self):
            arrived = time.monotonic()
            if self.path.split("?")[0] != "/invocations":
                self._drain()
                return self._error(HTTPStatus.NOT_FOUND, "not_found", f"no route {self.path}")
            length = self.headers.get("Content-Length")
            if length is None or not (length.isascii() and length.isdigit()):  # "²".isdigit(), but int() refuses it
                self.close_connection = True
                return self._error(HTTPStatus.LENGTH_REQUIRED, "length_required", "send a Content-Length")
            if int(length) > endpoint.max_payload_bytes:
                self.close_connection = True  # the unread body must not be parsed as the next request
                return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "payload_too_large",
                                   f"request body is over {endpoint.max_payload_bytes} bytes")
            endpoint.began()
            try:
                self._invocation(arrived, int(length))
            finally:
                endpoint.answered()

        def _invocation(self, arrived: float, length: int):
            body = self.rfile.read(length)
            try:
                reply = endpoint.invoke(body, self.headers.get("Content-Type"),
                                        give_up_at(arrived, self.headers.get(CUSTOM_ATTRIBUTES)))
                status, data = HTTPStatus.OK, body_of(reply)
            except RequestError as err:
                status, data = err.status, body_of(err.reply())
            except Exception:
                log.exception("invocation failed")
                status, data = HTTPStatus.INTERNAL_SERVER_ERROR, body_of(RequestError(
                    HTTPStatus.INTERNAL_SERVER_ERROR, "model_error", "the model failed on this request").reply())
            try:
                self._send(status, data)
            except (BrokenPipeError, ConnectionResetError):
                # The caller timed out meanwhile: its tasks' outcome is its to decide.
                log.info("the caller left before its answer (%d after %.1f s)", status, time.monotonic() - arrived)
                self.close_connection = True

        def _drain(self):
            length = self.headers.get("Content-Length", "0")
            if length.isascii() and length.isdigit() and int(length) <= endpoint.max_payload_bytes:
                self.rfile.read(int(length))
            else:
                self.close_connection = True

        def _error(self, status: HTTPStatus, code: str, message: str):
            self._send(status, body_of(RequestError(status, code, message).reply()))

        def _send(self, status: HTTPStatus, data: bytes):
            self.send_response(status)
            self.send_header("Content-Type", JSON)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt, *args):
            log.debug("%s " + fmt, self.address_string(), *args)

    return Handler


def make_server(endpoint: Endpoint, host: str, port: int) -> ThreadingHTTPServer:
    server = ThreadingHTTPServer((host, port), make_handler(endpoint))
    server.daemon_threads = True
    return server


def load_endpoint(settings: Settings) -> Endpoint:
    models = load_models(settings.model_names(), settings.torch_threads)
    max_mb = float(os.environ.get("SAGEMAKER_MAX_PAYLOAD_IN_MB", "6"))
    return Endpoint(models, default_model=settings.model_names()[0], max_payload_bytes=int(max_mb * 2**20),
                    max_batch_size=settings.max_batch_size)


# At SIGTERM, how long invocations in flight get to finish and be answered: a
# call cut off would be an attempt spent of every task in it.
STOP_GRACE_S = SAGEMAKER_INVOCATION_TIMEOUT_S


def stop_serving(server: ThreadingHTTPServer, endpoint: Endpoint, grace_s: float = STOP_GRACE_S) -> None:
    """Stops taking calls, then waits for those in flight to be answered (their
    handler threads are daemons, which the interpreter's exit would cut off)."""
    server.shutdown()
    left = endpoint.wait_idle(grace_s)
    if left:
        log.warning("stopping with %d invocations still running after %.0f s", left, grace_s)


def main() -> int:
    stop_at_once_until_ready()  # PID 1 in a container: a SIGTERM without a handler is dropped
    try:
        level = log_level()  # `debug` as well as `DEBUG`, as the worker takes it
    except SettingsError as exc:  # before logging exists: one line, no traceback
        print(f"sagemaker: refused settings: {exc}", file=sys.stderr, flush=True)
        return 2
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s sagemaker[%(process)d] %(message)s",
        stream=sys.stderr,
    )
    try:
        settings = Settings()
    except SettingsError as exc:
        log.error("refused settings:\n%s", exc)
        return 2
    endpoint = load_endpoint(settings)
    # SageMaker requires 0.0.0.0:8080; multi-container endpoints pass the port.
    server = make_server(endpoint, "0.0.0.0", int(os.environ.get("SAGEMAKER_BIND_TO_PORT", "8080")))
    # shutdown() blocks until serve_forever() returns, so it runs off the signal handler's thread.
    stopping = threading.Thread(target=stop_serving, args=(server, endpoint), name="sluice-stop")
    signal.signal(signal.SIGTERM, lambda *_: stopping.start() if stopping.ident is None else None)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    log.info("serving %s on port %d", ", ".join(endpoint.models), server.server_address[1])
    try:
        server.serve_forever()
        if stopping.ident is not None:
            stopping.join()  # the calls in flight answered
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
