"""Rigid baselines on tiny, hand-checkable traces."""

from __future__ import annotations

from sja.sim.baselines import run_baseline
from sja.sim.cluster import parse_cluster
from sja.sim.metrics import summarize
from sja.sim.model import SimConfig, TraceJob

CFG = SimConfig()


def job(job_id: str, submit: float, duration: float, gpus: int = 1, **kw: float) -> TraceJob:
    return TraceJob(job_id=job_id, submit_s=submit, duration_s=duration, num_gpus=gpus, mem_mib=8000.0, **kw)  # type: ignore[arg-type]


def starts(result: object) -> dict[str, tuple[float | None, float | None]]:
    jobs = result.recorder.jobs  # type: ignore[attr-defined]
    return {j.job_id: (j.first_start_s, j.finish_s) for j in jobs.values()}


BLOCKING_TRACE = [
    job("a", 0, 100),  # holds one of the two GPUs until t=100
    job("b", 1, 50, gpus=2),  # needs both: must wait for a
    job("c", 2, 10),  # short, fits the idle GPU at once
    job("d", 3, 500),  # long: would delay b's reservation
]


def test_fifo_head_of_line_blocking() -> None:
    s = starts(run_baseline("fifo", parse_cluster("2xA100-80GB"), BLOCKING_TRACE, CFG))
    assert s["a"] == (0, 100)
    assert s["b"] == (100, 150)
    # c could have run on the idle GPU at t=2, but it is behind b.
    assert s["c"] == (150, 160)
    assert s["d"] == (150, 650)


def test_easy_backfills_a_short_job_without_delaying_the_reservation() -> None:
    s = starts(run_baseline("easy", parse_cluster("2xA100-80GB"), BLOCKING_TRACE, CFG))
    assert s["a"] == (0, 100)
    assert s["c"] == (2, 12)  # backfilled: ends before b's reservation at t=100
    assert s["b"] == (100, 150)  # reservation kept
    assert s["d"] == (150, 650)  # would end after t=100 on a GPU b needs: not backfilled


def test_bestfit_takes_the_smallest_slice_that_holds_the_declaration() -> None:
    cluster = parse_cluster("1xA100-80GB:4g.40gb+2g.20gb+1g.20gb")
    trace = [
        TraceJob(job_id="small", submit_s=0, duration_s=10, num_gpus=1, mem_mib=15000.0),
        TraceJob(job_id="big", submit_s=0, duration_s=10, num_gpus=1, mem_mib=30000.0),
    ]
    s = starts(run_baseline("bestfit", cluster, trace, CFG))
    # A whole-GPU job runs at the slice's compute share: 10 s of a full GPU take 70 s on a 1g slice
    # (the smallest 20 GB slice) and 17.5 s on the 4g.40gb one.
    assert s["small"] == (0, 70)
    assert s["big"] == (0, 17.5)


def test_bestfit_oom_resubmits_with_the_real_memory() -> None:
    cluster = parse_cluster("1xA100-80GB:4g.40gb+2g.20gb+1g.20gb")
    trace = [
        TraceJob(
            job_id="liar",
            submit_s=0,
            duration_s=7,
            num_gpus=1,
            gpu_fraction=1 / 7,
            mem_mib=15000.0,
            true_mem_mib=30000.0,
        ),
    ]
    r = run_baseline("bestfit", cluster, trace, CFG)
    m = summarize(r.recorder)
    assert m["oom_count"] == 1
    # OOM after min(7 s, oom_detect_s) on the 1g slice, then 7 s on the 4g.40gb slice.
    assert starts(r)["liar"] == (0, 14)


def test_jobs_larger_than_the_cluster_are_unschedulable_for_rigid_baselines() -> None:
    r = run_baseline(
        "easy", parse_cluster("2xA100-80GB"), [job("huge", 0, 10, gpus=4), job("ok", 0, 10)], CFG
    )
    m = summarize(r.recorder)
    assert m["jobs_unschedulable"] == 1
    assert m["jobs_finished"] == 1


def test_bestfit_gives_a_declaration_no_slice_holds_an_entire_gpu_only_where_one_can_have_it() -> None:
    # A process sees one MIG instance: on a fixed layout no job has a GPU's whole memory.
    trace = [
        TraceJob(job_id="whole", submit_s=0, duration_s=10, num_gpus=1, mem_mib=60000.0),
        TraceJob(job_id="two", submit_s=1, duration_s=10, num_gpus=2, mem_mib=8000.0),
    ]
    fixed = run_baseline("bestfit", parse_cluster("2xA100-80GB:4g.40gb+2g.20gb+1g.20gb"), trace, CFG)
    s = starts(fixed)
    assert s["whole"] == (None, None)
    rec = fixed.recorder.jobs["whole"]
    assert rec.unschedulable and "largest slice holds 39,936 MiB" in rec.reason
    # a gang of MIG devices: the smallest slice holding 8 GB on each GPU (1g.20gb: a seventh of the
    # compute, so 7x the trace's duration)
    assert s["two"] == (1, 71)
    # MIG off (one slice per GPU), or a GPU that may be re-cut: an entire GPU at full speed.
    for spec in ("2xA100-80GB", "2xA100-80GB:4g.40gb+2g.20gb+1g.20gb~repart=0"):
        s = starts(run_baseline("bestfit", parse_cluster(spec), trace, CFG))
        assert s["whole"] == (0, 10), spec
