"""The embedded profile: the whole service on one machine, no Docker.

Starts moto server (the AWS emulator) on 127.0.0.1, optionally with fauxqs or
LocalStack core for SQS (SLUICE_EMBEDDED_SQS=fauxqs|localstack) and dynalite for
DynamoDB (SLUICE_EMBEDDED_DDB=dynalite); `make run` uses fauxqs and dynalite
when `make install` built them (docs/benchmarks.md has the figures behind each). Creates queues, tables and
the bucket, registers a demo API key, then runs the API and the workers with
the same entrypoints the container images use (containers/*/main.py), as
processes. Ctrl-C, SIGTERM or SIGHUP (its terminal closed) stops workers first
(they finish their batch), then the API, then the emulator: the children run in
sessions of their own, so nothing else would stop them. The same during start-up
stops it at once; a second one kills every child without waiting out its grace.
On Linux, if the launcher itself dies (kill -9, the OOM killer), the API and the
workers get SIGTERM and the emulators SIGKILL, so none is left holding its port. A worker that exits is
restarted after a delay that doubles with each exit in a row (1 s, 2 s, ... 30 s);
one that exits WORKER_RESTART_LIMIT times in a row without becoming ready ends
the launcher with an error, rather than restarting forever.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import fcntl
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Unset or empty: the repository's .sluice/ (an empty value is not the current folder).
STATE_DIR = Path(os.environ.get("SLUICE_STATE_DIR") or ROOT / ".sluice")
STATE_FILE = STATE_DIR / "embedded.json"
# Held (flock) by the launcher using STATE_DIR while it runs: its logs, its
# LocalStack data and the state file the CLI reads are one launcher's only.
LOCK_FILE = STATE_DIR / "embedded.lock"

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
WORKER_STOP_GRACE_S = 30.0  # a worker finishing its batch at a stop, before SIGKILL


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


class StartupStopped(Exception):
    """A stop (Ctrl-C, SIGTERM, SIGHUP) came while the stack was starting: no failure."""


class RefusedSetting(ValueError):
    """A launcher setting refused in one line that names its variable: `SLUICE_X='value': why`."""


def int_from(low: int, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number within bounds, refused in argparse's one line."""
    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            bounds = f"from {low} to {high}" if high is not None else f"of {low} or more"
            raise argparse.ArgumentTypeError(f"{raw!r}: should be a whole number {bounds}")
        return value
    return parse


def env_int(name: str, default: int, low: int, high: int | None = None) -> int:
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        return int_from(low, high)(raw)
    except argparse.ArgumentTypeError as exc:
        raise RefusedSetting(f"{name}={exc}") from None


def env_choice(name: str, allowed: tuple[str, ...], default: str) -> str:
    """The variable's value, one of `allowed`; unset or empty: `default`. A typo
    must not quietly run another emulator than the one asked for."""
    return one_of(name, os.environ.get(name) or default, allowed)


def one_of(name: str, value: str, allowed: tuple[str, ...]) -> str:
    """`value`, refused in one line naming `name` unless it is one of `allowed`."""
    if value not in allowed:
        raise RefusedSetting(f"{name}={value!r}: should be one of {', '.join(allowed)}")
    return value


def demo_key() -> str | None:
    """SLUICE_API_KEY, if set: one the API can match (api_keys.carriable),
    refused before anything starts."""
    from sluice.adapters.api_keys import carriable

    key = os.environ.get("SLUICE_API_KEY") or None
    if key is not None and not carriable(key):
        raise RefusedSetting(f"SLUICE_API_KEY={key!r}: should be printable ASCII without spaces at either end")
    return key


SQS_EMULATORS = ("moto", "localstack", "fauxqs")
SQS_NAMES = {"moto": "moto", "localstack": "LocalStack", "fauxqs": "fauxqs"}
SQS_HEALTH = {"localstack": "/_localstack/health", "fauxqs": "/health"}  # of the servers apart from moto
DDB_EMULATORS = ("moto", "dynalite")

# prctl(2): the signal a process gets when the thread that forked it exits.
PR_SET_PDEATHSIG = 1
# What an emulator gets when the launcher dies: it holds nothing but memory,
# and LocalStack does not exit on SIGTERM while it answers a worker's long poll.
EMULATOR_DEATH_SIGNAL = signal.SIGKILL


def die_with_launcher(sig: int = signal.SIGTERM) -> Callable[[], None] | None:
    """On Linux, a preexec_fn that has the child sent `sig` when the launcher
    dies, however it dies: with kill -9 or the OOM killer no handler runs to stop
    the children, and each (in a session of its own) would keep running, holding
    its port against the next `make run`. The kernel ties the signal to the
    thread that forks, so this applies only to children spawned from the main
    thread, which lives as long as the process (the launcher spawns from no
    other); elsewhere, and off Linux, None."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    launcher = os.getpid()

    def preexec() -> None:
        prctl(ctypes.c_int(PR_SET_PDEATHSIG), ctypes.c_ulong(sig), ctypes.c_ulong(0),
              ctypes.c_ulong(0), ctypes.c_ulong(0))
        if os.getppid() != launcher:  # it died before prctl took hold: no signal will come
            os.kill(os.getpid(), sig)

    return preexec


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, ok=(200,), alive: subprocess.Popen | None = None,
              stop: Callable[[], bool] | None = None) -> None:
    """Poll until the URL answers; gives up early if `alive` (the server) has exited,
    and raises StartupStopped once `stop()` says a stop was asked (within a poll:
    at most 2 s against a server that accepts and never answers)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        if stop is not None and stop():
            raise StartupStopped(f"stopped while waiting for {url}")
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
FAUXQS = ROOT / "onprem" / "fauxqs" / "serve.mjs"
FAUXQS_MODULES = ROOT / "onprem" / "fauxqs" / "node_modules" / "fauxqs"


def default_sqs() -> str:
    """What `make run` uses: fauxqs when make install built it (it needs npm),
    else LocalStack. fauxqs costs a quarter of LocalStack's CPU per task;
    moto's SQS slows as a queue grows and halved end-to-end throughput
    (docs/benchmarks.md)."""
    if FAUXQS_MODULES.exists():
        fallback = "fauxqs"
    else:
        fallback = "localstack" if LOCALSTACK_PYTHON.exists() else "moto"
    return env_choice("SLUICE_EMBEDDED_SQS", SQS_EMULATORS, fallback)


def default_ddb() -> str:
    """What `make run` uses: dynalite when make install built it (it needs npm).
    moto's DynamoDB costs 4-17x more CPU per call (docs/benchmarks.md)."""
    return env_choice("SLUICE_EMBEDDED_DDB", DDB_EMULATORS, "dynalite" if DYNALITE.exists() else "moto")


def fauxqs_command(port: int) -> list[str]:
    """The command of a fauxqs SQS server on 127.0.0.1:port, in memory; shared
    by the embedded profile and the tests' fauxqs pass (tests/conftest.py)."""
    if not FAUXQS_MODULES.exists():
        raise RuntimeError(f"{FAUXQS_MODULES} is missing: `make install` installs it (it needs npm)")
    return ["node", str(FAUXQS), str(port)]


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
    # SQS on "moto", "localstack" or "fauxqs": moto's SQS slows as a queue grows,
    # the other two stay flat (docs/benchmarks.md). Unset, SLUICE_EMBEDDED_SQS or moto.
    sqs: str = field(default_factory=lambda: env_choice("SLUICE_EMBEDDED_SQS", SQS_EMULATORS, "moto"))
    sqs_port: int = 0
    # DynamoDB on "moto" or "dynalite"; unset, SLUICE_EMBEDDED_DDB or moto. S3 is
    # on moto whatever either says.
    ddb: str = field(default_factory=lambda: env_choice("SLUICE_EMBEDDED_DDB", DDB_EMULATORS, "moto"))
    ddb_port: int = 0
    env_overrides: dict[str, str] = field(default_factory=dict)
    log_dir: Path = STATE_DIR / "logs"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    # Per process: where its log stood when it was started, and when, so that
    # only what this run of it wrote counts (the logs are appended to).
    spawned: dict[str, tuple[int, float]] = field(default_factory=dict)
    # Whether a stop was asked: the start-up's waits end at once when it says so
    # (StartupStopped) instead of running out their time.
    stop_asked: Callable[[], bool] | None = None
    # Set by kill(): stop_process no longer gives a process its grace.
    killing: bool = False

    def __post_init__(self) -> None:  # values passed in, not read from the environment, are checked too
        one_of("SLUICE_EMBEDDED_SQS", self.sqs, SQS_EMULATORS)
        one_of("SLUICE_EMBEDDED_DDB", self.ddb, DDB_EMULATORS)

    def check_stop(self) -> None:
        if self.stop_asked is not None and self.stop_asked():
            raise StartupStopped("stopped during start-up")

    def wait(self, url: str, timeout_s: float, alive: subprocess.Popen) -> None:
        try:
            wait_http(url, timeout_s, alive=alive, stop=self.stop_asked)
        except RuntimeError as exc:  # it exited: the end of its log says why
            name = next((n for n, p in self.procs.items() if p is alive), None)
            raise RuntimeError(f"{exc}: {self.last_lines(name)}" if name else str(exc)) from None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    def env(self) -> dict[str, str]:
        from sluice.settings import OPERATOR_AWS_SETTINGS

        # The emulator's endpoints, region and keys, whatever the operator's AWS settings.
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("AWS_ENDPOINT_URL") and k not in OPERATOR_AWS_SETTINGS}
        env.update(emulator_env(self.emulator_port, self.sqs_url, self.ddb_url))
        env.setdefault("SLUICE_TORCH_THREADS", str(max(1, (os.cpu_count() or 2) // max(1, self.workers))))
        env["PYTHONUNBUFFERED"] = "1"
        env["SLUICE_PORT"] = str(self.api_port)
        env.update(self.env_overrides)
        return env

    @property
    def sqs_url(self) -> str | None:
        return f"http://127.0.0.1:{self.sqs_port}" if self.sqs != "moto" and self.sqs_port else None

    @property
    def ddb_url(self) -> str | None:
        return f"http://127.0.0.1:{self.ddb_port}" if self.ddb == "dynalite" and self.ddb_port else None

    def _spawn(self, name: str, args: list[str], env: dict[str, str] | None = None,
               on_launcher_death: int = signal.SIGTERM) -> subprocess.Popen:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with open(self.log_dir / f"{name}.log", "ab") as log:
            offset = log.tell()
            # Own session: Ctrl-C in the terminal, or the terminal closing, reaches
            # the launcher only, which then stops each child in order. And on
            # Linux, the launcher's death (kill -9 too) sends it `on_launcher_death`.
            proc = subprocess.Popen(args, env=env or self.env(), stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, cwd=ROOT, start_new_session=True,
                                    preexec_fn=die_with_launcher(on_launcher_death))
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
                            f"stop what listens there, or choose another port: SLUICE_PORT=N make run "
                            f"(or --port N)")

    def start_emulator(self) -> None:
        self.emulator_port = self.emulator_port or free_port()
        if os.environ.get("SLUICE_EMBEDDED_MOTO") == "stock":  # the plain server, for comparisons
            command = [str(Path(sys.executable).with_name("moto_server"))]
        else:
            command = [sys.executable, "-m", "onprem.moto_server"]
        proc = self._spawn("emulator", [*command, "-H", "127.0.0.1", "-p", str(self.emulator_port)],
                           on_launcher_death=EMULATOR_DEATH_SIGNAL)
        sqs = {"localstack": self.start_localstack, "fauxqs": self.start_fauxqs}.get(self.sqs, lambda: None)()
        ddb = self.start_dynalite() if self.ddb == "dynalite" else None
        self.wait(f"http://127.0.0.1:{self.emulator_port}/moto-api/", 30, alive=proc)
        if sqs is not None:
            self.wait(f"{self.sqs_url}{SQS_HEALTH[self.sqs]}", 60, alive=sqs)
        if ddb is not None:
            self.wait(f"{self.ddb_url}/", 30, alive=ddb)  # "healthy: dynamodb..." once it listens

    def start_dynalite(self) -> subprocess.Popen:
        self.ddb_port = self.ddb_port or free_port()
        # In memory; tables are ACTIVE at once instead of after 500 ms.
        return self._spawn("ddb", [str(DYNALITE), "--host", "127.0.0.1", "--port", str(self.ddb_port),
                                   "--createTableMs", "0"], on_launcher_death=EMULATOR_DEATH_SIGNAL)

    def start_fauxqs(self) -> subprocess.Popen:
        self.sqs_port = self.sqs_port or free_port()
        # In memory, like LocalStack here: make run's queues start empty.
        return self._spawn("sqs", fauxqs_command(self.sqs_port), on_launcher_death=EMULATOR_DEATH_SIGNAL)

    def start_localstack(self) -> subprocess.Popen:
        self.sqs_port = self.sqs_port or free_port()
        args, env = localstack_command(self.sqs_port, self.log_dir / "localstack-data")
        return self._spawn("sqs", args, env=env, on_launcher_death=EMULATOR_DEATH_SIGNAL)

    @contextlib.contextmanager
    def environ(self):
        """This process's environment as the stack's processes get it, for the
        calls the launcher makes itself; the operator's again after."""
        saved = dict(os.environ)
        os.environ.clear()
        os.environ.update(self.env())
        try:
            yield
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def bootstrap(self) -> None:
        with self.environ():
            from sluice.bootstrap import ensure_resources
            from sluice.settings import Settings

            ensure_resources(Settings())

    def create_key(self, tenant: str, key: str | None = None) -> str:
        with self.environ():
            from sluice.adapters.api_keys import ApiKeys
            from sluice.settings import Settings

            return ApiKeys(Settings()).create(tenant, key)[0]

    def start_api(self) -> None:
        self.check_api_port()  # again: the emulator's start left time for another server to take it
        proc = self._spawn("api", [sys.executable, "containers/api/main.py"])
        self.wait(f"{self.url}/health", 60, alive=proc)
        self.check_alive("api")

    def check_alive(self, name: str) -> None:
        """An answer on the API's port proves little if the API itself has exited:
        another server may hold the port."""
        proc = self.procs[name]
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited with {proc.returncode} although {self.url} answers "
                               f"(another server on port {self.api_port}?): {self.last_lines(name)}")

    def last_lines(self, name: str, n: int = 3) -> str:
        """The end of what this run of a process logged, on one line."""
        return " | ".join(self.log_since_start(name).decode(errors="replace").strip().splitlines()[-n:])

    def start_worker(self, index: int) -> subprocess.Popen:
        return self._spawn(f"worker-{index}", [sys.executable, "containers/worker/main.py"])

    def start(self) -> None:
        self.check_api_port()  # before anything is started
        self.start_emulator()
        self.check_stop()
        self.bootstrap()
        self.check_stop()
        self.start_api()
        for i in range(self.workers):
            self.check_stop()
            self.start_worker(i)
        self.wait(f"{self.url}/ready", 30, alive=self.procs["api"])
        self.check_alive("api")

    def kill(self) -> None:
        """SIGKILL to every process now, and to what each started in its session
        (it leads a process group): a second Ctrl-C, for a child that takes its
        time over SIGTERM. Safe in a signal handler: poll() gives up rather than
        wait for a lock that the interrupted code holds."""
        self.killing = True
        for proc in list(self.procs.values()):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except OSError:
                    proc.kill()

    def stop_process(self, name: str, timeout_s: float = 30) -> int | None:
        proc = self.procs.get(name)
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        if self.killing:
            proc.kill()
            return proc.wait()
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
        # One grace for them all, as they were told together: N stuck workers
        # must not hold the first Ctrl-C for N graces.
        deadline = time.monotonic() + WORKER_STOP_GRACE_S
        for name in workers:
            self.stop_process(name, timeout_s=max(0.0, deadline - time.monotonic()))
        self.stop_process("api")
        self.stop_process("emulator", timeout_s=10)
        self.stop_process("sqs", timeout_s=15)
        self.stop_process("ddb", timeout_s=10)

    def write_state(self, api_key: str) -> None:
        STATE_DIR.mkdir(parents=True, exist_ok=True)
        state = {"url": self.url, "api_key": api_key, "env": emulator_env(self.emulator_port, self.sqs_url, self.ddb_url), "pid": os.getpid()}
        # It holds the API key: 0600 from its creation, never readable by others
        # for a moment; written beside and renamed, so a reader never sees half.
        part = STATE_FILE.with_name(f".{STATE_FILE.name}.{os.getpid()}")
        part.unlink(missing_ok=True)
        with os.fdopen(os.open(part, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as out:
            out.write(json.dumps(state, indent=2))
        os.replace(part, STATE_FILE)


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


def served_models(stack: Stack) -> list[str]:
    """SLUICE_MODELS as the workers read it (sluice.settings; the same default)."""
    from sluice.settings import Settings, model_names_of

    raw = stack.env().get("SLUICE_MODELS") or Settings.model_fields["models"].default
    return model_names_of(raw) or ["minilm-embed"]


def print_banner(stack: Stack, key: str) -> None:
    url = stack.url
    model = served_models(stack)[0]
    cli_model = "" if model == "minilm-embed" else f" --model {model}"  # the CLI's default
    # The CLI finds the stack by its state file, in .sluice unless told otherwise.
    cli = ".venv/bin/sluice"
    if Path(STATE_DIR).resolve() != (ROOT / ".sluice").resolve():
        cli = f"SLUICE_STATE_DIR={shlex.quote(str(STATE_DIR))} {cli}"
    say(
        f"""
Sluice is running (embedded profile): API {url}, {stack.workers} workers, emulator on 127.0.0.1:{stack.emulator_port}{f", SQS: {SQS_NAMES[stack.sqs]} on {stack.sqs_url}" if stack.sqs_url else ""}{f", DynamoDB: dynalite on {stack.ddb_url}" if stack.ddb_url else ""}
API docs: {url}/docs      logs: {stack.log_dir}/
Demo API key (tenant "demo"): {key}

  export SLUICE_API_KEY={key}
  curl -s -X POST {url}/v1/tasks -H "x-api-key: $SLUICE_API_KEY" -H 'content-type: application/json' \\
       -d '{{"model": "{model}", "inputs": ["The cat sits on the mat."], "priority": "high"}}'
  curl -s {url}/v1/tasks/TASK_ID -H "x-api-key: $SLUICE_API_KEY"
  {cli} submit{cli_model} --wait "The cat sits on the mat."
  {cli} keys create --tenant team-a

Ctrl-C stops everything. A second Ctrl-C kills it all at once.
""",
    )


class StateDirInUse(RuntimeError):
    pass


def hold_state_dir() -> int:
    """Lock STATE_DIR for this launcher's lifetime (the lock goes with the
    process, a killed one's too; children do not inherit it). Another launcher
    on the same folder would mix its logs into this one's, replace the state
    file the CLI reads, and delete it on exit while this one still runs."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        try:
            running = json.loads(STATE_FILE.read_text()).get("url") or "starting"
        except (OSError, ValueError):
            running = "starting"
        raise StateDirInUse(
            f"another `make run` is using {STATE_DIR} (API: {running}): stop it first, or give this one a "
            f"folder and a port of its own: SLUICE_STATE_DIR=/tmp/sluice-2 SLUICE_PORT=8001 make run") from None
    return fd


def main(argv: list[str] | None = None) -> int:
    # SLUICE_PORT=80a or a misspelled emulator: one line naming the variable, as
    # sluice.settings words them, not a traceback.
    from sluice.settings import SettingsError, log_level

    try:
        port, workers = env_int("SLUICE_PORT", 8000, 1, 65535), env_int("SLUICE_WORKERS", 2, 0)
        sqs, ddb = default_sqs(), default_ddb()
        key = demo_key()
        log_level()  # the API and the workers would each exit on it, said only in their logs
    except (RefusedSetting, SettingsError) as exc:
        say(f"embedded: refused settings: {exc}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int_from(1, 65535), default=port,
                        help="the API's port (default: SLUICE_PORT, else 8000)")
    parser.add_argument("--workers", type=int_from(0), default=workers,
                        help="worker processes (default: SLUICE_WORKERS, else 2)")
    args = parser.parse_args(argv)
    try:
        hold_state_dir()  # released when this process ends
    except StateDirInUse as exc:
        say(f"start-up refused: {exc}", file=sys.stderr)
        return 1

    # Per-key rate limit on by default here (on AWS, usage plans do it);
    # SLUICE_RATE_LIMIT_PER_S=0 turns it off (docs/reliability.md).
    rate_limit = {"SLUICE_RATE_LIMIT_PER_S": os.environ.get("SLUICE_RATE_LIMIT_PER_S", "100")}
    signals = 0
    stack = Stack(api_port=args.port, workers=args.workers, sqs=sqs, ddb=ddb, env_overrides=rate_limit,
                  stop_asked=lambda: signals > 0)
    wrote_state = False

    def on_signal(*_):
        nonlocal signals
        signals += 1
        if signals > 1:  # the second: no more grace for anyone
            stack.kill()

    # SIGHUP too: a closed terminal must not leave the emulator, API and workers
    # running, each in its own session, with nothing left to stop them.
    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, on_signal)
    try:
        say(f"starting emulator, API on 127.0.0.1:{args.port} and {args.workers} workers ...")
        stack.start()
        key = stack.create_key("demo", key)
        stack.write_state(key)
        wrote_state = True
        if not signals:
            print_banner(stack, key)
        return supervise(stack, lambda: signals > 0)
    except StartupStopped:
        return 0  # as supervise() returns when told to stop
    except PortInUse as exc:
        say(f"start-up failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if signals:  # a child killed by the second signal, say: the stop's doing, not a failure
            return 0
        say(f"start-up failed: {exc}; logs in {stack.log_dir}/", file=sys.stderr)
        return 1
    finally:
        if stack.procs:  # not when the port check refused before anything started
            say("stopping workers, API and emulator (Ctrl-C again to kill them at once) ...")
            stack.stop()
            say("killed." if stack.killing else "stopped.")
        if wrote_state:  # never another launcher's (the one holding the port, say)
            STATE_FILE.unlink(missing_ok=True)


if __name__ == "__main__":
    sys.exit(main())
