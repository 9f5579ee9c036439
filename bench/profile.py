"""Where the CPU goes: the e2e load against Sluice, with each process's CPU
time (from /proc) divided by the tasks completed, and optionally a py-spy
profile of each process (raw collapsed stacks in bench/results/profile-*.txt).

    .venv/bin/python -m bench.profile [--py-spy] [--requests 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import time

from bench.common import RESULTS, Http, closed_loop, cpu_s, log, save, sentence, stack
from bench.e2e import LONG_POLL_S
from bench.worker import py_spy

def stages(seen: list[tuple[dict, float]]) -> dict[str, float]:
    """Where a request's latency goes, from its task's timings: created ->
    started (queues, batching), started -> finished (model and outcome write),
    finished -> the client has it (the long poll noticing, the response)."""
    def p50(values):
        return round(statistics.median(values), 1) if values else None

    return {
        "queued": p50([t["started_at"] - t["created_at"] for t, _ in seen]),
        "inference": p50([t["inference_ms"] for t, _ in seen]),
        "started_to_finished": p50([t["finished_at"] - t["started_at"] for t, _ in seen]),
        "finished_to_client": p50([at - t["finished_at"] for t, at in seen]),
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--sqs", default=None, help="moto, localstack or fauxqs (default: what make run uses)")
    p.add_argument("--py-spy", action="store_true")
    a = p.parse_args()
    env = {"SLUICE_MODELS": "minilm-embed", "SLUICE_TORCH_THREADS": str(a.threads)}
    with stack(workers=a.workers, api=True, sqs=a.sqs, env=env) as s:
        key = s.create_key("bench")

        def one(client, i):
            status, body = client.call("POST", "/v1/tasks", {"model": "minilm-embed", "inputs": [sentence(i)]})
            assert status == 202, body
            while True:
                status, view = client.call("GET", f"/v1/tasks/{body['task_id']}?wait_s={LONG_POLL_S}")
                if view["status"] != "queued":
                    assert view["status"] == "succeeded", view
                    seen.append((view["timings"], time.time() * 1000))
                    return

        seen: list[tuple[dict, float]] = []
        make = lambda: Http(s.url, {"x-api-key": key})  # noqa: E731
        closed_loop(64, 8, make, one, 120)
        seen.clear()
        pids = {name: proc.pid for name, proc in s.procs.items()}
        pids["load generator"] = os.getpid()
        before = {n: cpu_s(pid) for n, pid in pids.items()}
        spies = []
        if a.py_spy:
            RESULTS.mkdir(parents=True, exist_ok=True)
            spy = py_spy()
            if spy is None:
                raise SystemExit("bench.profile --py-spy: no py-spy beside the interpreter or on PATH (make install)")
            for name, pid in pids.items():
                if name != "load generator":
                    spies.append(subprocess.Popen(
                        [spy, "record", "-p", str(pid), "-d", "15", "-r", "100", "-f", "raw", "-t",
                         "-o", str(RESULTS / f"profile-{name}.txt")], stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL))
        t0 = time.monotonic()
        r = closed_loop(a.requests, a.clients, make, one, timeout_s=300)
        wall = time.monotonic() - t0
        after = {n: cpu_s(pid) for n, pid in pids.items()}
        for sp in spies:
            sp.wait(60)
    done = max(1, len(r.latencies))
    per_task = {n: round((after[n] - before[n]) * 1000 / done, 2) for n in pids}
    out = {"requests": a.requests, "sqs": s.sqs, "workers": a.workers, "threads": a.threads,
           "wall_s": round(wall, 1), **r.summary(), "cpu_ms_per_task": per_task,
           "cpu_ms_per_task_total": round(sum(per_task.values()), 1),
           "machine_cpu_ms_per_task_available": round(wall * (os.cpu_count() or 2) * 1000 / done, 1),
           "stage_p50_ms": stages(seen)}
    save("profile", out)
    log(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
