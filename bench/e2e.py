"""End-to-end against peers: 2000 one-sentence requests from 64 concurrent
clients, each waiting for its own result, against Sluice (submit, then a long
poll `GET /v1/tasks/{id}?wait_s=` as `sluice submit --wait` does; or, with
poll_s set, a plain poll every poll_s), Ray Serve and Celery + Redis (in
.venv-peers, when it exists), and the raw model in the same run."""

from __future__ import annotations

import json
import subprocess
import sys
import time

from bench.common import default_ddb, ROOT, Http, closed_loop, log, save, sentence, stack
from bench.worker import raw

PEERS_PYTHON = ROOT / ".venv-peers" / "bin" / "python"
LONG_POLL_S = 10
# Measured on a machine like this one (2 cores), not in this run: ../shared/NOTES.md.
REFERENCE = {
    "Ray Serve": {"per_s": 149, "p50_ms": 419, "p99_ms": 717,
                  "config": "2 replicas x 1 torch thread, @serve.batch(32, 10 ms)"},
    "Celery + Redis": {"per_s": 94, "p50_ms": 564, "p99_ms": 1338,
                       "config": "2 prefork workers x 1 torch thread"},
}


def sluice(requests: int, clients: int, workers: int, threads: int, sqs: str, env: dict | None = None,
           poll_s: float | None = None) -> dict:
    env = {"SLUICE_MODELS": "minilm-embed", "SLUICE_TORCH_THREADS": str(threads), **(env or {})}
    with stack(workers=workers, api=True, sqs=sqs, env=env) as s:
        key = s.create_key("bench")

        def one(client, i):
            status, body = client.call("POST", "/v1/tasks", {"model": "minilm-embed", "inputs": [sentence(i)]})
            if status != 202:
                raise RuntimeError(f"submit {status} {body}")
            path = f"/v1/tasks/{body['task_id']}"
            if poll_s is None:
                path += f"?wait_s={LONG_POLL_S}"
            while True:
                if poll_s is not None:
                    time.sleep(poll_s)
                status, view = client.call("GET", path)
                if status != 200:
                    raise RuntimeError(f"get {status}")
                if view["status"] == "succeeded":
                    if len(view["result"]["embeddings"][0]) != 384:
                        raise RuntimeError("bad result")
                    return
                if view["status"] != "queued":
                    raise RuntimeError(f"task {view['status']}")

        make = lambda: Http(s.url, {"x-api-key": key})  # noqa: E731
        t0 = time.monotonic()
        closed_loop(64, 8, make, one, 120)  # warm-up: every worker has loaded its model
        warm_s = time.monotonic() - t0
        r = closed_loop(requests, clients, make, one, timeout_s=300)
    return {"system": "Sluice", "config": f"{workers} worker(s) x {threads} torch thread(s), {sqs} SQS + {s.ddb} "
            f"DynamoDB, " + (f"poll every {int(poll_s * 1000)} ms" if poll_s else f"long poll (wait_s={LONG_POLL_S})"), "warm_s": round(warm_s, 1), "env": env, **r.summary()}


def peer(module: str, requests: int, clients: int) -> dict | None:
    if not PEERS_PYTHON.exists():
        return None
    try:
        out = subprocess.run([str(PEERS_PYTHON), "-m", module, "--requests", str(requests), "--clients", str(clients)],
                             cwd=ROOT, capture_output=True, text=True, timeout=420)
        return json.loads(out.stdout.strip().splitlines()[-1])
    except Exception as exc:  # a peer that fails is reported, not fatal
        return {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}


def main(quick: bool = False, sqs: str = "localstack", workers: int = 1, threads: int = 2) -> dict:
    requests, clients = (600, 64) if quick else (2000, 64)
    results: dict = {"requests": requests, "clients": clients, "sqs": sqs, "dynamodb": default_ddb(), "systems": {}}
    log("e2e: raw model (batch 32, 2 threads, bf16 as the worker runs it)")
    results["raw_32"] = raw(32, threads, seconds=6)
    log(f"e2e: Sluice, {requests} requests, {clients} clients")
    results["systems"]["Sluice"] = sluice(requests, clients, workers, threads, sqs)
    log(f"e2e: Sluice {results['systems']['Sluice']['per_s']}/s")
    for name, module in (("Ray Serve", "bench.peers.ray_serve"), ("Celery + Redis", "bench.peers.celery_redis")):
        log(f"e2e: {name}")
        measured = peer(module, requests, clients)
        if measured and "error" not in measured:
            results["systems"][name] = {**measured, "source": "this run"}
        else:
            results["systems"][name] = {**REFERENCE[name], "system": name, "source":
                                        "measured on a machine like this one, not in this run (../shared/NOTES.md)",
                                        "why_not_this_run": (measured or {}).get("error", "no .venv-peers")}
        log(f"e2e: {name} {results['systems'][name].get('per_s')}/s ({results['systems'][name]['source']})")
    # Latency against throughput: the same Sluice stack at lighter closed-loop loads.
    results["sluice_sweep"] = []
    for c in ((8, 32) if quick else (4, 16, 32)):
        r = sluice(max(100, c * 10), c, workers, threads, sqs)
        results["sluice_sweep"].append({"clients": c, "per_s": r["per_s"], "p50_ms": r["p50_ms"], "p99_ms": r["p99_ms"]})
        log(f"e2e: Sluice at {c} clients: {r['per_s']}/s p50 {r['p50_ms']} ms")
    ours = results["systems"]["Sluice"]["per_s"]
    results["vs_ray"] = round(ours / results["systems"]["Ray Serve"]["per_s"], 2)
    results["vs_raw"] = round(ours / results["raw_32"]["per_s"], 2)
    save("e2e", results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv, sqs="moto" if "--moto" in sys.argv else "localstack"),
                     indent=1))
