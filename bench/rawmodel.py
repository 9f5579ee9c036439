"""The raw model in a plain torch loop: the ceiling Sluice is measured against.

Run as its own process with the worker's thread count and the worker's
OpenMP setting (OMP_WAIT_POLICY=PASSIVE unless the environment says
otherwise, as models/registry.py sets it for a worker before torch loads), so
it gets the same CPU a worker would. Prints one JSON line per batch size.

    .venv/bin/python -m bench.rawmodel --batch 32 --threads 2 --seconds 8
    .venv/bin/python -m bench.rawmodel --batch 64,256,1024 --device cuda --seconds 6

Each line also says what the loop computed: the tokens it fed the model,
padded as each real batch was (the longest sentence of the batch), and the
wall-clock window of the timed loop (time.time(), for a utilization sampler).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections import Counter

# Before torch (and with it the OpenMP runtime) is imported, as for a worker.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from bench.common import sentence  # noqa: E402

TEXTS = 4096


def thread_settings() -> dict:
    import torch

    return {"omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "torch_threads": torch.get_num_threads(), "torch_interop_threads": torch.get_num_interop_threads()}


def padded_lengths(tokenizer, texts: list[str], batch: int, starts: Counter) -> Counter:
    """{padded length: batches} for the batches the loop ran (one per start
    offset counted in `starts`), each padded to its own longest sentence as
    MiniLMEmbed.embed pads it. Computed after the timed loop, not in it."""
    lengths: Counter = Counter()
    for start, times in starts.items():
        chunk = [texts[(start + j) % len(texts)] for j in range(batch)]
        lengths[max(len(e.ids) for e in tokenizer.encode_batch(chunk))] += times
    return lengths


def measure_loaded(model, batch: int, threads: int, seconds: float, dtype: str) -> dict:
    import torch

    texts = [sentence(i) for i in range(TEXTS)]
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    for i in range(3):  # warm-up: first calls allocate and pick kernels
        model.embed([texts[(i * batch + j) % TEXTS] for j in range(batch)]).cpu()
    sync()
    n, i = 0, 0
    starts: Counter = Counter()
    window_start = time.time()
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        chunk = [texts[(i + j) % TEXTS] for j in range(batch)]
        model.embed(chunk).cpu()  # tokenize + forward + copy out: what a plain serving loop does
        starts[i % TEXTS] += 1
        n += batch
        i += batch
    sync()
    elapsed = time.perf_counter() - started
    window_end = time.time()
    lengths = padded_lengths(model.tokenizer, texts, batch, starts)
    real = sum(times * sum(len(e.ids) for e in model.tokenizer.encode_batch(
        [texts[(start + j) % TEXTS] for j in range(batch)])) for start, times in starts.items())
    padded = sum(length * batch * times for length, times in lengths.items())
    return {"batch": batch, "threads": threads, "dtype": dtype, "device": str(model.device),
            "sentences": n, "seconds": round(elapsed, 2), "per_s": round(n / elapsed, 3),
            "window_start_s": round(window_start, 3), "window_end_s": round(window_end, 3),
            "tokens_padded": padded, "tokens_real": real,
            "padded_length_batches": {str(k): v for k, v in sorted(lengths.items())},
            **thread_settings()}


def measure(batch: int, threads: int, seconds: float, dtype: str, device: str = "cpu") -> dict:
    return measure_many([batch], threads, seconds, dtype, device)[0]


def measure_many(batches: list[int], threads: int, seconds: float, dtype: str, device: str = "cpu",
                 emit=None) -> list[dict]:
    import torch

    from models.minilm import MiniLMEmbed

    torch.set_num_threads(threads)
    model = MiniLMEmbed(device=device, dtype=dtype)
    model.load()
    out = []
    for batch in batches:
        r = measure_loaded(model, batch, threads, seconds, dtype)
        out.append(r)
        if emit:
            emit(r)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batch", default="32", help="a batch size, or several separated by commas (one model load)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seconds", type=float, default=8)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--device", default="cpu")
    a = p.parse_args()
    measure_many([int(b) for b in a.batch.split(",")], a.threads, a.seconds, a.dtype, a.device,
                 emit=lambda r: print(json.dumps(r), flush=True))


if __name__ == "__main__":
    main()
