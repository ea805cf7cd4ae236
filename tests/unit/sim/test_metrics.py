"""Metrics on a hand-made schedule."""

from __future__ import annotations

import math

import pytest

from sja.sim.metrics import JobRecord, ScheduleRecorder, jain_index, makespan_lower_bound, summarize


def schedule() -> ScheduleRecorder:
    # Two GPUs (capacity 2.0, 2 x 1000 MiB). Job a: submitted 0, runs [10, 110) on one GPU.
    # Job b: submitted 0, runs [0, 50) on the other. Makespan 110; 150 GPU-s of work done.
    rec = ScheduleRecorder(mem_capacity_mib=2000.0, compute_capacity=2.0, bin_s=50.0)
    rec.add_job(JobRecord("a", "t1", 0.0, 100.0, 100.0, 100.0))
    rec.add_job(JobRecord("b", "t2", 0.0, 50.0, 50.0, 50.0))
    rec.start_job("a", 10.0)
    rec.start_job("b", 0.0)
    rec.add_piece(10.0, 110.0, share=1.0, mem_mib=500.0, useful_gpu_s=100.0)
    rec.add_piece(0.0, 50.0, share=1.0, mem_mib=1000.0, useful_gpu_s=40.0, overhead_s=10.0)
    rec.finish_job("a", 110.0)
    rec.finish_job("b", 50.0)
    rec.add_stranded(1000.0, 10.0)
    return rec


def test_summary_of_a_hand_made_schedule() -> None:
    m = summarize(schedule())
    assert m["makespan_s"] == 110.0
    assert m["utilization"] == pytest.approx(140.0 / 220.0)
    assert m["alloc_utilization"] == pytest.approx(150.0 / 220.0)
    assert m["mem_utilization"] == pytest.approx((500 * 100 + 1000 * 50) / (2000 * 110))
    assert m["mean_jct_s"] == pytest.approx(80.0)
    assert m["mean_wait_s"] == pytest.approx(5.0)
    assert m["p95_wait_s"] == pytest.approx(9.5)
    assert m["makespan_lower_bound_s"] == pytest.approx(100.0)  # a's critical path beats 150/2
    assert m["fragmentation"] == pytest.approx(1000 * 10 / (2000 * 110))
    assert m["overhead_s"] == 10.0
    assert m["subjobs"] == 2
    # Slowdown service: a 100/110, b 50/50 -> Jain over the two tenants.
    x = [100 / 110, 1.0]
    assert m["jain_fairness"] == pytest.approx(sum(x) ** 2 / (2 * sum(v * v for v in x)))


def test_utilization_series_spreads_pieces_over_bins() -> None:
    times, comp, mem = schedule().utilization_series()
    assert times == [0.0, 50.0, 100.0]
    # bin [0,50): a 40 s at rate 1, b 50 s at 0.8 -> 80 of 100 GPU-s
    assert comp[0] == pytest.approx(0.8)
    assert comp[2] == pytest.approx(10.0 / 100.0)
    assert mem[1] == pytest.approx(500 * 50 / (2000 * 50))


def test_jain_index_bounds() -> None:
    assert jain_index([1.0, 1.0, 1.0]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert math.isnan(jain_index([]))


def test_lower_bound_uses_capacity_when_work_dominates() -> None:
    jobs = [JobRecord(f"j{i}", "t", float(i), 10.0, 10.0, 10.0) for i in range(10)]
    assert makespan_lower_bound(jobs, compute_capacity=1.0) == pytest.approx(100.0)
    unschedulable = JobRecord("x", "t", 0.0, 1e6, 1e6, 1e6, unschedulable=True)
    assert makespan_lower_bound([*jobs, unschedulable], compute_capacity=1.0) == pytest.approx(100.0)


def test_fragmentation_spans_the_whole_simulation_when_a_job_never_finishes() -> None:
    rec = schedule()
    rec.add_job(JobRecord("stuck", "t1", 0.0, 10.0, 10.0, 10.0))
    rec.add_stranded(2000.0, 110.0)  # both GPUs free and useless to "stuck" from t=110 to t=220
    rec.end_s = 220.0
    m = summarize(rec)
    assert m["jobs_unfinished"] == 1
    assert m["fragmentation"] == pytest.approx((1000 * 10 + 2000 * 110) / (2000 * 220))
    assert m["fragmentation"] <= 1.0
