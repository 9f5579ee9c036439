"""Shared pieces of the benchmarks: emulators, percentiles, the load generator,
result files. Every benchmark talks to 127.0.0.1 only and is bounded in time."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# SLUICE_BENCH_RESULTS: another folder for the results (on the GPU machine, $OUT).
RESULTS = Path(os.environ.get("SLUICE_BENCH_RESULTS") or ROOT / "bench" / "results")
sys.path.insert(0, str(ROOT))

from onprem.embedded import Stack, default_ddb, default_sqs, free_port  # noqa: E402

SENTENCES = [
    "The cat sits on the mat.",
    "A quick brown fox jumps over the lazy dog.",
    "Stock markets rallied after the central bank held rates.",
    "How do I reset my password?",
    "The weather in Lisbon is sunny and warm today.",
    "She plays the violin in a small orchestra.",
    "Our servers process millions of requests every day.",
    "Fresh bread smells wonderful in the morning.",
]


def sentence(i: int) -> str:
    # Distinct texts of the same length class (~10-14 tokens): no cache can help anyone.
    return f"{SENTENCES[i % len(SENTENCES)]} ({i})"


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))
    return ordered[k]


def lat_summary(seconds: list[float]) -> dict:
    ms = [s * 1000 for s in seconds]
    return {"n": len(ms), "p50_ms": round(pct(ms, 50), 2), "p90_ms": round(pct(ms, 90), 2),
            "p99_ms": round(pct(ms, 99), 2), "mean_ms": round(sum(ms) / max(1, len(ms)), 2)}


def command_line() -> str:
    return " ".join(shlex.quote(a) for a in [".venv/bin/python", "-m", "bench"] + sys.argv[1:])


def machine() -> dict:
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    import torch

    return {"cores": os.cpu_count(), "cpu": cpu, "python": platform.python_version(), "torch": torch.__version__,
            "commit": _commit()}


def _commit() -> str | None:
    """The checkout measured: its commit, marked when the tree has changes."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None  # not a git checkout (the GPU kit's copy may not be)
    return head + ("+changes" if dirty else "")


def save(name: str, data: dict) -> Path:
    folder = RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    data = {"benchmark": name, "at": time.strftime("%Y-%m-%dT%H:%M:%S"), **data}
    path = folder / f"{name}.json"
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)  # a run killed mid-write leaves the previous file whole
    return path


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class BenchProblems(RuntimeError):
    """Raised by a benchmark after it saved its result, when some figure in it
    is not a clean measurement (a drain cut off, a peer that failed, errors):
    `python -m bench` then lists the benchmark as failed and exits non-zero."""


def flag(results: dict, problem: str) -> None:
    """Record a problem in the result (its "problems" list) and say it loudly."""
    results.setdefault("problems", []).append(problem)
    log(f"!!! PROBLEM: {problem}")


def raise_if_flagged(name: str, results: dict) -> None:
    if results.get("problems"):
        raise BenchProblems(f"{name}: {len(results['problems'])} problem(s), saved in its result: "
                            + "; ".join(results["problems"]))


def keep_logs(log_dir: Path, dest: str, header: str, tail_lines: int = 200) -> Path | None:
    """Append the last lines of every process log of a stack to one file in the
    results folder (one file, so that a device run returns it among its few)."""
    files = sorted(Path(log_dir).glob("*.log"))
    if not files:
        return None
    folder = RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / dest
    with path.open("a", errors="replace") as out:
        out.write(f"\n===== {time.strftime('%Y-%m-%dT%H:%M:%S')} {header} =====\n")
        for f in files:
            lines = f.read_text(errors="replace").splitlines()[-tail_lines:]
            out.write(f"----- {f.name} (last {len(lines)} lines) -----\n" + "\n".join(lines) + "\n")
    log(f"kept the stack's logs in {path}")
    return path


# ---------------------------------------------------------- process trees


def proc_stat(pid: int) -> list[str]:
    """The fields of /proc/<pid>/stat after the command name (which may hold
    spaces and parentheses): [0] is the state, as in proc(5) from field 3 on.
    Raises OSError when the process is gone."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _start_time(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (tells a pid from a
    reused one); None when it is gone or a zombie (dead, not yet reaped)."""
    try:
        fields = proc_stat(pid)
        return None if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def descendants(pid: int) -> list[int]:
    """Every process below pid (children, grandchildren...), with psutil when
    it is installed, else from /proc."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        try:
            return [c.pid for c in psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            return []
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int(proc_stat(int(d.name))[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def snapshot_tree(pid: int) -> dict[int, int | None]:
    """pid and its descendants now, each with its start time: taken while the
    tree is whole, since a child whose parent died is re-parented and can no
    longer be found from it."""
    return {p: _start_time(p) for p in [pid, *descendants(pid)]}


def kill_snapshot(tree: dict[int, int | None], sig: int = signal.SIGKILL) -> list[int]:
    """Send sig to every process of a snapshot that is still the same process
    (same start time), and to its process group when that group is not ours.
    Returns the pids signalled."""
    ours = os.getpgrp()
    hit = []
    for p, started in tree.items():
        if started is None or _start_time(p) != started:
            continue  # gone, or the pid now belongs to another process
        with contextlib.suppress(OSError):
            group = os.getpgid(p)
            if group != ours:
                os.killpg(group, sig)
        with contextlib.suppress(OSError):
            os.kill(p, sig)
        hit.append(p)
    return hit


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """kill_snapshot of pid's tree as it is now."""
    return kill_snapshot(snapshot_tree(pid), sig)


# ------------------------------------------------------------------ stacks


def stop_bounded(s: Stack, timeout_s: float) -> None:
    """Stop a stack's processes within about timeout_s in all: workers first
    (SIGTERM: each finishes its batch while the emulators still answer), then
    the API and the emulators; whatever is left then gets SIGKILL, its whole
    process group (each was started in a session of its own)."""
    deadline = time.monotonic() + timeout_s

    def term(names: list[str], share: float) -> None:
        procs = [s.procs[n] for n in names if s.procs[n].poll() is None]
        for proc in procs:
            with contextlib.suppress(OSError):
                proc.send_signal(signal.SIGTERM)
        until = time.monotonic() + max(0.5, share * (deadline - time.monotonic()))
        for proc in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.05, until - time.monotonic()))

    term([n for n in s.procs if n.startswith("worker")], 0.6)
    term([n for n in s.procs if not n.startswith("worker")], 1.0)
    for proc in s.procs.values():
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group, children included; a no-op once it is gone
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(2)


@contextlib.contextmanager
def stack(workers: int = 1, api: bool = True, sqs: str | None = None, env: dict[str, str] | None = None,
          ddb: str | None = None, stop_timeout_s: float | None = None):
    """The embedded profile (S3 on moto; SQS and DynamoDB on what `make run`
    uses unless `sqs` or `ddb` says). Yields the Stack with AWS_* of this
    process pointed at its emulators. With stop_timeout_s, stopping it takes
    at most about that long (the GPU benchmark's time budget)."""
    logs = Path(tempfile.mkdtemp(prefix="sluice-bench-"))
    overrides = {"SLUICE_ACCESS_LOG": "0", "SLUICE_LOG_LEVEL": "WARNING", **(env or {})}
    s = Stack(api_port=free_port(), workers=workers, sqs=sqs or default_sqs(), ddb=ddb or default_ddb(), log_dir=logs,
              env_overrides=overrides)
    saved = dict(os.environ)
    try:
        s.start_emulator()
        reset_clients()
        s.bootstrap()
        os.environ.update({k: v for k, v in s.env().items() if k.startswith(("AWS_", "SLUICE_"))})
        if api:
            s.start_api()
        for i in range(workers):
            s.start_worker(i)
        yield s
    finally:
        os.environ.clear()
        os.environ.update(saved)
        reset_clients()
        if stop_timeout_s is not None:
            stop_bounded(s, stop_timeout_s)
        s.stop()


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and its reaped children."""
    try:
        fields = proc_stat(pid)
    except OSError:
        return 0.0
    return sum(int(x) for x in fields[11:15]) / _TICK


def settings():
    from sluice.settings import Settings

    return Settings()


def reset_clients() -> None:
    """boto3 clients are cached per process; a new emulator needs new clients."""
    from sluice import aws

    with aws._lock:
        aws._clients.clear()


# ------------------------------------------------------------ load generator


class Http:
    """One keep-alive HTTP/1.1 connection per client thread (stdlib only, as a user's script)."""

    def __init__(self, url: str, headers: dict[str, str] | None = None):
        host, port = url.split("//", 1)[1].split(":")
        self.conn = http.client.HTTPConnection(host, int(port), timeout=60)
        self.headers = {"content-type": "application/json", **(headers or {})}

    def call(self, method: str, path: str, body=None) -> tuple[int, dict]:
        data = json.dumps(body).encode() if body is not None else None
        for attempt in range(2):
            try:
                self.conn.request(method, path, body=data, headers=self.headers)
                response = self.conn.getresponse()
                raw = response.read()
                return response.status, (json.loads(raw) if raw else {})
            except (http.client.HTTPException, ConnectionError):
                self.conn.close()  # the server closed an idle connection: reconnect once
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.conn.close()


@dataclass
class LoadResult:
    latencies: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    started: float = 0.0
    ended: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        return self.ended - self.started

    def summary(self) -> dict:
        done = len(self.latencies)
        return {"completed": done, "errors": len(self.errors), "error_examples": self.errors[:3],
                "seconds": round(self.seconds, 2), "per_s": round(done / max(1e-9, self.seconds), 3),
                **lat_summary(self.latencies), **self.extra}


def at_least(a: float | None, b: float | None) -> float | None:
    """a / b for a target it must reach (0.8, 3x): four places, rounded down,
    so that 0.79989 reads 0.7998, never 0.8. From rates kept to three places,
    not the tenths they are shown in: 529.96 / 662.54 would be 530.0 / 662.5 = 0.8."""
    if not a or not b:
        return None
    return math.floor(round(a / b * 10_000, 6)) / 10_000  # round(): 0.8 * 10_000 is 7999.999...


def at_most(a: float | None, b: float | None) -> float | None:
    """a / b for a target it must stay under (1/5): four places, rounded up."""
    if not a or not b:
        return None
    return math.ceil(round(a / b * 10_000, 6)) / 10_000


def closed_loop(n_requests: int, clients: int, make_client, one_request, timeout_s: float) -> LoadResult:
    """`clients` threads share `n_requests`; each sends its next request when the
    previous one completed (closed loop). one_request(client, i) -> None or raises."""
    result = LoadResult()
    counter = iter(range(n_requests))
    lock = threading.Lock()
    deadline = time.monotonic() + timeout_s

    def run() -> None:
        c = make_client()
        try:
            while time.monotonic() < deadline:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                t0 = time.perf_counter()
                try:
                    one_request(c, i)
                except Exception as exc:  # counted, never fatal to the run
                    with lock:
                        result.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                    continue
                elapsed = time.perf_counter() - t0
                with lock:
                    result.latencies.append(elapsed)
        finally:
            with contextlib.suppress(Exception):
                c.close()

    threads = [threading.Thread(target=run, daemon=True) for _ in range(clients)]
    result.started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.1, deadline - time.monotonic() + 5))
    result.ended = time.perf_counter()
    if time.monotonic() >= deadline:
        result.errors.append(f"timed out after {timeout_s}s")
    return result
