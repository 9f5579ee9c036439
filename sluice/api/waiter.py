"""Long-poll support for GET /v1/tasks/{id}?wait_s=N.

Every request waiting on an unfinished task registers here; one poller per API
process reads all their records with a single BatchGetItem per round and wakes
each waiter when its task is final. So 64 waiting clients cost the table about
one read call per round instead of 64 (client-side polling was the largest
share of the table's load in bench/e2e.py).
"""

from __future__ import annotations

import asyncio

from sluice.adapters.task_store import TaskStore
from sluice.contract import TaskRecord, TaskStatus, now_ms


class CompletionWaiter:
    def __init__(self, store: TaskStore, interval_s: float = 0.05):
        self.store = store
        self.interval_s = interval_s
        self._waiting: dict[str, list[asyncio.Future]] = {}
        self._poller: asyncio.Task | None = None

    async def wait(self, task_id: str, timeout_s: float) -> TaskRecord | None:
        """The task's record once it is final (or overdue), or None if timeout_s passes first."""
        future = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(task_id, []).append(future)
        if self._poller is None or self._poller.done():
            self._poller = asyncio.create_task(self._poll())
        try:
            return await asyncio.wait_for(future, timeout_s)
        except asyncio.TimeoutError:
            return None
        finally:
            futures = self._waiting.get(task_id, [])
            if future in futures:
                futures.remove(future)
            if not futures:
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
            except Exception:
                # The table is unreachable: waiters time out and fall back to
                # the state they already returned; keep trying meanwhile.
                await asyncio.sleep(0.5)
                continue
            now = now_ms()
            for task_id, record in records.items():
                # A queued task past its deadline will never run: wake its
                # waiters too, and the route's GET marks it expired.
                overdue = record.status == TaskStatus.queued and record.deadline_at is not None \
                    and record.deadline_at <= now
                if record.status.is_terminal or overdue:
                    for future in self._waiting.get(task_id, []):
                        if not future.done():
                            future.set_result(record)
