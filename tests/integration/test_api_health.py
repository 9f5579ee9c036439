"""The probes and reads keep their budgets while submits hold every thread they may take."""

import asyncio
import threading
from contextlib import asynccontextmanager

import httpx
import pytest

from sluice.adapters.api_keys import ApiKeys
from sluice.adapters.task_store import TaskStore
from sluice.api.app import READY_BUDGET_S, SUBMIT_THREADS, create_app
from sluice.api.service import TaskService

LIVENESS_BUDGET_S = 1.0  # a kubelet's default probe timeout


@asynccontextmanager
async def submits_holding_every_request_thread(settings, monkeypatch):
    """A client of the app while more submits than it has request threads wait
    on a table that does not answer; the table answers on leaving."""
    # A cached key is checked on the event loop: the submits hold their threads only in the write.
    settings = settings.model_copy(update={"key_cache_s": 60})
    key = ApiKeys(settings).create("tenant-a")[0]
    threads = SUBMIT_THREADS
    table_answers, every_thread_held = threading.Event(), threading.Event()
    in_submit, lock = [0], threading.Lock()
    real_create_many, real_submit = TaskStore.create_many, TaskService.submit

    def slow_table(store, records, token=None):
        table_answers.wait(30)  # bounded, so that a failing test still ends
        return real_create_many(store, records, token)

    def counted_submit(service, *args):
        with lock:
            in_submit[0] += 1
            if in_submit[0] >= threads:
                every_thread_held.set()
        return real_submit(service, *args)

    monkeypatch.setattr(TaskStore, "create_many", slow_table)
    monkeypatch.setattr(TaskService, "submit", counted_submit)
    transport = httpx.ASGITransport(app=create_app(settings))
    async with httpx.AsyncClient(transport=transport, base_url="http://sluice", timeout=30) as http:
        headers = {"x-api-key": key}
        assert (await http.get("/v1/models", headers=headers)).status_code == 200  # the key is now cached
        body = {"model": "synthetic", "inputs": ["x"]}
        submits = [asyncio.create_task(http.post("/v1/tasks", json=body, headers=headers))
                   for _ in range(threads + 20)]
        try:
            held = await asyncio.to_thread(every_thread_held.wait, 30)
            assert held, f"{in_submit[0]} of {threads} request threads in a submit"
            yield http
        finally:
            table_answers.set()
            accepted = await asyncio.wait_for(asyncio.gather(*submits), 60)
    assert {r.status_code for r in accepted} == {202}


async def answered_within(request, budget_s: float) -> httpx.Response:
    try:
        return await asyncio.wait_for(request, budget_s)
    except asyncio.TimeoutError:
        pytest.fail(f"no answer within {budget_s} s")


def test_health_answers_at_once_while_submits_wait_on_the_table(settings, monkeypatch):
    async def main():
        async with submits_holding_every_request_thread(settings, monkeypatch) as http:
            health = await answered_within(http.get("/health"), LIVENESS_BUDGET_S)
            assert health.status_code == 200 and health.json() == {"status": "ok"}

    asyncio.run(main())


def test_ready_keeps_its_budget_while_submits_wait_on_the_table(settings, monkeypatch):
    async def main():
        async with submits_holding_every_request_thread(settings, monkeypatch) as http:
            # The probes' own calls are not the ones held up: it is ready.
            ready = await answered_within(http.get("/ready"), READY_BUDGET_S)
            assert ready.status_code == 200, ready.text

    asyncio.run(main())


def test_a_read_answers_at_once_while_submits_wait_on_the_table(settings, monkeypatch):
    # From one pool, submits waiting on a stalled dependency held every thread
    # (AnyIO's 40), and a GET or DELETE waited behind them.
    async def main():
        async with submits_holding_every_request_thread(settings, monkeypatch) as http:
            keys = ApiKeys(settings)
            key = keys.create("tenant-b")[0]
            missing = await answered_within(http.get("/v1/tasks/no-such-task", headers={"x-api-key": key}),
                                            LIVENESS_BUDGET_S)
            assert missing.status_code == 404, missing.text

    asyncio.run(main())
