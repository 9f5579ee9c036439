"""What the reliability scenarios share: a stack of real processes, an HTTP
client, a view of the emulator that bypasses the service, a cuttable TCP proxy,
and the ledger that counts submitted / succeeded / failed / lost / duplicated.

Every wait is a poll against a deadline; nothing sleeps in place of an event.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import socket
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import boto3
from botocore.config import Config

from onprem.embedded import Stack, free_port, wait_http
from sluice.adapters.task_store import TaskStore, from_item
from sluice.contract import Priority, TaskRecord
from sluice.settings import Settings

# Every input a scenario sends carries this marker, and every key it creates is
# remembered, so the log check can prove that neither reaches a log.
CANARY = f"canary{secrets.token_hex(6)}"
SECRETS: set[str] = set()
LOG_DIRS: list[Path] = []

SYNTHETIC_ENV = {
    "SLUICE_MODELS": "synthetic",
    "SLUICE_SYNTHETIC_FAULTS": "1",  # the poison inputs' markers
    "SLUICE_ACCESS_LOG": "0",
    # Small, so that a message a killed worker held comes back within seconds.
    # bootstrap gives the queues this visibility timeout too.
    "SLUICE_VISIBILITY_TIMEOUT_S": "5",
    "SLUICE_KEY_CACHE_S": "2",
}


def wait_until(predicate, timeout_s: float, what: str, every_s: float = 0.25, state=None):
    """Poll `predicate` until it returns something truthy; fail naming `what`
    (and, if given, what `state()` says then)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}"
                                 + (f"; state: {state()}" if state else ""))
        time.sleep(every_s)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


# --------------------------------------------------------------------- HTTP
@dataclass
class Reply:
    status: int
    body: dict | None
    text: str
    headers: dict[str, str]


class Client:
    """A stdlib HTTP client, as a user's script would have."""

    def __init__(self, url: str, key: str):
        self.url, self.key = url, key

    def call(self, method: str, path: str, body=None, key: str | None = None, headers: dict | None = None,
             raw: bytes | None = None, timeout_s: float = 30) -> Reply:
        data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
        hdrs = {"content-type": "application/json", "x-api-key": key if key is not None else self.key}
        hdrs.update(headers or {})
        request = urllib.request.Request(self.url + path, method=method, data=data, headers=hdrs)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as r:
                return _reply(r.status, r.read(), r.headers)
        except urllib.error.HTTPError as err:
            return _reply(err.code, err.read(), err.headers)

    def submit(self, inputs: list[str], model: str = "synthetic", priority: str = "normal", key: str | None = None,
               idempotency_key: str | None = None, **extra) -> Reply:
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self.call("POST", "/v1/tasks", {"model": model, "inputs": inputs, "priority": priority, **extra},
                         key=key, headers=headers)

    def submit_many(self, texts: list[str], priority: str = "normal", model: str = "synthetic") -> list[str]:
        """One task per text, through the batch endpoint (100 a call)."""
        ids: list[str] = []
        for i in range(0, len(texts), 100):
            tasks = [{"model": model, "inputs": [t], "priority": priority} for t in texts[i:i + 100]]
            reply = self.call("POST", "/v1/tasks/batch", {"tasks": tasks})
            assert reply.status == 202, (reply.status, reply.text[:300])
            ids += [t["task_id"] for t in reply.body["tasks"]]
        return ids


def _reply(status: int, raw: bytes, headers) -> Reply:
    text = raw.decode(errors="replace")
    try:
        body = json.loads(text) if text else None
    except ValueError:
        body = None
    return Reply(status, body, text, {k.lower(): v for k, v in (headers or {}).items()})


# ----------------------------------------------------------------- emulator
class Inspector:
    """Reads and pokes the stack's queues and table directly, bypassing the
    service (and any proxy in front of the emulator)."""

    def __init__(self, emulator_port: int, prefix: str = "sluice", table: str = "sluice-tasks"):
        cfg = Config(region_name="us-east-1", retries={"mode": "standard", "max_attempts": 3})
        kw = dict(endpoint_url=f"http://127.0.0.1:{emulator_port}", aws_access_key_id="embedded",
                  aws_secret_access_key="embedded", config=cfg)
        self.sqs = boto3.client("sqs", **kw)
        self.ddb = boto3.client("dynamodb", **kw)
        self.prefix, self.table = prefix, table
        self.store = TaskStore(Settings(tasks_table=table), ddb=self.ddb)
        self._urls: dict[str, str] = {}

    def queue_url(self, priority: Priority | str, dlq: bool = False) -> str:
        name = f"{self.prefix}-{Priority(priority).value}{'-dlq' if dlq else ''}"
        if name not in self._urls:
            self._urls[name] = self.sqs.get_queue_url(QueueName=name)["QueueUrl"]
        return self._urls[name]

    def records(self, task_ids) -> dict[str, TaskRecord]:
        return self.store.get_many(task_ids)

    def statuses(self, task_ids) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.records(task_ids).values():
            counts[r.status.value] = counts.get(r.status.value, 0) + 1
        return counts

    def count_records(self) -> int:
        return self.ddb.scan(TableName=self.table, Select="COUNT")["Count"]

    def all_records(self) -> list[TaskRecord]:
        items, kwargs = [], {}
        while True:
            page = self.ddb.scan(TableName=self.table, **kwargs)
            items += page["Items"]
            if "LastEvaluatedKey" not in page:
                return [from_item(i) for i in items]
            kwargs["ExclusiveStartKey"] = page["LastEvaluatedKey"]

    def depth(self, priority: Priority | str, dlq: bool = False) -> tuple[int, int]:
        """(visible, in flight) messages."""
        attrs = self.sqs.get_queue_attributes(
            QueueUrl=self.queue_url(priority, dlq),
            AttributeNames=["ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible"])["Attributes"]
        return int(attrs["ApproximateNumberOfMessages"]), int(attrs["ApproximateNumberOfMessagesNotVisible"])

    def drained(self) -> bool:
        return all(self.depth(p) == (0, 0) for p in Priority)

    def peek_dlq(self, priority: Priority | str) -> list[dict]:
        seen: dict[str, dict] = {}
        while True:
            response = self.sqs.receive_message(QueueUrl=self.queue_url(priority, dlq=True), MaxNumberOfMessages=10,
                                                VisibilityTimeout=0, WaitTimeSeconds=0)
            fresh = [m for m in response.get("Messages", []) if m["MessageId"] not in seen]
            if not fresh:
                return list(seen.values())
            seen.update({m["MessageId"]: m for m in fresh})

    def send_raw(self, priority: Priority | str, body: str) -> None:
        self.sqs.send_message(QueueUrl=self.queue_url(priority), MessageBody=body)


# -------------------------------------------------------------------- ledger
FINAL_FIELDS = ("status", "finished_at", "result_json", "result_key", "error_code", "error_message", "attempts")


@dataclass
class Ledger:
    """What a scenario submitted and what became of it."""

    name: str
    inspector: Inspector
    submitted: list[str] = field(default_factory=list)
    intended_failures: dict[str, str] = field(default_factory=dict)  # task id -> the final status intended
    first_final: dict[str, dict] = field(default_factory=dict)

    def add(self, task_ids, intended: str | None = None) -> None:
        task_ids = list(task_ids)
        self.submitted += task_ids
        if intended:
            self.intended_failures.update({t: intended for t in task_ids})

    def settle(self, timeout_s: float) -> dict[str, TaskRecord]:
        """Wait until every task is final; remember what each looked like then."""
        deadline = time.monotonic() + timeout_s
        while True:
            records = self.inspector.records(self.submitted)
            for task_id, r in records.items():
                if r.status.is_terminal and task_id not in self.first_final:
                    self.first_final[task_id] = _final(r)
            if len(self.first_final) == len(set(self.submitted)) or time.monotonic() >= deadline:
                return records
            time.sleep(0.5)  # moto serves every process: poll gently

    def report(self, records: dict[str, TaskRecord] | None = None, drain_timeout_s: float = 30,
               extra_lost: int = 0) -> dict[str, int]:
        """Print the scenario's line and return its figures. A task is lost if it
        is missing, not final, or final in another status than intended; it is
        duplicated if its id was handed out twice or its final record changed
        after it first became final (written twice, or run again)."""
        if records is None:
            records = self.settle(0)
        # Leftover deliveries (duplicates, redeliveries) are consumed before the
        # final records are compared, so a late overwrite would show.
        wait_until(self.inspector.drained, drain_timeout_s, f"{self.name}: queues to drain")
        again = self.inspector.records(self.submitted)
        unique = set(self.submitted)
        succeeded = failed_as_intended = lost = 0
        for task_id in unique:
            r = again.get(task_id)
            intended = self.intended_failures.get(task_id, "succeeded")
            if r is None or not r.status.is_terminal or r.status.value != intended:
                lost += 1
            elif intended == "succeeded":
                succeeded += 1
            else:
                failed_as_intended += 1
        lost += extra_lost
        duplicated = len(self.submitted) - len(unique)
        duplicated += sum(1 for t, snap in self.first_final.items() if t in again and _final(again[t]) != snap)
        figures = dict(submitted=len(self.submitted), succeeded=succeeded, failed_as_intended=failed_as_intended,
                       lost=lost, duplicated=duplicated)
        print(f"\nscenario={self.name} " + " ".join(f"{k}={v}" for k, v in figures.items()), flush=True)
        _record_figures(self.name, figures)
        return figures

    def lost_examples(self, n: int = 5) -> list[tuple[str, str]]:
        again = self.inspector.records(self.submitted)
        out = []
        for t in self.submitted:
            r = again.get(t)
            want = self.intended_failures.get(t, "succeeded")
            if r is None or r.status.value != want:
                out.append((t, r.status.value if r else "missing"))
        return out[:n]


def _final(r: TaskRecord) -> dict:
    return {f: getattr(r, f) for f in FINAL_FIELDS}


def _record_figures(name: str, figures: dict) -> None:
    """Append to a JSON-lines file when asked (docs/reliability.md quotes it)."""
    path = os.environ.get("SLUICE_RELIABILITY_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": name, **figures, "at": int(time.time())}) + "\n")


# ------------------------------------------------------------------- proxy
class TcpProxy:
    """A TCP relay in front of the emulator that can be cut and restored, or
    stalled and resumed. Cutting resets every open connection and every new
    one, the way a network partition or a crashed endpoint looks to a client;
    stalling accepts connections and holds every byte until resumed, the way a
    hung process looks (its requests then land late). The emulator keeps its
    state, so the scenario can check what was (not) written."""

    def __init__(self, target_port: int):
        self.target = ("127.0.0.1", target_port)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.up = threading.Event()
        self.up.set()
        self.flowing = threading.Event()
        self.flowing.set()
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            if not self.up.is_set():
                _reset(client)
                continue
            threading.Thread(target=self._open, args=(client,), daemon=True).start()

    def _open(self, client: socket.socket) -> None:
        self.flowing.wait()
        try:
            upstream = socket.create_connection(self.target, timeout=2)
            upstream.settimeout(None)
        except OSError:
            _reset(client)
            return
        with self._lock:
            self._conns.update((client, upstream))
        for a, b in ((client, upstream), (upstream, client)):
            threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with self._lock:
                    self._conns.discard(s)
                _reset(s)

    def cut(self) -> None:
        self.up.clear()
        with self._lock:
            conns, self._conns = list(self._conns), set()
        for s in conns:
            _reset(s)

    def restore(self) -> None:
        self.up.set()

    def stall(self) -> None:
        self.flowing.clear()

    def resume(self) -> None:
        self.flowing.set()

    def close(self) -> None:
        self._closed = True
        self.resume()
        self.cut()
        self.server.close()


def _reset(s: socket.socket) -> None:
    with contextlib.suppress(OSError):
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    with contextlib.suppress(OSError):
        s.shutdown(socket.SHUT_RDWR)
    with contextlib.suppress(OSError):
        s.close()


# -------------------------------------------------------------------- stack
@dataclass
class Running:
    stack: Stack
    client: Client
    inspector: Inspector
    tenant: str
    proxy: TcpProxy | None = None

    def new_key(self, tenant: str) -> str:
        key = self.stack.create_key(tenant)
        SECRETS.add(key)
        return key


@contextlib.contextmanager
def running_stack(log_dir: Path, workers: int = 2, env: dict[str, str] | None = None, proxy: bool = False,
                  tenant: str = "rel"):
    """The embedded stack as real processes: moto, the API, `workers` workers.
    With proxy=True every service process reaches moto through a TcpProxy."""
    # SQS and DynamoDB on moto, whatever SLUICE_EMBEDDED_SQS and _DDB say: one
    # emulator behind the proxy, one endpoint for the Inspector.
    stack = Stack(api_port=free_port(), workers=0, log_dir=log_dir, sqs="moto", ddb="moto",
                  env_overrides={**SYNTHETIC_ENV, **(env or {})})
    LOG_DIRS.append(log_dir)
    relay = None
    try:
        stack.start_emulator()
        moto_port = stack.emulator_port
        if proxy:
            relay = TcpProxy(moto_port)
            stack.emulator_port = relay.port
        stack.bootstrap()
        stack.start_api()
        for i in range(workers):
            stack.start_worker(i)
        wait_http(f"{stack.url}/ready", 30)
        for i in range(workers):
            wait_worker_ready(stack, i)
        key = stack.create_key(tenant)
        SECRETS.add(key)
        yield Running(stack, Client(stack.url, key), Inspector(moto_port), tenant, relay)
    finally:
        stack.stop()
        if relay:
            relay.close()


def wait_worker_ready(stack: Stack, index: int, timeout_s: float = 60) -> None:
    """Until worker-<index> (the process running now under that name) says it is ready."""
    proc = stack.procs[f"worker-{index}"]
    log = stack.log_dir / f"worker-{index}.log"

    def ready() -> bool:
        assert proc.poll() is None, f"worker-{index} exited with {proc.returncode}"
        return any(f"worker[{proc.pid}]" in line and "worker ready" in line
                   for line in log.read_text(errors="replace").splitlines())

    wait_until(ready, timeout_s, f"worker-{index} to be ready")
