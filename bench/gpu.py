"""GPU: the raw model and the worker drain at large batch with the model on
CUDA; throughput, GPU utilization sampled with NVML (pynvml) or `nvidia-smi`
over each timed window only, the fraction of the GPU's dense bf16 peak, and
the fraction of a memory-bandwidth roofline of the model's matmuls. Skipped,
with the reason saved, where no CUDA GPU is visible. On the lent GPU machine
the stack's emulators come from the kit `bench/gpu_kit.sh` builds
(`bench/gpu_setup.sh`, whose header has the commands).

    .venv/bin/python -m bench.gpu                 # or: python -m bench --only gpu
    .venv/bin/python -m bench.gpu --cpu-dry-run   # the whole path on CPU, small, no NVML
                                                  # (or SLUICE_GPU_DRY_RUN=1 python -m bench --only gpu)

Results go to $SLUICE_BENCH_RESULTS (set it to the device's $OUT: only $OUT
comes back) as gpu.json, saved after every phase, and the stacks' logs to
drain-logs.txt beside it. Every figure is printed as well. The run keeps to a
time budget (SLUICE_GPU_BUDGET_S, 420 s by default): a phase that would not
fit is skipped and flagged, so the whole command stays under the device's
600 s per command (docs/benchmarks.md, section 6).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import threading
import time

from bench.common import ROOT, at_least, default_ddb, default_sqs, flag, log, raise_if_flagged, save
from bench.worker import drain, raw_many

# The worker drains at another switch interval go through this folder's
# sitecustomize (bench-only; the worker has no setting for it).
SWITCH_INTERVAL_SITE = str(ROOT / "bench" / "switch_interval")

# (substring of the device name, dense bf16 tensor TFLOP/s, memory TB/s), from
# the vendors' data sheets. The first match wins, so the more specific names
# come first: "NVIDIA H200 NVL" also contains "H200", "NVIDIA L40S" "L4".
GPU_SPECS = [
    ("GH200", 989, 4.0),
    ("H200 NVL", 835, 4.8),
    ("H200", 989, 4.8),
    ("H100 NVL", 835, 3.9),
    ("H100 PCIe", 756, 2.0),
    ("H100", 989, 3.35),  # SXM: "NVIDIA H100 80GB HBM3"
    ("A100-SXM4-80GB", 312, 2.039),
    ("A100 80GB PCIe", 312, 1.935),
    ("A100", 312, 1.555),  # the 40 GB parts
    ("L40S", 362, 0.864),
    ("L40", 181, 0.864),
    ("L4", 121, 0.3),
    ("A10G", 70, 0.6),
]
# The dry run's stand-in "device", so that every figure is computed on CPU too
# (its values mean nothing).
DRY_RUN_SPEC = ("CPU dry run (stand-in figures)", 1.0, 0.02)

# MiniLM-L6: 6 layers, hidden 384, MLP 1536, 12 heads (config.json).
LAYERS, HIDDEN, INTER, HEADS = 6, 384, 1536, 12


def gpu_spec(name: str) -> tuple[str, float, float] | None:
    return next((s for s in GPU_SPECS if s[0] in name), None)


def flops_per_sentence(tokens: int, layers: int = LAYERS, hidden: int = HIDDEN, inter: int = INTER) -> float:
    per_token = 2 * layers * (4 * hidden * hidden + 2 * hidden * inter)  # QKV+O and the MLP
    attention = 2 * layers * 2 * tokens * hidden  # QK^T and AV
    return tokens * (per_token + attention)


def roofline_s(batch: int, length: int, peak_flops: float, bandwidth: float, layers: int = LAYERS,
               hidden: int = HIDDEN, inter: int = INTER, heads: int = HEADS, nbytes: int = 2) -> float:
    """The least time one forward of `batch` sentences padded to `length` can
    take: each matmul at least max(FLOPs / peak, bytes / bandwidth), its bytes
    being its operands read and its result written once in bf16. Elementwise
    work (layer norms, GELU, softmax, residuals) is taken as fused into the
    matmuls, so it adds no traffic: the bound is optimistic, a model's roofline,
    not this implementation's. Its FLOPs add up to batch x flops_per_sentence."""
    tokens = batch * length
    t = 0.0
    for i, o in [(hidden, hidden)] * 4 + [(hidden, inter), (inter, hidden)]:
        t += max(2 * tokens * i * o / peak_flops, nbytes * (i * o + tokens * i + tokens * o) / bandwidth)
    scores = heads * length * length  # per sentence
    attention_flops = 2 * batch * length * length * hidden  # QK^T, and again AV
    t += max(attention_flops / peak_flops, nbytes * batch * (2 * length * hidden + scores) / bandwidth)  # QK^T
    t += max(attention_flops / peak_flops, nbytes * batch * (scores + 2 * length * hidden) / bandwidth)  # AV
    return layers * t


def work(batch: int, padded_length_batches: dict, peak_tflops: float | None, bandwidth_tbps: float | None) -> dict:
    """FLOPs and the roofline's least time of the batches a loop ran, each
    batch counted at its own padded length ({length: batches})."""
    flops = sum(n * batch * flops_per_sentence(int(length)) for length, n in padded_length_batches.items())
    least = (sum(n * roofline_s(batch, int(length), peak_tflops * 1e12, bandwidth_tbps * 1e12)
                 for length, n in padded_length_batches.items()) if peak_tflops and bandwidth_tbps else None)
    return {"flops": flops, "roofline_least_s": least}


class Sampler:
    """GPU utilization every 100 ms, NVML when it answers, else nvidia-smi,
    each sample with its wall-clock time (time.time(), the clock of the raw
    loop's window and of the task records), so that a window can be averaged.
    `read` replaces both (the dry run's stub)."""

    def __init__(self, read=None, method: str | None = None):
        self.samples: list[tuple[float, float]] = []
        self.errors: list[str] = []
        self.method = method
        self._read = read
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _pick(self):
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            read = lambda: pynvml.nvmlDeviceGetUtilizationRates(handle).gpu  # noqa: E731
            read()  # NVML that initializes but cannot read (some sandboxes) falls back too
            return read, "nvml"
        except Exception as exc:
            self.errors.append(f"nvml: {type(exc).__name__}: {exc}"[:200])
        if shutil.which("nvidia-smi"):
            return (lambda: float(subprocess.run(
                ["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits", "-i", "0"],
                capture_output=True, text=True, timeout=5).stdout.strip().splitlines()[0])), "nvidia-smi"
        return None, "none"

    def _run(self) -> None:
        if self._read is None:
            self._read, self.method = self._pick()
        if self._read is None:
            return
        while not self._stop.wait(0.1):
            try:
                self.samples.append((time.time(), float(self._read())))
            except Exception as exc:
                if len(self.errors) < 5:
                    self.errors.append(f"{self.method}: {type(exc).__name__}: {exc}"[:200])

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)

    def window(self, start_s: float, end_s: float) -> list[float]:
        return [u for t, u in self.samples if start_s <= t <= end_s]

    def mean(self, skip: int = 5, start_s: float | None = None, end_s: float | None = None) -> float | None:
        """Mean utilization, over [start_s, end_s] when given, else all but the first `skip` samples."""
        if start_s is not None:
            s = [u for t, u in self.samples if start_s <= t <= (end_s or t)]
        else:
            s = [u for _, u in self.samples[skip:]] or [u for _, u in self.samples]
        return round(sum(s) / len(s), 1) if s else None


def mean_rounded_down(samples: list[float]) -> float | None:
    """Utilization over a window, to two places rounded down: judged against 90%."""
    return math.floor(round(sum(samples) / len(samples) * 100, 6)) / 100 if samples else None


def gil_contention(batch: int, threads: int, device: str, seconds: float, timeout_s: float) -> dict:
    """bench/gil_contention.py in its own process; its last line is its result."""
    out = subprocess.run([sys.executable, "-m", "bench.gil_contention", "--batch", str(batch), "--threads",
                          str(threads), "--device", device, "--seconds", str(seconds)],
                         cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode:
        raise RuntimeError(f"bench.gil_contention exited with {out.returncode}: {out.stderr.strip()[-1000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


class Budget:
    """The benchmark's wall-clock budget: phases take their timeouts from it."""

    def __init__(self, total_s: float):
        self.total_s = total_s
        self.deadline = time.monotonic() + total_s

    def left(self) -> float:
        return self.deadline - time.monotonic()


def printed(label: str, d: dict) -> None:
    """Every figure of a phase on stdout (the long lists left out)."""
    shown = {k: v for k, v in d.items() if k not in ("padded_length_batches", "env")}
    log(f"gpu: {label}: {json.dumps(shown, default=str)}")


def main(quick: bool = False, dry_run: bool = False) -> dict:
    import torch

    # SLUICE_GPU_DRY_RUN=1: the dry run through `python -m bench --only gpu` (bench/gpu_run.sh's path).
    dry_run = dry_run or os.environ.get("SLUICE_GPU_DRY_RUN") == "1"
    if not dry_run and not torch.cuda.is_available():
        reason = ("no CUDA GPU visible to torch on this machine (torch " + torch.__version__ +
                  (", nvidia-smi present" if shutil.which("nvidia-smi") else ", no nvidia-smi") + "); skipped")
        log(f"gpu: {reason}")
        save("gpu", {"skipped": reason})
        return {"skipped": reason}
    budget = Budget(float(os.environ.get("SLUICE_GPU_BUDGET_S", "420")))
    name_out = "gpu-dry-run" if dry_run else "gpu"
    if dry_run:
        device, name, threads = "cpu", DRY_RUN_SPEC[0], 2
        spec = DRY_RUN_SPEC
        batches, big, raw_seconds = (8, 32), 32, 1.0
        drains = [("drain_big", 300, 1, 1), ("drain_big_2_workers", 300, 2, 1), ("drain_big_8_per_task", 40, 1, 8),
                  ("drain_big_8_per_task_switch_0_5ms", 40, 1, 8)]
        sampler = lambda: Sampler(read=lambda: 50.0, method="dry-run stub (no NVML)")  # noqa: E731
        extra_env = {"SLUICE_DEVICE": "cpu"}
    else:
        device, name, threads = "cuda", torch.cuda.get_device_name(0), 4
        spec = gpu_spec(name)
        batches, big, raw_seconds = (64, 256, 1024), 1024, 5.0
        n = 2000 if quick else 6000
        drains = [("drain_1024", n, 1, 1), ("drain_1024_4_workers", n, 4, 1),
                  ("drain_1024_64_per_task", n // 8, 1, 64), ("drain_1024_64_per_task_switch_0_5ms", n // 8, 1, 64)]
        sampler = Sampler
        extra_env = {"SLUICE_DEVICE": "cuda"}
    peak, bandwidth = (spec[1], spec[2]) if spec else (None, None)
    results: dict = {"device": name, "dry_run": dry_run, "spec_matched": spec[0] if spec else None,
                     "peak_bf16_tflops": peak, "memory_tbps": bandwidth,
                     "roofline": "per matmul max(FLOPs / peak, bytes / bandwidth), operands read and results "
                                 "written once in bf16, elementwise ops taken as fused (an optimistic bound)",
                     "cores": os.cpu_count(), "dynamodb": default_ddb(), "sqs": default_sqs(),
                     "budget_s": budget.total_s, "torch": torch.__version__}
    log(f"gpu: {name}: peak bf16 {peak} TFLOP/s, {bandwidth} TB/s ({results['spec_matched']}); "
        f"time budget {budget.total_s:.0f}s")
    if not spec:
        flag(results, f"no data-sheet peak for {name!r}: fractions of peak and roofline not computed")
    save(name_out, results)

    # ---------------------------------------------------------------- raw model
    raw_timeout = len(batches) * (raw_seconds + 15) + 60
    with sampler() as s:
        try:
            if budget.left() < raw_timeout:
                raise TimeoutError(f"only {budget.left():.0f}s of the budget left")
            runs = raw_many(list(batches), threads, seconds=raw_seconds, dtype="bf16", device=device,
                            timeout_s=min(raw_timeout, budget.left()))
        except Exception as exc:
            runs = []
            flag(results, f"raw model: {type(exc).__name__}: {str(exc)[:500]}")
    results["sampler"] = {"method": s.method, "samples": len(s.samples), "errors": s.errors}
    for r in runs:
        b = r["batch"]
        w = work(b, r["padded_length_batches"], peak, bandwidth)
        window = s.window(r["window_start_s"], r["window_end_s"])
        r["gpu_util_pct"] = mean_rounded_down(window)
        r["gpu_util_samples"] = len(window)
        r["tflops"] = round(w["flops"] / r["seconds"] / 1e12, 3)
        r["flops_per_sentence"] = round(w["flops"] / r["sentences"])
        r["mean_padded_tokens"] = round(r["tokens_padded"] / r["sentences"], 2)
        r["fraction_of_peak_bf16"] = round(r["tflops"] / peak, 4) if peak else None
        if w["roofline_least_s"]:
            r["roofline_tflops"] = round(w["flops"] / w["roofline_least_s"] / 1e12, 1)
            r["fraction_of_roofline"] = round(w["roofline_least_s"] / r["seconds"], 4)
        if len(window) < 5:
            flag(results, f"raw batch {b}: {len(window)} utilization samples in its timed window")
        results[f"raw_{b}"] = r
        printed(f"raw model, batch {b}", r)
    save(name_out, results)
    ref = results.get(f"raw_{big}")
    per_sentence = ({"flops": ref["flops_per_sentence"],
                     "roofline_s": work(big, ref["padded_length_batches"], peak, bandwidth)["roofline_least_s"]}
                    if ref else None)
    if per_sentence and per_sentence["roofline_s"]:
        per_sentence["roofline_s"] /= ref["sentences"]

    # ------------------------------------------------- the interpreter's lock
    # The forward at the drains' batch size alone, then beside a thread of
    # pure-Python work (the worker's other threads), at 5 ms and 0.5 ms switch
    # intervals (bench/gil_contention.py; docs/benchmarks.md, section 6).
    gil_timeout = 3 * (raw_seconds / 2 + 5) + 60
    if budget.left() < gil_timeout + 200:
        flag(results, f"gil_contention: skipped, only {budget.left():.0f}s of the time budget left")
    else:
        try:
            results["gil_contention"] = gil_contention(big, threads, device, raw_seconds / 2, gil_timeout)
            printed("the forward beside a busy Python thread", results["gil_contention"])
        except Exception as exc:
            flag(results, f"gil_contention: {type(exc).__name__}: {str(exc)[:500]}")
    save(name_out, results)

    # ------------------------------------------------------------------- drains
    # One-sentence tasks: the per-task pipeline (a record, a message, an outcome
    # write each) against the GPU; the same with several workers sharing it;
    # then tasks of many sentences, where that cost is shared.
    stop_reserve = 35  # a stack's bounded stop (stop_timeout_s) and the final record read
    for key, n_tasks, workers, per_task in drains:
        # Within what is left: the stack's start and the fill (~40 s allowed), the
        # workers' start (start_timeout), the drain itself (timeout), the stop.
        left = budget.left() - stop_reserve
        start_timeout = min(90.0, 0.3 * left)
        timeout = min(180.0, left - start_timeout - 40)
        if timeout < 30:
            flag(results, f"{key}: skipped, only {budget.left():.0f}s of the time budget left")
            save(name_out, results)
            continue
        env = dict(extra_env)
        if key.endswith("_switch_0_5ms"):
            env["SLUICE_BENCH_SWITCH_INTERVAL_S"] = "0.0005"
            env["PYTHONPATH"] = os.pathsep.join(p for p in (SWITCH_INTERVAL_SITE, os.environ.get("PYTHONPATH")) if p)
        log(f"gpu: {key}: {n_tasks} tasks x {per_task} sentence(s), batch {big}, {workers} worker(s); "
            f"worker start within {start_timeout:.0f}s, drain within {timeout:.0f}s")
        with sampler() as s:
            try:
                d = drain(n_tasks, big, threads, timeout_s=timeout, workers=workers,
                          inputs_per_task=per_task, extra_env=env, start_timeout_s=start_timeout,
                          stop_timeout_s=25, keep_logs_always=True,
                          profile_as=key if per_task > 1 else None, profile_s=6)
            except Exception as exc:
                d = {"error": f"{type(exc).__name__}: {str(exc)[:500]}", "problems": [str(exc)[:500]]}
        for problem in d.get("problems", []):
            flag(results, f"{key}: {problem}")
        if d.get("inputs_per_s"):
            start_s, end_s = d["first_started_ms"] / 1000, d["last_finished_ms"] / 1000
            window = s.window(start_s, end_s)
            # Two places, four for the ratio: the report judges them against 90% and
            # 0.9, which 89.96 and 0.8996 rounded further would pass.
            d["gpu_util_pct"] = mean_rounded_down(window)
            d["gpu_util_samples"] = len(window)
            if len(window) < 5:
                flag(results, f"{key}: {len(window)} utilization samples over its span")
            if ref:
                d["efficiency_vs_raw"] = at_least(d["inputs_per_s"], ref["per_s"])
                d["efficiency_vs_raw_batch"] = big
                full = (d.get("inference") or {}).get("full_batch_p50_ms")
                if full:  # the worker's forward of a full batch against the raw loop's
                    d["inference_vs_raw_batch_time"] = round(full / (big * 1000 / ref["per_s"]), 2)
            if per_sentence:
                # The raw loop's own sentences at the same batch size: FLOPs per sentence estimated from it.
                d["tflops_estimated"] = round(d["inputs_per_s"] * per_sentence["flops"] / 1e12, 3)
                d["fraction_of_peak_bf16"] = round(d["tflops_estimated"] / peak, 4) if peak else None
                if per_sentence["roofline_s"]:
                    d["fraction_of_roofline"] = round(d["inputs_per_s"] * per_sentence["roofline_s"], 4)
        results[key] = d
        printed(key, d)
        save(name_out, results)

    # ------------------------------------------------------------------ summary
    log(f"gpu: summary, {name} (peak bf16 {peak} TFLOP/s, {bandwidth} TB/s)")
    for key in [f"raw_{b}" for b in batches] + [k for k, *_ in drains]:
        r = results.get(key)
        if not r:
            log(f"gpu:   {key:26} not measured")
            continue
        log(f"gpu:   {key:26} {r.get('inputs_per_s', r.get('per_s'))} sentences/s, util {r.get('gpu_util_pct')}%, "
            f"peak {r.get('fraction_of_peak_bf16')}, roofline {r.get('fraction_of_roofline')}"
            + (f", vs raw {r.get('efficiency_vs_raw')}" if "efficiency_vs_raw" in r else "")
            + (f", inference {r['inference_vs_raw_batch_time']} x the raw batch's time"
               if r.get("inference_vs_raw_batch_time") else "")
            + (f", mean padded tokens {r.get('mean_padded_tokens')}" if "mean_padded_tokens" in r else ""))
    log(f"gpu: {budget.total_s - budget.left():.0f}s of the {budget.total_s:.0f}s budget used")
    save(name_out, results)
    raise_if_flagged(name_out, results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv, dry_run="--cpu-dry-run" in sys.argv), indent=1))
