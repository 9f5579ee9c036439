"""Priorities under saturation: a backlog of each priority, then equal arrivals
of high, normal and low above what one worker can serve, for a fixed window; queue wait (started_at -
created_at) per priority and each priority's share of the tasks started.
With weights high=6, normal=3, low=1 and all three backlogged, low's configured
share is 1/10."""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time

from bench.common import log, save, settings, stack
from bench.worker import fill


def main(quick: bool = False, sqs: str = "localstack") -> dict:
    window_s = 20 if quick else 40
    per_s = 100  # per priority: 300/s in all, above one worker's capacity here (~215/s, bench.worker)
    backlog = 400  # per priority, queued before the worker starts: saturated from the first batch
    env = {"SLUICE_MODELS": "minilm-embed", "SLUICE_TORCH_THREADS": "2"}
    ids: dict[str, list[str]] = {"high": [], "normal": [], "low": []}
    with stack(workers=0, api=False, sqs=sqs, env=env) as s:
        for p in ids:
            ids[p] += fill(backlog, priority=p)
        s.start_worker(0)
        stop = time.monotonic() + window_s
        log(f"priorities: {backlog} each queued, then {per_s}/s each of high, normal, low for {window_s}s")

        def arrivals(priority: str) -> None:
            tick = time.monotonic()
            while tick < stop:
                ids[priority] += fill(per_s // 4, priority=priority)
                tick += 0.25
                time.sleep(max(0.0, tick - time.monotonic()))

        threads = [threading.Thread(target=arrivals, args=(p,)) for p in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        from sluice.adapters.task_store import TaskStore

        store = TaskStore(settings())
        records = {p: list(store.get_many(v).values()) for p, v in ids.items()}
    started = {p: [r for r in recs if r.started_at] for p, recs in records.items()}
    total_started = sum(len(v) for v in started.values())
    results: dict = {"sqs": sqs, "dynamodb": s.ddb, "window_s": window_s, "arrivals_per_s_each": per_s,
                     "backlog_each": backlog,
                     "weights": settings().priority_weights, "per_priority": {}}
    for p, recs in started.items():
        waits = [r.started_at - r.created_at for r in recs]
        results["per_priority"][p] = {
            "submitted": len(ids[p]), "started": len(recs),
            "share_of_started": round(len(recs) / max(1, total_started), 3),
            "p50_queue_wait_ms": statistics.median(waits) if waits else None,
            "p90_queue_wait_ms": sorted(waits)[int(0.9 * (len(waits) - 1))] if waits else None,
        }
        log(f"priorities: {p}: {results['per_priority'][p]}")
    hi, lo = results["per_priority"]["high"], results["per_priority"]["low"]
    results["high_over_low_p50_wait"] = (round(hi["p50_queue_wait_ms"] / lo["p50_queue_wait_ms"], 3)
                                         if hi["p50_queue_wait_ms"] and lo["p50_queue_wait_ms"] else None)
    results["saturated"] = total_started < sum(len(v) for v in ids.values())
    save("priorities", results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv), indent=1))
