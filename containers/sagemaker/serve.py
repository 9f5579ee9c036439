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

Either way the inputs run through the model in chunks of SLUICE_MAX_BATCH_SIZE
(or the model's own max_batch_size, if smaller). A request holds at most 1024
inputs; in the many-task form, at most 100 tasks of 64 inputs each, as the API allows. In
the many-task form a model failure is bisected (sluice.isolation) until the
task that causes it stands alone, and only that task gets an error.

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
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from models.base import ModelInputError
from models.registry import load_models
from sluice.contract import MAX_INPUT_CHARS, MAX_INPUTS_PER_TASK, MAX_TASKS_PER_BATCH
from sluice.isolation import run_isolating
from sluice.settings import Settings

log = logging.getLogger("sluice.sagemaker")

JSON = "application/json"
# A request's work is bounded as an async task's is: the dispatcher sends at most
# 64 tasks and 256 inputs a call, and a response over 6 MB is one SageMaker drops.
MAX_INPUTS_PER_REQUEST = 1024


class RequestError(Exception):
    def __init__(self, status: HTTPStatus, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


class Endpoint:
    """Loaded models and the logic of one invocation, free of HTTP."""

    def __init__(self, models: dict, default_model: str, max_payload_bytes: int = 6 * 2**20,
                 max_batch_size: int | None = None):
        self.models = models
        self.default_model = default_model
        self.max_payload_bytes = max_payload_bytes
        self.max_batch_size = max_batch_size  # SLUICE_MAX_BATCH_SIZE; each model's own limit applies too
        self._locks = {name: threading.Lock() for name in models}

    def invoke(self, body: bytes, content_type: str | None) -> dict:
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
        except ValueError:
            raise RequestError(HTTPStatus.BAD_REQUEST, "malformed_json", "the request body is not valid JSON") from None
        # A bare list is the batch itself; an object names the model too.
        if isinstance(request, list):
            request = {"inputs": request}
        if not isinstance(request, dict):
            raise RequestError(HTTPStatus.BAD_REQUEST, "validation_error", 'send {"inputs": [...]} or a JSON list')
        name = request.get("model") or self.default_model
        if not isinstance(name, str):
            raise RequestError(HTTPStatus.BAD_REQUEST, "validation_error", "model must be a string")
        model = self.models.get(name)
        if model is None:
            raise RequestError(HTTPStatus.BAD_REQUEST, "unknown_model",
                               f"unknown model {name!r}; served: {', '.join(sorted(self.models))}")
        if "tasks" in request:
            return self._invoke_tasks(name, model, request["tasks"])
        inputs = request.get("inputs")
        problem = _inputs_problem(inputs, "inputs", MAX_INPUTS_PER_REQUEST)
        if problem:
            raise RequestError(HTTPStatus.BAD_REQUEST, "validation_error", problem)
        try:
            with self._locks[name]:
                outputs = self._predict(model, inputs)
        except ModelInputError as exc:
            raise RequestError(HTTPStatus.BAD_REQUEST, "invalid_input", str(exc)) from None
        return {"model": name, "model_version": model.version, "result": model.result_for_task(outputs)}

    def _invoke_tasks(self, name: str, model, tasks) -> dict:
        if not isinstance(tasks, list) or not 1 <= len(tasks) <= MAX_TASKS_PER_BATCH:
            raise RequestError(HTTPStatus.BAD_REQUEST, "validation_error",
                               f"tasks must be a list of 1 to {MAX_TASKS_PER_BATCH} tasks")
        answers: list[dict | None] = [None] * len(tasks)
        runnable: list[tuple[int, str, list[str]]] = []
        for i, task in enumerate(tasks):
            task_id = task.get("task_id") if isinstance(task, dict) else None
            if not isinstance(task_id, str) or not task_id:
                raise RequestError(HTTPStatus.BAD_REQUEST, "validation_error",
                                   f"tasks[{i}] must be an object with a task_id string")
            # A bad task is that task's error, not the request's: the others still run.
            problem = _inputs_problem(task.get("inputs"), f"tasks[{i}].inputs", MAX_INPUTS_PER_TASK)
            if problem:
                answers[i] = {"task_id": task_id, "error": {"code": "validation_error", "message": problem}}
            else:
                runnable.append((i, task_id, task["inputs"]))
        total = sum(len(inputs) for _, _, inputs in runnable)
        if total > MAX_INPUTS_PER_REQUEST:
            raise RequestError(HTTPStatus.BAD_REQUEST, "validation_error",
                               f"the tasks hold {total} inputs; at most {MAX_INPUTS_PER_REQUEST} a request")

        def run(group: list[tuple[int, str, list[str]]]) -> list[dict]:
            outputs = self._predict(model, [text for _, _, inputs in group for text in inputs])
            answered, offset = [], 0
            for _, task_id, inputs in group:
                result = model.result_for_task(outputs[offset : offset + len(inputs)])
                answered.append({"task_id": task_id, "result": result})
                offset += len(inputs)
            return answered

        def failed(task: tuple[int, str, list[str]], exc: Exception) -> dict:
            if isinstance(exc, ModelInputError):
                return {"task_id": task[1], "error": {"code": "invalid_input", "message": str(exc)}}
            # Logged here in full; the caller gets no internals, as with a 500.
            log.error("the model failed on task %s", task[1], exc_info=exc)
            return {"task_id": task[1], "error": {"code": "model_error",
                                                   "message": f"the model failed on this task ({type(exc).__name__})"}}

        if runnable:
            with self._locks[name]:
                results = run_isolating(run, runnable, failed)
            for (i, _, _), answer in zip(runnable, results):
                answers[i] = answer
        return {"model": name, "model_version": model.version, "tasks": answers}


    def _predict(self, model, inputs: list[str]) -> list:
        limit = min(model.max_batch_size, self.max_batch_size or model.max_batch_size)
        outputs: list = []
        for start in range(0, len(inputs), limit):
            outputs += model.predict_batch(inputs[start : start + limit])
        # A short answer would shift every later task's outputs onto the wrong task.
        if len(outputs) != len(inputs):
            raise RuntimeError(f"model returned {len(outputs)} outputs for {len(inputs)} inputs")
        return outputs


def _inputs_problem(inputs, where: str, most: int) -> str | None:
    if not isinstance(inputs, list) or not 1 <= len(inputs) <= most:
        return f"{where} must be a list of 1 to {most} inputs"
    for i, text in enumerate(inputs):
        if not isinstance(text, str) or not 1 <= len(text) <= MAX_INPUT_CHARS:
            return f"{where}[{i}] must be a string of 1 to {MAX_INPUT_CHARS} characters"
    return None


def make_handler(endpoint: Endpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        # Keep-alive: SageMaker reuses connections to the container.
        protocol_version = "HTTP/1.1"

        def do_GET(self):
            if self.path.split("?")[0] == "/ping":
                self._send(HTTPStatus.OK, {"status": "ok", "models": sorted(endpoint.models)})
            else:
                self._error(HTTPStatus.NOT_FOUND, "not_found", f"no route {self.path}")

        def do_POST(self):
            if self.path.split("?")[0] != "/invocations":
                self._drain()
                return self._error(HTTPStatus.NOT_FOUND, "not_found", f"no route {self.path}")
            length = self.headers.get("Content-Length")
            if length is None or not length.isdigit():
                self.close_connection = True
                return self._error(HTTPStatus.LENGTH_REQUIRED, "length_required", "send a Content-Length")
            if int(length) > endpoint.max_payload_bytes:
                self.close_connection = True  # the unread body must not be parsed as the next request
                return self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, "payload_too_large",
                                   f"request body is over {endpoint.max_payload_bytes} bytes")
            body = self.rfile.read(int(length))
            try:
                self._send(HTTPStatus.OK, endpoint.invoke(body, self.headers.get("Content-Type")))
            except RequestError as err:
                self._error(err.status, err.code, err.message)
            except Exception:
                log.exception("invocation failed")
                self._error(HTTPStatus.INTERNAL_SERVER_ERROR, "model_error", "the model failed on this request")

        def _drain(self):
            length = self.headers.get("Content-Length", "0")
            if length.isdigit() and int(length) <= endpoint.max_payload_bytes:
                self.rfile.read(int(length))
            else:
                self.close_connection = True

        def _error(self, status: HTTPStatus, code: str, message: str):
            self._send(status, {"error": {"code": code, "message": message}})

        def _send(self, status: HTTPStatus, payload: dict):
            data = json.dumps(payload, separators=(",", ":")).encode()
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


def main() -> int:
    logging.basicConfig(
        level=os.environ.get("SLUICE_LOG_LEVEL", "INFO"),
        format="%(asctime)s %(levelname)s sagemaker[%(process)d] %(message)s",
        stream=sys.stderr,
    )
    endpoint = load_endpoint(Settings())
    # SageMaker requires 0.0.0.0:8080; multi-container endpoints pass the port.
    server = make_server(endpoint, "0.0.0.0", int(os.environ.get("SAGEMAKER_BIND_TO_PORT", "8080")))
    # shutdown() blocks until serve_forever() returns, so it runs off the signal handler's thread.
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown, daemon=True).start())
    log.info("serving %s on port %d", ", ".join(endpoint.models), server.server_address[1])
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
