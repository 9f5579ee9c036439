"""The embedded profile: the whole service on one machine, no Docker.

Starts moto server (the AWS emulator) on 127.0.0.1, optionally with LocalStack
core for SQS (SLUICE_EMBEDDED_SQS=localstack) and dynalite for DynamoDB
(SLUICE_EMBEDDED_DDB=dynalite); `make run` uses both when `make install` built
them (docs/benchmarks.md has the figures behind each). Creates queues, tables and
the bucket, registers a demo API key, then runs the API and the workers with
the same entrypoints the container images use (containers/*/main.py), as
processes. Ctrl-C, SIGTERM or SIGHUP (its terminal closed) stops workers first
(they finish their batch), then the API, then the emulator: the children run in
sessions of their own, so nothing else would stop them. A worker that exits is
restarted after a delay that doubles with each exit in a row (1 s, 2 s, ... 30 s);
one that exits WORKER_RESTART_LIMIT times in a row without becoming ready ends
the launcher with an error, rather than restarting forever.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STATE_DIR = Path(os.environ.get("SLUICE_STATE_DIR", ROOT / ".sluice"))
STATE_FILE = STATE_DIR / "embedded.json"

# A worker that exits is started again after WORKER_BACKOFF_S, doubled for each
# exit in a row, at most WORKER_BACKOFF_MAX_S. One that became ready (its log
# says so, or it ran WORKER_READY_AFTER_S) starts a new row. After
# WORKER_RESTART_LIMIT exits in a row the launcher gives up: the cause is in the
# worker's log, and restarting cannot fix it.
WORKER_RESTART_LIMIT = 5
WORKER_BACKOFF_S = 1.0
WORKER_BACKOFF_MAX_S = 30.0
WORKER_READY_AFTER_S = 60.0
WORKER_READY_LINE = b"worker ready"


def say(*args, **kwargs) -> None:
    """print(), except that a closed terminal (SIGHUP: writes fail with EIO) or a
    closed pipe must not keep the launcher from stopping its children."""
    try:
        print(*args, **kwargs, flush=True)
    except (OSError, ValueError):
        pass


def port_in_use(host: str, port: int) -> bool:
    """Whether a server could not listen on host:port now. SO_REUSEADDR, as
    uvicorn sets it: a closed connection's TIME_WAIT does not count."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class PortInUse(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, ok=(200,), alive: subprocess.Popen | None = None) -> None:
    """Poll until the URL answers; gives up early if `alive` (the server) has exited."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if alive is not None and alive.poll() is not None:
            raise RuntimeError(f"the process serving {url} exited with {alive.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status in ok:
                    return
        except Exception as exc:  # not up yet
            last = exc
        time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s ({last})")


def emulator_env(port: int, sqs_url: str | None = None, ddb_url: str | None = None) -> dict[str, str]:
    env = {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "embedded",
        "AWS_SECRET_ACCESS_KEY": "embedded",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    if sqs_url:
        env["AWS_ENDPOINT_URL_SQS"] = sqs_url
    if ddb_url:
        env["AWS_ENDPOINT_URL_DYNAMODB"] = ddb_url
    return env


LOCALSTACK_PYTHON = ROOT / ".venv-localstack" / "bin" / "python"
LOCALSTACK_CATALOG = ROOT / ".venv-localstack" / "filesystem" / "usr" / "lib" / "localstack"
DYNALITE = ROOT / "onprem" / "dynalite" / "node_modules" / ".bin" / "dynalite"


def default_sqs() -> str:
    """What `make run` uses: LocalStack when make install built it. moto's SQS
    slows as a queue grows and halved end-to-end throughput (docs/benchmarks.md)."""
    return os.environ.get("SLUICE_EMBEDDED_SQS") or ("localstack" if LOCALSTACK_PYTHON.exists() else "moto")


def default_ddb() -> str:
    """What `make run` uses: dynalite when make install built it (it needs npm).
    moto's DynamoDB costs 4-17x more CPU per call (docs/benchmarks.md)."""
    return os.environ.get("SLUICE_EMBEDDED_DDB") or ("dynalite" if DYNALITE.exists() else "moto")


def localstack_env(port: int, data_dir: Path) -> dict[str, str]:
    """LocalStack core in host mode (no Docker, no auth token), SQS only, loopback only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SLUICE_"))}
    env.update({
        "OVERRIDE_IN_DOCKER": "0",
        "GATEWAY_SERVER": "hypercorn",  # the default server ignores GATEWAY_LISTEN and binds 0.0.0.0
        "GATEWAY_LISTEN": f"127.0.0.1:{port}",
        "LOCALSTACK_HOST": f"127.0.0.1:{port}",
        "SERVICES": "sqs",
        "SQS_ENDPOINT_STRATEGY": "off",
        "DNS_ADDRESS": "0",
        "DISABLE_EVENTS": "1",
        # No log line per request: 5% of its CPU per SQS call (docs/benchmarks.md).
        "LS_LOG": "warn",
        "SKIP_SSL_CERT_DOWNLOAD": "1",
        "FILESYSTEM_ROOT": str(data_dir),
        "LOCALSTACK_VOLUME_DIR": str(data_dir),
    })
    return env


def localstack_command(port: int, data_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The command and environment of a LocalStack SQS server on 127.0.0.1:port,
    its state under data_dir; shared by the embedded profile and tests/onprem."""
    if not LOCALSTACK_PYTHON.exists():
        raise RuntimeError(f"{LOCALSTACK_PYTHON} is missing: `make install` creates it")
    # The service catalog `make install` builds: without it a fresh LocalStack
    # spends ~10 s building one on its first request.
    static_libs = data_dir / "usr" / "lib" / "localstack"
    static_libs.mkdir(parents=True, exist_ok=True)
    for catalog in LOCALSTACK_CATALOG.glob("service-catalog-*"):
        shutil.copy(catalog, static_libs)
    return [str(LOCALSTACK_PYTHON), "-m", "localstack.runtime.main"], localstack_env(port, data_dir)


@dataclass
class Stack:
    """Processes of one embedded stack; also used by the e2e and reliability tests."""

    api_port: int
    workers: int = 2
    emulator_port: int = 0
    # "moto" or "localstack": moto's SQS slows as a queue grows, LocalStack's stays
    # flat (docs/benchmarks.md); DynamoDB and S3 stay on moto either way.
    sqs: str = field(default_factory=lambda: os.environ.get("SLUICE_EMBEDDED_SQS", "moto"))
    sqs_port: int = 0
    # "moto" or "dynalite" for DynamoDB; S3 stays on moto.
    ddb: str = field(default_factory=lambda: os.environ.get("SLUICE_EMBEDDED_DDB", "moto"))
    ddb_port: int = 0
    env_overrides: dict[str, str] = field(default_factory=dict)
    log_dir: Path = STATE_DIR / "logs"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    # Per process: where its log stood when it was started, and when, so that
    # only what this run of it wrote counts (the logs are appended to).
    spawned: dict[str, tuple[int, float]] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_ENDPOINT_URL")}
        env.update(emulator_env(self.emulator_port, self.sqs_url, self.ddb_url))
        env.setdefault("SLUICE_TORCH_THREADS", str(max(1, (os.cpu_count() or 2) // max(1, self.workers))))
        env["PYTHONUNBUFFERED"] = "1"
        env["SLUICE_PORT"] = str(self.api_port)
        env.update(self.env_overrides)
        return env

    @property
    def sqs_url(self) -> str | None:
        return f"http://127.0.0.1:{self.sqs_port}" if self.sqs == "localstack" and self.sqs_port else None

    @property
    def ddb_url(self) -> str | None:
        return f"http://127.0.0.1:{self.ddb_port}" if self.ddb == "dynalite" and self.ddb_port else None

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as log:
            offset = log.tell()
            # Own session: Ctrl-C in the terminal, or the terminal closing, reaches
            # the launcher only, which then stops each child in order.
            proc = subprocess.Popen(args, env=env or self.env(), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True)
        self.procs[name] = proc
        self.spawned[name] = (offset, time.monotonic())
        return proc

    def log_since_start(self, name: str) -> bytes:
        offset, _ = self.spawned.get(name, (0, 0.0))
        try:
            with open(self.log_dir / f"{name}.log", "rb") as log:
                log.seek(offset)
                return log.read()
        except OSError:
            return b""

    def became_ready(self, name: str) -> bool:
        """Whether this run of a worker got as far as serving: its ready line, or
        (a log level above INFO hides the line) a run of WORKER_READY_AFTER_S."""
        _, started = self.spawned.get(name, (0, time.monotonic()))
        return WORKER_READY_LINE in self.log_since_start(name) or time.monotonic() - started >= WORKER_READY_AFTER_S

    @property
    def api_host(self) -> str:
        return self.env().get("SLUICE_HOST", "127.0.0.1")

    def check_api_port(self) -> None:
        if port_in_use(self.api_host, self.api_port):
            raise PortInUse(f"port {self.api_port} on {self.api_host} is already in use (another `make run`?): "
                            f"stop what listens there, or choose another port with --port N or SLUICE_PORT=N")

    def start_emulator(self) -> None:
        self.emulator_port = self.emulator_port or free_port()
        if os.environ.get("SLUICE_EMBEDDED_MOTO") == "stock":  # the plain server, for comparisons
            command = [str(Path(sys.executable).with_name("moto_server"))]
        else:
            command = [sys.executable, "-m", "onprem.moto_server"]
        proc = self._spawn("emulator", [*command, "-H", "127.0.0.1", "-p", str(self.emulator_port)])
        sqs = self.start_localstack() if self.sqs == "localstack" else None
        ddb = self.start_dynalite() if self.ddb == "dynalite" else None
        wait_http(f"http://127.0.0.1:{self.emulator_port}/moto-api/", 30, alive=proc)
        if sqs is not None:
            wait_http(f"{self.sqs_url}/_localstack/health", 60, alive=sqs)
        if ddb is not None:
            wait_http(f"{self.ddb_url}/", 30, alive=ddb)  # "healthy: dynamodb..." once it listens

    def start_dynalite(self) -> subprocess.Popen:
        self.ddb_port = self.ddb_port or free_port()
        # In memory; tables are ACTIVE at once instead of after 500 ms.
        return self._spawn("ddb", [str(DYNALITE), "--host", "127.0.0.1", "--port", str(self.ddb_port),
                                   "--createTableMs", "0"])

    def start_localstack(self) -> subprocess.Popen:
        self.sqs_port = self.sqs_port or free_port()
        args, env = localstack_command(self.sqs_port, self.log_dir / "localstack-data")
        return self._spawn("sqs", args, env=env)

    def bootstrap(self) -> None:
        saved = dict(os.environ)
        os.environ.update(self.env())
        try:
            from sluice.bootstrap import ensure_resources
            from sluice.settings import Settings

            ensure_resources(Settings())
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def create_key(self, tenant: str, key: str | None = None) -> str:
        saved = dict(os.environ)
        os.environ.update(self.env())
        try:
            from sluice.adapters.api_keys import ApiKeys
            from sluice.settings import Settings

            return ApiKeys(Settings()).create(tenant, key)[0]
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def start_api(self) -> None:
        self.check_api_port()  # again: the emulator's start left time for another server to take it
        proc = self._spawn("api", [sys.executable, "containers/api/main.py"])
        wait_http(f"{self.url}/health", 60, alive=proc)
        self.check_alive("api")

    def check_alive(self, name: str) -> None:
        """An answer on the API's port proves little if the API itself has exited:
        another server may hold the port."""
        proc = self.procs[name]
        if proc.poll() is not None:
            tail = self.log_since_start(name).decode(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"{name} exited with {proc.returncode} although {self.url} answers "
                               f"(another server on port {self.api_port}?): {' | '.join(tail)}")

    def start_worker(self, index: int) -> subprocess.Popen:
        return self._spawn(f"worker-{index}", [sys.executable, "containers/worker/main.py"])

    def start(self) -> None:
        self.check_api_port()  # before anything is started
        self.start_emulator()
        self.bootstrap()
        self.start_api()
        for i in range(self.workers):
            self.start_worker(i)
        wait_http(f"{self.url}/ready", 30, alive=self.procs["api"])
        self.check_alive("api")

    def stop_process(self, name: str, timeout_s: float = 30) -> int | None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait()

    def stop(self) -> None:
        workers = [n for n in self.procs if n.startswith("worker")]
        for name in workers:  # all at once: each finishes its own batch
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name in workers:
            self.stop_process(name)
        self.stop_process("api")
        self.stop_process("emulator", timeout_s=10)
        self.stop_process("sqs", timeout_s=15)
        self.stop_process("ddb", timeout_s=10)

    def write_state(self, api_key: str) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"url": self.url, "api_key": api_key, "env": emulator_env(self.emulator_port, self.sqs_url, self.ddb_url), "pid": os.getpid()}
        STATE_FILE.write_text(json.dumps(state, indent=2))
        STATE_FILE.chmod(0o600)


@dataclass
class _Restarts:
    exits: int = 0  # in a row, without becoming ready in between
    due: float | None = None  # when the next start is due, while one is pending


def supervise(stack: Stack, should_stop: Callable[[], bool], restart_limit: int = WORKER_RESTART_LIMIT,
              backoff_s: float = WORKER_BACKOFF_S, backoff_max_s: float = WORKER_BACKOFF_MAX_S,
              poll_s: float = 0.2) -> int:
    """Watch the stack's processes until should_stop(): restart exited workers with
    exponential backoff. Returns 0 when told to stop, 1 when the emulator or the API
    exits, or a worker exits restart_limit times in a row without becoming ready."""
    restarts: dict[str, _Restarts] = {}
    while not should_stop():
        now = time.monotonic()
        for name, proc in list(stack.procs.items()):
            if not name.startswith("worker"):
                if proc.poll() is not None:
                    say(f"{name} exited with {proc.returncode}; see {stack.log_dir}/{name}.log")
                    return 1
                continue
            state = restarts.setdefault(name, _Restarts())
            if state.due is not None:
                if now >= state.due:
                    state.due = None
                    stack.start_worker(int(name.split("-")[1]))
                continue
            if proc.poll() is None:
                continue
            if stack.became_ready(name):
                state.exits = 0
            state.exits += 1
            if state.exits >= restart_limit:
                say(f"{name} exited {state.exits} times in a row without becoming ready (last exit status "
                    f"{proc.returncode}); not restarting it again. Its log: {stack.log_dir}/{name}.log", file=sys.stderr)
                return 1
            delay = min(backoff_s * 2 ** (state.exits - 1), backoff_max_s)
            say(f"{name} exited with {proc.returncode}; restarting it in {delay:g}s")
            state.due = now + delay
        time.sleep(poll_s)
    return 0


def print_banner(stack: Stack, key: str) -> None:
    url = stack.url
    say(
        f"""
Sluice is running (embedded profile): API {url}, {stack.workers} workers, emulator on 127.0.0.1:{stack.emulator_port}{f", SQS: LocalStack on {stack.sqs_url}" if stack.sqs_url else ""}{f", DynamoDB: dynalite on {stack.ddb_url}" if stack.ddb_url else ""}
API docs: {url}/docs      logs: {stack.log_dir}/
Demo API key (tenant "demo"): {key}

  export SLUICE_API_KEY={key}
  curl -s -X POST {url}/v1/tasks -H "x-api-key: $SLUICE_API_KEY" -H 'content-type: application/json' \\
       -d '{{"model": "minilm-embed", "inputs": ["The cat sits on the mat."], "priority": "high"}}'
  curl -s {url}/v1/tasks/TASK_ID -H "x-api-key: $SLUICE_API_KEY"
  .venv/bin/sluice submit --wait "The cat sits on the mat."
  .venv/bin/sluice keys create --tenant team-a

Ctrl-C stops everything.
""",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=int(os.environ.get("SLUICE_PORT", "8000")))
    parser.add_argument("--workers", type=int, default=int(os.environ.get("SLUICE_WORKERS", "2")))
    args = parser.parse_args(argv)

    # Per-key rate limit on by default here (on AWS, usage plans do it);
    # SLUICE_RATE_LIMIT_PER_S=0 turns it off (docs/reliability.md).
    rate_limit = {"SLUICE_RATE_LIMIT_PER_S": os.environ.get("SLUICE_RATE_LIMIT_PER_S", "100")}
    stack = Stack(api_port=args.port, workers=args.workers, sqs=default_sqs(), ddb=default_ddb(),
                  env_overrides=rate_limit)
    stopping = False
    wrote_state = False

    def on_signal(*_):
        nonlocal stopping
        stopping = True

    # SIGHUP too: a closed terminal must not leave the emulator, API and workers
    # running, each in its own session, with nothing left to stop them.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    try:
        say(f"starting emulator, API on 127.0.0.1:{args.port} and {args.workers} workers ...")
        stack.start()
        key = stack.create_key("demo", os.environ.get("SLUICE_API_KEY") or None)
        stack.write_state(key)
        wrote_state = True
        if not stopping:
            print_banner(stack, key)
        return supervise(stack, lambda: stopping)
    except PortInUse as exc:
        say(f"start-up failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        say(f"start-up failed: {exc}; logs in {stack.log_dir}/", file=sys.stderr)
        return 1
    finally:
        say("stopping workers, API and emulator ...")
        stack.stop()
        if wrote_state:  # never another launcher's (the one holding the port, say)
            STATE_FILE.unlink(missing_ok=True)
        say("stopped.")


if __name__ == "__main__":
    sys.exit(main())
