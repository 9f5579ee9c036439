"""Run the benchmark suite and write the plots: `make bench` or

    .venv/bin/python -m bench [--quick] [--only api,worker,...] [--plots]

Results land in bench/results/*.json (or $SLUICE_BENCH_RESULTS; one file per
benchmark, with the time it ran). The plots (docs/bench-*.png) are redrawn from
those results after a full run only (no --only, no --quick), or with --plots:
a partial run would otherwise draw last run's figures beside this one's.
Bounded: every benchmark has its own limits; the whole suite takes about 8
minutes on 2 cores (7-8 in the runs docs/benchmarks.md reports). A benchmark
whose result is not a clean measurement (a drain cut off, a peer that failed)
saves it with its "problems" and counts as failed: the exit code is then 1."""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
import traceback

from bench import api, e2e, emulators, gpu, priorities, report, sdk, startup, worker
from bench.common import ROOT, RESULTS, BenchProblems, log, machine, save

# The result file a benchmark saves, where its name is not the benchmark's (a
# GPU dry run keeps a real gpu.json, perhaps copied here from a device, intact).
RESULT_FILES = {"sdk": "sdk_cpu", **({"gpu": "gpu-dry-run"} if os.environ.get("SLUICE_GPU_DRY_RUN") == "1" else {})}

# Kept from the shell: where results go, which emulators, the GPU benchmark's
# switches. Any other SLUICE_* setting (SLUICE_MINILM_DTYPE=fp32, a batch size)
# would reach the stacks and the peers but not the raw model they are divided
# by, so the suite measures Sluice's defaults, each benchmark setting its own.
KEPT_SETTINGS = ("SLUICE_BENCH_", "SLUICE_EMBEDDED_", "SLUICE_GPU_")


def measure_the_defaults(environ: dict) -> list[str]:
    """Drops the SLUICE_* settings the suite must not inherit; returns their names."""
    dropped = sorted(k for k in environ if k.startswith("SLUICE_") and not k.startswith(KEPT_SETTINGS))
    for name in dropped:
        del environ[name]
    return dropped


def _stop_on_sigterm(signum, frame) -> None:
    # `make bench`'s time limit sends SIGTERM: as SystemExit it unwinds the
    # benchmarks' `finally`s, which stop their stacks and peers, where the
    # signal's default would leave them running in their own sessions.
    raise SystemExit(128 + signum)


SUITE = {
    "emulators": emulators.main,
    "sdk": sdk.main,
    "api": api.main,
    "worker": worker.main,
    "e2e": e2e.main,
    "priorities": priorities.main,
    "gpu": gpu.main,
    "startup": startup.main,
}


def plots() -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    docs = ROOT / "docs"
    cores = ((json.loads((RESULTS / "machine.json").read_text()).get("machine") or {}).get("cores")
             if (RESULTS / "machine.json").exists() else None)
    where = f"{cores}-core machine" if cores else "this machine"
    e2e_file, worker_file = RESULTS / "e2e.json", RESULTS / "worker.json"
    if e2e_file.exists():
        d = json.loads(e2e_file.read_text())
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for name, r in d["systems"].items():
            if "per_s" not in r:
                continue
            label = name + ("" if r.get("source") in (None, "this run") else " (reference, not this run)")
            ax.errorbar([r["per_s"]], [r["p50_ms"]], yerr=[[0], [r["p99_ms"] - r["p50_ms"]]], fmt="o", capsize=4,
                        label=label)
        sweep = d.get("sluice_sweep", []) + [{"per_s": d["systems"]["Sluice"]["per_s"],
                                              "p50_ms": d["systems"]["Sluice"]["p50_ms"],
                                              "clients": d["clients"]}]
        sweep.sort(key=lambda x: x["clients"])
        ax.plot([x["per_s"] for x in sweep], [x["p50_ms"] for x in sweep], "--", color="grey", label="Sluice p50, 4-64 clients")
        ax.axvline(d["raw_32"]["per_s"], color="black", lw=0.8, ls=":", label="raw model, batch 32 (same run)")
        ax.set_xlabel("completed requests/s")
        ax.set_ylabel("latency, ms (dot p50, bar to p99)")
        ax.set_yscale("log")
        ax.set_title(f"{d['requests']} one-sentence requests, {d['clients']} clients, {where}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(docs / "bench-latency-throughput.png", dpi=110)
        written.append("docs/bench-latency-throughput.png")
    if worker_file.exists():
        d = json.loads(worker_file.read_text())
        c = d["curve"]
        fig, ax = plt.subplots(figsize=(7, 4.5))
        ax.plot([x["batch"] for x in c], [x["raw_per_s"] for x in c], "o-", label="raw model, plain torch loop")
        ax.plot([x["batch"] for x in c], [x["sluice_tasks_per_s"] for x in c], "s-",
                label=f"one Sluice worker draining a queue ({d['sqs']} SQS, {d.get('dynamodb', 'moto')} DynamoDB)")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max batch size")
        ax.set_ylabel("sentences (tasks)/s")
        ax.set_title(f"MiniLM bf16, {d['drain_32'].get('threads', '?')} torch threads, {where}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(docs / "bench-batch-size.png", dpi=110)
        written.append("docs/bench-batch-size.png")
    return written


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--only", default="", help="comma-separated: " + ",".join(SUITE))
    p.add_argument("--plots", action="store_true", help="redraw docs/bench-*.png after a partial or --quick run too")
    p.add_argument("--plots-only", action="store_true", help="only redraw the plots from bench/results")
    a = p.parse_args()
    chosen = [n for n in (a.only.split(",") if a.only else SUITE) if n]
    unknown = [n for n in chosen if n not in SUITE]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(SUITE)}")
    dropped = measure_the_defaults(os.environ)
    if dropped:
        log(f"measuring Sluice's defaults: ignoring {', '.join(dropped)} from the environment")
    signal.signal(signal.SIGTERM, _stop_on_sigterm)
    failed = []
    started = time.monotonic()
    if not a.plots_only:
        save("machine", {"machine": machine(), "command": ".venv/bin/python -m bench " + " ".join(
            x for x in (["--quick"] if a.quick else []) + ([f"--only {a.only}"] if a.only else []))})
        for name in chosen:
            t0 = time.monotonic()
            # An earlier run's file must not stand in for a benchmark that fails
            # before it saves: the table and the plots read whatever is there.
            (RESULTS / f"{RESULT_FILES.get(name, name)}.json").unlink(missing_ok=True)
            try:
                SUITE[name](quick=a.quick)
            except BenchProblems as exc:  # saved, with its problems: no traceback needed
                log(f"FAILED {exc}")
                failed.append(name)
            except Exception:
                traceback.print_exc()
                failed.append(name)
            log(f"{name}: {time.monotonic() - t0:.0f}s")
    if a.plots or a.plots_only or not (a.only or a.quick):
        for path in plots():
            log(f"wrote {path}")
        if not a.plots_only:
            log("targets (python -m bench.report, also in summary.json):")
            report.main()
    else:
        log("plots not redrawn (a partial or --quick run; --plots redraws them)")
    log(f"suite: {time.monotonic() - started:.0f}s; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
