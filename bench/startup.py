"""Start-up: `make run`'s command (python -m onprem.embedded) to the first
succeeded task, and how many times each worker loaded its model."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import ROOT, Http, free_port, log, save


def once(sqs: str) -> dict:
    port = free_port()
    state = Path(tempfile.mkdtemp(prefix="sluice-startup-"))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SLUICE_"))},
           "SLUICE_STATE_DIR": str(state), "SLUICE_PORT": str(port), "SLUICE_EMBEDDED_SQS": sqs}
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "onprem.embedded"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out: dict = {"sqs": sqs}
    logs = state / "logs"
    try:
        key = None
        deadline = t0 + 120
        for line in proc.stdout:  # the banner prints the demo key once everything is up
            if "export SLUICE_API_KEY=" in line:
                key = line.split("=", 1)[1].strip()
                out["banner_s"] = round(time.monotonic() - t0, 2)
                break
            if time.monotonic() > deadline:
                break
        if not key:
            raise RuntimeError("no banner")
        client = Http(f"http://127.0.0.1:{port}", {"x-api-key": key})
        status, body = client.call("POST", "/v1/tasks", {"model": "minilm-embed", "inputs": ["Hello there."],
                                                          "priority": "high"})
        assert status == 202, body
        while time.monotonic() < deadline:
            status, view = client.call("GET", f"/v1/tasks/{body['task_id']}")
            if view["status"] == "succeeded":
                out["first_task_s"] = round(time.monotonic() - t0, 2)
                break
            time.sleep(0.05)
        # The first task may be served before the other worker is up: wait for
        # every worker to be ready before counting their model loads.
        while time.monotonic() < deadline:
            workers = sorted(logs.glob("worker-*.log"))
            if workers and all("worker ready" in f.read_text(errors="replace") for f in workers):
                out["all_workers_ready_s"] = round(time.monotonic() - t0, 2)
                break
            time.sleep(0.1)
    finally:
        os.killpg(proc.pid, signal.SIGINT)  # as Ctrl-C in the terminal
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    loads = {}
    for f in sorted(logs.glob("worker-*.log")):
        loads[f.stem] = f.read_text(errors="replace").count("worker ready")
    out["model_loads_per_worker"] = loads
    return out


def main(quick: bool = False) -> dict:
    results = {"runs": []}
    for sqs in ("localstack", "moto"):
        log(f"startup: python -m onprem.embedded (SQS on {sqs}) to the first succeeded task")
        r = once(sqs)
        results["runs"].append(r)
        log(f"startup: {r}")
    save("startup", results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
