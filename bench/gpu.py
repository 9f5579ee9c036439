"""GPU: the worker drain at large batch with the model on CUDA; throughput, GPU
utilization sampled with NVML (pynvml) or `nvidia-smi`, and the fraction of the
GPU's bf16 peak the model reaches. Skipped, with the reason saved, where no
CUDA GPU is visible.

    .venv/bin/python -m bench.gpu
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

from bench.common import log, save, sentence
from bench.worker import drain, raw

# Dense bf16 tensor-core peaks (TFLOP/s) from the vendors' data sheets.
PEAK_BF16_TFLOPS = {"H100 80GB HBM3": 989, "H100 PCIe": 756, "H200": 989, "A100": 312, "L4": 121, "A10G": 70}


def flops_per_sentence(tokens: int, layers: int = 6, hidden: int = 384, inter: int = 1536) -> float:
    per_token = 2 * layers * (4 * hidden * hidden + 2 * hidden * inter)  # QKV+O and the MLP
    attention = 2 * layers * 2 * tokens * hidden  # QK^T and AV
    return tokens * (per_token + attention)


class Sampler:
    """GPU utilization every 100 ms, NVML when importable, else nvidia-smi."""

    def __init__(self):
        self.samples: list[float] = []
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
                self.samples.append(float(read()))
            except Exception:
                pass

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(5)

    def mean(self, skip: int = 5) -> float | None:
        s = self.samples[skip:] or self.samples
        return round(sum(s) / len(s), 1) if s else None


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
    results: dict = {"device": name, "peak_bf16_tflops": peak, "mean_tokens_padded": tokens}
    for batch in (64, 256, 1024):
        with Sampler() as s:
            r = raw(batch, 4, seconds=8, dtype="bf16", device="cuda")
        r["gpu_util_pct"] = s.mean()
        r["tflops"] = round(r["per_s"] * flops_per_sentence(int(tokens)) / 1e12, 2)
        r["fraction_of_peak"] = round(r["tflops"] / peak, 4) if peak else None
        results[f"raw_{batch}"] = r
        log(f"gpu: raw batch {batch}: {r}")
    with Sampler() as s:
        d = drain(2000 if quick else 6000, 64, 4, timeout_s=240, extra_env={"SLUICE_DEVICE": "cuda"})
    d["gpu_util_pct"] = s.mean()
    results["drain_64"] = d
    results["efficiency_vs_raw_64"] = round(d["tasks_per_s"] / results["raw_64"]["per_s"], 3)
    log(f"gpu: drain {d}")
    save("gpu", results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv), indent=1))
