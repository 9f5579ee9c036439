"""Promise 5: past the backlog cap, submits of that priority get 429 with
Retry-After (other priorities still get in), and memory in the API and the
worker stays bounded under a flood.

The worker is paused (SIGSTOP) for the first part of the flood so that the
queue fills to the cap, then resumed so that it works through the flood.
"""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter

import pytest

from tests.reliability.harness import CANARY, Ledger, rss_mb, running_stack, wait_until

pytestmark = pytest.mark.slow

CAP = 100
FLOOD_S = 16
ENV = {"SLUICE_BACKLOG_CAP": str(CAP), "SLUICE_SYNTHETIC_BASE_MS": "50", "SLUICE_MAX_BATCH_SIZE": "8"}


def test_a_flood_past_the_backlog_cap_gets_429s_and_memory_stays_bounded(tmp_path):
    with running_stack(tmp_path / "logs", workers=1, env=ENV) as env:
        ledger = Ledger("backpressure_flood", env.inspector)
        api, worker = env.stack.procs["api"], env.stack.procs["worker-0"]
        replies: Counter = Counter()
        refusals: list[tuple[str, dict]] = []
        samples: list[tuple[float, float, float, int]] = []  # (t, api MB, worker MB, normal depth)
        lock = threading.Lock()
        stop = threading.Event()
        started = time.monotonic()
        text = f"{CANARY} " + "x" * 1000  # ~8 KB a task: enough to show a leak, small for the emulator

        def flood(batch: bool) -> None:
            while not stop.is_set():
                if batch:
                    reply = env.client.call("POST", "/v1/tasks/batch", {"tasks": [
                        {"model": "synthetic", "inputs": [text] * 8} for _ in range(5)]})
                    ids = [t["task_id"] for t in reply.body["tasks"]] if reply.status == 202 else []
                else:
                    reply = env.client.submit([text] * 8)
                    ids = [reply.body["task_id"]] if reply.status == 202 else []
                with lock:
                    replies[reply.status] += 1
                    ledger.add(ids)
                    if reply.status == 429 and len(refusals) < 50:
                        refusals.append((reply.text, reply.headers))

        def sample() -> None:
            while not stop.is_set():
                depth = env.inspector.depth("normal")[0]
                samples.append((time.monotonic() - started, rss_mb(api.pid), rss_mb(worker.pid), depth))
                stop.wait(0.5)

        worker.send_signal(signal.SIGSTOP)
        threads = [threading.Thread(target=flood, args=(i == 0,), daemon=True) for i in range(5)]
        threads.append(threading.Thread(target=sample, daemon=True))
        for t in threads:
            t.start()
        try:
            wait_until(lambda: replies[429] >= 20, 30, "the cap to be reached", state=lambda: dict(replies))
            high = env.client.submit([f"{CANARY} high"], priority="high")
            assert high.status == 202, high.text  # the cap is per priority
            ledger.add([high.body["task_id"]])
            worker.send_signal(signal.SIGCONT)
            resumed = time.monotonic() - started
            # Its course, and at least 8 samples of the resumed worker at work
            # (from 4 s after SIGCONT): on a slow machine the cap comes late.
            wait_until(lambda: time.monotonic() - started >= FLOOD_S
                       and sum(1 for s in list(samples) if s[0] >= resumed + 4) >= 8,
                       FLOOD_S + 60, "the flood to run its course", state=lambda: len(samples))
        finally:
            worker.send_signal(signal.SIGCONT)
            stop.set()
            for t in threads:
                t.join(30)

        for body, headers in refusals:
            assert '"backlog_full"' in body and headers.get("retry-after", "").isdigit(), (body, headers)
        records = ledger.settle(90)
        figures = ledger.report(records)
        # A refused submit leaves nothing behind: the table holds the accepted tasks only.
        assert env.inspector.count_records() == len(set(ledger.submitted))
        max_depth = max(s[3] for s in samples)
        # Bounded = flat once warm: each process's peak over the rest of the
        # flood against its size a few seconds into its work (the worker's work
        # starts when it is resumed).
        api_warm = [s[1] for s in samples if s[0] >= 3]
        worker_warm = [s[2] for s in samples if s[0] >= resumed + 4]
        assert len(api_warm) >= 10 and len(worker_warm) >= 8, samples
        api_warm, api_peak = api_warm[0], max(api_warm)
        worker_warm, worker_peak = worker_warm[0], max(worker_warm)
        print(f"scenario=backpressure_flood replies={dict(replies)} cap={CAP} max_depth={max_depth} "
              f"api_rss_mb={api_warm:.0f}->{api_peak:.0f} worker_rss_mb={worker_warm:.0f}->{worker_peak:.0f}")
        assert figures["lost"] == 0, ledger.lost_examples()
        assert figures["duplicated"] == 0
        assert replies[429] >= 20 and set(replies) <= {202, 429}, replies
        # Overshoot is bounded by the submits in flight at once (5 threads, a batch of 5).
        assert max_depth <= CAP + 10, max_depth
        assert api_peak - api_warm < 40 and worker_peak - worker_warm < 40, samples[-5:]
