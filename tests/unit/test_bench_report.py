"""bench.report: the targets table read from saved results."""

import json

import pytest

from bench import report


@pytest.fixture
def results(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "RESULTS", tmp_path)
    import bench.common

    monkeypatch.setattr(bench.common, "RESULTS", tmp_path)

    def write(name, data):
        (tmp_path / f"{name}.json").write_text(json.dumps(data))

    return write


def by_target(rows):
    return {r.target.split(":")[0].split(",")[0]: r for r in rows}


def test_nothing_measured_is_not_run_never_met(results):
    rows = report.rows()
    assert rows and all(r.met is None for r in rows)
    assert all("not run" in r.measured for r in rows if not r.target.startswith("6."))


def test_each_target_is_judged_at_its_threshold(results):
    phase = {"p50_ms": 10.0, "p99_ms": 12.0}
    results("api", {"phases": {"api_1": phase, "direct_1": phase, "api_32": {**phase, "p99_ms": 49.9},
                               "direct_32": phase},
                    "ratio_p50_1": 1.25, "ratio_p99_1": 1.26, "ratio_p50_32": 0.5, "ratio_p99_32": 0.6})
    results("worker", {"drain_32": {"tasks_per_s": 80.0}, "raw_32": {"per_s": 100.0}, "efficiency": 0.8,
                       "drain_1": {"tasks_per_s": 27.0}, "batching_gain": 2.96})
    results("e2e", {"systems": {"Sluice": {"per_s": 200.0}, "Ray Serve": {"per_s": 100.0, "source": "this run"}},
                    "raw_32": {"per_s": 290.0}, "vs_ray": 2.0, "vs_raw": 0.69})
    results("priorities", {"per_priority": {"high": {"p50_queue_wait_s": 1.0}, "low": {"p50_queue_wait_s": 5.0}},
                           "high_over_low_p50_wait": 0.2, "high_over_low_is": "exact",
                           "low_share_vs_configured": 0.99})
    results("startup", {"runs": [{"sqs": "localstack", "first_task_s": 19.9,
                                  "model_loads_per_worker": {"w0": 1, "w1": 2}}]})
    met = [(r.target[:2], r.met) for r in report.rows()]
    assert met == [
        ("1.", False),  # p99 ratio 1.26
        ("1.", True),  # 49.9 ms
        ("2.", True),
        ("3.", False),
        ("4.", True),
        ("4.", False),
        ("5.", False),  # low below its share
        ("6.", None),
        ("7.", False),  # a worker loaded its model twice
    ]


def test_a_gpu_run_reports_its_best_drain(results):
    results("gpu", {"drain_1024": {"gpu_util_pct": 93.5, "inputs_per_s": 9000, "efficiency_vs_raw": 0.92},
                    "drain_1024_4_workers": {"gpu_util_pct": 71.0}})
    (gpu,) = [r for r in report.rows() if r.target.startswith("6.")]
    assert gpu.met is True and "drain_1024: **93.5%**" in gpu.measured


def test_the_table_and_summary_are_written(results, capsys):
    text = report.main()
    assert text.splitlines()[0] == "| Target | Wanted | Measured | Met? |"
    assert "| n/a |" in capsys.readouterr().out
    saved = json.loads((report.RESULTS / "summary.json").read_text())
    assert saved["markdown"] == text and len(saved["rows"]) == len(text.splitlines()) - 2


def test_a_result_with_problems_shows_its_figures_and_judges_nothing(results):
    results("worker", {"drain_32": {"tasks_per_s": 90.0}, "raw_32": {"per_s": 100.0}, "efficiency": 0.9,
                       "drain_1": {"tasks_per_s": 20.0}, "batching_gain": 4.5,
                       "problems": ["drain_32: CUT OFF at its timeout"]})
    found = by_target(report.rows())
    for target in ("2. Worker efficiency", "3. Batching gain"):
        assert found[target].met is None
        assert "CUT OFF" in found[target].measured and "**0.9**" in found["2. Worker efficiency"].measured


def test_a_ratio_of_two_lower_bounds_is_not_judged(results):
    results("priorities", {"per_priority": {"high": {"p50_queue_wait_s": 1.0}, "low": {"p50_queue_wait_s": 50.0}},
                           "high_over_low_p50_wait": 0.02, "high_over_low_is": "uncertain (both p50s are lower bounds)",
                           "low_share_vs_configured": 1.2})
    assert by_target(report.rows())["5. Priorities under saturation"].met is None


@pytest.mark.parametrize("name, data", [
    ("worker", {"drain_32": {"tasks_per_s": None}, "raw_32": {"per_s": 100.0}, "efficiency": None,
                "drain_1": {"tasks_per_s": None}, "batching_gain": None}),
    ("startup", {"runs": [{"sqs": "localstack", "first_task_s": None, "error": "LocalStack did not start"}]}),
    ("priorities", {"per_priority": {"high": {"p50_queue_wait_s": None}, "low": {"p50_queue_wait_s": 3.0}},
                    "high_over_low_p50_wait": None, "high_over_low_is": "exact", "low_share_vs_configured": 1.0}),
])
def test_a_result_missing_a_figure_says_so_and_the_table_is_still_written(results, name, data):
    results(name, data)
    text = report.main()
    [row] = [r for r in report.rows() if r.measured.startswith("not measured") and not r.target.startswith("6.")]
    assert row.met is None and row.measured in text


def test_a_gpu_run_judges_the_workers_efficiency_on_the_gpu_too(results):
    results("gpu", {"drain_1024": {"gpu_util_pct": 95.0, "efficiency_vs_raw": 0.1},
                    "drain_64x": {"gpu_util_pct": 20.0, "efficiency_vs_raw": 0.5}})
    [row] = [r for r in report.rows() if r.target.startswith("2. Worker efficiency on a GPU")]
    assert row.met is False and "drain_64x: **0.5**" in row.measured


def test_the_gpu_rows_judge_only_what_sluice_ships_and_efficiency_on_one_worker(results):
    # Target 2 is one worker's drain; the switch interval is a bench-only setting.
    results("gpu", {"drain_1024": {"workers": 1, "gpu_util_pct": 40.0, "efficiency_vs_raw": 0.45},
                    "drain_1024_4_workers": {"workers": 4, "gpu_util_pct": 80.0, "efficiency_vs_raw": 0.93},
                    "drain_1024_64_per_task_switch_0_5ms": {"workers": 1, "gpu_util_pct": 95.0,
                                                            "efficiency_vs_raw": 0.95}})
    rows = {r.target[:2]: r for r in report.rows() if r.target.startswith(("2. Worker efficiency on", "6."))}
    assert rows["2."].met is False and "drain_1024: **0.45**" in rows["2."].measured
    assert rows["6."].met is False and "drain_1024_4_workers: **80.0%**" in rows["6."].measured
