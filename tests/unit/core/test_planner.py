"""Subjob planning: every planned size fits its window with the stated probability."""

from __future__ import annotations

import random
from dataclasses import dataclass

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sja.core.planner import (
    PlanLimits,
    PlanRequest,
    is_safe,
    largest_safe_size,
    materialize_size,
    plan_candidates,
    plan_length,
    usable_memory,
    usable_time,
)
from sja.core.profiles import JobProfile
from sja.protocol.messages import MemoryDecl, TimeDecl, Window

LIMITS = PlanLimits()
NOW = 10_000.0


def make_window(mem_mib: int, length_s: float | None, share7: int, start: float = NOW) -> Window:
    return Window(
        slice_id=f"n-g0-{share7}g-0",
        node="n",
        pool="p",
        gpu_model="A100-40GB",
        profile=f"{share7}g",
        mem_mib=mem_mib,
        compute_share=share7 / 7,
        start_s=start,
        end_s=None if length_s is None else start + length_s,
    )


def make_profile(
    base: float,
    per_unit: float,
    mem_sd: float,
    warmup: float,
    per_unit_s: float,
    time_sd: float,
    typical: int,
) -> JobProfile:
    return JobProfile.from_declaration(
        MemoryDecl(base_mib=base, per_unit_mib=per_unit, rel_sd=mem_sd),
        TimeDecl(warmup_s=warmup, per_unit_s=per_unit_s, rel_sd=time_sd),
        typical_units=typical,
    )


@dataclass(frozen=True)
class Case:
    profile: JobProfile
    req: PlanRequest


@st.composite
def cases_for(
    draw: st.DrawFn,
    base: float | None = None,
    per_unit: float | None = None,
    warmup: float | None = None,
    per_unit_s: float | None = None,
) -> Case:
    window = make_window(
        mem_mib=draw(st.integers(1000, 80_000)),
        length_s=draw(st.floats(1.0, 60.0)),
        share7=draw(st.integers(1, 7)),
    )
    profile = make_profile(
        base=draw(st.floats(0.0, 5000.0)) if base is None else base,
        per_unit=draw(st.floats(0.0, 500.0)) if per_unit is None else per_unit,
        mem_sd=draw(st.floats(0.0, 1.0)),
        warmup=draw(st.floats(0.0, 5.0)) if warmup is None else warmup,
        per_unit_s=draw(st.floats(1e-4, 2.0)) if per_unit_s is None else per_unit_s,
        time_sd=draw(st.floats(0.0, 1.0)),
        typical=draw(st.integers(1, 500)),
    )
    max_units = draw(st.integers(1, 2000))
    min_units = draw(st.one_of(st.just(1), st.integers(1, max_units)))
    req = PlanRequest(
        window=window,
        now=NOW,
        eps_mem=draw(st.sampled_from([0.01, 0.05, 0.1, 0.2])),
        eps_time=draw(st.sampled_from([0.01, 0.05, 0.1, 0.2])),
        max_units=max_units,
        min_units=min_units,
        remaining_units=draw(st.integers(max_units, 4000)),
    )
    return Case(profile, req)


def cases() -> st.SearchStrategy[Case]:
    return cases_for()


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
LEARNED = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


PROFILE_NAMES = ("1g", "2g", "3g", "4g", "5g", "6g", "7g")


@st.composite
def learned_cases(draw: st.DrawFn) -> Case:
    """A case whose profile has first learned from completions, OOMs and timeouts of a job whose
    real memory and speed are its declaration's times a drawn factor (or, for some, arbitrary)."""
    base = draw(st.floats(0.0, 5000.0))
    per_unit = draw(st.floats(0.0, 500.0))
    warmup = draw(st.floats(0.0, 5.0))
    per_unit_s = draw(st.floats(1e-4, 2.0))
    case = draw(cases_for(base, per_unit, warmup, per_unit_s))
    profile = case.profile
    mem_factor, time_factor = draw(st.floats(0.3, 3.0)), draw(st.floats(0.3, 3.0))
    arbitrary = draw(st.booleans())
    for kind, k, below, share7, noise in draw(
        st.lists(
            st.tuples(
                st.sampled_from(["ok", "ok", "oom", "timeout"]),
                st.integers(1, 2000),
                st.floats(0.2, 1.0),
                st.integers(1, 7),
                st.floats(-0.1, 0.1),
            ),
            min_size=1,
            max_size=10,
        )
    ):
        name, share = PROFILE_NAMES[share7 - 1], share7 / 7
        if arbitrary:
            peak, seconds = draw(st.floats(1.0, 80_000.0)), draw(st.floats(0.01, 600.0))
        else:
            peak = mem_factor * (base + per_unit * k) * (1.0 + noise) + 1.0
            seconds = time_factor * (warmup + per_unit_s * k) / share * (1.0 + noise) + 0.01
        if kind == "ok":
            profile.observe(k, peak, seconds, name, share)
        elif kind == "oom":
            profile.observe_oom(k, peak * below, draw(st.sampled_from([0.0, peak])))
        else:
            profile.observe_timeout(k, seconds * below, name, share)
    return case


def assert_candidates_fit(case: Case, mode: str) -> None:
    req = case.req
    mem_cap = usable_memory(req.window, LIMITS)
    length = plan_length(case.profile, req, LIMITS)
    assert length >= usable_time(req.window, NOW, LIMITS)
    for c in plan_candidates(case.profile, req, LIMITS, mode):
        assert req.min_units <= c.size <= req.max_units
        if case.profile.measuring:
            # memory unknown: the smallest size, planned for the whole slice
            assert c.size == req.min_units and c.mem_q_mib == mem_cap, c
        else:
            # P(peak > slice memory - reserve) <= eps_mem
            assert c.p_fit_mem >= 1.0 - req.eps_mem, c
        # P(duration > window) <= eps_time
        assert c.p_fit_time >= 1.0 - req.eps_time, c
        assert c.mem_q_mib <= mem_cap, c
        assert c.duration_q_s <= length, c
        assert is_safe(case.profile, c.size, req, LIMITS), c


@PROPERTY
@given(case=cases(), mode=st.sampled_from(["sja", "jasda"]))
def test_every_candidate_fits_its_window(case: Case, mode: str) -> None:
    assert_candidates_fit(case, mode)


@LEARNED
@given(case=learned_cases(), mode=st.sampled_from(["sja", "jasda"]))
def test_every_candidate_fits_its_window_after_learning(case: Case, mode: str) -> None:
    assert_candidates_fit(case, mode)


def _shrunk(req: PlanRequest, window: Window) -> PlanRequest:
    return PlanRequest(
        window=window,
        now=req.now,
        eps_mem=req.eps_mem,
        eps_time=req.eps_time,
        max_units=req.max_units,
        min_units=req.min_units,
        remaining_units=req.remaining_units,
    )


@LEARNED
@given(case=learned_cases(), smaller_mem=st.floats(0.0, 1.0), shorter=st.floats(0.0, 1.0))
def test_no_size_that_failed_is_planned_again_into_the_same_or_a_smaller_window(
    case: Case, smaller_mem: float, shorter: float
) -> None:
    profile, req = case.profile, case.req
    k = largest_safe_size(profile, req, LIMITS)
    if k is None:
        return
    w = req.window
    length = usable_time(w, NOW, LIMITS)
    # the subjob ran out of memory: no size >= k on this slice or on one with less memory
    after_oom = profile.copy()
    after_oom.observe_oom(k, usable_memory(w, LIMITS))
    less_mem = make_window(
        int(w.mem_mib - smaller_mem * (w.mem_mib - 1000)), length, round(w.compute_share * 7)
    )
    for window in (w, msgspec.structs.replace(less_mem, end_s=w.end_s)):
        again = largest_safe_size(after_oom, _shrunk(req, window), LIMITS)
        assert again is None or again < k, (k, again, window)
    # the subjob overran its time cap (what is materialized: the window plus the start overhead)
    after_timeout = profile.copy()
    after_timeout.observe_timeout(k, length + LIMITS.start_overhead_s, w.profile, w.compute_share)
    assert w.end_s is not None
    shorter_window = msgspec.structs.replace(w, end_s=w.start_s + (w.end_s - w.start_s) * (1.0 - shorter))
    for window in (w, shorter_window):
        again = largest_safe_size(after_timeout, _shrunk(req, window), LIMITS)
        assert again is None or again < k, (k, again, window)


@PROPERTY
@given(case=cases())
def test_sja_mode_returns_the_largest_safe_size(case: Case) -> None:
    cands = plan_candidates(case.profile, case.req, LIMITS, "sja")
    k = largest_safe_size(case.profile, case.req, LIMITS)
    if k is None:
        assert cands == []
    else:
        assert [c.size for c in cands] == [k]
        assert is_safe(case.profile, k, case.req, LIMITS)
        if k < case.req.max_units:
            assert not is_safe(case.profile, k + 1, case.req, LIMITS)


@PROPERTY
@given(case=cases())
def test_jasda_candidates_are_distinct_sorted_and_led_by_the_largest(case: Case) -> None:
    cands = plan_candidates(case.profile, case.req, LIMITS, "jasda")
    k = largest_safe_size(case.profile, case.req, LIMITS)
    if k is None:
        assert cands == []
        return
    sizes = [c.size for c in cands]
    assert len(sizes) == len(set(sizes))
    assert k in sizes
    assert max(sizes) == k
    assert len(cands) <= len(LIMITS.candidate_fractions)
    keys = [(-c.score, -c.size) for c in cands]
    assert keys == sorted(keys)


@PROPERTY
@given(case=cases(), mode=st.sampled_from(["sja", "jasda"]))
def test_planning_is_deterministic(case: Case, mode: str) -> None:
    first = plan_candidates(case.profile, case.req, LIMITS, mode)
    again = plan_candidates(case.profile, case.req, LIMITS, mode)
    assert first == again
    clone = JobProfile.from_state(case.profile.to_state())
    assert plan_candidates(clone, case.req, LIMITS, mode) == first


@PROPERTY
@given(case=cases(), proposed=st.integers(1, 2000))
def test_materialize_never_exceeds_the_proposal(case: Case, proposed: int) -> None:
    size = materialize_size(case.profile, case.req, LIMITS, proposed)
    if size is not None:
        assert case.req.min_units <= size <= min(proposed, case.req.max_units)
        assert is_safe(case.profile, size, case.req, LIMITS)


def test_materialize_shrinks_after_the_profile_learns_of_an_oom() -> None:
    profile = make_profile(100.0, 100.0, 0.1, 0.1, 0.001, 0.3, typical=16)
    req = PlanRequest(window=make_window(4864, 30.0, 1), now=NOW, eps_mem=0.05, eps_time=0.05, max_units=500)
    proposed = largest_safe_size(profile, req, LIMITS)
    assert proposed is not None and proposed > 10
    assert materialize_size(profile, req, LIMITS, proposed) == proposed
    # before the grant arrives, a subjob of size 10 ran out of memory on a slice this size
    profile.observe_oom(10, usable_memory(req.window, LIMITS))
    after = materialize_size(profile, req, LIMITS, proposed)
    assert after is None or after < 10


def test_bigger_windows_allow_bigger_subjobs() -> None:
    profile = make_profile(500.0, 50.0, 0.2, 0.5, 0.05, 0.3, typical=32)
    sizes = []
    for mem in (2000, 5000, 10_000, 20_000, 40_000):
        req = PlanRequest(
            window=make_window(mem, 600.0, 7),
            now=NOW,
            eps_mem=0.05,
            eps_time=0.05,
            max_units=10_000,
        )
        k = largest_safe_size(profile, req, LIMITS)
        assert k is not None
        sizes.append(k)
    assert sizes == sorted(sizes) and sizes[0] < sizes[-1]


def test_smaller_eps_plans_smaller_subjobs() -> None:
    profile = make_profile(500.0, 50.0, 0.3, 0.5, 0.05, 0.5, typical=32)
    window = make_window(20_000, 20.0, 3)
    sizes = [
        largest_safe_size(
            profile,
            PlanRequest(window=window, now=NOW, eps_mem=eps, eps_time=eps, max_units=10_000),
            LIMITS,
        )
        for eps in (0.01, 0.05, 0.2)
    ]
    assert all(s is not None for s in sizes)
    assert sizes == sorted(sizes)  # type: ignore[type-var]
    assert sizes[0] < sizes[-1]  # type: ignore[operator]


def test_nothing_fits_a_window_smaller_than_the_reserve_or_the_overhead() -> None:
    profile = make_profile(0.0, 1.0, 0.1, 0.0, 0.001, 0.1, typical=1)
    tiny_mem = PlanRequest(
        window=make_window(200, 30.0, 1), now=NOW, eps_mem=0.05, eps_time=0.05, max_units=10
    )
    assert plan_candidates(profile, tiny_mem, LIMITS, "jasda") == []
    short = PlanRequest(
        window=make_window(40_000, 0.2, 7), now=NOW, eps_mem=0.05, eps_time=0.05, max_units=10
    )
    assert plan_candidates(profile, short, LIMITS, "sja") == []


def test_min_units_larger_than_what_fits_gives_nothing() -> None:
    profile = make_profile(100.0, 100.0, 0.1, 0.1, 0.001, 0.3, typical=16)
    req = PlanRequest(
        window=make_window(4864, 30.0, 1),
        now=NOW,
        eps_mem=0.05,
        eps_time=0.05,
        max_units=500,
        min_units=400,
    )
    assert largest_safe_size(profile, req, LIMITS) is None
    assert plan_candidates(profile, req, LIMITS, "jasda") == []


def test_open_ended_window_is_bounded_by_the_horizon() -> None:
    open_window = make_window(40_000, None, 7)
    assert usable_time(open_window, NOW, LIMITS) == pytest.approx(LIMITS.horizon_s - LIMITS.start_overhead_s)
    bounded = make_window(40_000, LIMITS.horizon_s, 7)
    profile = make_profile(100.0, 1.0, 0.1, 0.1, 0.05, 0.3, typical=16)

    def req(w: Window) -> PlanRequest:
        return PlanRequest(window=w, now=NOW, eps_mem=0.05, eps_time=0.05, max_units=100_000)

    assert largest_safe_size(profile, req(open_window), LIMITS) == largest_safe_size(
        profile, req(bounded), LIMITS
    )


def test_window_already_partly_elapsed_counts_from_now() -> None:
    w = make_window(40_000, 30.0, 7, start=NOW - 20.0)
    assert usable_time(w, NOW, LIMITS) == pytest.approx(10.0 - LIMITS.start_overhead_s)
    future = make_window(40_000, 30.0, 7, start=NOW + 100.0)
    assert usable_time(future, NOW, LIMITS) == pytest.approx(30.0 - LIMITS.start_overhead_s)


def test_a_candidate_that_finishes_the_job_is_preferred() -> None:
    profile = make_profile(100.0, 1.0, 0.1, 0.1, 0.001, 0.3, typical=16)
    base = dict(window=make_window(40_000, 30.0, 7), now=NOW, eps_mem=0.05, eps_time=0.05)
    finishing = plan_candidates(
        profile,
        PlanRequest(**base, max_units=40, remaining_units=40),
        LIMITS,
        "jasda",  # type: ignore[arg-type]
    )
    assert finishing[0].size == 40


# --- after learning ------------------------------------------------------------------------------


def _learned_scenario(seed: int) -> tuple[JobProfile, PlanRequest]:
    """A declared profile, a few completed subjobs on various slices, then a window (all drawn from
    ``seed``)."""
    r = random.Random(seed)
    profile = make_profile(
        r.uniform(0, 5000),
        r.uniform(0, 500),
        r.uniform(0, 1),
        r.uniform(0, 5),
        r.uniform(1e-4, 2),
        r.uniform(0, 1),
        r.randint(1, 500),
    )
    for _ in range(r.randint(1, 4)):
        k, share7 = r.randint(1, 2000), r.randint(1, 7)
        duration, peak = r.uniform(0.01, 600), r.uniform(1, 80000)
        profile.observe(k, peak, duration, f"{share7}g", share7 / 7)
    window = make_window(r.randint(1000, 80000), r.uniform(1, 60), r.randint(1, 7))
    max_units = r.randint(1, 2000)
    req = PlanRequest(
        window=window,
        now=NOW,
        eps_mem=0.05,
        eps_time=r.choice([0.01, 0.05, 0.1, 0.2]),
        max_units=max_units,
        remaining_units=max_units,
    )
    return profile, req


def _handmade_learned_scenario() -> tuple[JobProfile, PlanRequest]:
    # declared 1.5 s per unit; one subjob of 215 units then took 8 s on a 2g slice: far faster
    profile = make_profile(500.0, 100.0, 0.1, 2.0, 1.5, 0.1, typical=400)
    profile.observe(215, 22_000.0, 8.0, "2g", 2 / 7)
    req = PlanRequest(
        window=make_window(70_000, 15.0, 2), now=NOW, eps_mem=0.05, eps_time=0.05, max_units=1500
    )
    return profile, req


@pytest.mark.parametrize("seed", [None, 22767, 30238, 46270, 48062, 49553])
def test_jasda_candidates_stay_safe_after_learning(seed: int | None) -> None:
    profile, req = _handmade_learned_scenario() if seed is None else _learned_scenario(seed)
    length = usable_time(req.window, NOW, LIMITS)
    for c in plan_candidates(profile, req, LIMITS, "jasda"):
        assert c.duration_q_s <= length, c
        assert is_safe(profile, c.size, req, LIMITS), c


def test_a_tiny_window_gets_no_subjob_the_history_says_is_too_long() -> None:
    profile = make_profile(500.0, 100.0, 0.1, 1.7, 1.5, 0.15, typical=479)
    profile.observe(215, 22_000.0, 8.0, "2g", 2 / 7)  # 215 units in 8 s on this slice type
    req = PlanRequest(
        window=make_window(70_000, 0.5, 2), now=NOW, eps_mem=0.05, eps_time=0.05, max_units=1500
    )
    usable = usable_time(req.window, NOW, LIMITS)  # 0.2 s
    for c in plan_candidates(profile, req, LIMITS, "sja"):
        # at the observed 8 s / 215 units, even without any warmup
        assert c.size * 8.0 / 215 <= usable, c
