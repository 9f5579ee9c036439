"""GPU: the raw model and the worker drain at large batch with the model on
CUDA; throughput, GPU utilization sampled with NVML (pynvml) or `nvidia-smi`,
and the fraction of the GPU's bf16 peak the model reaches. Skipped, with the
reason saved, where no CUDA GPU is visible. On the lent GPU machine the stack's
emulators come from the kit `bench/gpu_kit.sh` builds (`bench/gpu_setup.sh`).

    .venv/bin/python -m bench.gpu
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

from bench.common import default_ddb, log, save, sentence
from bench.worker import drain, raw

# Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets.
PEAK_BF16_TFLOPS = {"H100 80GB HBM3": 989, "H100 PCIe": 756, "H200": 989, "A100": 312, "L4": 121, "A10G": 70}


def flops_per_sentence(tokens: int, layers: int = 6, hidden: int = 384, inter: int = 1536) -> float:
    per_token = 2 * layers * (4 * hidden * hidden + 2 * hidden * inter)  # QKV+O and the MLP
    attention = 2 * layers * 2 * tokens * hidden  # QK^T and AV
    return tokens * (per_token + attention)


class Sampler:
    """GPU utilization every 100 ms, NVML when importable, else nvidia-smi,
    each sample with its wall-clock time so that a window can be averaged."""

    def __init__(self):
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            read = lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu  # noqa: E731
        except Exception:
            read = lambda: float(subprocess.run(  # noqa: E731
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True, text=True, timeout=5).stdout.strip().splitlines()[0])
        while not self._stop.wait(0.1):
            try:
                self.samples.append((time.time(), float(read())))
            except Exception:
                pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)

    def mean(self, skip: int = 5, start_s: float | None = None, end_s: float | None = None) -> float | None:
        """Mean utilization, over [start_s, end_s] when given, else all but the first `skip` samples."""
        if start_s is not None:
            s = [u for t, u in self.samples if start_s <= t <= (end_s or t)]
        else:
            s = [u for _, u in self.samples[skip:]] or [u for _, u in self.samples]
        return round(sum(s) / len(s), 1) if s else None


def gpu_drain(n: int, batch: int, workers: int = 1, inputs_per_task: int = 1) -> dict:
    """One drain with the model on CUDA; utilization averaged over the drain's
    span only (first task started to last finished), not the fill or model load."""
    with Sampler() as s:
        d = drain(n, batch, 4, timeout_s=300, workers=workers, inputs_per_task=inputs_per_task,
                  extra_env={"SLUICE_DEVICE": "cuda"})
    if d.get("succeeded"):
        d["gpu_util_pct"] = s.mean(start_s=d["first_started_ms"] / 1000, end_s=d["last_finished_ms"] / 1000)
    log(f"gpu: drain {n} tasks x {inputs_per_task} inputs, batch {batch}, {workers} worker(s): "
        f"{d.get('inputs_per_s')} sentences/s, util {d.get('gpu_util_pct')}%")
    return d


def main(quick: bool = False) -> dict:
    import torch

    if not torch.cuda.is_available():
        reason = ("no CUDA GPU visible to torch on this machine (torch " + torch.__version__ +
                  (", nvidia-smi present" if shutil.which("nvidia-smi") else ", no nvidia-smi") + "); skipped")
        log(f"gpu: {reason}")
        save("gpu", {"skipped": reason})
        return {"skipped": reason}
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
    from models.minilm import MiniLMEmbed

    m = MiniLMEmbed(device="cpu")
    m.load()
    tokens = sum(len(e.ids) for e in m.tokenizer.encode_batch([sentence(i) for i in range(64)])) / 64
    results: dict = {"device": name, "peak_bf16_tflops": peak, "mean_tokens_padded": tokens,
                     "cores": os.cpu_count(), "dynamodb": default_ddb(), "sqs": "localstack"}
    for batch in (64, 256, 1024):
        with Sampler() as s:
            r = raw(batch, 4, seconds=8, dtype="bf16", device="cuda")
        r["gpu_util_pct"] = s.mean()
        r["tflops"] = round(r["per_s"] * flops_per_sentence(int(tokens)) / 1e12, 2)
        r["fraction_of_peak"] = round(r["tflops"] / peak, 4) if peak else None
        results[f"raw_{batch}"] = r
        log(f"gpu: raw batch {batch}: {r}")
    n = 2000 if quick else 6000
    # One-sentence tasks: the per-task pipeline (a record, a message, an
    # outcome write each) against the GPU; then the same with four workers
    # sharing it, then tasks of 64 sentences, where that cost is shared.
    results["drain_1024"] = gpu_drain(n, 1024)
    results["drain_1024_4_workers"] = gpu_drain(n, 1024, workers=4)
    results["drain_1024_64_per_task"] = gpu_drain(n // 8, 1024, inputs_per_task=64)
    for key in ("drain_1024", "drain_1024_4_workers", "drain_1024_64_per_task"):
        d = results[key]
        if d.get("inputs_per_s"):
            d["efficiency_vs_raw_1024"] = round(d["inputs_per_s"] / results["raw_1024"]["per_s"], 3)
            d["fraction_of_peak"] = (round(d["inputs_per_s"] * flops_per_sentence(int(tokens)) / 1e12 / peak, 4)
                                     if peak else None)
    save("gpu", results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv), indent=1))
