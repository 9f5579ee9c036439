"""Worker efficiency, batching gain and the batch-size curve.

One worker process drains a pre-filled queue of one-sentence minilm-embed
tasks. Its throughput (tasks finished / span from the first task started to the
last finished, from the task records) is divided by the raw model's throughput
at the same batch size and thread count, measured in the same run right before.
The end of a drain is noticed from the queues (GetQueueAttributes), not by
reading the records while it runs; the records are read once, at the end. A
drain cut off at its timeout, a worker that exited, or tasks failed or never
finished are recorded in the result's "problems" and make the benchmark fail.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from bench.common import (RESULTS, ROOT, at_least, cpu_s, default_ddb, default_sqs, flag, keep_logs, log, raise_if_flagged, save,
                          sentence, settings, stack)


def fill(n: int, model: str = "minilm-embed", priority: str = "normal", inputs_per_task: int = 1) -> list[str]:
    """Create n tasks of `inputs_per_task` sentences each the way POST
    /v1/tasks/batch does (records, then messages)."""
    from sluice.api.service import TaskService
    from sluice.contract import SubmitRequest, new_task_id

    service = TaskService(settings())
    ids: list[str] = []
    for start in range(0, n, 100):
        built = [service._build("bench", SubmitRequest(
            model=model, priority=priority,
            inputs=[sentence((start + i) * inputs_per_task + j) for j in range(inputs_per_task)]),
            new_task_id()) for i in range(min(100, n - start))]
        service.store.create_many([r for r, _ in built])
        service.queues.send_many([m for _, m in built])
        ids += [r.task_id for r, _ in built]
    return ids


class WorkerExited(RuntimeError):
    def __init__(self, dead: dict[str, int | None]):
        super().__init__("worker exited during the drain: " + ", ".join(f"{n} (exit code {rc})" for n, rc in dead.items()))
        self.dead = dead


def dead_workers(procs: dict | None) -> dict[str, int | None]:
    """The worker processes of `procs` (name -> Popen) that have exited, with their exit codes."""
    return {name: proc.returncode for name, proc in (procs or {}).items()
            if name.startswith("worker") and proc.poll() is not None}


QUEUE_COUNTS = ("ApproximateNumberOfMessages", "ApproximateNumberOfMessagesNotVisible",
                "ApproximateNumberOfMessagesDelayed")


def queued_messages(queues=None, priorities=None) -> int:
    """Messages in the priority queues (all, or those named): waiting, in
    flight (received, not yet deleted) or delayed. One GetQueueAttributes per queue."""
    from sluice.adapters.queues import PriorityQueues
    from sluice.contract import Priority

    queues = queues or PriorityQueues(settings())
    total = 0
    for priority in [Priority(p) for p in priorities] if priorities else Priority:
        attrs = queues.sqs.get_queue_attributes(QueueUrl=queues.url(priority),
                                                AttributeNames=list(QUEUE_COUNTS))["Attributes"]
        total += sum(int(attrs.get(k, 0)) for k in QUEUE_COUNTS)
    return total


def wait_drained(timeout_s: float, procs: dict | None = None, backlog=None, poll_s: float = 0.2,
                 confirm: int = 2, priorities=None) -> dict:
    """Until every priority queue is empty `confirm` polls in a row, a worker
    exits, or timeout_s. A worker deletes a message only after it wrote the
    task's outcome, so empty queues mean every outcome is written. The poll is
    cheap on purpose (a GetQueueAttributes per queue, not the task records):
    it runs on the machine it times. The records are read once, afterwards.
    `backlog()` counts the queued messages (queued_messages of `priorities`,
    all by default: a drain filled one queue only polls that one).
    Returns {"end": "queues empty" | "timeout" | "worker exited", "waited_s", "dead"}."""
    if backlog is None:
        from sluice.adapters.queues import PriorityQueues

        queues = PriorityQueues(settings())
        backlog = lambda: queued_messages(queues, priorities)  # noqa: E731
    started = time.monotonic()
    deadline = started + timeout_s
    empty_in_a_row = 0
    while True:
        dead = dead_workers(procs)
        if dead:
            return {"end": "worker exited", "waited_s": round(time.monotonic() - started, 2), "dead": dead}
        empty_in_a_row = empty_in_a_row + 1 if backlog() == 0 else 0
        if empty_in_a_row >= confirm:
            return {"end": "queues empty", "waited_s": round(time.monotonic() - started, 2), "dead": {}}
        if time.monotonic() >= deadline:
            return {"end": "timeout", "waited_s": round(time.monotonic() - started, 2), "dead": {}}
        time.sleep(poll_s)


def first_finished(sample: list[str], timeout_s: float, procs: dict | None = None) -> int:
    """Waits until a task of the sample is terminal; returns how many are.
    Raises WorkerExited as soon as a worker of `procs` has exited."""
    from sluice.adapters.task_store import TaskStore

    store = TaskStore(settings())
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = dead_workers(procs)
        if dead:
            raise WorkerExited(dead)
        done = sum(status.is_terminal for status in store.statuses(sample).values())
        if done:
            return done
        time.sleep(0.1)
    raise TimeoutError(f"no task finished within {timeout_s:.0f}s of the workers' start")


def inference_ms(log_dir: Path, max_batch: int) -> dict | None:
    """The workers' own InferenceLatency metric, read back from the EMF lines
    of their logs: milliseconds a batch (p50, all batches and the full ones),
    to set against the raw loop's time for the same batch. None without lines."""
    batches: list[tuple[float, float]] = []  # (inputs, ms)
    for path in sorted(Path(log_dir).glob("worker-*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if not line.startswith("{") or '"InferenceLatency"' not in line:
                continue
            try:
                emf = json.loads(line)
            except ValueError:
                continue
            sizes, ms = emf.get("BatchSize"), emf.get("InferenceLatency")
            sizes, ms = (sizes if isinstance(sizes, list) else [sizes]), (ms if isinstance(ms, list) else [ms])
            batches += [(b, m) for b, m in zip(sizes, ms) if b and m is not None]
    if not batches:
        return None
    full = [m for b, m in batches if b >= max_batch]
    return {"batches": len(batches), "p50_ms": round(statistics.median(m for _, m in batches), 1),
            "full_batches": len(full), "full_batch_p50_ms": round(statistics.median(full), 1) if full else None,
            "p50_ms_per_input": round(statistics.median(m / b for b, m in batches), 4)}


def py_spy() -> str | None:
    """py-spy where this environment has it: beside the interpreter (the
    venv's), else on PATH (the GPU kit puts it there)."""
    beside = Path(sys.executable).with_name("py-spy")
    return str(beside) if beside.is_file() else shutil.which("py-spy")


def profile_summary(path: Path, top: int = 10) -> dict:
    """Of a py-spy raw profile taken with threads (-t): each thread's share of
    the samples, and the busiest thread's hottest places, each named by its
    innermost Sluice or model frame and the frame it was in."""
    per_thread: Counter = Counter()
    places: dict[str, Counter] = defaultdict(Counter)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        thread = frames[0].split(": ", 1)[-1]  # "thread (0x7f..): MainThread"
        ours = [f for f in frames[1:] if "sluice/" in f or "models/" in f]
        per_thread[thread] += int(count)
        places[thread][f"{ours[-1] if ours else frames[-1]} <- {frames[-1]}"] += int(count)
    total = sum(per_thread.values()) or 1
    busiest = per_thread.most_common(1)[0][0] if per_thread else None
    return {"samples": total, "threads": {t: round(c / total, 3) for t, c in per_thread.most_common(12)},
            "busiest_thread": busiest,
            "busiest_places": [(p, round(c / total, 3)) for p, c in places[busiest].most_common(top)] if busiest else []}


def drain(n: int, batch: int, threads: int, timeout_s: float, workers: int = 1, extra_env: dict | None = None,
          sqs: str | None = None, model: str = "minilm-embed", inputs_per_task: int = 1,
          start_timeout_s: float = 120, stop_timeout_s: float | None = None, keep_logs_always: bool = False,
          profile_as: str | None = None, profile_s: float = 8) -> dict:
    """Fill the queue with n tasks, start the workers, time their drain. The
    result's "problems" lists what makes it not a clean measurement (a drain
    cut off, a worker that exited, tasks failed or never finished); the
    stack's logs are then kept in the results folder (drain-logs.txt).
    `profile_as`: py-spy records worker-0 for `profile_s` from the first
    finished task into drain-profile-<profile_as>.txt there, where py-spy is
    installed (its summary is the result's "profile")."""
    from sluice.adapters.task_store import TaskStore

    sqs = sqs or default_sqs()
    # On the CPU unless told (bench.gpu): the raw model it is measured against is.
    env = {"SLUICE_MODELS": model, "SLUICE_MAX_BATCH_SIZE": str(batch), "SLUICE_DEVICE": "cpu",
           "SLUICE_TORCH_THREADS": str(threads), **(extra_env or {})}
    label = f"drain of {n} {model} tasks x {inputs_per_task} inputs, batch {batch}, {workers} worker(s)"
    out: dict = {"tasks": n, "model": model, "batch": batch, "threads": threads, "workers": workers, "sqs": sqs,
                 "inputs_per_task": inputs_per_task, "env": extra_env or {}}
    problems: list[str] = []
    cpu: dict[str, float] = {}
    done_before = 0
    with stack(workers=0, api=False, sqs=sqs, env=env, stop_timeout_s=stop_timeout_s) as s:
        out["dynamodb"] = s.ddb
        t0 = time.monotonic()
        ids = fill(n, model, inputs_per_task=inputs_per_task)
        out["fill_s"] = round(time.monotonic() - t0, 2)
        drain_started = time.time()
        for i in range(workers):
            s.start_worker(i)
        procs = {name: proc for name, proc in s.procs.items() if name.startswith("worker")}
        try:
            # Each process's CPU from the first finished task on, so that the
            # worker's start-up (importing torch, loading the model) is left out.
            done_before = first_finished(ids[:100], timeout_s=min(start_timeout_s, timeout_s), procs=procs)
        except (TimeoutError, WorkerExited) as exc:
            problems.append(f"no task finished: {exc}")
            out["end"] = "worker exited" if isinstance(exc, WorkerExited) else "timeout"
        else:
            pids = {name: proc.pid for name, proc in s.procs.items()}
            cpu_before = {name: cpu_s(pid) for name, pid in pids.items()}
            spy = start_profile(profile_as, pids.get("worker-0"), profile_s, out) if profile_as else None
            waited = wait_drained(timeout_s, procs, priorities=["normal"])  # fill()'s priority
            cpu = {name: cpu_s(pid) - cpu_before[name] for name, pid in pids.items()}
            if spy:
                finish_profile(spy, profile_s, out)
            out["end"], out["waited_s"] = waited["end"], waited["waited_s"]
            if waited["end"] == "timeout":
                problems.append(f"CUT OFF: the drain was still running after {timeout_s:.0f}s; "
                                f"its figures cover part of the tasks only")
            elif waited["end"] == "worker exited":
                problems.append(str(WorkerExited(waited["dead"])))
        records = {t: r.model_dump(mode="json") for t, r in TaskStore(settings()).get_many(ids).items()}
        for name, proc in s.procs.items():
            if name.startswith("worker") and proc.poll() is not None:
                out.setdefault("worker_exit_codes", {})[name] = proc.returncode
        terminal = [r for r in records.values() if r["status"] in ("succeeded", "failed", "cancelled", "expired")]
        ok = [r for r in terminal if r["status"] == "succeeded"]
        out.update({"succeeded": len(ok), "failed": len(terminal) - len(ok), "not_finished": n - len(terminal)})
        if out["failed"]:
            problems.append(f"{out['failed']} of {n} tasks failed")
        if out["not_finished"]:
            problems.append(f"{out['not_finished']} of {n} tasks never finished")
        if problems or keep_logs_always:
            keep_logs(s.log_dir, "drain-logs.txt", label + (": " + "; ".join(problems) if problems else ""))
    # After the stop: a worker's last metrics are flushed as it stops.
    out["inference"] = inference_ms(s.log_dir, batch)
    out["problems"] = problems
    if not ok:
        out["tasks_per_s"] = out["inputs_per_s"] = None
        return out
    # Throughput from the records' own times, not from when the poll noticed.
    first = min(r["started_at"] for r in ok)
    last = max(r["finished_at"] for r in ok)
    span = max(1e-3, (last - first) / 1000)
    sizes = [r.get("batch_size") or 0 for r in ok]
    out.update({
        "span_s": round(span, 2), "tasks_per_s": round(len(ok) / span, 3),
        "inputs_per_s": round(len(ok) * inputs_per_task / span, 3), "first_started_ms": first,
        "last_finished_ms": last, "workers_started_ms": round(drain_started * 1000),
        "mean_batch": round(sum(sizes) / len(sizes), 1),
        "cpu_ms_per_task": {name: round(v * 1000 / max(1, len(ok) - done_before), 2) for name, v in cpu.items()}})
    return out


def start_profile(name: str, pid: int | None, seconds: float, out: dict) -> tuple | None:
    spy = py_spy()
    if not spy or not pid:
        out["profile"] = {"error": "no py-spy here" if not spy else "no worker-0"}
        return None
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"drain-profile-{name}.txt"
    path.unlink(missing_ok=True)
    # --nonblocking: the worker is never paused, so the drain's timing stands.
    proc = subprocess.Popen([spy, "record", "-p", str(pid), "-d", str(max(1, round(seconds))), "-r", "100",
                             "-f", "raw", "-t", "--nonblocking", "-o", str(path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, path


def finish_profile(spy: tuple, seconds: float, out: dict) -> None:
    proc, path = spy
    try:
        _, err = proc.communicate(timeout=seconds + 20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    if path.is_file() and path.stat().st_size:
        out["profile"] = {"file": path.name, **profile_summary(path)}
    else:
        out["profile"] = {"error": f"py-spy exited {proc.returncode}: {err.decode(errors='replace').strip()[-300:]}"}


def raw(batch: int, threads: int, seconds: float = 6, dtype: str = "bf16", device: str = "cpu",
        timeout_s: float = 120) -> dict:
    """The raw model in its own process (bench/rawmodel.py), with the OpenMP
    setting a worker runs with (OMP_WAIT_POLICY=PASSIVE unless this process's
    environment says otherwise, as models/registry.py does for the worker)."""
    return raw_many([batch], threads, seconds, dtype, device, timeout_s)[0]


def raw_many(batches: list[int], threads: int, seconds: float = 6, dtype: str = "bf16", device: str = "cpu",
             timeout_s: float = 120) -> list[dict]:
    """raw() for several batch sizes in one process (one model load)."""
    env = dict(os.environ)
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    out = subprocess.run([sys.executable, "-m", "bench.rawmodel", "--batch", ",".join(map(str, batches)),
                          "--threads", str(threads), "--seconds", str(seconds), "--dtype", dtype, "--device", device],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    if out.returncode:
        raise RuntimeError(f"bench.rawmodel exited with {out.returncode}: {out.stderr.strip()[-2000:]}")
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    if len(lines) != len(batches):
        raise RuntimeError(f"bench.rawmodel printed {len(lines)} results for {len(batches)} batch sizes: "
                           f"{out.stdout[-500:]} {out.stderr[-1000:]}")
    return lines




def main(quick: bool = False, sqs: str | None = None) -> dict:
    sqs = sqs or default_sqs()
    threads = max(1, os.cpu_count() or 2)
    n = 600 if quick else 1500
    results: dict = {"sqs": sqs, "dynamodb": default_ddb()}

    def checked(key: str, d: dict) -> dict:
        results[key] = d
        for problem in d.get("problems", []):
            flag(results, f"{key}: {problem}")
        return d

    log(f"worker: raw model, batch 32, {threads} threads")
    results["raw_32"] = raw(32, threads)
    # The worker serves bf16 (SLUICE_MINILM_DTYPE); fp32 is the issue's
    # reference and, on some CPUs, the faster of the two: both are recorded.
    results["raw_32_fp32"] = raw(32, threads, seconds=4, dtype="fp32")
    log(f"worker: raw model bf16 {results['raw_32']['per_s']}/s, fp32 {results['raw_32_fp32']['per_s']}/s "
        f"(OMP_WAIT_POLICY={results['raw_32']['omp_wait_policy']}, as the worker)")
    log(f"worker: drain {n} tasks, one worker, max_batch_size=32 ({sqs} SQS)")
    checked("drain_32", drain(n, 32, threads, timeout_s=240, sqs=sqs))
    results["efficiency"] = at_least(results["drain_32"]["tasks_per_s"], results["raw_32"]["per_s"])
    log(f"worker: efficiency {results['efficiency']} "
        f"({results['drain_32']['tasks_per_s']} tasks/s vs raw {results['raw_32']['per_s']}/s)")
    # The model's own time inside the drain against the raw loop's for the same batch.
    full = (results["drain_32"].get("inference") or {}).get("full_batch_p50_ms")
    results["inference_vs_raw_batch_time"] = round(full / (32 * 1000 / results["raw_32"]["per_s"]), 2) if full else None
    log(f"worker: a full batch's inference in the drain took {full} ms p50, "
        f"{results['inference_vs_raw_batch_time']} x the raw loop's")

    # The same drain with a model that costs nothing: what the pipeline alone
    # (queues, table, the worker's own Python) allows on this machine.
    log(f"worker: drain {n} tasks of a zero-cost model (the pipeline's ceiling)")
    checked("drain_free_model", drain(n, 32, threads, timeout_s=240, sqs=sqs, model="synthetic", extra_env={
        "SLUICE_SYNTHETIC_BASE_MS": "0", "SLUICE_SYNTHETIC_PER_ITEM_MS": "0"}))
    results["pipeline_ceiling"] = at_least(results["drain_free_model"]["tasks_per_s"], results["raw_32"]["per_s"])
    log(f"worker: zero-cost model {results['drain_free_model']['tasks_per_s']} tasks/s = "
        f"{results['pipeline_ceiling']} x the raw model")

    n1 = 200 if quick else 400
    log(f"worker: drain {n1} tasks with max_batch_size=1")
    checked("drain_1", drain(n1, 1, threads, timeout_s=240, sqs=sqs))
    results["raw_1"] = raw(1, threads)
    results["batching_gain"] = at_least(results["drain_32"]["tasks_per_s"], results["drain_1"]["tasks_per_s"])
    log(f"worker: batching gain {results['batching_gain']}x")

    curve = []
    sizes = [1, 8, 32] if quick else [1, 4, 8, 16, 32, 64]
    for b in sizes:
        r = raw(b, threads, seconds=4)
        if b == 1:
            d = results["drain_1"]
        elif b == 32:
            d = results["drain_32"]
        else:
            d = checked(f"drain_{b}", drain(max(200, min(n, 25 * b)), b, threads, timeout_s=180, sqs=sqs))
        curve.append({"batch": b, "raw_per_s": r["per_s"], "sluice_tasks_per_s": d["tasks_per_s"],
                      "mean_batch": d.get("mean_batch")})
        log(f"worker: curve batch {b}: raw {r['per_s']}/s, sluice {d['tasks_per_s']}/s")
    results["curve"] = curve
    save("worker", results)
    raise_if_flagged("worker", results)
    return results


if __name__ == "__main__":
    print(json.dumps(main(quick="--quick" in sys.argv,
                          sqs="moto" if "--moto" in sys.argv else None), indent=1))
