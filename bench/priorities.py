"""Priorities under saturation: one worker, weights high=6, normal=3, low=1.

`normal` and `low` start with a backlog; the worker's capacity is measured on
it. Then, for a fixed window, the three arrive at RATES x capacity, 1.5x in
all: `high` below its 6/10 share, so a scheduler that honours the weights
serves it as it comes; `normal` and `low` above what is left, so both stay
backlogged and the weights alone split the rest between them (3:1, so low
gets 0.15 of the completions, at least its configured 1/10). Both failures
show: FIFO gives high low's wait (ratio near 1), strict priority gives low
nothing (high 0.4 + normal 0.7 fill the worker). After the window the worker
drains what is queued, for at most DRAIN_S, so that the window's tasks get
their real queue waits.

Reported per priority: the share of the completions (finished_at) inside the
window, low's share against its configured one, whether each priority was
backlogged throughout, and the queue wait (started_at - created_at) of the
tasks that arrived in the window. A task that had not started when the drain
ended counts as waiting until then: a lower bound of its wait, and the
percentiles say when they are lower bounds. The arrival rate follows the
capacity measured in the same run, because this machine's speed moves 2x
between runs."""

from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter

from bench.common import at_least, at_most, default_sqs, flag, log, raise_if_flagged, save, settings, stack
from bench.worker import fill, first_finished, wait_drained

RATES = {"high": 0.4, "normal": 0.7, "low": 0.4}  # x capacity: 1.5x in all
BACKLOG = {"high": 0, "normal": 400, "low": 400}  # queued before the worker starts
MUST_BE_BACKLOGGED = ("normal", "low")  # else the window does not test the weights
SETTLE_S = 2.0  # the first seconds of the window are left out of the shares (queues fill up)


def measure_capacity(task_ids: list[str], seconds: float, procs: dict | None = None) -> float:
    """Tasks/s the worker finishes from the backlog, from its first outcome on."""
    from sluice.adapters.task_store import TaskStore

    store = TaskStore(settings())
    done_at_start = first_finished(task_ids[:100], timeout_s=120, procs=procs)
    t0 = time.monotonic()
    time.sleep(seconds)
    done = sum(status.is_terminal for status in store.statuses(task_ids).values())
    return max(1.0, (done - done_at_start) / (time.monotonic() - t0))


def censored_percentile(waits: list[float], censored: list[float], q: float) -> tuple[float | None, bool]:
    """The q-th percentile of all waits, where `censored` are lower bounds (tasks
    not started by the end). Returns (value, exact): exact is False when the
    value could be higher were the censored waits known."""
    every = sorted([(w, False) for w in waits] + [(c, True) for c in censored])
    if not every:
        return None, True
    k = min(len(every) - 1, max(0, round(q / 100 * (len(every) - 1))))
    value, is_censored = every[k]
    exact = not is_censored and all(c > value for c in censored)
    return value, exact


def backlogged_fraction(records: list, start_ms: float, end_ms: float, step_ms: float = 500) -> float:
    """Of the instants start_ms, start_ms + step_ms, ... < end_ms, the fraction at
    which this priority had a task created and not yet started."""
    instants = [start_ms + i * step_ms for i in range(max(1, int((end_ms - start_ms) // step_ms)))]
    hits = 0
    for t in instants:
        if any(r.created_at <= t and (r.started_at is None or r.started_at > t) for r in records):
            hits += 1
    return round(hits / len(instants), 3)


def main(quick: bool = False, sqs: str | None = None) -> dict:
    sqs = sqs or default_sqs()
    window_s = 15 if quick else 30
    drain_s = 30 if quick else 60  # at most, after the window: ~1.2 x window_s at capacity
    env = {"SLUICE_MODELS": "minilm-embed", "SLUICE_DEVICE": "cpu", "SLUICE_TORCH_THREADS": "2"}
    ids: dict[str, list[str]] = {"high": [], "normal": [], "low": []}
    weights = settings().weights()
    configured = {p.value: w / sum(weights.values()) for p, w in weights.items()}
    with stack(workers=0, api=False, sqs=sqs, env=env) as s:
        for p in ids:
            ids[p] += fill(BACKLOG[p], priority=p) if BACKLOG[p] else []
        s.start_worker(0)
        procs = {n: proc for n, proc in s.procs.items() if n.startswith("worker")}
        capacity = measure_capacity([t for v in ids.values() for t in v], seconds=2 if quick else 4, procs=procs)
        rate = {p: x * capacity for p, x in RATES.items()}
        log(f"priorities: capacity {capacity:.0f} tasks/s on the backlog of {BACKLOG}, then "
            + ", ".join(f"{p} {r:.0f}/s" for p, r in rate.items()) + f" for {window_s}s")
        arrived: dict[str, list[str]] = {p: [] for p in ids}
        window_start = time.time()
        stop = time.monotonic() + window_s

        failed_arrivals: dict[str, str] = {}

        def arrivals(priority: str) -> None:
            # Every 0.25 s, the tasks due by the next tick, until the window's end
            # by the clock: a slow fill lowers the rate offered (arrived_per_s
            # says what it was), never lengthens the window.
            t0 = time.monotonic()
            sent = 0
            try:
                while (now := time.monotonic()) < stop:
                    due = int(rate[priority] * min(now - t0 + 0.25, window_s)) - sent
                    if due > 0:
                        new = fill(due, priority=priority)
                        arrived[priority] += new
                        sent += len(new)
                    time.sleep(max(0.0, 0.25 - (time.monotonic() - now)))
            except Exception as exc:  # noqa: BLE001 - the run is flagged below: its arrivals stopped early
                failed_arrivals[priority] = f"{type(exc).__name__}: {exc}"

        threads = [threading.Thread(target=arrivals, args=(p,)) for p in ids]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        window_end = time.time()
        log(f"priorities: window over; draining what is queued (at most {drain_s}s)")
        drained = wait_drained(drain_s, procs)
        dead = {n: proc.returncode for n, proc in procs.items() if proc.poll() is not None}
        from sluice.adapters.task_store import TaskStore

        store = TaskStore(settings())
        measured_at = time.time()  # what has not started by now waits at least until now
        records = {p: list(store.get_many(ids[p] + arrived[p]).values()) for p in ids}
    start_ms, end_ms, now_ms = (window_start + SETTLE_S) * 1000, window_end * 1000, measured_at * 1000
    results: dict = {"sqs": sqs, "dynamodb": s.ddb, "window_s": window_s, "capacity_per_s": round(capacity, 1),
                     "offered_x_capacity": {p: round(r / capacity, 2) for p, r in rate.items()},
                     "backlog": BACKLOG, "weights": settings().priority_weights,
                     "shares_counted_from_s": SETTLE_S, "drain_after_window": drained["end"],
                     "drain_s": drained["waited_s"], "per_priority": {}}
    if drained["end"] != "queues empty":
        log(f"priorities: the drain after the window ended by {drained['end']} after {drained['waited_s']}s: "
            "the waits of tasks still queued are lower bounds")
    if dead:
        flag(results, f"the worker exited during the window: {dead}")
    for p, why in failed_arrivals.items():
        flag(results, f"{p}'s arrivals stopped during the window: {why}")
    completions = {p: [r for r in recs if r.finished_at and start_ms <= r.finished_at <= end_ms]
                   for p, recs in records.items()}
    total_done = sum(len(v) for v in completions.values())
    if not total_done:
        flag(results, "no task finished inside the window")
    p50s: dict[str, float | None] = {}
    for p, recs in records.items():
        window_ids = set(arrived[p])
        in_window = [r for r in recs if r.task_id in window_ids]
        started = [r for r in in_window if r.started_at]
        waits = [(r.started_at - r.created_at) / 1000 for r in started]
        censored = [(now_ms - r.created_at) / 1000 for r in in_window if not r.started_at]
        p50, p50_exact = censored_percentile(waits, censored, 50)
        p90, p90_exact = censored_percentile(waits, censored, 90)
        p50s[p] = p50
        unfinished = Counter(r.status.value for r in in_window if r.status.value not in ("succeeded", "queued", "running"))
        if unfinished:  # a failed task finishes too: it would count as a completion, its wait in the p50
            flag(results, f"{p}: tasks of the window ended other than succeeded: {dict(unfinished)}")
        row = {
            "backlog_submitted": BACKLOG[p], "arrived_in_window": len(arrived[p]),
            "arrived_per_s": round(len(arrived[p]) / max(1e-9, window_end - window_start), 1),
            "arrivals_started": len(started), "arrivals_not_started": len(censored),
            "completed_in_window": len(completions[p]),
            "share_of_completions": round(len(completions[p]) / max(1, total_done), 3),
            "configured_share": round(configured[p], 3),
            "backlogged_fraction_of_window": backlogged_fraction(recs, start_ms, end_ms),
            "p50_queue_wait_s": round(p50, 3) if p50 is not None else None, "p50_is_lower_bound": not p50_exact,
            "p90_queue_wait_s": round(p90, 3) if p90 is not None else None, "p90_is_lower_bound": not p90_exact,
        }
        results["per_priority"][p] = row
        log(f"priorities: {p}: {row}")
        if p in MUST_BE_BACKLOGGED and row["backlogged_fraction_of_window"] < 0.95:
            flag(results, f"{p} was backlogged only {row['backlogged_fraction_of_window']:.0%} of the window: "
                 "not saturated, so the shares do not test the weights")
    hi, lo = results["per_priority"]["high"], results["per_priority"]["low"]
    # From the waits and counts as measured, not the rounded figures above, to
    # four places rounded toward failing: the report judges them against 1/5 and 1.
    results["high_over_low_p50_wait"] = at_most(p50s["high"], p50s["low"])
    # Low's p50 is a lower bound when low waits past the end: then so is the ratio's denominator, and the
    # true ratio is at most this (an upper bound); high's being a lower bound would make it a lower bound.
    results["high_over_low_is"] = ("upper bound" if lo["p50_is_lower_bound"] and not hi["p50_is_lower_bound"]
                                   else "exact" if not (lo["p50_is_lower_bound"] or hi["p50_is_lower_bound"])
                                   else "uncertain (both p50s are lower bounds)")
    results["low_share_vs_configured"] = at_least(len(completions["low"]) / max(1, total_done), configured["low"])
    log(f"priorities: high/low p50 wait {results['high_over_low_p50_wait']} ({results['high_over_low_is']}); "
        f"low's share of completions {lo['share_of_completions']:.3f} against its configured "
        f"{lo['configured_share']:.3f} = {results['low_share_vs_configured']}x")
    save("priorities", results)
    raise_if_flagged("priorities", results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv), indent=1))
