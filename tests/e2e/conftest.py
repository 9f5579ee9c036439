import json
import os
import time
import urllib.error
import urllib.request

import pytest

from onprem.embedded import Stack, default_ddb, default_sqs, free_port


class Client:
    """A tiny HTTP client for the running service (stdlib only, like a user's script)."""

    def __init__(self, url: str, key: str):
        self.url, self.key = url, key

    def call(self, method: str, path: str, body=None, key: str | None = None):
        request = urllib.request.Request(
            self.url + path, method=method, data=json.dumps(body).encode() if body is not None else None,
            headers={"content-type": "application/json", "x-api-key": key or self.key})
        try:
            with urllib.request.urlopen(request, timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as err:
            return err.code, json.loads(err.read() or b"{}")

    def wait_final(self, task_ids, timeout_s: float = 120) -> dict[str, dict]:
        """Poll until every task is final; fails with the stragglers named."""
        pending, done = set(task_ids), {}
        deadline = time.monotonic() + timeout_s
        while pending and time.monotonic() < deadline:
            for task_id in list(pending):
                status, view = self.call("GET", f"/v1/tasks/{task_id}")
                assert status == 200, view
                if view["status"] != "queued":
                    done[task_id] = view
                    pending.discard(task_id)
            if pending:
                time.sleep(0.2)
        assert not pending, f"{len(pending)} tasks not final after {timeout_s}s, e.g. {sorted(pending)[:3]}"
        return done


@pytest.fixture(scope="session")
def stack(tmp_path_factory):
    """The embedded profile, started as `make run` starts it: real processes, real model."""
    s = Stack(api_port=free_port(), workers=2, sqs=default_sqs(), ddb=default_ddb(),
              log_dir=tmp_path_factory.mktemp("logs"), env_overrides={"SLUICE_ACCESS_LOG": "0"})
    try:
        s.start()
        yield s
    finally:
        s.stop()
        if os.environ.get("CI"):
            for log in sorted(s.log_dir.glob("*.log")):
                tail = log.read_text(errors="replace").splitlines()[-15:]
                print(f"--- {log.name}\n" + "\n".join(tail))


@pytest.fixture(scope="session")
def client(stack):
    return Client(stack.url, stack.create_key("e2e"))
