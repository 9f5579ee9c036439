"""Does another busy Python thread slow MiniLM's forward pass?

    .venv/bin/python -m bench.gil_contention [--batch 32] [--device cpu|cuda] [--threads 1] [--seconds 4]

A worker runs inference on one thread while its other threads receive
messages, encode results and call AWS, all under one interpreter lock. torch
lets go of the lock inside each operation and takes it back after, so a
forward pass of many short operations (MiniLM on a GPU launches about 150
kernels) waits for the lock once per operation while another thread runs
Python. This times predict_batch alone, then beside one thread of pure-Python
work (what botocore's serializing and signing is), at the interpreter's
default switch interval (5 ms) and at 0.5 ms. `--threads 1` keeps the busy
thread off torch's cores on a small machine. bench/gpu.py runs it on CUDA at
batch 1024. Section 6 of docs/benchmarks.md says what it showed and why the
worker's setting was left as it is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as a worker runs

import torch  # noqa: E402

from bench.common import save, sentence  # noqa: E402
from models.minilm import MiniLMEmbed  # noqa: E402


def per_batch_ms(model: MiniLMEmbed, texts: list[str], seconds: float) -> float:
    for _ in range(3):
        model.predict_batch(texts)
    n, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        model.predict_batch(texts)
        n += 1
    return round((time.perf_counter() - started) / n * 1000, 2)


def busy_python(stop: threading.Event) -> None:
    while not stop.is_set():
        d = {}
        for i in range(200):
            d[str(i)] = [i, str(i) * 3]


def main() -> dict:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=min(4, os.cpu_count() or 1))
    p.add_argument("--seconds", type=float, default=4)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    model = MiniLMEmbed(device=a.device)
    model.load()
    texts = [sentence(i) for i in range(a.batch)]
    default_interval = sys.getswitchinterval()
    out: dict = {"batch": a.batch, "device": str(model.device), "threads": a.threads,
                 "alone_ms": per_batch_ms(model, texts, a.seconds)}
    stop = threading.Event()
    busy = threading.Thread(target=busy_python, args=(stop,), daemon=True)
    busy.start()
    try:
        for label, interval in (("beside_busy_thread_ms", default_interval), ("beside_busy_thread_0_5ms_switch_ms", 0.0005)):
            sys.setswitchinterval(interval)
            out[label] = per_batch_ms(model, texts, a.seconds)
    finally:
        sys.setswitchinterval(default_interval)
        stop.set()
        busy.join()
    out["slowdown"] = round(out["beside_busy_thread_ms"] / out["alone_ms"], 2)
    out["slowdown_0_5ms_switch"] = round(out["beside_busy_thread_0_5ms_switch_ms"] / out["alone_ms"], 2)
    save("gil_contention", out)
    print(json.dumps(out))  # one line: bench/gpu.py reads it
    return out


if __name__ == "__main__":
    main()
