"""Processes for the on-prem parity suite: three real AWS-compatible servers on
127.0.0.1 (LocalStack core for SQS, SeaweedFS for S3, moto for DynamoDB) and the
image entrypoints, each with its own log file. Every wait is bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dockerfile_reader import ROOT

from onprem.embedded import free_port, localstack_command

BIN = Path(sys.executable).parent
REGION = "us-east-1"
# SeaweedFS creates its S3 identity from these; every client signs with them.
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "sluice-onprem", "AWS_SECRET_ACCESS_KEY": "sluice-onprem-secret"}


def clean_env() -> dict[str, str]:
    """The environment without anything AWS or Sluice: no endpoint, key or setting
    from the caller (or from another test's fixture) can leak into a process."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SLUICE_"))}


def wait_for(check: Callable[[], object], timeout_s: float, what: str, proc: Proc | None = None):
    """Poll `check` until it returns a truthy value; fail with the cause after timeout_s."""
    deadline = time.monotonic() + timeout_s
    last: object = None
    while True:
        if proc is not None and proc.popen.poll() is not None:
            raise AssertionError(f"{proc.name} exited with {proc.popen.returncode} while waiting for {what}\n"
                                 f"{proc.tail()}")
        try:
            value = check()
            if value:
                return value
        except Exception as exc:  # not ready yet
            last = exc
        if time.monotonic() >= deadline:
            tail = proc.tail() if proc else ""
            raise AssertionError(f"{what}: not within {timeout_s}s (last: {last!r})\n{tail}")
        time.sleep(0.1)


def http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=2) as response:
        return response.status == 200


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"--- last lines of {self.log} ---\n" + "\n".join(text)

    def stop(self, timeout_s: float = 20) -> int:
        """SIGTERM, then SIGKILL after timeout_s; returns the exit status."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        try:
            self.popen.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.popen.kill()
            self.popen.wait(10)
        # Anything the process itself started is in its session's group, which is ours.
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        return self.popen.returncode


@dataclass
class Processes:
    log_dir: Path
    procs: list[Proc] = field(default_factory=list)

    def start(self, name: str, args: list[str], env: dict[str, str], cwd: Path = ROOT) -> Proc:
        log = self.log_dir / f"{name}.log"
        with open(log, "ab") as out:
            popen = subprocess.Popen(args, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, start_new_session=True)
        proc = Proc(name, popen, log)
        self.procs.append(proc)
        return proc

    def stop_all(self, first: tuple[str, ...] = ()) -> None:
        """Stop the named processes one by one, then signal the rest together (the
        servers take seconds each to shut down) and wait for them."""
        for proc in [p for p in self.procs if p.name in first]:
            proc.stop()
        rest = [p for p in self.procs if p.name not in first]
        for proc in rest:
            if proc.popen.poll() is None:
                proc.popen.send_signal(signal.SIGTERM)
        for proc in rest:
            proc.stop()


def start_localstack(procs: Processes, data_dir: Path) -> tuple[Proc, str]:
    """LocalStack core runtime in host mode (no Docker, no auth token), SQS only,
    started exactly as the embedded profile starts it (onprem/compose.yaml's
    AWS-shaped queue URLs: SQS_ENDPOINT_STRATEGY=off)."""
    port = free_port()
    args, env = localstack_command(port, data_dir)
    proc = procs.start("localstack", args, env)
    return proc, f"http://127.0.0.1:{port}"


def start_seaweedfs(procs: Processes, data_dir: Path) -> tuple[Proc, str]:
    """SeaweedFS all-in-one, the S3-compatible stand-in for MinIO. Every port is
    chosen here so nothing collides, telemetry is off, and only loopback is bound."""
    s3 = free_port()
    ports = {flag: free_port() for flag in (
        "master.port", "master.port.grpc", "volume.port", "volume.port.grpc", "filer.port", "filer.port.grpc",
        "s3.port.grpc", "admin.port", "admin.port.grpc")}
    args = [str(BIN / "weed"), "mini", f"-dir={data_dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            "-admin.ui=false", "-webdav=false", "-master.telemetry=false", "-s3.port.iceberg=0",
            "-s3.port.lance=0", f"-s3.port={s3}", *[f"-{flag}={port}" for flag, port in ports.items()]]
    proc = procs.start("seaweedfs", args, {**clean_env(), **CREDENTIALS})
    return proc, f"http://127.0.0.1:{s3}"


def start_moto(procs: Processes) -> tuple[Proc, str]:
    port = free_port()
    proc = procs.start("moto", [sys.executable, "-m", "onprem.moto_server", "-H", "127.0.0.1", "-p", str(port)],
                       clean_env())
    return proc, f"http://127.0.0.1:{port}"
