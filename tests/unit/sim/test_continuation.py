"""Open subjobs in the simulator (``core.continuation``): a subjob goes on past its window while no
other job wins its slice, and yields at its next unit boundary when one does."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from sja.core.shadow import DUE_SLACK, SPAN_SLACK
from sja.sim.cluster import parse_cluster
from sja.sim.engine import SjaEngine, _Running, _Slice
from sja.sim.metrics import summarize
from sja.sim.model import SimConfig, TraceJob

CFG = SimConfig(horizon_s=600.0, unit_s=60.0, policy="fair")


def job(name: str, submit_s: float, duration_s: float, gpus: int = 1, mem: float = 8000.0) -> TraceJob:
    return TraceJob(
        job_id=name,
        submit_s=submit_s,
        duration_s=duration_s,
        num_gpus=gpus,
        mem_mib=mem,
        true_mem_mib=mem * 0.7,
        tenant=name,
    )


class Spy(SjaEngine):
    """Records every yield: when it was asked, the holder's window end, its subjob and the units it
    was planned for."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.yields: list[tuple[float, float, str, int]] = []

    def _yield(self, s: _Slice, run: _Running) -> None:
        c = run.completion
        self.yields.append((self.now, s.state.contestable_at, c.subjob_id, c.units))
        super()._yield(s, run)


def run(jobs: list[TraceJob], cluster: str = "1xA100-80GB", cfg: SimConfig = CFG) -> Spy:
    engine = Spy(parse_cluster(cluster), jobs, cfg)
    engine.run()
    return engine


def units_exactly_once(engine: SjaEngine) -> None:
    for j in engine.jobs.values():
        st = j.state
        assert st.status == "done" and st.units_done == st.total_units, st.job_id
        covered = 0
        for h in sorted((h for h in st.history if h.status == "ok"), key=lambda h: h.unit_start):
            assert h.unit_start == covered, f"{st.job_id}: gap or overlap at unit {h.unit_start}"
            covered += h.units
        assert covered == st.total_units


def test_an_uncontested_long_job_runs_as_one_subjob_with_one_start() -> None:
    # Four hours on a 10-minute window: no window-boundary re-starts while nobody waits.
    engine = run([job("long", 0.0, 4 * 3600.0)])
    st = engine.jobs["j0"].state
    assert [(h.unit_start, h.units, h.status) for h in st.history] == [(0, st.total_units, "ok")]
    m = summarize(engine.recorder)
    assert m["subjobs"] == 1
    assert m["overhead_s"] == CFG.start_s + CFG.checkpoint_s
    assert engine.yields == []
    # It ran far past the window it was planned for.
    assert st.history[0].finished_at - st.history[0].started_at > 10 * CFG.horizon_s


@pytest.mark.parametrize("duration_s", [4 * 3600.0, 600.0, 40.0, 12.0])
def test_an_uncontested_job_takes_what_its_trace_run_took(duration_s: float) -> None:
    # The trace's duration is one run of the program, one start-up and one save included: a job
    # nobody contends with runs as one subjob and finishes in that time, as under a rigid
    # scheduler (a job too short for a whole start-up has a shorter one).
    cfg = dataclasses.replace(CFG, time_noise_sd=0.0)
    engine = run([job("one", 0.0, duration_s)], cfg=cfg)
    rec = engine.recorder.jobs["one"]
    assert rec.finish_s - rec.submit_s == pytest.approx(duration_s)
    assert summarize(engine.recorder)["subjobs"] == 1
    model = engine.models[0]
    assert model.start_s + model.checkpoint_s <= duration_s / 2 + 1e-9


@pytest.mark.parametrize("seed", range(5))
def test_a_long_open_subjob_varies_as_many_window_long_pieces_do(seed: int) -> None:
    # The time noise is a window-long piece's: a 4-hour run is not 10 % off on one draw.
    engine = run([job("long", 0.0, 4 * 3600.0)], cfg=dataclasses.replace(CFG, seed=seed))
    h = engine.jobs["j0"].state.history[0]
    work_s = h.duration_s - CFG.start_s - CFG.checkpoint_s
    assert work_s == pytest.approx(4 * 3600.0, rel=0.06)


def test_a_waiting_job_gets_the_slice_at_the_holders_next_unit_boundary() -> None:
    engine = run([job("holder", 0.0, 4 * 3600.0), job("waiter", 100.0, 1800.0)])
    holder, waiter = engine.jobs["j0"].state, engine.jobs["j1"].state
    first = holder.history[0]
    window_end = first.started_at + first.time_cap_s + CFG.start_overhead_s
    assert engine.yields[0][:2] == (pytest.approx(window_end), pytest.approx(window_end))
    # It stopped after the unit it was doing when the waiter won: at the first boundary after its
    # window's end, and kept every unit it finished.
    unit_s = (first.duration_s - CFG.start_s - CFG.checkpoint_s) / first.units
    work_end = first.started_at + CFG.start_s + first.units * unit_s
    assert work_end >= window_end - 1e-6
    assert work_end - unit_s < window_end
    assert first.status == "ok" and first.units >= 1
    # The waiter's first subjob starts as the holder's ends.
    assert waiter.history[0].started_at == pytest.approx(first.finished_at)
    assert engine.recorder.jobs["waiter"].first_start_s == pytest.approx(first.finished_at)
    units_exactly_once(engine)


@pytest.mark.parametrize("seed", range(5))
def test_the_completion_a_yield_replaced_is_no_instant(seed: int) -> None:
    # After a short waiter, the holder runs the rest at another draw of its speed, and may end
    # before its first subjob would have: the run ends with the last job all the same.
    cfg = dataclasses.replace(CFG, seed=seed, time_noise_sd=0.5)
    engine = run([job("holder", 0.0, 4 * 3600.0), job("waiter", 100.0, 60.0)], cfg=cfg)
    assert engine.yields
    last = max(r.finish_s for r in engine.recorder.jobs.values() if r.finish_s is not None)
    assert engine.recorder.end_s == last


def test_a_holder_is_never_preempted_before_its_window_ends() -> None:
    # Jobs arrive every minute on two GPUs: every holder has someone waiting from its start on.
    jobs = [job(f"j{i}", 60.0 * i, 1800.0 + 600.0 * (i % 3)) for i in range(8)]
    engine = run(jobs, "2xA100-80GB")
    assert engine.yields, "nobody was asked to yield"
    ended = {h.subjob_id: h for j in engine.jobs.values() for h in j.state.history}
    for now, contestable_at, subjob_id, _ in engine.yields:
        h = ended[subjob_id]
        window_end = h.started_at + h.time_cap_s + CFG.start_overhead_s
        assert contestable_at == pytest.approx(window_end)
        assert now >= window_end - 1e-6
        assert h.finished_at >= window_end - 1e-6
    units_exactly_once(engine)


def test_jobs_that_run_several_subjobs_at_once_continue_side_by_side() -> None:
    # max_parallel 2 on two idle GPUs: each subjob holds half the job (its even share of the work
    # not handed out) and runs it through, past its window, in one start.
    engine = run([job("wide", 0.0, 3600.0, gpus=2)], "2xA100-80GB")
    st = engine.jobs["j0"].state
    assert len(st.history) == 2 and engine.counters["open_subjobs"] == 2
    assert sorted((h.unit_start, h.units) for h in st.history) == [(0, 60), (60, 60)]
    for h in st.history:
        assert h.status == "ok" and h.finished_at - h.started_at > h.time_cap_s
    assert {h.slice_id for h in st.history} == {s.state.slice_id for s in engine.slices}
    units_exactly_once(engine)


def test_an_open_subjob_stops_where_growing_memory_would_outgrow_its_slice() -> None:
    # Half its peak grows with the units it does: an open subjob reaches only as far as the memory
    # quantile fits the slice (core.continuation.open_units), and never runs out of memory there.
    cfg = dataclasses.replace(CFG, mem_per_unit_frac=0.5, mem_noise_sd=0.0)
    engine = run([job("grows", 0.0, 4 * 3600.0, mem=30_000.0)], "1xA100-80GB", cfg)
    st = engine.jobs["j0"].state
    m = summarize(engine.recorder)
    assert m["oom_count"] == 0
    assert len(st.history) > 1  # it could not go on to the end in one
    assert all(h.status == "ok" for h in st.history)
    units_exactly_once(engine)


def test_a_slow_holder_yields_with_fewer_units_than_planned_and_loses_none() -> None:
    # Durations far above what the job declares: its first subjob has not done its planned units
    # when its window ends, and a waiter is there.
    cfg = dataclasses.replace(CFG, time_noise_sd=0.0, speed_table={"7g.80gb": 0.1})
    engine = run([job("slow", 0.0, 3 * 3600.0), job("waiter", 10.0, 1200.0)], "1xA100-80GB", cfg)
    first = engine.jobs["j0"].state.history[0]
    assert engine.yields and engine.yields[0][2] == first.subjob_id
    planned = engine.yields[0][3]
    # 600 s a unit where 60 s was declared: by its window's end it is in its first unit.
    assert first.status == "ok"
    assert first.units == math.ceil((first.time_cap_s + CFG.start_overhead_s - CFG.start_s) / 600.0)
    assert first.units < planned
    units_exactly_once(engine)


def test_a_job_best_fit_would_run_whole_is_served_first_once_due() -> None:
    """A 4-hour job best-fit starts at once, and half-hour newcomers every 20 minutes: by attained
    service alone each newcomer would take the slice from it at its window's end. Once it is due
    (``core.shadow``: ``DUE_SLACK - 1`` times its rigid JCT after its submission) no job that is not
    due takes its slice, so it finishes within ``DUE_SLACK`` times its best-fit JCT, up to the one
    window it had yielded."""
    # one tenant: across tenants ``fair`` serves the tenant with the least service first
    long = dataclasses.replace(job("long", 0.0, 4 * 3600.0), tenant="t")
    newcomers = [dataclasses.replace(job(f"n{i}", 100.0 + 1200.0 * i, 1800.0), tenant="t") for i in range(18)]
    engine = run([long, *newcomers])
    st = engine.jobs["j0"].state
    # due by the reference at (DUE_SLACK - 1) x 4 h, to finish by DUE_SLACK x 4 h (what it carries);
    # its measured durations (noisy around its declaration) may put that back by a little
    # (``shadow.due_by_evidence``)
    assert DUE_SLACK * 4 * 3600.0 <= st.due_at <= DUE_SLACK * 4 * 3600.0 * 1.02
    rec = engine.recorder.jobs["long"]
    assert rec.finish_s is not None and rec.finish_s <= DUE_SLACK * 4 * 3600.0 + CFG.horizon_s
    units_exactly_once(engine)
    # without the reference's due times it would have come after every newcomer
    plain = Spy(parse_cluster("1xA100-80GB"), [long, *newcomers], CFG)
    plain._dues = lambda started: None  # type: ignore[method-assign]
    plain.run()
    late = plain.recorder.jobs["long"].finish_s
    assert late is not None and late > 1.5 * 4 * 3600.0


def test_a_job_slower_than_it_declared_is_due_when_its_measurements_say() -> None:
    """The slice runs at a quarter of the speed its share says: the reference (by the declaration
    and the share) has the 2-hour job run 2 h, due after 1 h. Newcomers from 30 min make it yield
    and be measured: its run is 8 h, so it is due once ``(DUE_SLACK - 1) x 8 h`` have passed
    (``shadow.due_by_evidence``), and not before."""
    cfg = dataclasses.replace(CFG, time_noise_sd=0.0, speed_table={"7g.80gb": 0.25})
    long = dataclasses.replace(job("long", 0.0, 2 * 3600.0), tenant="t")
    newcomers = [dataclasses.replace(job(f"n{i}", 1800.0 + 1200.0 * i, 600.0), tenant="t") for i in range(20)]
    marks: list[tuple[float, str, float]] = []

    class Marks(Spy):
        def _set_due(self, job: Any, at: float) -> None:
            marks.append((self.now, job.state.job_id, at))
            super()._set_due(job, at)

    engine = Marks(parse_cluster("1xA100-80GB"), [long, *newcomers], cfg)
    engine.shadow.span_slack = math.inf  # alone at first, it ends its busy period: not this test's bound
    engine.run()
    assert engine.shadow.basis["j0"].due_at() == pytest.approx((DUE_SLACK - 1) * 2 * 3600.0)
    own = [(t, at) for t, j, at in marks if j == "j0"]
    measured = (DUE_SLACK - 1) * 2 * 3600.0 + (DUE_SLACK - 1) * (8 - 2) * 3600.0
    # marked then, to finish by DUE_SLACK x its measured 8 h (what it carries)
    assert own and own[0][0] == pytest.approx(measured, rel=0.1)
    assert own[0][1] == pytest.approx(DUE_SLACK * 8 * 3600.0, rel=0.1)
    assert engine.jobs["j0"].state.due_at == pytest.approx(DUE_SLACK * 8 * 3600.0, rel=0.1)
    units_exactly_once(engine)


def test_a_long_job_that_ends_the_busy_period_is_not_kept_past_its_span() -> None:
    """An 8-hour 2-GPU job and half-hour newcomers every 20 minutes on 3 GPUs: best-fit runs it
    from the start to the end of everything (8 h), the newcomers on the third GPU. By attained
    service the newcomers take its slices at their windows' ends, and it ends the run almost an
    hour late. As the job whose run is most of the reference's busy period it is due once it must
    run at full width to finish within ``SPAN_SLACK`` times that span (``shadow.span_due_at``)."""
    long = dataclasses.replace(job("long", 0.0, 8 * 3600.0, gpus=2), tenant="t")
    newcomers = [dataclasses.replace(job(f"n{i}", 60.0 + 1200.0 * i, 1800.0), tenant="t") for i in range(12)]
    engine = run([long, *newcomers], "3xA100-80GB")
    span = 8 * 3600.0
    assert engine.jobs["j0"].state.due_at == pytest.approx(SPAN_SLACK * span)  # to finish by
    finish = engine.recorder.jobs["long"].finish_s
    assert finish is not None and finish <= SPAN_SLACK * span
    units_exactly_once(engine)
    plain = Spy(parse_cluster("3xA100-80GB"), [long, *newcomers], CFG)
    plain.shadow.span_slack = math.inf
    plain.run()
    late = plain.recorder.jobs["long"].finish_s
    assert late is not None and late > SPAN_SLACK * span
