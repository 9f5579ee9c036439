"""The raw model in a plain torch loop: the ceiling Sluice is measured against.

Run as its own process with the worker's thread count, so it gets the same CPU
a worker would. Prints one JSON line.

    .venv/bin/python -m bench.rawmodel --batch 32 --threads 2 --seconds 8
"""

from __future__ import annotations

import argparse
import json
import time

from bench.common import sentence


def measure(batch: int, threads: int, seconds: float, dtype: str, device: str = "cpu") -> dict:
    import torch

    from models.minilm import MiniLMEmbed

    torch.set_num_threads(threads)
    model = MiniLMEmbed(device=device, dtype=dtype)
    model.load()
    texts = [sentence(i) for i in range(4096)]
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    for i in range(3):  # warm-up: first calls allocate and pick kernels
        model.embed(texts[i * batch:(i + 1) * batch])
    sync()
    n, i = 0, 0
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        chunk = [texts[(i + j) % len(texts)] for j in range(batch)]
        model.embed(chunk).cpu()  # tokenize + forward + copy out: what a plain serving loop does
        n += batch
        i += batch
    sync()
    elapsed = time.perf_counter() - started
    return {"batch": batch, "threads": threads, "dtype": dtype, "device": str(model.device),
            "sentences": n, "seconds": round(elapsed, 2), "per_s": round(n / elapsed, 1)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=8)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    print(json.dumps(measure(a.batch, a.threads, a.seconds, a.dtype, a.device)), flush=True)


if __name__ == "__main__":
    main()
