"""Priorities under saturation: a backlog of each priority, then equal arrivals
of high, normal and low above what one worker can serve, for a fixed window; queue wait (started_at -
created_at) per priority and each priority's share of the tasks started.
With weights high=6, normal=3, low=1 and all three backlogged, low's configured
share is 1/10.

The arrival rate is set from the worker's capacity measured on the backlog in
the same run, not fixed: this machine's speed moves 2x between runs, and at a
fixed rate a slow run offers `high` alone more than its 6/10 share, so that
its wait measures its own backlog rather than the scheduler."""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time

from bench.common import log, save, settings, stack
from bench.worker import fill, first_finished


CAPACITY_SHARE = 0.4  # of the measured capacity, per priority


def measure_capacity(task_ids: list[str], seconds: float) -> float:
    """Tasks/s the worker finishes from the backlog, from its first outcome on."""
    from sluice.adapters.task_store import TaskStore

    store = TaskStore(settings())
    done_at_start = first_finished(task_ids[:100], timeout_s=120)
    t0 = time.monotonic()
    time.sleep(seconds)
    done = sum(r.status.is_terminal for r in store.get_many(task_ids).values())
    return max(1.0, (done - done_at_start) / (time.monotonic() - t0))


def main(quick: bool = False, sqs: str = "localstack") -> dict:
    window_s = 20 if quick else 40
    backlog = 400  # per priority, queued before the worker starts: saturated from the first batch
    env = {"SLUICE_MODELS": "minilm-embed", "SLUICE_TORCH_THREADS": "2"}
    ids: dict[str, list[str]] = {"high": [], "normal": [], "low": []}
    with stack(workers=0, api=False, sqs=sqs, env=env) as s:
        for p in ids:
            ids[p] += fill(backlog, priority=p)
        s.start_worker(0)
        capacity = measure_capacity([t for v in ids.values() for t in v], seconds=2 if quick else 4)
        # Each priority gets 0.4 x capacity: 1.2 x in all, and more than that
        # of the worker's time once the arrivals' own writes share the machine.
        # `high` (6/10 of the starts when all are backlogged) keeps up; normal and low queue.
        per_s = max(4, round(CAPACITY_SHARE * capacity / 4) * 4)
        stop = time.monotonic() + window_s
        log(f"priorities: capacity {capacity:.0f} tasks/s on the backlog; {backlog} each queued, "
            f"then {per_s}/s each of high, normal, low for {window_s}s")

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
    results: dict = {"sqs": sqs, "dynamodb": s.ddb, "window_s": window_s, "capacity_per_s": round(capacity, 1),
                     "arrivals_per_s_each": per_s,
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
