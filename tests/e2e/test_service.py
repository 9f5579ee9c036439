"""The running embedded service, driven only through its HTTP API."""

import math
import random
import subprocess
import sys
from collections import Counter

import pytest

pytestmark = pytest.mark.slow

PARAPHRASES = ("A man is eating food.", "A man is eating a piece of bread.")
UNRELATED = "The stock market closed higher on Friday."


def cosine(a, b):
    return sum(x * y for x, y in zip(a, b))


def test_embeddings_are_unit_vectors_that_rank_a_paraphrase_first(client):
    status, accepted = client.call("POST", "/v1/tasks", {
        "model": "minilm-embed", "inputs": [*PARAPHRASES, UNRELATED], "priority": "high"})
    assert status == 202
    view = client.wait_final([accepted["task_id"]], 60)[accepted["task_id"]]
    assert view["status"] == "succeeded", view
    result = view["result"]
    assert result["dim"] == 384 and len(result["embeddings"]) == 3
    for vector in result["embeddings"]:
        assert len(vector) == 384
        assert math.isclose(math.sqrt(sum(v * v for v in vector)), 1.0, abs_tol=1e-3)
    a, b, c = result["embeddings"]
    assert cosine(a, b) > cosine(a, c) + 0.3
    assert view["model_version"] == "all-MiniLM-L6-v2"
    assert view["timings"]["inference_ms"] is not None and view["timings"]["queue_ms"] >= 0


def test_200_mixed_priority_tasks_all_succeed_once_with_correct_embeddings(client):
    rng = random.Random(7)
    sentences = [f"Request {i}: the {rng.choice(['cat', 'dog', 'bird'])} sat on the mat." for i in range(200)]
    priorities = [rng.choice(["high", "normal", "low"]) for _ in sentences]
    task_ids = []
    for start in range(0, 200, 50):  # batch endpoint and single submits both in play
        chunk = [{"model": "minilm-embed", "inputs": [s], "priority": p}
                 for s, p in zip(sentences[start:start + 50], priorities[start:start + 50])]
        if start % 100 == 0:
            status, body = client.call("POST", "/v1/tasks/batch", {"tasks": chunk})
            assert status == 202, body
            task_ids += [t["task_id"] for t in body["tasks"]]
        else:
            for task in chunk:
                status, body = client.call("POST", "/v1/tasks", task)
                assert status == 202, body
                task_ids.append(body["task_id"])
    assert len(set(task_ids)) == 200
    views = client.wait_final(task_ids, 180)
    outcomes = Counter(v["status"] for v in views.values())
    assert outcomes == {"succeeded": 200}, outcomes
    assert all(v["attempts"] == 1 for v in views.values()), "a task ran twice"
    # Each result belongs to its own input: the same sentence embedded alone matches it.
    probe = 137
    status, body = client.call("POST", "/v1/tasks", {"model": "minilm-embed", "inputs": [sentences[probe]]})
    alone = client.wait_final([body["task_id"]])[body["task_id"]]["result"]["embeddings"][0]
    batched = views[task_ids[probe]]["result"]["embeddings"][0]
    assert cosine(alone, batched) > 0.999
    sizes = [v["batch_size"] for v in views.values()]
    assert max(sizes) > 1, "the batcher never packed tasks together"


def test_errors_are_clear_and_isolated_per_tenant(client, stack):
    other = stack.create_key("someone-else")
    status, body = client.call("POST", "/v1/tasks", {"model": "minilm-embed", "inputs": ["mine"]})
    assert client.call("GET", f"/v1/tasks/{body['task_id']}", key=other)[0] == 404
    status, body = client.call("POST", "/v1/tasks", {"model": "gpt-9", "inputs": ["x"]})
    assert status == 422 and body["error"]["details"][0]["field"] == "model"
    assert client.call("GET", "/v1/models", key="sk_wrong")[0] == 403


def test_cli_creates_keys_and_submits_against_the_running_service(stack, tmp_path):
    env = {**stack.env(), "SLUICE_STATE_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-m", "sluice.cli", "keys", "create", "--tenant", "cli"],
                         env=env, capture_output=True, text=True, timeout=60, check=True).stdout
    key = out.split()[-1]
    assert key.startswith("sk_")
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "--url", stack.url, "--api-key", key,
                           "submit", "--wait", "--model", "synthetic", "hello"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert '"status": "succeeded"' in done.stdout


def test_workers_exit_cleanly_on_sigterm(stack):
    # Runs last in this module: replaces worker-1 with a fresh one after checking its exit.
    assert stack.stop_process("worker-1", timeout_s=30) == 0
    stack.start_worker(1)
