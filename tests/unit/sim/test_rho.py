"""Finish-time fairness: each job's JCT under a policy over its own JCT under best-fit."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from sja.sim.cluster import parse_cluster
from sja.sim.metrics import RHO_FIELDS, JobRecord, ScheduleRecorder, finish_time_fairness
from sja.sim.model import SimConfig, SimResult, TraceJob
from sja.sim.report import rho_lines
from sja.sim.runner import compare, rho_note, run_comparison

REPO = Path(__file__).resolve().parents[3]


def recorder(jobs: dict[str, tuple[float, float | None]]) -> ScheduleRecorder:
    """A schedule of ``job id -> (submit, finish or None)``."""
    rec = ScheduleRecorder(mem_capacity_mib=1000.0, compute_capacity=1.0)
    for job_id, (submit, finish) in jobs.items():
        rec.add_job(JobRecord(job_id, "t", submit, 100.0, 100.0, 100.0))
        if finish is not None:
            rec.start_job(job_id, submit)
            rec.finish_job(job_id, finish)
    return rec


# Best-fit: a 100 s, b 0 s, c 50 s, e 40 s; d never finished.
BESTFIT = {"a": (0.0, 100.0), "b": (10.0, 10.0), "c": (0.0, 50.0), "d": (0.0, None), "e": (20.0, 60.0)}
# The policy: a 150 s (rho 1.5), b 0 s (1: both floored), c unfinished, d 30 s (best-fit never
# finished it: left out), e 10 s (0.25).
POLICY = {"a": (0.0, 150.0), "b": (10.0, 10.0), "c": (0.0, None), "d": (0.0, 30.0), "e": (20.0, 30.0)}


def test_rho_over_the_jobs_both_finished() -> None:
    m = finish_time_fairness(recorder(POLICY), recorder(BESTFIT))
    assert m["rho_jobs"] == 3  # a, b, e: c unfinished here, d unfinished under best-fit
    assert m["rho_max"] == pytest.approx(1.5)
    assert m["rho_mean"] == pytest.approx((1.5 + 1.0 + 0.25) / 3)
    # "higher": a rho some job got; of [0.25, 1, 1.5] the median is 1 and p90/p99 the largest
    assert m["rho_p50"] == pytest.approx(1.0)
    assert m["rho_p90"] == m["rho_p99"] == pytest.approx(1.5)
    assert m["rho_over_1_5"] == 0.0  # strictly above 1.5
    assert [w["job_id"] for w in m["rho_worst"]] == ["a", "b", "e"]
    assert m["rho_worst"][0] == {"job_id": "a", "rho": 1.5, "jct_s": 150.0, "reference_jct_s": 100.0}
    assert set(m) == set(RHO_FIELDS)


def test_rho_floors_a_zero_best_fit_jct_and_names_only_the_worst() -> None:
    ref = recorder({"z": (0.0, 0.0), "y": (0.0, 10.0), "x": (0.0, 10.0)})
    mine = recorder({"z": (0.0, 5.0), "y": (0.0, 20.0), "x": (0.0, 10.0)})
    m = finish_time_fairness(mine, ref, worst=2)
    assert m["rho_max"] == pytest.approx(5.0)  # 5 s over best-fit's 0 s floored at 1 s
    assert m["rho_over_1_5"] == pytest.approx(2 / 3)
    assert [(w["job_id"], w["rho"]) for w in m["rho_worst"]] == [("z", 5.0), ("y", 2.0)]


def test_best_fit_against_itself_is_one_for_every_job() -> None:
    bf = recorder(BESTFIT)
    m = finish_time_fairness(bf, bf)
    assert m["rho_jobs"] == 4
    for key in ("rho_p50", "rho_p90", "rho_p99", "rho_max", "rho_mean"):
        assert m[key] == 1.0
    assert m["rho_over_1_5"] == 0.0


def test_no_job_in_common_gives_no_figures() -> None:
    m = finish_time_fairness(recorder({"a": (0.0, 1.0)}), recorder({"b": (0.0, 1.0)}))
    assert m["rho_jobs"] == 0 and m["rho_worst"] == []
    assert math.isnan(m["rho_p99"]) and math.isnan(m["rho_max"])


def test_compare_adds_rho_to_every_policy_and_needs_best_fit() -> None:
    results = {
        "bestfit": SimResult("bestfit", recorder(BESTFIT)),
        "sja:fair": SimResult("sja:fair", recorder(POLICY)),
    }
    metrics: dict[str, dict[str, object]] = {name: {} for name in results}
    compare(results, metrics)
    assert metrics["sja:fair"]["rho_max"] == pytest.approx(1.5)
    assert metrics["bestfit"]["rho_max"] == 1.0 and metrics["bestfit"]["rho_jobs"] == 4
    assert rho_note(metrics) == ""
    lines = rho_lines(metrics)
    assert len(lines) == 1 and lines[0].startswith("sja:fair: p99 rho 1.500, max rho 1.500 over 3 jobs")

    del results["bestfit"]
    alone: dict[str, dict[str, object]] = {"sja:fair": {}}
    compare(results, alone)
    assert all(alone["sja:fair"][k] is None for k in RHO_FIELDS)
    assert "needs 'bestfit'" in rho_note(alone)
    assert rho_lines(alone) == [rho_note(alone)]


def small_trace(n: int = 10) -> list[TraceJob]:
    return [
        TraceJob(
            job_id=f"job{i}",
            submit_s=90.0 * i,
            duration_s=600.0 + 300.0 * (i % 3),
            num_gpus=1 + (i % 4 == 3),
            mem_mib=8000.0,
            true_mem_mib=6000.0,
            tenant=f"t{i % 2}",
        )
        for i in range(n)
    ]


def test_run_comparison_reports_consistent_rho() -> None:
    cluster = parse_cluster("2xA100-80GB:4g.40gb+2g.20gb+1g.20gb")
    cfg = SimConfig(horizon_s=600.0, unit_s=60.0, eps_mem=0.2)
    jobs = small_trace()
    _, metrics = run_comparison(cluster, jobs, ["sja:fair", "bestfit", "fifo"], cfg)
    for name, m in metrics.items():
        assert set(RHO_FIELDS) <= set(m), name
        assert m["rho_jobs"] == len(jobs), name  # every policy finishes this trace
        assert m["rho_max"] >= m["rho_p99"] >= m["rho_p90"] >= m["rho_p50"] > 0, name
        assert 0.0 <= m["rho_over_1_5"] <= 1.0
        assert m["rho_worst"] and m["rho_worst"][0]["rho"] == m["rho_max"]
        json.dumps(m)  # JSON as it is
    assert metrics["bestfit"]["rho_max"] == metrics["bestfit"]["rho_p50"] == 1.0


def test_the_grid_checks_p99_rho_per_cell(tmp_path: Path) -> None:
    # In a subprocess: the grid's module switches the decision core to its compiled build on import.
    script = r"""
import csv, json, sys
from pathlib import Path
sys.path.insert(0, "bench")
import evaluation as ev

def metrics(rho_p99):
    m = {"jobs": 10, "jobs_finished": 10, "mean_jct_common_s": 100.0, "p95_jct_common_s": 200.0,
         "utilization": 0.5, "makespan_s": 1000.0, "rho_jobs": 10, "rho_p99": rho_p99,
         "rho_max": rho_p99 * 2}
    return m

def row(seed, fair_rho):
    ms = {p: metrics(1.0) for p in ev.POLICIES}
    ms["sja:fair"] = metrics(fair_rho)
    ms["sja:efficiency"] = metrics(1.2)
    cell = {"layout": "mig", "load": 1.3}
    checks = ev.goal_checks(ms, {s: True for s in ev.SJA}, cell)
    return {"name": "c/m/mig/130%", "cluster": "4xA100-80GB", "seed": seed, "metrics": ms, "checks": checks,
            "cell": cell}

rows = [row(0, 1.4), row(1, 1.6)]
assert rows[0]["checks"]["sja:fair"]["rho"] and not rows[1]["checks"]["sja:fair"]["rho"]
out = Path(sys.argv[1])
ev.write_csv(out / "grid.csv", rows)
summary = ev.write_markdown(out / "grid.md", rows, {})
print(json.dumps(summary))
print(json.dumps([r["rho_met"] for r in csv.DictReader((out / "grid.csv").open())]))
"""
    done = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=REPO, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    summary, rho_met = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    assert summary["rho_met_cells"] == {"sja:efficiency": 1, "sja:fair": 0}
    assert rho_met.count("True") == 3 and rho_met.count("False") == 1  # two SJA rows per seed
    grid = (tmp_path / "grid.md").read_text()
    assert "at most 1.5" in grid and " / 1/2 (2/2 / 2/2) |" in grid and "1.50 / 3.00" in grid
