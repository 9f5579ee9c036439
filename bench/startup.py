"""Start-up: `make run`'s command (python -m onprem.embedded) to the first
succeeded task, and how many times each worker loaded its model.

Every wait has a deadline, also the wait for the banner when the launcher
prints nothing. A run whose first task does not succeed is recorded with the
reason, and the benchmark then exits non-zero. Ctrl-C (SIGINT) stops the stack
as in a terminal; if that takes too long, the launcher and every process it
started (each in a session of its own) are killed, found from the process tree
taken while the stack was up."""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.common import ROOT, Http, default_sqs, flag, free_port, kill_snapshot, log, raise_if_flagged, save, snapshot_tree

DEADLINE_S = 120
STOP_WAIT_S = 60  # after SIGINT, before SIGKILL


def _lines(stream, into: queue.Queue) -> None:
    for line in stream:
        into.put(line)
    into.put(None)  # end of output: the launcher exited


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def once(sqs: str) -> dict:
    port = free_port()
    state = Path(tempfile.mkdtemp(prefix="sluice-startup-"))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SLUICE_"))},
           "SLUICE_STATE_DIR": str(state), "SLUICE_PORT": str(port), "SLUICE_EMBEDDED_SQS": sqs}
    t0 = time.monotonic()
    deadline = t0 + DEADLINE_S
    proc = subprocess.Popen([sys.executable, "-m", "onprem.embedded"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_lines, args=(proc.stdout, lines), daemon=True).start()
    out: dict = {"sqs": sqs}
    logs = state / "logs"
    printed: list[str] = []
    tree: dict = {}
    try:
        key = None
        while key is None:  # the banner prints the demo key once everything is up
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"no banner within {DEADLINE_S}s; the launcher printed: {''.join(printed)[-1500:]}")
            try:
                line = lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError(f"the launcher exited ({proc.wait()}) before its banner; it printed: "
                                   f"{''.join(printed)[-1500:]}")
            printed.append(line)
            if "export SLUICE_API_KEY=" in line:
                key = line.split("=", 1)[1].strip()
                out["banner_s"] = round(time.monotonic() - t0, 2)
        tree = snapshot_tree(proc.pid)  # the launcher and its children, while all are up
        client = Http(f"http://127.0.0.1:{port}", {"x-api-key": key})
        status, body = client.call("POST", "/v1/tasks", {"model": "minilm-embed", "inputs": ["Hello there."],
                                                          "priority": "high"})
        if status != 202:
            raise RuntimeError(f"the submit was answered {status}: {body}")
        view: dict = {}
        while time.monotonic() < deadline:
            status, view = client.call("GET", f"/v1/tasks/{body['task_id']}")
            if status == 200 and view.get("status") == "succeeded":
                out["first_task_s"] = round(time.monotonic() - t0, 2)
                break
            if status == 200 and view.get("status") in ("failed", "cancelled", "expired"):
                raise RuntimeError(f"the first task ended {view['status']}: {view.get('error')}")
            if proc.poll() is not None:
                raise RuntimeError(f"the launcher exited ({proc.returncode}) before the first task succeeded")
            time.sleep(0.05)
        else:
            workers = "; ".join(f"{f.name}: {_tail(f, 5)}" for f in sorted(logs.glob("worker-*.log")))
            raise RuntimeError(f"the first task did not succeed within {DEADLINE_S}s (last seen: "
                               f"{view.get('status', 'no answer')}); worker logs: {workers[-1500:]}")
        # The first task may be served before the other worker is up: wait for
        # every worker to be ready before counting their model loads.
        while time.monotonic() < deadline:
            workers = sorted(logs.glob("worker-*.log"))
            if workers and all("worker ready" in f.read_text(errors="replace") for f in workers):
                out["all_workers_ready_s"] = round(time.monotonic() - t0, 2)
                break
            time.sleep(0.1)
        else:
            out["all_workers_ready_s"] = None
    finally:
        tree = tree or snapshot_tree(proc.pid)
        tree.update({p: s for p, s in snapshot_tree(proc.pid).items() if p not in tree})
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in the terminal
        try:
            proc.wait(STOP_WAIT_S)
        except subprocess.TimeoutExpired:
            out["killed"] = kill_snapshot(tree)  # the launcher and each child's own session
            log(f"startup: the stack did not stop within {STOP_WAIT_S}s of SIGINT; killed {out['killed']}")
            proc.wait(10)
        # What the launcher started and did not stop (it stops each child with a time limit).
        left = kill_snapshot({p: s for p, s in tree.items() if p != proc.pid})
        if left:
            out["left_running_then_killed"] = left
            log(f"startup: processes left running after the launcher exited, killed: {left}")
    loads = {}
    for f in sorted(logs.glob("worker-*.log")):
        loads[f.stem] = f.read_text(errors="replace").count("worker ready")
    out["model_loads_per_worker"] = loads
    return out


def main(quick: bool = False) -> dict:
    results: dict = {"runs": []}
    # make run's own SQS first (the target is judged on it), then moto's.
    for sqs in dict.fromkeys((default_sqs(), "moto")):
        log(f"startup: python -m onprem.embedded (SQS on {sqs}) to the first succeeded task")
        try:
            r = once(sqs)
        except Exception as exc:
            r = {"sqs": sqs, "error": f"{type(exc).__name__}: {exc}"}
            flag(results, f"SQS on {sqs}: {r['error']}")
        results["runs"].append(r)
        log(f"startup: {r}")
    save("startup", results)
    raise_if_flagged("startup", results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
