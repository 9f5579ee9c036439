"""Long-poll support for GET /v1/tasks/{id}?wait_s=N.

Every request waiting on a task registers here; one poller per API process
reads their records with a single BatchGetItem per round. A long poll's first
look at its task (`read`) joins a round too, so 64 waiting clients cost the
table about one read call per round instead of 64 plus one each (client-side
polling was the largest share of the table's load in bench/e2e.py).

DynamoDB bills every item a BatchGetItem reads, so a round reads only the
tasks due then, each on its waiter's schedule (READ_SCHEDULE), counted from
when the waiter registered: every round for its first 2 s, when most tasks
finish (bench/e2e.py's within 0.2-2 s), then every 250 ms, and every second
after 5 s, with one last read a round before its deadline. A 20 s wait reads
its task about 65 times instead of 347 on the emulator (a client polling once a second: 20).
A wait that times out hands back what its latest read saw, so the route
answers the task's current state without a read of its own. A task is read
for all its waiters at once: a newcomer makes it due every round again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sluice.adapters.task_store import TaskStore, UnreadableRecord
from sluice.contract import TaskRecord, now_ms

# (from this long into a wait, read the task every this many seconds); None: every round.
READ_SCHEDULE: tuple[tuple[float, float | None], ...] = ((0.0, None), (2.0, 0.25), (5.0, 1.0))


@dataclass(eq=False)
class _Waiter:
    future: asyncio.Future
    any_state: bool  # wake on the next read, whatever the task's state (or absence)
    since: float  # the loop's time when it registered: its schedule counts from here
    due: float  # the loop's time of its next read
    until: float  # the loop's time when it gives up (inf: never)
    last: TaskRecord | None = None  # what the latest round read (None: nothing yet, or no record)


class CompletionWaiter:
    def __init__(self, store: TaskStore, interval_s: float = 0.05,
                 schedule: tuple[tuple[float, float | None], ...] = READ_SCHEDULE):
        self.store = store
        self.interval_s = interval_s
        self.schedule = schedule
        self._waiting: dict[str, list[_Waiter]] = {}
        self._poller: asyncio.Task | None = None

    async def read(self, task_id: str) -> TaskRecord | None:
        """The task's record as the next round reads it; None if there is none."""
        return await self._register(task_id, None, any_state=True)

    async def wait(self, task_id: str, timeout_s: float) -> TaskRecord | None:
        """The task's record once it is final (or overdue). If timeout_s passes
        first, the latest record a round read meanwhile (not final), or None if
        no round read one."""
        return await self._register(task_id, timeout_s, any_state=False)

    def _every(self, waited_s: float) -> float:
        every = self.interval_s
        for from_s, period in self.schedule:
            if waited_s >= from_s:
                every = period or self.interval_s
        return every

    def _next(self, w: _Waiter, now: float) -> float:
        due = now + self._every(now - w.since)
        # One last read a round before the deadline, so that a task final late
        # in the wait is still noticed, and a wait that times out answers a
        # state at most a round or so old: at most one read more per wait.
        last = w.until - self.interval_s
        return last if now < last < due else due

    async def _register(self, task_id: str, timeout_s: float | None, any_state: bool) -> TaskRecord | None:
        loop = asyncio.get_running_loop()
        now = loop.time()
        until = now + timeout_s if timeout_s is not None else float("inf")
        waiter = _Waiter(loop.create_future(), any_state, since=now, due=now, until=until)
        self._waiting.setdefault(task_id, []).append(waiter)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll())
        try:
            return await asyncio.wait_for(waiter.future, timeout_s)
        except asyncio.TimeoutError:
            return waiter.last
        finally:
            waiters = self._waiting.get(task_id, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._waiting.pop(task_id, None)

    async def _poll(self) -> None:
        # Everything but the read itself runs on the event loop, so the
        # registry needs no lock.
        loop = asyncio.get_running_loop()
        while self._waiting:
            await asyncio.sleep(self.interval_s)
            started = loop.time()
            # Half a round's slack: a read due just after this round is taken
            # now, not a whole round late.
            soon = started + self.interval_s / 2
            ids = [t for t, waiters in self._waiting.items() if any(w.due <= soon for w in waiters)]
            if not ids:
                continue  # every waiter is between reads: no call this round
            unreadable: dict[str, UnreadableRecord] = {}  # a newer release wrote them: their own waiters' failure
            try:
                records = await asyncio.to_thread(self.store.get_many, ids, unreadable)
            except Exception as exc:  # noqa: BLE001 - handed to the round's first looks, the poll goes on
                # The table is unreachable (or the read failed otherwise): a
                # first read fails like a plain GET would; waiters for an
                # outcome time out and fall back to the latest state they
                # read. Keep trying meanwhile (they stay due).
                for task_id in ids:
                    self._fail_first_looks(task_id, exc)
                await asyncio.sleep(0.5)
                continue
            now = now_ms()
            for task_id in ids:
                record = records.get(task_id)
                if task_id in unreadable:
                    self._fail_first_looks(task_id, unreadable[task_id])
                    for w in self._waiting.get(task_id, []):  # not due again every round meanwhile
                        w.due = self._next(w, started)
                    continue
                # A queued task past its deadline will never run: wake its
                # waiters too, and the route's GET marks it expired.
                final = record is not None and (record.status.is_terminal or record.overdue(now))
                for w in self._waiting.get(task_id, []):
                    if w.since > started:
                        continue  # registered while this read was on its way: it may be older than the request
                    w.last = record
                    w.due = self._next(w, started)
                    if (w.any_state or final) and not w.future.done():
                        w.future.set_result(record)

    def _fail_first_looks(self, task_id: str, exc: Exception) -> None:
        for w in self._waiting.get(task_id, []):
            if w.any_state and not w.future.done():
                w.future.set_exception(exc)
