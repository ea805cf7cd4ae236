"""The rigid reference (``core.shadow``): best-fit run online, and when a job becomes due."""

from __future__ import annotations

import math
import random

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sja.core import continuation
from sja.core.jobs import new_job
from sja.core.profiles import JobProfile
from sja.core.shadow import (
    DUE_SLACK,
    SPAN_SLACK,
    Basis,
    Reference,
    RigidJob,
    RigidShadow,
    RigidSlice,
    due_at,
    due_by_evidence,
    rigid_job,
    rigid_slices,
    span_due_at,
)
from sja.protocol.messages import JobSpec, JobState, MemoryDecl, SliceState, SubjobSummary, TimeDecl
from sja.sim.baselines import run_baseline
from sja.sim.cluster import parse_cluster
from sja.sim.engine import _rigid_reference
from sja.sim.model import SimConfig, TraceJob


def job(job_id: str, t: float, run_s: float, mem: float = 8_000.0, gpus: int = 1) -> RigidJob:
    return RigidJob(job_id=job_id, submitted_at=t, run_s=run_s, mem_mib=mem, gpus=gpus)


def whole(n: int, mem: float = 81_920.0) -> list[RigidSlice]:
    return [RigidSlice(f"g{i}", mem, 1.0) for i in range(n)]


def test_due_at_is_the_last_start_that_finishes_within_the_slack() -> None:
    # submitted at 100, started by best-fit at 400, runs 1000: rigid JCT 1300
    due = due_at(100.0, 400.0, 1000.0, slack=1.2)
    assert due == pytest.approx(100.0 + 1.2 * 1300.0 - 1000.0)
    # served from then at full speed it finishes at 1.2 x its rigid JCT
    assert (due + 1000.0 - 100.0) / 1300.0 == pytest.approx(1.2)
    # never before the reference starts it
    assert due_at(0.0, 0.0, 100.0, slack=1.0) == 0.0
    assert due_at(0.0, 50.0, 100.0, slack=1.0) == 50.0


def test_a_job_that_starts_at_once_is_due_after_a_slack_of_its_run() -> None:
    shadow = RigidShadow(whole(1), span_slack=math.inf)
    started = shadow.submit(job("a", 10.0, 1000.0), 10.0)
    assert started == [("a", pytest.approx(10.0 + (DUE_SLACK - 1.0) * 1000.0))]


def test_a_waiting_job_starts_when_the_reference_frees_its_gpu() -> None:
    shadow = RigidShadow(whole(1), span_slack=math.inf)
    shadow.submit(job("a", 0.0, 100.0), 0.0)
    assert shadow.submit(job("b", 5.0, 50.0), 5.0) == []  # waits behind a
    assert len(shadow) == 1 and shadow.next_change() == 100.0
    assert shadow.advance(99.0) == []
    # advanced late, b still starts at a's finish (100), not at the call's time
    assert shadow.advance(130.0) == [("b", pytest.approx(due_at(5.0, 100.0, 50.0)))]
    assert len(shadow) == 0 and shadow.next_change() == 150.0


def test_best_fit_takes_the_smallest_slice_that_holds_the_job_and_backfills() -> None:
    # one A100-80GB cut 4g.40gb + 3g.40gb (slowed to its share), one 1g.10gb on another GPU
    slices = [
        RigidSlice("g0", 40_960, 4 / 7),
        RigidSlice("g0", 40_960, 3 / 7),
        RigidSlice("g1", 10_240, 1 / 7),
    ]
    shadow = RigidShadow(slices, span_slack=math.inf)
    out = dict(shadow.submit(job("small", 0.0, 70.0, mem=5_000.0), 0.0))
    # the 1g slice, at a seventh of the speed: 490 s
    assert shadow.running[0].units == (2,) and shadow.next_change() == pytest.approx(490.0)
    assert out["small"] == pytest.approx(due_at(0.0, 0.0, 490.0))
    shadow.submit(job("mid", 1.0, 30.0, mem=30_000.0), 1.0)  # the 3g (smaller share of the two)
    assert {r.units for r in shadow.running} == {(2,), (1,)}
    shadow.submit(job("big", 2.0, 10.0, mem=60_000.0), 2.0)  # no slice holds it: never due
    assert len(shadow) == 0 and "big" not in shadow.started
    shadow.submit(job("mid2", 3.0, 30.0, mem=30_000.0), 3.0)  # the 4g
    shadow.submit(job("mid3", 4.0, 30.0, mem=30_000.0), 4.0)  # waits
    shadow.submit(job("tiny", 5.0, 7.0, mem=1_000.0), 5.0)  # waits for the 1g too (nothing is free)
    assert [j.job_id for j in shadow.queue] == ["mid3", "tiny"]
    # the 4g frees at 3 + 52.5: mid3 (first in order) takes it, tiny keeps waiting
    started = shadow.advance(60.0)
    assert started == [("mid3", pytest.approx(due_at(4.0, 55.5, 52.5)))]
    assert [j.job_id for j in shadow.queue] == ["tiny"]
    # the 3g frees at 1 + 70: tiny takes it, as the smallest free slice that holds it
    assert [j for j, _ in shadow.advance(71.0)] == ["tiny"]
    assert next(r.units for r in shadow.running if r.job_id == "tiny") == (1,)


def test_a_multi_gpu_job_takes_whole_gpus_or_a_slice_on_each() -> None:
    shadow = RigidShadow(whole(3))
    shadow.submit(job("one", 0.0, 100.0), 0.0)
    assert shadow.submit(job("three", 1.0, 10.0, gpus=3), 1.0) == []  # two free GPUs of three
    assert shadow.submit(job("two", 2.0, 10.0, gpus=2), 2.0)[0][0] == "two"  # backfilled
    assert [j for j, _ in shadow.advance(100.0)] == ["three"]
    cut = [RigidSlice(f"g{g}", 40_960, 0.5) for g in range(2) for _ in range(2)]
    shadow = RigidShadow(cut)
    assert [j for j, _ in shadow.submit(job("pair", 0.0, 10.0, mem=20_000.0, gpus=2), 0.0)] == ["pair"]
    assert {shadow.units[u].gpu for u in shadow.running[0].units} == {"g0", "g1"}
    assert shadow.next_change() == pytest.approx(20.0)  # half a GPU each: twice as long


def test_a_gpu_that_may_be_re_cut_is_taken_whole_by_a_job_no_slice_holds() -> None:
    slices = [RigidSlice("g0", 40_960, 4 / 7), RigidSlice("g0", 40_960, 3 / 7)]
    fixed = RigidShadow(slices)
    assert fixed.submit(job("big", 0.0, 10.0, mem=70_000.0), 0.0) == [] and len(fixed) == 0
    recut = RigidShadow(slices, pooled={"g0": 81_920})
    assert [j for j, _ in recut.submit(job("big", 0.0, 10.0, mem=70_000.0), 0.0)] == ["big"]
    assert recut.running[0].units == (0, 1) and recut.next_change() == pytest.approx(10.0)


# --- the span bound ---------------------------------------------------------------------------------


def test_a_job_alone_in_its_busy_period_is_due_to_end_it_within_the_span_slack() -> None:
    shadow = RigidShadow(whole(1))
    started = shadow.submit(job("a", 10.0, 1000.0), 10.0)
    # it ends the busy period (10 .. 1010): due once it must run at full width to end it by 1060
    assert started == [("a", pytest.approx(10.0 + (SPAN_SLACK - 1.0) * 1000.0))]
    assert started[0][1] == pytest.approx(span_due_at(10.0, 1010.0, 10.0, 1000.0))
    assert started[0][1] < due_at(10.0, 10.0, 1000.0)


def test_work_queued_in_the_reference_puts_the_span_bound_back() -> None:
    """The reference's span is at least as long as its slices need for the work it runs and queues:
    once a second job waits behind it, the first no longer ends the busy period by much, and the
    slack on its rigid JCT is the earlier bound again."""
    ref = Reference()
    ref.set_slices(whole(1))
    ref.admit(job("a", 0.0, 1000.0))
    ref.advance(100.0)
    assert ref.due_at("a", 100.0) == pytest.approx((SPAN_SLACK - 1.0) * 1000.0)
    ref.admit(job("b", 100.0, 1000.0))
    ref.advance(101.0)
    assert ref.span_ends[0.0] == pytest.approx(2000.0)
    assert ref.due_at("a", 101.0) == 0.0  # not due yet: 1.05 x 2000 - 1000 = 1100, slack 500
    assert ref.due_at("a", 600.0) == pytest.approx(due_at(0.0, 0.0, 1000.0))
    # b starts at 1000 and ends the period at 2000: due by the span at 1.05 x 2000 - 1000
    ref.advance(1000.0)
    assert ref.due_at("b", 1100.0) == pytest.approx(SPAN_SLACK * 2000.0 - 1000.0)


def test_a_busy_period_begins_when_the_reference_is_idle_and_a_replay_continues_it() -> None:
    ref = Reference()
    ref.set_slices(whole(1))
    ref.admit(job("a", 0.0, 100.0))
    ref.admit(job("b", 50.0, 100.0))
    ref.advance(300.0)  # both over at 200: idle
    ref.admit(job("c", 300.0, 100.0))
    ref.admit(job("d", 310.0, 100.0))
    ref.advance(320.0)
    assert [ref.bases[j].busy_since for j in "abc"] == [0.0, 0.0, 300.0]
    assert ref.span_ends[0.0] == pytest.approx(200.0)
    # a second GPU: d (still in the reference) is replayed, and its busy period is still c's
    assert ref.set_slices(whole(2)) is True
    ref.advance(321.0)
    assert ref.bases["d"].busy_since == 300.0 and ref.bases["d"].started_at == 310.0


def test_the_span_bound_takes_a_jobs_measured_run_either_way() -> None:
    """Overstating its run makes a job look like the one that ends the busy period (due at once by
    the span bound); measured, its short run leaves only the slack on its rigid JCT."""
    state = declared_job(10.0)  # 10 units: 100 s declared
    basis = Basis(0.0, 0.0, 100.0, 40_000.0, busy_since=0.0)
    assert due_by_evidence(basis, state, None, span_end=100.0) == pytest.approx((SPAN_SLACK - 1.0) * 100.0)
    fast, profile = measured(state, *[(1, 0.5, 900.0, "ok")] * 6)
    assert due_by_evidence(basis, fast, profile, span_end=100.0) == basis.due_at()
    # understating still gains nothing: measured, its due time moves back, by both bounds
    liar = declared_job(0.1)
    basis = Basis(0.0, 0.0, 1.0, 40_000.0, busy_since=0.0)
    slow, profile = measured(liar, *[(1, 10.0, 900.0, "ok")] * 6)
    assert due_by_evidence(basis, slow, profile, span_end=120.0) > basis.due_at(span_end=120.0) + 10.0


def test_forget_drops_a_waiting_job() -> None:
    shadow = RigidShadow(whole(1))
    shadow.submit(job("a", 0.0, 100.0), 0.0)
    shadow.submit(job("b", 1.0, 100.0), 1.0)
    shadow.forget("b")
    assert shadow.advance(100.0) == [] and not shadow.running


def _trace(rng: random.Random, n: int) -> list[TraceJob]:
    t, out = 0.0, []
    for i in range(n):
        t += rng.expovariate(1 / 60.0)
        gpus = rng.choice((1, 1, 1, 2, 4))
        mem = rng.choice((4_000.0, 15_000.0, 35_000.0, 70_000.0)) if gpus == 1 else 30_000.0
        out.append(
            TraceJob(
                job_id=f"t{i}", submit_s=t, duration_s=rng.uniform(30, 3_000), num_gpus=gpus, mem_mib=mem
            )
        )
    return out


@pytest.mark.parametrize(
    "cluster", ["6xA100-80GB", "4xA100-80GB:4g.40gb+3g.40gb", "8xA100-80GB:3g.40gb+2g.20gb+1g.10gb+1g.10gb"]
)
@pytest.mark.parametrize("seed", [0, 1])
def test_the_reference_starts_every_job_when_the_best_fit_baseline_does(cluster: str, seed: int) -> None:
    """Fed the same jobs, the online reference starts each one at the instant the simulator's
    best-fit baseline does (declarations true: no OOM rerun), for as long, and it is due from the
    slack on its rigid JCT or earlier (the span bound), never later."""
    cfg = SimConfig(seed=seed)
    sim = parse_cluster(cluster)
    trace = _trace(random.Random(seed), 120)
    baseline = run_baseline("bestfit", sim, trace, cfg).recorder.jobs
    shadow = _rigid_reference(sim, cfg)
    dues: dict[str, float] = {}
    for tj in trace:
        rj = RigidJob(tj.job_id, tj.submit_s, tj.duration_s, tj.mem_mib or 0.0, max(1, tj.num_gpus))
        dues.update(shadow.submit(rj, tj.submit_s))
    dues.update(shadow.advance(math.inf))
    checked = 0
    for tj in trace:
        rec = baseline[tj.job_id]
        if rec.unschedulable:
            assert tj.job_id not in dues
            continue
        assert rec.first_start_s is not None and rec.finish_s is not None
        basis = shadow.basis[tj.job_id]
        assert basis.started_at == pytest.approx(rec.first_start_s, abs=1e-6)
        assert basis.run_s == pytest.approx(rec.finish_s - rec.first_start_s, abs=1e-6)
        assert dues[tj.job_id] <= due_at(tj.submit_s, basis.started_at, basis.run_s) + 1e-6
        checked += 1
    assert checked > 100


@settings(max_examples=60, deadline=None)
@given(
    st.tuples(st.floats(0, 1e9), st.floats(0, 1e9)),
    st.tuples(st.floats(0, 1e9), st.floats(0, 1e9)),
    st.floats(1.0, 2e9),
)
def test_a_due_job_comes_before_every_job_that_is_not(
    a: tuple[float, float], b: tuple[float, float], due: float
) -> None:
    """Any due job's service key is below any other's, and due jobs are served earliest first (by
    the instant each is due to finish by)."""
    assert continuation.service_key(a[0], a[1], due) < continuation.service_key(b[0], b[1])
    assert continuation.service_key(a[0], a[1], due) < continuation.service_key(b[0], b[1], due + 1.0)


# --- the live reference ---------------------------------------------------------------------------


def test_the_live_reference_tells_when_each_job_is_due_and_replays_on_new_slices() -> None:
    ref = Reference(slack=1.2, span_slack=math.inf)
    ref.admit(job("early", 0.0, 100.0))  # heard of before any slice: replayed once they are known
    ref.advance(1.0)
    assert ref.due_at("early", 1.0) == 0.0 and not ref.due_times
    assert ref.set_slices(whole(1)) is True
    assert ref.set_slices(whole(1)) is False  # the same slices: nothing replayed
    ref.admit(job("late", 5.0, 50.0))  # waits behind early
    ref.advance(10.0)
    assert ref.due_at("early", 10.0) == ref.due_at("late", 10.0) == 0.0  # not yet
    assert ref.due_at("early", 20.0) == pytest.approx(20.0)
    ref.advance(25.0)
    assert ref.due_at("early", 25.0) == pytest.approx(20.0) and ref.due_at("late", 25.0) == 0.0
    assert "late" not in ref.due_times  # the reference has not started it
    # late starts at 100 when early ends, due 0.2 x its rigid JCT of 145 s after that
    ref.advance(200.0)
    assert ref.due_times["late"] == pytest.approx(due_at(5.0, 100.0, 50.0, slack=1.2))
    assert ref.due_at("late", 200.0) == ref.due_times["late"]
    assert "early" not in ref.jobs  # over in the reference: forgotten, its due time kept
    assert ref.due_at("early", 200.0) == pytest.approx(20.0)
    # a second GPU: the jobs still in the reference are replayed on both
    ref.admit(job("third", 210.0, 100.0))
    ref.admit(job("fourth", 211.0, 100.0))
    assert ref.set_slices(whole(2)) is True
    assert ref.due_at("fourth", 400.0) == pytest.approx(due_at(211.0, 211.0, 100.0, slack=1.2))


def live_job(max_parallel: int, mem: MemoryDecl, time: TimeDecl, submitted_at: float = 0.0) -> JobState:
    """A 10-unit job as the gateway admits it."""
    spec = JobSpec(
        name="j",
        tenant="t",
        workload="montecarlo",
        params={"units": 10},
        max_parallel=max_parallel,
        memory=mem,
        time=time,
    )
    return new_job("j1", spec, submitted_at)


def test_a_live_job_is_referenced_by_its_declarations() -> None:
    state = live_job(
        3, MemoryDecl(base_mib=1_000.0, per_unit_mib=10.0), TimeDecl(warmup_s=5.0, per_unit_s=2.0), 100.0
    )
    rj = rigid_job(state)
    # three subjobs at once from the start, each with 4 of the 10 units
    assert (rj.submitted_at, rj.gpus, rj.distinct_gpus) == (100.0, 3, False)
    assert rj.run_s == pytest.approx(5.0 + 2.0 * 4) and rj.mem_mib == pytest.approx(1_000.0 + 10.0 * 4)
    # three slices on one GPU are enough for it
    shadow = RigidShadow([RigidSlice("g0", 10_240, 1 / 7)] * 2 + [RigidSlice("g0", 20_480, 2 / 7)])
    assert [j for j, _ in shadow.submit(rj, 100.0)] == ["j1"]


def test_live_slices_are_named_by_node_and_gpu_and_offline_ones_left_out() -> None:
    def sl(i: int, node: str, gpu: int, status: str = "free", recut: int = 0) -> SliceState:
        return SliceState(
            slice_id=f"s{i}",
            node=node,
            pool="p",
            gpu_index=gpu,
            gpu_model="A100-80GB",
            profile="3g.40gb",
            mem_mib=40_960,
            compute_slots=3,
            compute_share=3 / 7,
            status=status,  # type: ignore[arg-type]
            recut_mib=recut,
        )

    slices, pooled = rigid_slices([sl(0, "a", 0, recut=81_920), sl(1, "a", 0), sl(2, "b", 0, "offline")])
    assert [s.gpu for s in slices] == [("a", 0), ("a", 0)]
    assert pooled == {("a", 0): 81_920.0}


def test_jobs_heard_of_late_are_replayed_at_their_own_submission() -> None:
    """An agent that starts late reads the submissions from the first: the reference, already at the
    present, places each at its own submission and not when it was heard of."""
    ref = Reference(span_slack=math.inf)
    ref.set_slices(whole(1))
    ref.advance(10_000.0)
    ref.admit(job("a", 100.0, 1_000.0))
    ref.admit(job("b", 200.0, 1_000.0))
    ref.advance(10_001.0)
    assert ref.due_times == {
        "a": pytest.approx(due_at(100.0, 100.0, 1_000.0)),
        "b": pytest.approx(due_at(200.0, 1_100.0, 1_000.0)),
    }


# --- a tenant's declaration against its own measurements ------------------------------------------


def declared_job(per_unit_s: float) -> JobState:
    return live_job(
        1, MemoryDecl(base_mib=1_000.0, per_unit_mib=0.0), TimeDecl(warmup_s=0.0, per_unit_s=per_unit_s)
    )


def measured(state: JobState, *runs: tuple[int, float, float, str]) -> tuple[JobState, JobProfile]:
    """``state`` after subjobs ``(units, duration, peak MiB, status)`` on a full-speed slice."""
    assert state.profile is not None
    profile = JobProfile.from_state(state.profile)
    history = []
    for n, (units, dur, peak, status) in enumerate(runs):
        if status == "ok":
            profile.observe(units, peak, dur, "7g.80gb", 1.0)
        elif status == "timeout":
            profile.observe_timeout(units, dur, "7g.80gb", 1.0)
        history.append(
            SubjobSummary(
                subjob_id=f"j1.s{n}",
                slice_id="s",
                profile="7g.80gb",
                status=status,
                unit_start=0,
                units=units,
                planned_mem_q_mib=0.0,
                peak_mem_mib=peak,
                mem_cap_mib=80_000 if status != "oom" else int(peak),
                planned_duration_q_s=0.0,
                duration_s=dur,
                time_cap_s=dur,
                started_at=0.0,
                finished_at=dur,
            )
        )
    return msgspec.structs.replace(state, history=history, profile=profile.to_state()), profile


def test_a_job_that_understates_its_run_is_due_later_once_measured() -> None:
    """It declares 0.1 s a unit (10 units: 1 s) and takes 10 s a unit: best-fit, starting it at
    once, would have it run 100 s, so it is due 50 s after its submission, not 0.5 s."""
    state = declared_job(0.1)
    basis = Basis(0.0, 0.0, 1.0, 40_000.0)
    assert due_by_evidence(basis, state, None) == basis.due_at() == pytest.approx(0.5)
    liar, profile = measured(state, *[(1, 10.0, 900.0, "ok")] * 6)
    # the profile learned it as a slow slice profile more than as a slow job: both count
    slow = profile.speed["7g.80gb"].mean
    assert profile.time.mean(10) * math.exp(slow) == pytest.approx(100.0, rel=0.25)
    due = due_by_evidence(basis, liar, profile)
    assert due == pytest.approx(
        basis.due_at() + (DUE_SLACK - 1) * (profile.time.mean(10) * math.exp(slow) - 1.0)
    )
    assert due > 0.5 * 75.0
    # a subjob cut off at its window is evidence too (a lower bound on the run)
    cut, profile = measured(state, (10, 60.0, 900.0, "timeout"))
    assert due_by_evidence(basis, cut, profile) >= basis.due_at() + (DUE_SLACK - 1) * (60.0 - 1.0) - 1e-9


def test_a_job_that_overstates_its_run_only_delays_itself() -> None:
    state = declared_job(10.0)
    basis = Basis(0.0, 0.0, 100.0, 40_000.0)
    fast, profile = measured(state, *[(1, 0.5, 900.0, "ok")] * 6)
    assert profile.time.mean(10) * math.exp(profile.speed["7g.80gb"].mean) < 50.0
    assert due_by_evidence(basis, fast, profile) == basis.due_at()


def test_a_job_that_needed_more_memory_than_its_reference_slice_has_no_reference() -> None:
    state = declared_job(1.0)
    basis = Basis(0.0, 0.0, 10.0, 10_000.0)
    fits, profile = measured(state, (2, 2.0, 9_000.0, "ok"))
    assert due_by_evidence(basis, fits, profile) > 0
    over, profile = measured(state, (2, 2.0, 12_000.0, "ok"))
    assert due_by_evidence(basis, over, profile) == 0.0
    oom, profile = measured(state, (2, 2.0, 11_000.0, "oom"))
    assert due_by_evidence(basis, oom, profile) == 0.0
    # a subjob larger than its share of the reference may need more
    big = replace_units(over, 11)
    assert due_by_evidence(basis, big, profile) > 0


def replace_units(state: JobState, units: int) -> JobState:
    return msgspec.structs.replace(
        state, history=[msgspec.structs.replace(h, units=units) for h in state.history]
    )


def test_the_live_reference_counts_a_jobs_measurements() -> None:
    ref = Reference(span_slack=math.inf)
    ref.set_slices(whole(1))
    state = declared_job(0.1)
    ref.admit(rigid_job(state))
    ref.advance(0.6)
    basis = ref.bases["j1"]
    assert basis.run_s == pytest.approx(1.0) and basis.usable_mib == 81_920.0
    assert ref.due_at("j1", 0.6) == ref.due_at("j1", 0.6, state) == pytest.approx(0.5)
    liar, profile = measured(state, *[(1, 10.0, 900.0, "ok")] * 6)
    assert ref.due_at("j1", 0.6, liar, profile) == 0.0  # not yet: due 45 s or more later
    at = due_by_evidence(basis, liar, profile)
    assert ref.due_at("j1", at, liar, profile) == at
