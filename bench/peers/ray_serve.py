"""Ray Serve with @serve.batch, the configuration that measured best here
(2 replicas x 1 torch thread, batch 32, 10 ms wait). Runs in .venv-peers:

    .venv-peers/bin/python -m bench.peers.ray_serve --requests 2000 --clients 64
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench.common import Http, closed_loop, free_port, sentence  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--replicas", type=int, default=2)
    a = p.parse_args()

    import ray
    from ray import serve
    from starlette.requests import Request

    @serve.deployment(num_replicas=a.replicas, ray_actor_options={"num_cpus": 1}, max_ongoing_requests=64)
    class Embedder:
        def __init__(self):
            import torch

            from models.minilm import MiniLMEmbed

            torch.set_num_threads(1)
            self.model = MiniLMEmbed(device="cpu")
            self.model.load()

        @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
        async def embed(self, texts: list[str]) -> list[list[float]]:
            return self.model.predict_batch(texts)

        async def __call__(self, request: Request) -> dict:
            return {"embedding": await self.embed((await request.json())["text"])}

    port = free_port()
    started = time.monotonic()
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             _node_ip_address="127.0.0.1")
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(Embedder.bind(), route_prefix="/")
    ready_s = time.monotonic() - started

    def one(client, i):
        status, body = client.call("POST", "/", {"text": sentence(i)})
        if status != 200 or len(body.get("embedding", [])) != 384:
            raise RuntimeError(f"{status}")

    url = f"http://127.0.0.1:{port}"
    closed_loop(64, 8, lambda: Http(url), one, 60)  # warm-up
    r = closed_loop(a.requests, a.clients, lambda: Http(url), one, timeout_s=240)
    serve.shutdown()
    ray.shutdown()
    print(json.dumps({"system": "Ray Serve", "version": ray.__version__, "ready_s": round(ready_s, 1),
                      "config": f"{a.replicas} replicas x 1 torch thread, @serve.batch(32, 10 ms)", **r.summary()}))


if __name__ == "__main__":
    main()
