"""The issue's targets against the saved results, as the Markdown table
docs/benchmarks.md shows: `.venv/bin/python -m bench.report`.

Reads bench/results/*.json (or $SLUICE_BENCH_RESULTS); a benchmark without a
result file is listed as not run. Prints the table and writes it, with each
row's figures, to summary.json beside the results. The suite runs it after a
full run."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from bench.common import RESULTS, save


@dataclass
class Row:
    target: str
    wanted: str
    measured: str
    met: bool | None  # None: not measured in these results


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _api(api: dict) -> list[Row]:
    ph = api["phases"]
    r50, r99 = api["ratio_p50_1"], api["ratio_p99_1"]
    p99 = ph["api_32"]["p99_ms"]
    return [
        Row("1. API overhead, 1 client: API ÷ direct boto3", "≤ 1.25 (p50 and p99)",
            f"p50 {ph['api_1']['p50_ms']} / {ph['direct_1']['p50_ms']} ms = **{r50}**; "
            f"p99 {ph['api_1']['p99_ms']} / {ph['direct_1']['p99_ms']} ms = **{r99}**",
            r50 <= 1.25 and r99 <= 1.25),
        Row("1. API overhead, 32 clients", "≤ 1.25, API p99 < 50 ms",
            f"ratios p50 **{api['ratio_p50_32']}**, p99 **{api['ratio_p99_32']}**; API p99 **{p99} ms**",
            api["ratio_p50_32"] <= 1.25 and api["ratio_p99_32"] <= 1.25 and p99 < 50),
    ]


def _worker(worker: dict) -> list[Row]:
    d, raw = worker["drain_32"], worker["raw_32"]
    free = worker.get("drain_free_model", {})
    return [
        Row("2. Worker efficiency: one worker ÷ raw model, batch 32, CPU", "≥ 0.8",
            f"{d['tasks_per_s']} ÷ {raw['per_s']}/s = **{worker['efficiency']}** "
            f"(zero-cost model: {free.get('tasks_per_s')} tasks/s = {worker.get('pipeline_ceiling')} × raw)",
            worker["efficiency"] >= 0.8),
        Row("3. Batching gain: batch 32 ÷ batch 1", "≥ 3×",
            f"{d['tasks_per_s']} ÷ {worker['drain_1']['tasks_per_s']} = **{worker['batching_gain']}×**",
            worker["batching_gain"] >= 3),
    ]


def _e2e(e2e: dict) -> list[Row]:
    s = e2e["systems"]
    sluice, ray = s["Sluice"], s.get("Ray Serve", {})
    vs_ray, vs_raw = e2e.get("vs_ray"), e2e["vs_raw"]
    ray_fig = f"{ray['per_s']} req/s" if "per_s" in ray and ray.get("source") == "this run" else "not measured"
    return [
        Row("4. End to end, 2000 requests, 64 clients: Sluice ÷ Ray Serve", "≥ 2×",
            f"{sluice.get('per_s')} ÷ {ray_fig} = **{vs_ray}**", None if vs_ray is None else vs_ray >= 2),
        Row("4. End to end: Sluice ÷ raw model (same run)", "≥ 0.7",
            f"{sluice.get('per_s')} ÷ {e2e['raw_32']['per_s']} = **{vs_raw}**", vs_raw >= 0.7),
    ]


def _priorities(pri: dict) -> list[Row]:
    per = pri["per_priority"]
    ratio, share, kind = pri["high_over_low_p50_wait"], pri["low_share_vs_configured"], pri["high_over_low_is"]
    # An exact ratio, or an upper bound of it (low's p50 a lower bound), can be
    # judged; with both p50s lower bounds it could be anything.
    met = None if kind.startswith("uncertain") else ratio <= 0.2 and share >= 1.0
    return [Row("5. Priorities under saturation: p50 queue wait high ÷ low; low's share", "≤ 1/5; ≥ its share",
                f"{per['high']['p50_queue_wait_s']} s ÷ {per['low']['p50_queue_wait_s']} s = **{ratio}** "
                f"({kind}); low got **{share} ×** its configured share", met)]


def _gpu(gpu: dict) -> list[Row]:
    drains = {k: v for k, v in gpu.items() if k.startswith("drain_") and isinstance(v, dict)}
    if gpu.get("skipped") or not drains:
        raise LookupError(gpu.get("skipped", "no drain on the GPU"))
    # Judged on what Sluice ships: not the drains under a bench-only setting
    # (the switch interval, which the worker has no setting for); and target 2
    # is one worker's drain, not several sharing the GPU.
    shipped = {k: d for k, d in drains.items() if "_switch_" not in k}
    if not shipped:
        raise LookupError("no drain with Sluice's own settings")
    best_key = max(shipped, key=lambda k: shipped[k].get("gpu_util_pct") or 0)
    best = shipped[best_key]
    util = best.get("gpu_util_pct") or 0
    one_worker = {k: d for k, d in shipped.items() if d.get("workers", 1) == 1}
    efficient_key = max(one_worker, key=lambda k: one_worker[k].get("efficiency_vs_raw") or 0, default=None)
    efficiency = one_worker[efficient_key].get("efficiency_vs_raw") if efficient_key else None
    return [
        Row("6. GPU: utilization during the drain", "≥ 90%",
            f"{best_key}: **{util}%**, {best.get('inputs_per_s')} sentences/s, "
            f"{best.get('efficiency_vs_raw')} × raw, {best.get('fraction_of_peak_bf16')} of bf16 peak",
            util >= 90),
        Row("2. Worker efficiency on a GPU: drain ÷ raw model, same batch", "≥ 0.9",
            f"{efficient_key}: **{efficiency}**", None if efficiency is None else efficiency >= 0.9),
    ]


def _startup(startup: dict) -> list[Row]:
    first = startup["runs"][0]
    loads = first["model_loads_per_worker"]
    return [Row(f"7. Start-up: `make run` to the first succeeded task ({first['sqs']} SQS)",
                "< 20 s, one model load per worker",
                f"**{first['first_task_s']} s**; loads per worker {sorted(loads.values())}",
                first["first_task_s"] < 20 and set(loads.values()) == {1})]


# (result file, its rows, what a missing file shows): in the order of the issue.
_SECTIONS = [
    ("api", _api, Row("1. API overhead", "≤ 1.25; p99 < 50 ms at 32 clients", "not run", None)),
    ("worker", _worker, Row("2-3. Worker efficiency, batching gain", "≥ 0.8; ≥ 3×", "not run", None)),
    ("e2e", _e2e, Row("4. End to end against peers", "≥ 2× Ray Serve, ≥ 0.7 × raw", "not run", None)),
    ("priorities", _priorities, Row("5. Priorities under saturation", "≤ 1/5; low at its share", "not run", None)),
    ("gpu", _gpu, Row("6. GPU utilization", "≥ 90%", "not measured: not run", None)),
    ("startup", _startup, Row("7. Start-up", "< 20 s", "not run", None)),
]


def rows() -> list[Row]:
    """A row per target. A result that lists problems (a drain cut off, failed
    requests) shows its figures but judges nothing; one that lacks a figure
    says which, rather than ending the table with a traceback."""
    out: list[Row] = []
    for name, build, missing in _SECTIONS:
        result = _load(name)
        if result is None:
            out.append(missing)
            continue
        try:
            found = build(result)
        except (LookupError, TypeError, ZeroDivisionError, AttributeError) as exc:
            why = exc.args[0] if isinstance(exc, LookupError) and name == "gpu" else f"{type(exc).__name__}: {exc}"
            out.append(Row(missing.target, missing.wanted, f"not measured: {why}", None))
            continue
        problems = result.get("problems") or []
        for row in found:
            if problems:
                row.measured += f"; not a clean measurement ({'; '.join(problems)})"
                row.met = None
            out.append(row)
    return out


def table(found: list[Row]) -> str:
    lines = ["| Target | Wanted | Measured | Met? |", "|---|---|---|---|"]
    for r in found:
        met = "n/a" if r.met is None else ("yes" if r.met else "no")
        lines.append(f"| {r.target} | {r.wanted} | {r.measured} | {met} |")
    return "\n".join(lines)


def main() -> str:
    found = rows()
    machine = _load("machine") or {}
    text = table(found)
    save("summary", {"machine": machine.get("machine"), "rows": [asdict(r) for r in found], "markdown": text})
    print(text)
    return text


if __name__ == "__main__":
    main()
