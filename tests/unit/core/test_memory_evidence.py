"""Leaving a declaration takes evidence (``JobProfile.mem_evidence``): a job whose peak memory depends
on the data is not planned on a slice far below its declaration after one small peak, nor after a few
peaks that vary widely, and an out-of-memory subjob keeps the peak it showed. Each test tries to get
a job onto a smaller slice than its peaks justify, and checks the planner refuses."""

from __future__ import annotations

import math
import random
from statistics import NormalDist

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sja.core.planner import PlanLimits, PlanRequest, largest_safe_size, usable_memory
from sja.core.profiles import EVIDENCE_MIN_DOF, JobProfile
from sja.protocol.messages import MemoryDecl, TimeDecl, Window

LIMITS = PlanLimits()
EPS = 0.05
Q = 1.0 - EPS


def declared(mib: float = 30_000.0, per_unit: float = 0.0) -> JobProfile:
    return JobProfile.from_declaration(
        MemoryDecl(base_mib=mib, per_unit_mib=per_unit), TimeDecl(warmup_s=0.01, per_unit_s=1e-6), 8
    )


def window(mem_mib: int) -> Window:
    return Window(
        slice_id=f"s-{mem_mib}", node="n", pool="p", gpu_model="A100-40GB", profile=f"{mem_mib}",
        mem_mib=mem_mib, compute_share=1.0, start_s=0.0, end_s=3600.0,
    )  # fmt: skip


SMALL, TEN, TWENTY, FORTY = window(4864), window(9856), window(19968), window(40192)


def plans_on(profile: JobProfile, w: Window, k: int = 8) -> bool:
    req = PlanRequest(window=w, now=0.0, eps_mem=EPS, eps_time=0.05, max_units=k, min_units=k)
    return largest_safe_size(profile, req, LIMITS) == k


def run(profile: JobProfile, k: int, peak: float, w: Window) -> None:
    cap = usable_memory(w, LIMITS)
    if peak > cap:
        profile.observe_oom(k, cap)
    else:
        profile.observe(k, peak, 1.0, w.profile, 1.0, cap)


def test_one_small_peak_does_not_take_a_30000_mib_job_to_a_small_slice() -> None:
    # the case: declared 30,000 MiB, its first subjob peaked at 299 MiB on the 40 GB slice
    p = declared()
    run(p, 8, 299.0, FORTY)
    assert p.mem.upper(8, Q) < 4000.0  # the regression alone would plan it on a 5 GB slice
    assert p.mem_quantile(8, Q) == 30_000.0
    for w in (SMALL, TEN, TWENTY):
        assert not plans_on(p, w)
    assert plans_on(p, FORTY)
    assert p.mem_fit_probability(8, usable_memory(SMALL, LIMITS)) == 0.0


def test_two_peaks_of_different_sizes_are_one_line_and_no_spread() -> None:
    # a line through two points fits them exactly: they say nothing of the spread between subjobs
    p = declared()
    run(p, 4, 299.0, FORTY)
    run(p, 8, 310.0, FORTY)
    assert p.evidence()[0] < EVIDENCE_MIN_DOF
    assert not plans_on(p, TWENTY, 4)


def test_peaks_within_a_few_percent_leave_the_declaration_after_two() -> None:
    p = declared()
    run(p, 8, 800.0, FORTY)
    run(p, 8, 812.0, FORTY)
    assert plans_on(p, SMALL)
    assert p.mem_quantile(8, Q) >= 812.0


def test_peaks_that_vary_widely_keep_the_job_on_large_slices() -> None:
    # log-normal with sigma 2 around 300 MiB: its 95th percentile is about 8,000 MiB
    p = declared()
    for peak in (300.0, 2200.0, 45.0):
        run(p, 8, peak, FORTY)
    assert not plans_on(p, SMALL)
    assert not plans_on(p, TEN)


def test_an_oom_is_a_peak_seen_even_after_smaller_peaks_at_that_size() -> None:
    # 800 MiB subjobs and a rare 8x spike: after the spike ran out of memory on the 5 GB slice,
    # neither that size nor a smaller one is planned there again, whatever completes afterwards
    p = declared()
    run(p, 8, 800.0, FORTY)
    run(p, 8, 805.0, FORTY)
    assert plans_on(p, SMALL)
    run(p, 8, 6400.0, SMALL)  # out of memory
    for _ in range(5):
        run(p, 8, 800.0, TEN)
    for k in (8, 7, 4):
        assert not plans_on(p, SMALL, k), k
    assert plans_on(p, TEN)


def test_the_largest_peak_is_a_distribution_free_bound_once_there_are_enough() -> None:
    rng = random.Random(3)
    p = declared()
    peaks = [800.0 * math.exp(rng.gauss(0.0, 0.05)) for _ in range(25)]
    for peak in peaks:
        run(p, 8, peak, FORTY)
    dof = p.evidence()[0]
    assert dof / (dof + 1.0) >= Q  # a new peak exceeds the largest of 24 with probability 1/25
    assert math.isclose(p.mem_evidence(8, Q), max(peaks), rel_tol=1e-6)
    assert p.mem_quantile(8, Q) >= max(peaks) * (1 - 1e-9)


def test_a_measured_peak_above_the_declaration_does_not_lower_the_plan_below_it() -> None:
    # the declaration said 400 MiB; the job measured 986: no longer a ceiling, but no reason to plan
    # below the declaration until the peaks vary little
    p = declared(400.0)
    run(p, 8, 986.0, FORTY)
    assert p.mem_bound is None and p.declared == (400.0, 0.0)
    assert p.mem_quantile(8, 0.05) >= 400.0
    assert p.mem_quantile(8, Q) >= 986.0
    restored = JobProfile.from_state(p.to_state())
    assert restored.declared == (400.0, 0.0)
    assert restored.mem_quantile(8, Q) == p.mem_quantile(8, Q)


def test_a_state_written_before_declarations_were_kept_reads_its_bound_as_its_declaration() -> None:
    p = declared(1000.0)
    old = msgspec.structs.replace(p.to_state(), mem_declared=[])
    assert JobProfile.from_state(old).declared == (1000.0, 0.0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sigma=st.sampled_from([0.5, 1.0, 2.0]), n=st.integers(2, 12), seed=st.integers(0, 10_000))
def test_the_fit_probability_agrees_with_the_quantile(sigma: float, n: int, seed: int) -> None:
    rng = random.Random(seed)
    p = declared()
    for _ in range(n):
        run(p, 8, 300.0 * math.exp(rng.gauss(0.0, sigma)), FORTY)
    for q in (0.5, 0.9, 0.95, 0.99):
        mq = p.mem_quantile(8, q)
        if mq < p.mem_ceiling(8):
            assert p.mem_fit_probability(8, mq * (1 + 1e-9)) >= q - 1e-6
            assert p.mem_fit_probability(8, mq * (1 - 1e-6)) <= q + 1e-6


def test_log_normal_peaks_overrun_their_plan_at_most_eps_of_the_time() -> None:
    """The calibration the rule promises, exactly: over many jobs whose peaks vary log-normally
    between subjobs, the probability that the next subjob's peak exceeds the memory planned for it
    after ``n`` peaks (computed from the true law, not sampled) averages at most ``eps_mem``."""
    for sigma in (0.5, 1.0, 2.0):
        law = NormalDist(math.log(300.0), sigma)
        for n in (2, 3, 5, 10):
            planned = evidence = 0.0
            jobs = 300
            for seed in range(jobs):
                rng = random.Random(seed * 100 + n)
                p = declared()
                for _ in range(n):
                    p.observe_memory(8, math.exp(law.inv_cdf(rng.random())), 39_936.0)
                planned += 1.0 - law.cdf(math.log(p.mem_quantile(8, Q)))
                evidence += 1.0 - law.cdf(math.log(p.mem_evidence(8, Q)))
            assert planned / jobs <= EPS, (sigma, n, planned / jobs)
            # the evidence bound alone is the log-normal prediction bound: eps on average, no more
            # (within the sampling error of 300 jobs)
            assert evidence / jobs <= EPS + 0.01, (sigma, n, evidence / jobs)
            assert evidence / jobs >= 0.5 * EPS, (sigma, n, evidence / jobs)  # and not far more cautious


def test_an_oom_is_outranked_once_enough_peaks_make_the_largest_measured_one_a_bound() -> None:
    # one OOM counted as the largest of dof + 1 peaks: with dof / (dof + 2) >= 0.95 the largest
    # measured peak is a distribution-free bound without it, and the 5 GB slice is planned again
    p = declared()
    run(p, 8, 800.0, FORTY)
    run(p, 8, 805.0, FORTY)
    run(p, 8, 6400.0, SMALL)  # out of memory
    runs = 0
    while not plans_on(p, SMALL, 7):
        run(p, 8, 800.0 * (1.0 + 0.01 * (runs % 3)), TEN)
        runs += 1
        assert runs < 60
    dof = p.evidence()[0]
    assert dof / (dof + 2.0) >= Q > (dof - 1.0) / (dof + 1.0)
