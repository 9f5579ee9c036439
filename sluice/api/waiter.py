"""Long-poll support for GET /v1/tasks/{id}?wait_s=N.

Every request waiting on a task registers here; one poller per API process
reads all their records with a single BatchGetItem per round. A long poll's
first look at its task (`read`) joins a round too, so 64 waiting clients cost
the table about one read call per round instead of 64 plus one each
(client-side polling was the largest share of the table's load in bench/e2e.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from sluice.adapters.task_store import TaskStore
from sluice.contract import TaskRecord, TaskStatus, now_ms


@dataclass
class _Waiter:
    future: asyncio.Future
    any_state: bool  # wake on the next read, whatever the task's state (or absence)


class CompletionWaiter:
    def __init__(self, store: TaskStore, interval_s: float = 0.05):
        self.store = store
        self.interval_s = interval_s
        self._waiting: dict[str, list[_Waiter]] = {}
        self._poller: asyncio.Task | None = None

    async def read(self, task_id: str) -> TaskRecord | None:
        """The task's record as the next round reads it; None if there is none."""
        return await self._register(task_id, None, any_state=True)

    async def wait(self, task_id: str, timeout_s: float) -> TaskRecord | None:
        """The task's record once it is final (or overdue), or None if timeout_s passes first."""
        return await self._register(task_id, timeout_s, any_state=False)

    async def _register(self, task_id: str, timeout_s: float | None, any_state: bool) -> TaskRecord | None:
        waiter = _Waiter(asyncio.get_running_loop().create_future(), any_state)
        self._waiting.setdefault(task_id, []).append(waiter)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll())
        try:
            return await asyncio.wait_for(waiter.future, timeout_s)
        except asyncio.TimeoutError:
            return None
        finally:
            waiters = self._waiting.get(task_id, [])
            if waiter in waiters:
                waiters.remove(waiter)
            if not waiters:
                self._waiting.pop(task_id, None)

    async def _poll(self) -> None:
        # Everything but the read itself runs on the event loop, so the
        # registry needs no lock.
        while self._waiting:
            await asyncio.sleep(self.interval_s)
            ids = list(self._waiting)
            if not ids:
                break
            try:
                records = await asyncio.to_thread(self.store.get_many, ids)
            except Exception as exc:
                # The table is unreachable: a first read fails like a plain
                # GET would; waiters for an outcome time out and fall back to
                # the state they already returned. Keep trying meanwhile.
                for task_id in ids:
                    for w in self._waiting.get(task_id, []):
                        if w.any_state and not w.future.done():
                            w.future.set_exception(exc)
                await asyncio.sleep(0.5)
                continue
            now = now_ms()
            for task_id in ids:
                record = records.get(task_id)
                # A queued task past its deadline will never run: wake its
                # waiters too, and the route's GET marks it expired.
                final = record is not None and (record.status.is_terminal or (
                    record.status == TaskStatus.queued and record.deadline_at is not None
                    and record.deadline_at <= now))
                for w in self._waiting.get(task_id, []):
                    if (w.any_state or final) and not w.future.done():
                        w.future.set_result(record)
