"""One long input among short ones: does it slow the whole batch?

    .venv/bin/python -m bench.mixed_lengths

Times MiniLM's predict_batch on 31 one-sentence inputs plus one input past the
256-word-piece window, against the same two parts run apart (the 31, then the
long one alone), in turns, in one process. A ratio near 1 means the long input
costs only itself; padded together in one forward pass (Sluice until session
9) the batch ran about 10x its parts. Also prints a batch of 32 short inputs,
which the length-aware passes must leave as it was (one pass).
"""

from __future__ import annotations

import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as a worker runs

import torch  # noqa: E402

from bench.common import save, sentence  # noqa: E402
from models.minilm import MiniLMEmbed  # noqa: E402

ROUNDS = 7


def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


def main() -> dict:
    torch.set_num_threads(2)
    model = MiniLMEmbed(device="cpu")
    model.load()
    short = [sentence(i) for i in range(31)]
    long = " ".join(f"word{i}" for i in range(600))
    uniform = [sentence(i) for i in range(32)]
    cases = {
        "mixed": lambda: model.predict_batch(short[:15] + [long] + short[15:]),
        "parts": lambda: (model.predict_batch(short), model.predict_batch([long])),
        "uniform": lambda: model.predict_batch(uniform),
    }
    for fn in cases.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(ROUNDS):
        for name, fn in cases.items():
            times[name].append(timed(fn))
    p50 = {name: round(statistics.median(v), 1) for name, v in times.items()}
    results = {"dtype": str(model.dtype), "threads": 2, "rounds": ROUNDS, "p50_ms": p50,
               "mixed_over_parts": round(p50["mixed"] / p50["parts"], 2)}
    save("mixed_lengths", results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(), indent=1))
