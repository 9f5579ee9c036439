"""Celery + Redis, the architecture many teams start with: one text per task,
prefork workers with one torch thread each, results in Redis. Runs in .venv-peers:

    .venv-peers/bin/python -m bench.peers.celery_redis --requests 2000 --clients 64
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

from celery import Celery

from bench.common import ROOT, closed_loop, free_port, sentence

BROKER = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
app = Celery("bench", broker=BROKER, backend=BROKER)
app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                worker_prefetch_multiplier=4, result_expires=600)
_model = None


@app.task(name="embed")
def embed(text: str) -> list[float]:
    global _model
    if _model is None:  # once per prefork child
        import torch

        from models.minilm import MiniLMEmbed

        torch.set_num_threads(1)
        _model = MiniLMEmbed(device="cpu")
        _model.load()
    return _model.predict_batch([text])[0]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=2)
    a = p.parse_args()

    redis_bin = shutil.which("redis-server")
    if not redis_bin:
        sys.exit("redis-server not found (apt-get install redis-server)")
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    data = tempfile.mkdtemp(prefix="bench-redis-")
    redis = subprocess.Popen([redis_bin, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                              "--appendonly", "no", "--dir", data], stdout=subprocess.DEVNULL)
    env = {**os.environ, "BENCH_REDIS_URL": url, "OMP_WAIT_POLICY": "PASSIVE", "PYTHONPATH": str(ROOT)}
    worker = subprocess.Popen([sys.executable, "-m", "celery", "-A", "bench.peers.celery_redis", "worker",
                               "-P", "prefork", "-c", str(a.concurrency), "--loglevel", "WARNING"],
                              cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        app.conf.broker_url = app.conf.result_backend = url
        started = time.monotonic()
        for _ in range(a.concurrency * 2):  # every prefork child loads its model before timing starts
            embed.delay("warm up").get(timeout=120)

        def one(_client, i):
            if len(embed.delay(sentence(i)).get(timeout=120)) != 384:
                raise RuntimeError("bad result")

        closed_loop(64, 8, lambda: None, one, 60)
        ready_s = time.monotonic() - started
        r = closed_loop(a.requests, a.clients, lambda: None, one, timeout_s=240)
    finally:
        worker.terminate()
        try:
            worker.wait(20)
        except subprocess.TimeoutExpired:
            worker.kill()
        redis.terminate()
        redis.wait(10)
        shutil.rmtree(data, ignore_errors=True)
    import celery

    print(json.dumps({"system": "Celery + Redis", "version": celery.__version__, "ready_s": round(ready_s, 1),
                      "config": f"{a.concurrency} prefork workers x 1 torch thread, one text per task", **r.summary()}))


if __name__ == "__main__":
    main()
