"""`make run`'s launcher (onprem/embedded.py) as a user meets it: started as a
process, stopped by a signal or its terminal closing, refused a busy port, and
its supervision of workers that keep exiting. Every wait is bounded and ends on
an event (a line printed, a process gone), never on a sleep standing in for one."""

from __future__ import annotations

import os
import pty
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from onprem.embedded import ROOT, Stack, free_port, supervise

STARTUP_S = 120
STOP_S = 60


def launcher_env(state_dir: Path) -> dict[str, str]:
    """The fastest whole stack: every emulator on moto, one worker, no real model;
    no endpoint or setting from the calling environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SLUICE_"))}
    env.update({"SLUICE_STATE_DIR": str(state_dir), "SLUICE_EMBEDDED_SQS": "moto", "SLUICE_EMBEDDED_DDB": "moto",
                "SLUICE_MODELS": "synthetic", "SLUICE_ACCESS_LOG": "0", "PYTHONUNBUFFERED": "1"})
    return env


def launcher_args(port: int) -> list[str]:
    return [sys.executable, "-m", "onprem.embedded", "--port", str(port), "--workers", "1"]


def stat(pid: int) -> list[str] | None:
    """/proc/<pid>/stat fields after the command name; None once the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()


def alive(pid: int) -> bool:
    fields = stat(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def descendants(root: int) -> set[int]:
    """The launcher's children, and everything in their sessions (each child leads one)."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := stat(int(entry.name))) is not None:
            table[int(entry.name)] = (int(fields[1]), int(fields[3]))  # ppid, session id
    children = {pid for pid, (ppid, _) in table.items() if ppid == root}
    return children | {pid for pid, (_, sid) in table.items() if sid in children}


def wait_gone(pids: set[int], timeout_s: float) -> set[int]:
    deadline = time.monotonic() + timeout_s
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {p for p in left if alive(p)}
    return left


pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")


@pytest.mark.slow
@pytest.mark.parametrize("how", ["terminal closed", "kill -HUP"])
def test_sighup_stops_every_process_the_launcher_started(tmp_path, how):
    # The launcher runs on a terminal of its own, as `make run` does in a shell;
    # closing the terminal (an SSH session dropped, a tab closed) sends it SIGHUP.
    port = free_port()
    env = launcher_env(tmp_path)
    pid, terminal = pty.fork()
    if pid == 0:  # the child: becomes the launcher at once
        try:
            os.chdir(ROOT)
            os.execve(sys.executable, launcher_args(port), env)
        finally:
            os._exit(127)
    started: set[int] = set()
    output = b""
    try:
        deadline = time.monotonic() + STARTUP_S
        while b"Ctrl-C stops everything." not in output:
            left = deadline - time.monotonic()
            assert left > 0, f"no banner within {STARTUP_S}s:\n{output.decode(errors='replace')[-2000:]}"
            if select.select([terminal], [], [], min(left, 1.0))[0]:
                try:
                    chunk = os.read(terminal, 65536)
                except OSError:  # EIO: the launcher is gone
                    chunk = b""
                assert chunk, f"the launcher exited before its banner:\n{output.decode(errors='replace')[-2000:]}"
                output += chunk
        started = descendants(pid)
        # The emulator, the API and the worker at least, each alive.
        assert len(started) >= 3 and all(alive(p) for p in started), started
        if how == "terminal closed":
            os.close(terminal)
            terminal = -1
        else:
            os.kill(pid, signal.SIGHUP)
        deadline = time.monotonic() + STOP_S
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if terminal >= 0 and select.select([terminal], [], [], 0.1)[0]:
                try:
                    output += os.read(terminal, 65536)
                except OSError:
                    pass
            elif terminal < 0:
                time.sleep(0.1)
            assert time.monotonic() < deadline, f"the launcher did not exit within {STOP_S}s of SIGHUP"
        pid = 0
        left = wait_gone(started, 10)
        assert not left, f"SIGHUP left processes the launcher started running: {sorted(left)}"
        logs = tmp_path / "logs"
        assert (logs / "worker-0.log").exists() and (logs / "api.log").exists()
        if how == "kill -HUP":
            assert b"stopped." in output, output.decode(errors="replace")[-2000:]
    finally:
        for leftover in started:  # processes this test's launcher started
            if alive(leftover):
                os.kill(leftover, signal.SIGKILL)
        if pid:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        if terminal >= 0:
            os.close(terminal)


def test_a_busy_api_port_is_refused_before_anything_starts(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    port = holder.getsockname()[1]
    # Another launcher's state (the one holding the port, say) must survive this one.
    (tmp_path / "embedded.json").write_text('{"url": "http://127.0.0.1:%d"}' % port)
    try:
        done = subprocess.run(launcher_args(port), env=launcher_env(tmp_path), cwd=ROOT, capture_output=True,
                              text=True, timeout=60, stdin=subprocess.DEVNULL)
    finally:
        holder.close()
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert f"port {port} on 127.0.0.1 is already in use" in done.stderr, out
    assert "--port" in done.stderr  # and how to choose another
    assert not (tmp_path / "logs" / "emulator.log").exists(), "the emulator was started anyway"
    assert (tmp_path / "embedded.json").exists(), "another launcher's state file was deleted"


class ExitingWorkers(Stack):
    """A stack whose only process is a worker that runs `script` and exits."""

    def __init__(self, log_dir: Path, script: str):
        super().__init__(api_port=0, workers=1, log_dir=log_dir)
        self.script = script
        self.starts: list[float] = []

    def start_worker(self, index: int) -> subprocess.Popen:
        self.starts.append(time.monotonic())
        return self._spawn(f"worker-{index}", [sys.executable, "-c", self.script])


def test_a_worker_that_never_becomes_ready_is_given_up_with_growing_delays(tmp_path, capsys):
    stack = ExitingWorkers(tmp_path, "import sys; print('model failed to load'); sys.exit(3)")
    stack.start_worker(0)
    try:
        started = time.monotonic()
        code = supervise(stack, lambda: time.monotonic() - started > 30, restart_limit=4, backoff_s=0.1,
                         poll_s=0.01)
    finally:
        stack.stop()
    assert code == 1
    assert len(stack.starts) == 4  # the first start and three restarts, then it gives up
    gaps = [b - a for a, b in zip(stack.starts, stack.starts[1:])]
    assert all(gap >= 0.1 * 2 ** i for i, gap in enumerate(gaps)), gaps  # 0.1, 0.2, 0.4 s at least
    err = capsys.readouterr().err
    assert "worker-0 exited 4 times in a row without becoming ready (last exit status 3)" in err
    assert str(tmp_path / "worker-0.log") in err


def test_a_worker_that_became_ready_before_exiting_is_always_restarted(tmp_path, capsys):
    stack = ExitingWorkers(tmp_path, "import sys; print('worker ready', flush=True); sys.exit(3)")
    stack.start_worker(0)
    try:
        started = time.monotonic()
        code = supervise(stack, lambda: len(stack.starts) >= 6 or time.monotonic() - started > 30,
                         restart_limit=3, backoff_s=0.05, poll_s=0.01)
    finally:
        stack.stop()
    assert code == 0 and len(stack.starts) == 6  # past the limit: each exit came after a ready line
    out = capsys.readouterr().out
    assert out.count("restarting it in 0.05s") == 5 and "restarting it in 0.1s" not in out  # no growing delay
