"""Promise 8: keys stored hashed, tenant isolation on every route, request size
limits, per-key rate limits (embedded profile), and no secret or payload in
any log the stacks of this session wrote. Runs last of the reliability set, so
its log check also covers the logs of the other scenarios' stacks.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import urllib.parse

import pytest

from models.synthetic import FAIL_MARKER
from tests.reliability.harness import CANARY, LOG_DIRS, SECRETS, Ledger, running_stack, wait_until

pytestmark = pytest.mark.slow

RATE, BURST = 2, 20
ENV = {"SLUICE_RATE_LIMIT_PER_S": str(RATE), "SLUICE_RATE_LIMIT_BURST": str(BURST), "SLUICE_ACCESS_LOG": "1",
       "SLUICE_MAX_BODY_BYTES": str(256 * 1024)}


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with running_stack(tmp_path_factory.mktemp("security-logs"), workers=1, env=ENV) as running:
        yield running


def test_keys_are_stored_only_as_hashes(env):
    key = env.new_key("hash-check")
    items = env.inspector.ddb.scan(TableName="sluice-api-keys")["Items"]
    dumped = json.dumps(items)
    assert key not in dumped and env.client.key not in dumped
    assert hashlib.sha256(key.encode()).hexdigest() in {i["key_hash"]["S"] for i in items}


def test_every_route_needs_a_key_and_no_tenant_sees_another(env):
    ledger = Ledger("tenant_isolation", env.inspector)
    a, b = env.new_key("tenant-a"), env.new_key("tenant-b")
    schema = env.client.call("GET", "/openapi.json").body
    routes = [(method.upper(), path) for path, ops in schema["paths"].items() for method in ops
              if path.startswith("/v1/")]
    assert len(routes) >= 5, routes
    for method, path in routes:
        url = path.replace("{task_id}", "0" * 32)
        assert env.client.call(method, url, {}, key="").status == 401, (method, path)
        assert env.client.call(method, url, {}, key="sk_not_a_key").status == 403, (method, path)

    mine = env.client.submit([f"{CANARY} a's secret"], key=a, deadline_s=600)
    batch = env.client.call("POST", "/v1/tasks/batch", {"tasks": [{"model": "synthetic", "inputs": [f"{CANARY} b"]}]},
                            key=b)
    assert mine.status == batch.status == 202
    a_id, b_id = mine.body["task_id"], batch.body["tasks"][0]["task_id"]
    ledger.add([a_id, b_id])
    for method in ("GET", "DELETE"):
        for task_id, other in ((a_id, b), (b_id, a)):
            reply = env.client.call(method, f"/v1/tasks/{task_id}", key=other)
            # Exactly what a task that does not exist looks like: nothing to probe.
            assert reply.status == 404 and reply.body["error"]["code"] == "not_found", reply.text
    # The same Idempotency-Key names different tasks for different tenants.
    first = env.client.submit([f"{CANARY} same"], key=a, idempotency_key="shared-key")
    second = env.client.submit([f"{CANARY} same"], key=b, idempotency_key="shared-key")
    assert first.body["task_id"] != second.body["task_id"]
    ledger.add([first.body["task_id"], second.body["task_id"]])
    records = ledger.settle(60)
    assert records[a_id].tenant_id == "tenant-a" and records[b_id].tenant_id == "tenant-b"
    figures = ledger.report(records)
    assert figures["lost"] == 0 and figures["duplicated"] == 0 and figures["succeeded"] == 4


def test_requests_over_the_size_limits_are_refused_before_they_are_read(env):
    key = env.new_key("sizes")
    big = json.dumps({"model": "synthetic", "inputs": ["x" * 8000] * 40}).encode()  # ~320 KB > 256 KB
    reply = env.client.call("POST", "/v1/tasks", raw=big, key=key)
    assert reply.status == 413 and reply.body["error"]["code"] == "payload_too_large", reply.text
    # The same body without a Content-Length (chunked) is cut off as it streams in.
    url = urllib.parse.urlsplit(env.stack.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    conn.putrequest("POST", "/v1/tasks")
    for k, v in (("x-api-key", key), ("content-type", "application/json"), ("transfer-encoding", "chunked")):
        conn.putheader(k, v)
    conn.endheaders()
    try:
        for i in range(0, len(big), 65536):
            chunk = big[i:i + 65536]
            conn.send(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
        conn.send(b"0\r\n\r\n")
    except OSError:
        pass  # the server answered and closed before the rest was sent: the point
    response = conn.getresponse()
    assert response.status == 413, response.read()[:300]
    conn.close()
    # Within the byte limit, the contract's own limits still hold.
    too_many = env.client.submit([f"{CANARY}"] * 65, key=key)
    too_long = env.client.submit(["y" * 8193], key=key)
    assert too_many.status == too_long.status == 422
    # A header far over any sane size is refused by the server, not a crash.
    huge_key = env.client.call("GET", "/v1/models", key="k" * 70_000)
    assert 400 <= huge_key.status < 500


def test_each_key_is_rate_limited_on_its_own(env):
    noisy, quiet = env.new_key("noisy"), env.new_key("quiet")
    statuses = [env.client.call("GET", "/v1/models", key=noisy) for _ in range(BURST + 15)]
    allowed = sum(r.status == 200 for r in statuses)
    limited = [r for r in statuses if r.status == 429]
    print(f"scenario=rate_limit burst={BURST} rate={RATE}/s allowed={allowed} limited={len(limited)}")
    # The burst, plus what refills while the calls run, then 429s with Retry-After.
    assert BURST <= allowed < BURST + 15 and limited
    assert all(r.body["error"]["code"] == "rate_limited" and r.headers["retry-after"].isdigit() for r in limited)
    assert env.client.call("GET", "/v1/models", key=quiet).status == 200  # another key is unaffected
    wait_until(lambda: env.client.call("GET", "/v1/models", key=noisy).status == 200, 5,
               "the noisy key's bucket to refill", every_s=0.5)


def test_no_secret_or_payload_reaches_a_log(env):
    # Give the logs something to hold: a failing task and refused calls.
    reply = env.client.submit([f"{CANARY} {FAIL_MARKER} log-check"])
    ledger = Ledger("log_hygiene", env.inspector)
    ledger.add([reply.body["task_id"]], intended="failed")
    env.client.call("GET", "/v1/models", key="sk_wrong_" + CANARY)
    ledger.settle(60)
    logs = [p for d in LOG_DIRS for p in sorted(d.glob("*.log")) if not p.name.startswith("emulator")]
    assert logs and any("POST /v1/tasks" in p.read_text(errors="replace") for p in logs), "no access log to check"
    leaks = []
    for path in logs:
        text = path.read_text(errors="replace")
        leaks += [(path.name, "payload") for _ in range(text.count(CANARY))][:1]
        leaks += [(path.name, "api key") for s in SECRETS if s in text][:1]
    print(f"scenario=log_hygiene logs_checked={len(logs)} secrets={len(SECRETS)} leaks={len(leaks)}")
    assert not leaks, leaks
