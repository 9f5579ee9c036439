import pytest
from fastapi.testclient import TestClient

from sluice.adapters.api_keys import ApiKeys
from sluice.api.app import create_app
from sluice.api.waiter import CompletionWaiter
from sluice.worker.runner import BatchRunner
from models.synthetic import SyntheticModel


@pytest.fixture
def api(settings):
    """The real app in-process, talking HTTP to the emulator; two tenants' keys."""
    keys = ApiKeys(settings)
    client = TestClient(create_app(settings), raise_server_exceptions=False)
    client.key_a = keys.create("tenant-a")[0]
    client.key_b = keys.create("tenant-b")[0]
    client.keys = keys
    return client


@pytest.fixture
def runner(settings):
    return BatchRunner(settings, {"synthetic": SyntheticModel(base_ms=0, per_item_ms=0)})


@pytest.fixture
def entered_waiters(monkeypatch):
    """The API's CompletionWaiter, each time a long poll enters its wait():
    how a test knows a GET has parked there before it changes the task."""
    entered = []
    real_wait = CompletionWaiter.wait

    async def spied_wait(self, task_id, timeout_s):
        entered.append(self)
        return await real_wait(self, task_id, timeout_s)

    monkeypatch.setattr(CompletionWaiter, "wait", spied_wait)
    return entered
