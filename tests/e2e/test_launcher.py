"""`make run`'s launcher (onprem/embedded.py) as a user meets it: started as a
process, stopped by a signal or its terminal closing, killed outright, stopped
during its start-up, refused a busy port or a setting it cannot use, and its
supervision of workers that keep exiting. Every wait is bounded and ends on an
event (a line printed, a process gone), never on a sleep standing in for one."""

from __future__ import annotations

import fcntl
import json
import os
import pty
import select
import signal
import socket
import stat as stat_mode
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import onprem.embedded as embedded
from onprem.embedded import ROOT, Stack, free_port, print_banner, supervise

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


def wait_file_line(path: Path, text: bytes, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not (path.exists() and text in path.read_bytes()):
        assert time.monotonic() < deadline, f"no {text!r} in {path} within {timeout_s}s"
        time.sleep(0.05)


class Launcher:
    """The launcher as a process, its stdout and stderr read together as they come."""

    def __init__(self, args: list[str], env: dict[str, str]):
        self.proc = subprocess.Popen(args, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self.output = b""
        self.eof = False

    @property
    def text(self) -> str:
        return self.output.decode(errors="replace")

    def _read(self, timeout_s: float) -> None:
        if not self.eof and select.select([self.proc.stdout], [], [], max(0.0, timeout_s))[0]:
            chunk = os.read(self.proc.stdout.fileno(), 65536)
            self.output += chunk
            self.eof = not chunk

    def wait_for(self, text: bytes, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while text not in self.output:
            left = deadline - time.monotonic()
            assert left > 0 and not self.eof, f"no {text!r} within {timeout_s}s:\n{self.text[-2000:]}"
            self._read(min(left, 0.5))

    def wait_exit(self, timeout_s: float) -> int:
        """Its exit status, all its output read; fails if it runs past timeout_s."""
        deadline = time.monotonic() + timeout_s
        while not self.eof or self.proc.poll() is None:
            left = deadline - time.monotonic()
            assert left > 0, f"the launcher did not exit within {timeout_s}s:\n{self.text[-2000:]}"
            if self.eof:
                time.sleep(min(left, 0.05))
            else:
                self._read(min(left, 0.5))
        return self.proc.returncode

    def close(self) -> None:
        """Whatever is left of this launcher and of the processes it started."""
        if self.proc.poll() is None:
            started = descendants(self.proc.pid)
            self.proc.kill()
            self.proc.wait(10)
            for pid in started:
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)
        self.proc.stdout.close()


HANGING_EMULATOR = """
import signal, socket, sys
port = int(sys.argv[sys.argv.index("-p") + 1])
server = socket.socket()
server.bind(("127.0.0.1", port))
server.listen(64)  # connections queue and are never accepted: each request waits out its timeout
if IGNORE_TERM:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("listening", flush=True)
while True:
    signal.pause()
"""


def hanging_emulator_python(tmp_path: Path, ignore_term: bool = False) -> Path:
    """An interpreter to run the launcher with, beside which `moto_server` (what the
    launcher runs with SLUICE_EMBEDDED_MOTO=stock: Path(sys.executable).with_name)
    is an emulator that listens and never answers, as a hung one does."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python = bin_dir / "python"
    python.symlink_to(sys.executable)  # sys.executable stays this path: the link is not resolved
    emulator = bin_dir / "moto_server"
    emulator.write_text(f"#!{sys.executable}\nIGNORE_TERM = {ignore_term}\n{HANGING_EMULATOR}")
    emulator.chmod(0o755)
    return python


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


@pytest.mark.slow
@pytest.mark.parametrize("sqs", ["moto", "localstack", pytest.param("fauxqs", marks=pytest.mark.skipif(
    not embedded.FAUXQS_MODULES.exists(), reason="make install builds fauxqs (it needs npm)"))])
def test_a_killed_launcher_takes_every_process_it_started_with_it(tmp_path, sqs):
    # kill -9, the OOM killer, an IDE's stop button: no handler runs, yet nothing
    # may be left holding the port against the next `make run`, whichever SQS it
    # runs. LocalStack does not exit on SIGTERM while it answers a worker's long poll.
    launcher = Launcher(launcher_args(free_port()), {**launcher_env(tmp_path), "SLUICE_EMBEDDED_SQS": sqs})
    started: set[int] = set()
    try:
        launcher.wait_for(b"Ctrl-C stops everything.", STARTUP_S)
        started = descendants(launcher.proc.pid)
        assert len(started) >= 3 and all(alive(p) for p in started), started
        # The state file holds the API key: for this user only.
        assert stat_mode.S_IMODE((tmp_path / "embedded.json").stat().st_mode) == 0o600
        # Killed at work: a task run end to end, the worker long-polling its queues.
        state = json.loads((tmp_path / "embedded.json").read_text())
        headers = {"x-api-key": state["api_key"], "content-type": "application/json"}
        submitted = urllib.request.Request(f"{state['url']}/v1/tasks", method="POST", headers=headers,
                                           data=b'{"model": "synthetic", "inputs": ["x"]}')
        with urllib.request.urlopen(submitted, timeout=30) as answer:
            task_id = json.loads(answer.read())["task_id"]
        polled = urllib.request.Request(f"{state['url']}/v1/tasks/{task_id}?wait_s=20", headers=headers)
        with urllib.request.urlopen(polled, timeout=30) as answer:
            assert json.loads(answer.read())["status"] == "succeeded"
        launcher.proc.kill()
        launcher.proc.wait(10)
        left = wait_gone(started, STOP_S)
        assert not left, f"SIGKILL of the launcher left processes it started running: {sorted(left)}"
    finally:
        launcher.close()
        for leftover in started:
            if alive(leftover):
                os.kill(leftover, signal.SIGKILL)


def hanging_start(tmp_path: Path, ignore_term: bool = False) -> tuple[Launcher, set[int]]:
    """A launcher waiting on an emulator that never answers, and that emulator's
    processes, once it listens."""
    python = hanging_emulator_python(tmp_path, ignore_term)
    env = {**launcher_env(tmp_path), "SLUICE_EMBEDDED_MOTO": "stock"}
    launcher = Launcher([str(python), *launcher_args(free_port())[1:]], env)
    try:
        wait_file_line(tmp_path / "logs" / "emulator.log", b"listening", 30)
        emulator = descendants(launcher.proc.pid)
        assert emulator and all(alive(p) for p in emulator), launcher.text
    except BaseException:
        launcher.close()
        raise
    return launcher, emulator


def test_ctrl_c_during_start_up_stops_it_at_once(tmp_path):
    # Without a stop check the emulator's wait ran out its 30 s (LocalStack's, 60).
    launcher, emulator = hanging_start(tmp_path)
    try:
        launcher.proc.send_signal(signal.SIGINT)
        code = launcher.wait_exit(10)
        assert code == 0, launcher.text  # as for Ctrl-C once it runs
        assert "start-up failed" not in launcher.text and "Traceback" not in launcher.text, launcher.text
        assert "stopped." in launcher.text, launcher.text
        assert not wait_gone(emulator, 5), "the emulator outlived the launcher"
    finally:
        launcher.close()


def test_a_second_ctrl_c_kills_what_the_first_would_wait_for(tmp_path):
    # An emulator that ignores SIGTERM would hold the first Ctrl-C for its whole grace (10 s).
    launcher, emulator = hanging_start(tmp_path, ignore_term=True)
    try:
        launcher.proc.send_signal(signal.SIGINT)
        launcher.wait_for(b"stopping workers, API and emulator", 10)
        launcher.proc.send_signal(signal.SIGINT)
        code = launcher.wait_exit(5)
        assert code == 0, launcher.text
        assert "killed." in launcher.text and "start-up failed" not in launcher.text, launcher.text
        assert not wait_gone(emulator, 5), "the emulator outlived the second Ctrl-C"
    finally:
        launcher.close()


@pytest.mark.parametrize("name, value, why", [
    ("SLUICE_PORT", "80a", "should be a whole number from 1 to 65535"),
    ("SLUICE_WORKERS", "two", "should be a whole number of 0 or more"),
    ("SLUICE_EMBEDDED_SQS", "locastack", "should be one of moto, localstack, fauxqs"),
    ("SLUICE_EMBEDDED_DDB", "dynalyte", "should be one of moto, dynalite"),
    # The API reads a header's bytes as Latin-1 and strips its ends: such a key never authenticates.
    ("SLUICE_API_KEY", "clé-demo", "should be printable ASCII without spaces at either end"),
    ("SLUICE_API_KEY", "sk_demo ", "should be printable ASCII without spaces at either end"),
    # Said by the API's log only, after a "the process serving ... exited with 2".
    ("SLUICE_LOG_LEVEL", "bogus", "should be one of DEBUG, INFO, WARNING, ERROR, CRITICAL (any case)"),
])
def test_a_setting_it_cannot_use_is_refused_in_one_line(tmp_path, name, value, why):
    # A misspelled emulator used to run moto instead, unnoticed; a bad number, a traceback.
    launcher = Launcher(launcher_args(free_port()), {**launcher_env(tmp_path), name: value})
    try:
        code = launcher.wait_exit(30)
    finally:
        launcher.close()
    assert code == 2, launcher.text
    assert launcher.text.strip() == f"embedded: refused settings: {name}={value!r}: {why}"
    assert not (tmp_path / "logs").exists(), "something was started anyway"


def test_the_stack_s_processes_and_calls_leave_the_operator_s_aws_profile_out(monkeypatch):
    # A profile named but missing (~/.aws absent) failed the bootstrap's first call.
    monkeypatch.setenv("AWS_PROFILE", "nosuch")
    monkeypatch.setenv("AWS_SESSION_TOKEN", "operator-token")
    stack = Stack(api_port=8000, sqs="moto", ddb="moto")
    assert not {"AWS_PROFILE", "AWS_SESSION_TOKEN"} & set(stack.env())
    with stack.environ():
        assert not {"AWS_PROFILE", "AWS_SESSION_TOKEN"} & set(os.environ)
        assert os.environ["AWS_ENDPOINT_URL"] == stack.env()["AWS_ENDPOINT_URL"]
    assert os.environ["AWS_PROFILE"] == "nosuch"


def test_a_process_that_exits_while_started_is_reported_with_the_end_of_its_log(tmp_path):
    stack = Stack(api_port=free_port(), sqs="moto", ddb="moto", log_dir=tmp_path)
    proc = stack._spawn("api", [sys.executable, "-c", "import sys; print('refused: SLUICE_X'); sys.exit(2)"])
    with pytest.raises(RuntimeError, match=r"exited with 2: refused: SLUICE_X$"):
        stack.wait(f"{stack.url}/health", 30, alive=proc)


def test_an_empty_state_dir_setting_is_the_default_folder_not_the_current_one():
    code = "import onprem.embedded as e; print(e.STATE_DIR)"
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "SLUICE_STATE_DIR": ""}, cwd="/tmp",
                         capture_output=True, text=True, timeout=60, check=True).stdout.strip()
    assert out == str(ROOT / ".sluice")


def test_the_state_file_is_private_from_its_creation(tmp_path, monkeypatch):
    state = tmp_path / "embedded.json"
    monkeypatch.setattr(embedded, "STATE_DIR", tmp_path)
    monkeypatch.setattr(embedded, "STATE_FILE", state)
    state.write_text("{}")  # a stale one (its launcher was killed), readable by all
    state.chmod(0o644)
    # It holds the API key: its mode must come with its creation, not from a chmod
    # once the key is in it, which leaves a moment when others can read it.
    monkeypatch.setattr(Path, "chmod", lambda *args, **kwargs: None)
    umask = os.umask(0o022)
    try:
        Stack(api_port=8000, sqs="moto", ddb="moto").write_state("sk_secret")
    finally:
        os.umask(umask)
    assert stat_mode.S_IMODE(state.stat().st_mode) == 0o600
    assert json.loads(state.read_text())["api_key"] == "sk_secret"
    assert [p.name for p in tmp_path.iterdir()] == ["embedded.json"]  # no partial file left beside it


def test_the_banner_submits_to_a_model_the_stack_serves(capsys):
    stack = Stack(api_port=8000, sqs="moto", ddb="moto", env_overrides={"SLUICE_MODELS": "synthetic"})
    print_banner(stack, "sk_demo")
    out = capsys.readouterr().out
    assert '"model": "synthetic"' in out and "minilm-embed" not in out, out
    assert "sluice submit --model synthetic --wait" in out, out


@pytest.mark.parametrize("state_dir", [None, "/tmp/sluice-2"])
def test_the_banner_s_cli_commands_reach_this_stack(capsys, monkeypatch, state_dir):
    # The CLI finds the stack by its state file: a second stack's lives elsewhere.
    if state_dir:
        monkeypatch.setattr(embedded, "STATE_DIR", Path(state_dir))
    print_banner(Stack(api_port=8001, sqs="moto", ddb="moto"), "sk_demo")
    commands = [line.strip() for line in capsys.readouterr().out.splitlines() if "bin/sluice " in line]
    assert len(commands) == 2, commands
    prefix = f"SLUICE_STATE_DIR={state_dir} .venv/bin/sluice " if state_dir else ".venv/bin/sluice "
    assert all(c.startswith(prefix) for c in commands), commands


@pytest.mark.parametrize("sqs, named", [("fauxqs", "SQS: fauxqs on"), ("localstack", "SQS: LocalStack on")])
def test_the_banner_names_the_sqs_server_it_started(capsys, sqs, named):
    print_banner(Stack(api_port=8001, sqs=sqs, sqs_port=4566, ddb="moto"), "sk_demo")
    assert f"{named} http://127.0.0.1:4566" in capsys.readouterr().out


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
    assert "SLUICE_PORT=N make run" in done.stderr, out  # how to choose another, as `make run` can
    assert not (tmp_path / "logs" / "emulator.log").exists(), "the emulator was started anyway"
    assert "stopping" not in out and "stopped." not in out, out  # nothing was started to stop
    assert (tmp_path / "embedded.json").exists(), "another launcher's state file was deleted"


def test_a_second_launcher_on_the_same_state_folder_is_refused(tmp_path):
    # Two on one folder mixed their logs, and the first to stop deleted the
    # other's state file, which the CLI reads for the key and the endpoints.
    state = '{"url": "http://127.0.0.1:8000", "pid": 1}'
    (tmp_path / "embedded.json").write_text(state)
    with open(tmp_path / "embedded.lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as the running launcher holds it
        done = subprocess.run(launcher_args(free_port()), env=launcher_env(tmp_path), cwd=ROOT, capture_output=True,
                              text=True, timeout=30, stdin=subprocess.DEVNULL)
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert f"another `make run` is using {tmp_path} (API: http://127.0.0.1:8000)" in done.stderr, out
    assert "SLUICE_STATE_DIR=/tmp/sluice-2 SLUICE_PORT=8001 make run" in done.stderr, out
    assert not (tmp_path / "logs").exists(), "something was started anyway"
    assert (tmp_path / "embedded.json").read_text() == state, "the running launcher's state was touched"


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


def test_workers_stuck_at_a_stop_share_one_grace_not_one_each(tmp_path, monkeypatch):
    # Told together, waited for together: four workers that ignore SIGTERM
    # held the first Ctrl-C for four graces, one after the other.
    monkeypatch.setattr(embedded, "WORKER_STOP_GRACE_S", 2.0)
    stuck = ("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
             "print('worker ready', flush=True); time.sleep(60)")
    stack = ExitingWorkers(tmp_path, stuck)
    for i in range(4):
        stack.start_worker(i)
    deadline = time.monotonic() + 30
    logs = [tmp_path / f"worker-{i}.log" for i in range(4)]
    # Each has its handler in place before the stop.
    while not all(log.exists() and "worker ready" in log.read_text() for log in logs):
        assert time.monotonic() < deadline, "the stuck workers never started"
        time.sleep(0.05)
    started = time.monotonic()
    stack.stop()
    took = time.monotonic() - started
    assert all(proc.poll() is not None for proc in stack.procs.values())
    assert took < 2 * embedded.WORKER_STOP_GRACE_S, took  # one grace (2 s), not four (8 s)


@pytest.mark.parametrize("built, setting, chosen", [
    ({"fauxqs", "localstack"}, None, "fauxqs"),
    ({"localstack"}, None, "localstack"),  # no npm: make install built no fauxqs
    (set(), None, "moto"),
    ({"fauxqs", "localstack"}, "localstack", "localstack"),
    ({"fauxqs", "localstack"}, "moto", "moto"),
])
def test_make_run_s_sqs_is_fauxqs_when_built_and_the_setting_chooses_another(tmp_path, monkeypatch,
                                                                           built, setting, chosen):
    monkeypatch.setattr(embedded, "FAUXQS_MODULES", tmp_path / "fauxqs" if "fauxqs" in built else tmp_path / "no")
    monkeypatch.setattr(embedded, "LOCALSTACK_PYTHON", tmp_path / "python" if "localstack" in built else tmp_path / "no")
    (tmp_path / "fauxqs").mkdir()
    (tmp_path / "python").touch()
    if setting is None:
        monkeypatch.delenv("SLUICE_EMBEDDED_SQS", raising=False)
    else:
        monkeypatch.setenv("SLUICE_EMBEDDED_SQS", setting)
    assert embedded.default_sqs() == chosen


def listening_addresses(pid: int) -> set[str]:
    """The local addresses (IPv4 and IPv6, hex as in /proc) of the sockets a process listens on."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except FileNotFoundError:  # closed since the listing: not a listener
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                found.add(fields[1].split(":")[0])
    return found


@pytest.mark.skipif(not embedded.FAUXQS_MODULES.exists(), reason="make install builds fauxqs (it needs npm)")
@pytest.mark.skipif(not Path("/proc/self/net/tcp").exists(), reason="reads listening sockets from Linux's /proc")
def test_make_run_s_sqs_listens_on_loopback_only(tmp_path):
    # fauxqs's own launcher listens on every interface; onprem/fauxqs/serve.mjs must not.
    stack = Stack(api_port=free_port(), sqs="fauxqs", ddb="moto", log_dir=tmp_path)
    proc = stack.start_fauxqs()
    try:
        embedded.wait_http(f"{stack.sqs_url}{embedded.SQS_HEALTH['fauxqs']}", 30, alive=proc)
        assert listening_addresses(proc.pid) == {"0100007F"}  # 127.0.0.1, and nothing else
    finally:
        proc.terminate()
        assert proc.wait(10) == 0  # a clean stop on SIGTERM
