"""How deep each priority queue is, as the API sees it on every submit.

A submit should not wait for SQS to count a queue: GetQueueAttributes is a
round trip, and made inline once a second per queue it lands on some request's
latency (its p99 at one client). So a queue's depth is the one last read plus
what this process sent since, and a reading older than `max_age_s` is renewed
in the background while the older figure answers. Near the cap the depth is
read inline instead, so that the cap is overshot by the submits in flight at
once, not by a second's worth (plus, on AWS, what SQS has not counted yet: its
count is eventually consistent; docs/reliability.md). A reading older than `stale_s` (the API sat
idle) is read inline too: it would give a queue position from long ago.

Successive readings also measure how fast the workers take tasks off each
queue (the depth then, plus what was sent since, less the depth now), which
turns a queue position into an estimated wait. Only readings with tasks
waiting at both ends measure it: from a queue the workers keep up with, what
left is what arrived, not their pace, and under light load that made waits of
seconds out of none. A queue position counts down at that pace from its
reading (what the workers took since); the cap is held against the depth
without it, since stalled workers take nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from botocore.exceptions import BotoCoreError, ClientError

from sluice.contract import Priority

log = logging.getLogger("sluice.api")


# Readings closer together than this measure the drain rate too noisily.
_RATE_WINDOW_S = 0.5


class QueueBacklog:
    def __init__(self, read: Callable[[Priority], int], cap: int, max_age_s: float = 1.0,
                 recheck_fraction: float = 0.9, stale_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        """`read` counts a queue's visible messages (one GetQueueAttributes)."""
        self._read = read
        self.cap, self.max_age_s, self.stale_s = cap, max_age_s, stale_s
        self._clock = clock
        self._recheck_at = cap * recheck_fraction
        self._seen: dict[Priority, tuple[float, int, int]] = {}  # read at, depth then, sent since
        # The drain rate's baseline is kept apart from the depth's: near the cap
        # readings come closer together than _RATE_WINDOW_S, and each would
        # otherwise restart the window before it could measure anything.
        self._rate_base: dict[Priority, tuple[float, int, int]] = {}  # read at, depth then, sent since
        self._rate: dict[Priority, float] = {}  # tasks/s taken off the queue, smoothed
        self._renewing: set[Priority] = set()
        self._sent_total: dict[Priority, int] = {}  # ever, so a reading can tell what was sent while it ran
        self._reads_started = 0  # orders readings by when they started, whenever they land
        self._seen_started: dict[Priority, int] = {}  # the held reading's place in that order
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sluice-backlog")

    def depth(self, priority: Priority) -> int:
        """The depth to hold against the cap: read inline when unknown or near the cap."""
        estimate = self._estimate(priority, counted_down=False)
        if estimate is not None and estimate < self._recheck_at:
            return estimate
        return self._read_now(priority)

    def estimate(self, priority: Priority) -> int:
        """The depth for a queue-position estimate; when the queue cannot be
        read, the last figure (0 if there is none)."""
        estimate = self._estimate(priority, counted_down=True)
        if estimate is not None:
            return estimate
        try:
            return self._read_now(priority)
        except (BotoCoreError, ClientError):
            with self._lock:
                seen = self._seen.get(priority)
            return seen[1] + seen[2] if seen else 0

    def drain_rate(self) -> float | None:
        """Tasks a second the workers took off all the queues, as last measured;
        None before two readings of a queue measured it."""
        with self._lock:
            return sum(self._rate.values()) if self._rate else None

    def sent(self, priority: Priority, n: int) -> None:
        with self._lock:
            self._sent_total[priority] = self._sent_total.get(priority, 0) + n
            # Before the first reading there is nothing to add to: it will count them.
            for readings in (self._seen, self._rate_base):
                if priority in readings:
                    read_at, depth, sent = readings[priority]
                    readings[priority] = (read_at, depth, sent + n)

    def _estimate(self, priority: Priority, counted_down: bool) -> int | None:
        """The last reading plus what was sent since; `counted_down`: less what
        the workers took since at their measured pace."""
        with self._lock:
            seen = self._seen.get(priority)
            if seen is None:
                return None
            read_at, depth, sent = seen
            age = self._clock() - read_at
            if age >= self.stale_s:
                return None
            renew = age >= self.max_age_s and priority not in self._renewing
            if renew:
                self._renewing.add(priority)
            taken = self._rate.get(priority, 0.0) * age if counted_down else 0.0
        if renew:
            self._pool.submit(self._renew, priority)
        return max(0, round(depth + sent - taken))

    def _renew(self, priority: Priority) -> None:
        try:
            self._read_now(priority)
        except (BotoCoreError, ClientError) as exc:
            # The older figure keeps answering; the next submit tries again.
            log.warning("could not read the %s queue's depth: %s", priority.value, type(exc).__name__)
        finally:
            with self._lock:
                self._renewing.discard(priority)

    def _read_now(self, priority: Priority) -> int:
        with self._lock:
            read_at, sent_before = self._clock(), self._sent_total.get(priority, 0)
            self._reads_started += 1
            started = self._reads_started
        depth = self._read(priority)
        with self._lock:
            # What was sent while the read ran may be missing from its count:
            # counted on top, the cap is held against too much, never too little.
            during = self._sent_total.get(priority, 0) - sent_before
            held = self._seen.get(priority)
            if held is not None and self._seen_started[priority] > started:
                # A later reading landed first (an inline one near the cap, while
                # this renewal's answer was slow): this one would put back an
                # older depth and drop what was sent since.
                return held[1] + held[2]
            self._seen[priority], self._seen_started[priority] = (read_at, depth, during), started
            base = self._rate_base.get(priority)
            if base is None or read_at - base[0] >= _RATE_WINDOW_S:
                self._rate_base[priority] = (read_at, depth, during)
            if base and read_at - base[0] >= _RATE_WINDOW_S and base[1] > 0 and depth > 0:
                then, depth_then, sent = base
                taken = max(0, depth_then + sent - depth) / (read_at - then)
                old = self._rate.get(priority)
                self._rate[priority] = taken if old is None else (old + taken) / 2
        return depth + during
