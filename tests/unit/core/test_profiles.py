"""Bayesian job profiles: calibration from observations, censored OOM/timeout observations, and
serialization."""

from __future__ import annotations

import dataclasses
import math
import random
from statistics import NormalDist

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from scipy.special import stdtrit

from sja.core.profiles import MAX_OBSERVATIONS, JobProfile, LinearPosterior, z_of
from sja.protocol.messages import MemoryDecl, ProfileState, TimeDecl

EPS = 0.05
Q = 1 - EPS


def true_mem(k: int) -> float:
    return 100.0 + 10.0 * k


def true_full_time(k: int) -> float:
    return 0.5 + 0.05 * k


def overestimating_profile() -> JobProfile:
    """A prior that believes the job needs twice its real memory (and time)."""
    return JobProfile.from_declaration(
        MemoryDecl(base_mib=200.0, per_unit_mib=20.0, rel_sd=0.3),
        TimeDecl(warmup_s=1.0, per_unit_s=0.1, rel_sd=0.5),
        typical_units=16,
    )


def test_prior_centres_on_the_declaration() -> None:
    p = overestimating_profile()
    assert p.mem.mean(50) == pytest.approx(200.0 + 20.0 * 50)
    assert p.time.mean(50) == pytest.approx(1.0 + 0.1 * 50)
    assert p.mem.upper(50, Q) > p.mem.mean(50)
    # the declaration is a bound the job vouches for: the planner never asks for more
    assert p.mem_quantile(50, Q) == pytest.approx(200.0 + 20.0 * 50)
    assert p.mem_quantile(50, 0.5) == pytest.approx(p.mem.mean(50))
    assert p.observations == 0


def test_memory_quantile_moves_toward_the_truth() -> None:
    rng = random.Random(7)
    p = overestimating_profile()
    k_probe = 50
    truth_q = true_mem(k_probe) * (1 + NormalDist().inv_cdf(Q) * 0.02)
    gaps = [abs(p.mem_quantile(k_probe, Q) - truth_q)]
    for i in range(40):
        k = rng.randint(5, 100)
        p.observe_memory(k, true_mem(k) * (1 + rng.gauss(0.0, 0.02)))
        if i % 5 == 4:
            gaps.append(abs(p.mem_quantile(k_probe, Q) - truth_q))
    # the gap closes (not strictly every time: observations are noisy) and stays closed
    assert max(gaps[1:]) < 0.5 * gaps[0], gaps
    assert gaps[-1] < 0.3 * gaps[0], gaps
    # the posterior mean has found the truth; the quantile stays on the safe side of it
    assert p.mem.mean(k_probe) == pytest.approx(true_mem(k_probe), rel=0.05)
    assert p.mem_quantile(k_probe, Q) >= true_mem(k_probe)
    # the learned slope, not just one point: a size never observed is predicted too
    assert p.mem.mean(150) == pytest.approx(true_mem(150), rel=0.08)


def test_underestimating_prior_is_corrected_upwards() -> None:
    rng = random.Random(3)
    p = JobProfile.from_declaration(
        MemoryDecl(base_mib=20.0, per_unit_mib=2.0, rel_sd=0.3),
        TimeDecl(warmup_s=0.1, per_unit_s=0.01, rel_sd=0.5),
        typical_units=16,
    )
    before = p.mem_quantile(50, Q)
    assert before < true_mem(50)
    for _ in range(30):
        k = rng.randint(5, 100)
        p.observe_memory(k, true_mem(k) * (1 + rng.gauss(0.0, 0.02)))
    assert p.mem_quantile(50, Q) >= true_mem(50)
    assert p.mem.mean(50) == pytest.approx(true_mem(50), rel=0.05)


def test_duration_quantile_moves_toward_the_truth_and_learns_slice_speed() -> None:
    rng = random.Random(11)
    p = overestimating_profile()
    share = 3 / 7
    # this profile runs 1.5x slower than its compute share suggests
    slow = 1.5

    def observed(k: int) -> float:
        return true_full_time(k) / share * slow * math.exp(rng.gauss(0.0, 0.03))

    truth = true_full_time(40) / share * slow
    first = p.duration_quantile(40, Q, "3g.20gb", share)
    for _ in range(30):
        k = rng.randint(5, 80)
        p.observe(k, true_mem(k), observed(k), "3g.20gb", share)
    last = p.duration_quantile(40, Q, "3g.20gb", share)
    assert abs(last - truth) < 0.5 * abs(first - truth)
    assert p.duration_mean(40, "3g.20gb", share) == pytest.approx(truth, rel=0.1)
    assert p.observations == 30
    # the learned slowdown is specific to that profile; a profile never seen keeps share scaling
    assert p.speed["3g.20gb"].n == 30
    assert "7g.40gb" not in p.speed
    assert p.duration_mean(40, "7g.40gb", 1.0) == pytest.approx(max(p.time.mean(40), 0.0))


def test_oom_forbids_sizes_at_and_above_k_under_smaller_caps() -> None:
    p = overestimating_profile()
    assert p.max_size_under_bounds(4608.0, 10.0, 1.0) is None
    q_before = p.mem_quantile(40, Q)
    p.observe_oom(40, 4608.0, peak_seen_mib=4700.0)
    assert p.observations == 1
    assert p.max_size_under_bounds(4608.0, 10.0, 1.0) == 39
    assert p.max_size_under_bounds(1000.0, 10.0, 1.0) == 39
    # a bigger slice is not bound by an OOM seen on a smaller one
    assert p.max_size_under_bounds(4609.0, 10.0, 1.0) is None
    assert p.max_size_under_bounds(19712.0, 10.0, 1.0) is None
    assert p.mem_quantile(40, Q) > q_before
    # a later, smaller OOM tightens the bound; the tightest one wins
    p.observe_oom(25, 4608.0)
    assert p.max_size_under_bounds(4608.0, 10.0, 1.0) == 24
    p.observe_oom(60, 9000.0)
    assert p.max_size_under_bounds(4608.0, 10.0, 1.0) == 24
    assert p.max_size_under_bounds(9000.0, 10.0, 1.0) == 59


def test_oom_pulls_the_memory_prediction_above_the_cap() -> None:
    p = JobProfile.from_declaration(
        MemoryDecl(base_mib=100.0, per_unit_mib=10.0, rel_sd=0.1),
        TimeDecl(warmup_s=0.1, per_unit_s=0.01, rel_sd=0.5),
        typical_units=16,
    )
    cap = 500.0
    k = 60  # believed to need ~700 MiB... the OOM says it needs more than 1.5x that
    for _ in range(3):
        p.observe_oom(k, 1050.0)
    assert p.mem.mean(k) > 1000.0
    assert p.mem_fit_probability(k, cap) < 0.05


def test_timeout_bounds_the_size_until_a_completion_runs_within_it() -> None:
    p = overestimating_profile()
    share = 1 / 7
    q_before = p.duration_quantile(30, Q, "1g.5gb", share)
    p.observe_timeout(30, 70.0, "1g.5gb", share)
    assert p.observations == 1
    assert p.duration_quantile(30, Q, "1g.5gb", share) > q_before
    # a size >= 30 is not planned again into a window no longer, on this share ...
    assert p.max_size_under_bounds(1e9, 70.0, share) == 29
    assert p.max_size_under_bounds(1e9, 50.0, share) == 29
    assert p.max_size_under_bounds(1e9, 70.1, share) is None
    # ... nor on a share twice as large with half the window (the time model scales it)
    assert p.max_size_under_bounds(1e9, 34.99, 2 / 7) == 29
    assert p.max_size_under_bounds(1e9, 35.01, 2 / 7) is None
    # the spread is not inflated by the censored point: small sizes stay cheap
    assert p.duration_quantile(1, Q, "1g.5gb", share) < p.duration_quantile(30, Q, "1g.5gb", share)
    # a completion at a size below it says nothing about the bound; one at or above it within
    # the length shows the timeout was noise (a stalled host), and lifts it
    p.observe(10, 300.0, 20.0, "1g.5gb", share)
    assert p.max_size_under_bounds(1e9, 70.0, share) == 29
    p.observe(40, 500.0, 60.0, "1g.5gb", share)
    assert p.timeout_bounds == []
    assert p.max_size_under_bounds(1e9, 70.0, share) is None


def test_a_stall_is_released_by_smaller_sizes_far_faster_than_the_line_allows() -> None:
    """A subjob that hung at its time cap leaves a timeout no later plan can contradict at its size
    (the planner stays below it). Completions at a smaller size ``k`` so fast that even ``s / k``
    times their duration is far below the cap say it was a stall: the bound goes, and larger sizes
    are planned again. One merely slower than a straight line would need is kept."""
    share = 1 / 7
    p = overestimating_profile()
    p.observe_timeout(5, 2.0, "1g.5gb", share)
    assert p.max_size_under_bounds(1e9, 2.0, share) == 4
    assert p.time.lower_bound(5) is not None
    p.observe(4, true_mem(4), 1.8, "1g.5gb", share)  # 5/4 of it is below the cap, by less than 4x
    assert p.max_size_under_bounds(1e9, 2.0, share) == 4, "plausible: the line could reach the cap"
    p.observe(4, true_mem(4), 0.002, "1g.5gb", share)
    assert p.timeout_bounds == []
    assert p.max_size_under_bounds(1e9, 2.0, share) is None
    assert p.time.lower_bound(5) is None
    assert all(bound <= 0.0 for _, _, bound in p.time.obs), "its censored point is gone too"
    assert p.duration_quantile(20, Q, "1g.5gb", share) < 2.0


def test_ooms_and_timeouts_are_hard_bounds() -> None:
    p = overestimating_profile()
    p.observe_oom(50, 4608.0)
    p.observe_timeout(20, 10.0, "7g.40gb", 1.0)
    assert p.max_size_under_bounds(4608.0, 5.0, 1.0) == 19
    assert p.max_size_under_bounds(4608.0, 20.0, 1.0) == 49
    assert p.max_size_under_bounds(40000.0, 20.0, 1.0) is None
    assert p.timeout_bounds == [(20, 10.0)], "the timeout is on record"


def test_fit_probabilities_are_monotone_in_the_cap() -> None:
    p = overestimating_profile()
    caps = [1.0, 100.0, 500.0, 1000.0, 1500.0, 3000.0, 1e6]
    probs = [p.mem_fit_probability(40, c) for c in caps]
    assert probs == sorted(probs)
    assert probs[0] < 0.05 and probs[-1] > 0.999
    lengths = [0.0, 1.0, 10.0, 30.0, 1e5]
    tprobs = [p.time_fit_probability(40, t, "3g.20gb", 3 / 7) for t in lengths]
    assert tprobs == sorted(tprobs)
    assert tprobs[0] == 0.0 and tprobs[-1] > 0.999
    # the quantile and the fit probability agree (of the learned profile: within the declared
    # bound the fit probability is 1)
    assert p.mem_fit_probability(40, p.mem_quantile(40, Q)) == 1.0
    p = dataclasses.replace(p, mem_bound=None)
    q = p.mem_quantile(40, Q)
    assert p.mem_fit_probability(40, q) == pytest.approx(Q, abs=1e-6)
    dq = p.duration_quantile(40, Q, "3g.20gb", 3 / 7)
    assert p.time_fit_probability(40, dq, "3g.20gb", 3 / 7) == pytest.approx(Q, abs=1e-6)


def test_smaller_compute_share_predicts_longer_durations() -> None:
    p = overestimating_profile()
    full = p.duration_mean(40, "7g.40gb", 1.0)
    assert p.duration_mean(40, "1g.5gb", 1 / 7) == pytest.approx(7 * full)
    assert p.duration_quantile(40, Q, "1g.5gb", 1 / 7) > p.duration_quantile(40, Q, "7g.40gb", 1)


def _trained_profile() -> JobProfile:
    rng = random.Random(5)
    p = overestimating_profile()
    for _ in range(12):
        k = rng.randint(1, 64)
        p.observe(k, true_mem(k) * 1.01, true_full_time(k) * 7 / 3, "3g.20gb", 3 / 7)
        p.observe(k, true_mem(k) * 0.99, true_full_time(k) * 7, "1g.5gb", 1 / 7)
    p.observe_oom(70, 4608.0, 4700.0)
    p.observe_timeout(90, 12.5, "1g.5gb", 1 / 7)
    return p


def _predictions(p: JobProfile) -> list[float | int | None]:
    out: list[float | int | None] = []
    for k in (1, 10, 33, 64, 100):
        out.append(p.mem_quantile(k, 0.95))
        out.append(p.mem_fit_probability(k, 1000.0))
        for prof, share in (("3g.20gb", 3 / 7), ("1g.5gb", 1 / 7), ("2g.10gb", 2 / 7)):
            out.append(p.duration_quantile(k, 0.9, prof, share))
            out.append(p.duration_mean(k, prof, share))
            out.append(p.time_fit_probability(k, 5.0, prof, share))
    out.append(p.max_size_under_bounds(4608.0, 12.5, 1 / 7))
    out.append(p.max_size_under_bounds(20000.0, 100.0, 1.0))
    return out


def test_state_round_trip_preserves_predictions_exactly() -> None:
    p = _trained_profile()
    state = p.to_state()
    # through the wire, as it is stored in the job state
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(state), type=ProfileState)
    for restored in (JobProfile.from_state(state), JobProfile.from_state(wire)):
        assert _predictions(restored) == _predictions(p)
        assert restored.observations == p.observations
        assert restored.oom_bounds == p.oom_bounds
        assert restored.timeout_bounds == p.timeout_bounds
        assert restored.to_state() == state


def test_state_round_trip_then_learning_matches_uninterrupted_learning() -> None:
    a = _trained_profile()
    b = JobProfile.from_state(a.to_state())
    for prof in (a, b):
        prof.observe(20, 300.0, 5.0, "2g.10gb", 2 / 7)
        prof.observe_oom(80, 4608.0)
    assert _predictions(a) == _predictions(b)
    assert a.to_state() == b.to_state()


def test_a_copy_is_the_restored_profile_and_learns_on_its_own() -> None:
    a = _trained_profile()
    c = a.copy()
    assert c == JobProfile.from_state(a.to_state())
    before = a.to_state()
    c.observe(20, 300.0, 5.0, "2g.10gb", 2 / 7)
    c.observe_oom(80, 4608.0)
    c.observe_timeout(40, 2.0, "1g.5gb", 1 / 7)
    assert a.to_state() == before, "learning on the copy changed the original"
    a.observe(20, 300.0, 5.0, "2g.10gb", 2 / 7)
    a.observe_oom(80, 4608.0)
    a.observe_timeout(40, 2.0, "1g.5gb", 1 / 7)
    assert a.to_state() == c.to_state()


def test_a_posterior_copy_carries_every_field_and_owns_its_lists() -> None:
    post = LinearPosterior.prior_from(10.0, 2.0, 0.2, 8, locality=0.7)
    post.update(4, 20.0)
    post.observe_censored(16, 60.0)
    # Every field set apart from its default, so a field the copy forgot shows.
    changed = {
        f.name: getattr(post, f.name) + 0.125
        for f in dataclasses.fields(LinearPosterior)
        if isinstance(getattr(post, f.name), float)
    }
    post = dataclasses.replace(post, **changed)
    c = post.copy()
    assert c == post
    assert all(getattr(c, n) is not getattr(post, n) for n in ("obs", "lower", "held"))


def test_linear_posterior_list_round_trip() -> None:
    post = LinearPosterior.prior_from(10.0, 2.0, 0.2, 8)
    post.update(4, 20.0)
    assert LinearPosterior.from_list(post.to_list()) == post


def test_z_of_is_clamped() -> None:
    assert z_of(0.5) == pytest.approx(0.0)
    assert math.isfinite(z_of(1.0))
    assert math.isfinite(z_of(0.0))
    assert z_of(0.95) == pytest.approx(1.6448536, rel=1e-6)


def test_one_fast_observation_does_not_make_small_subjobs_free() -> None:
    # declared 1.5 s per unit; a subjob of 215 units then took 8 s on a 2g slice (much faster)
    p = JobProfile.from_declaration(
        MemoryDecl(base_mib=500.0, per_unit_mib=100.0, rel_sd=0.1),
        TimeDecl(warmup_s=1.7, per_unit_s=1.5, rel_sd=0.15),
        typical_units=479,
    )
    p.observe(215, 22_000.0, 8.0, "2g", 2 / 7)
    # at the observed rate 29 units need about 29 / 215 * 8 s = 1.1 s on that slice, and a
    # larger subjob never needs less than a smaller one
    quantiles = [p.duration_quantile(k, Q, "2g", 2 / 7) for k in (1, 10, 29, 39, 100, 215)]
    assert p.duration_mean(29, "2g", 2 / 7) > 0.5
    assert quantiles == sorted(quantiles)


def test_memory_prior_width_follows_the_declaration() -> None:
    # A declaration that says it is within 10 % gets a prior quantile close to it; the old floor of
    # 50 % asked for more than twice the declared peak at eps 0.05 before any observation.
    def q95(rel_sd: float) -> float:
        p = JobProfile.from_declaration(
            MemoryDecl(base_mib=10_000.0, per_unit_mib=0.0, rel_sd=rel_sd),
            TimeDecl(warmup_s=1.0, per_unit_s=1.0, rel_sd=0.3),
            typical_units=8,
        )
        assert p.mem_quantile(8, Q) == 10_000.0  # the declared bound caps the planner's quantile
        return p.mem.upper(8, Q) / 10_000.0

    tight, default, loose = q95(0.1), q95(0.25), q95(0.8)
    assert tight < default < loose
    assert default < 1.7  # 2.17x with the 50 % floor
    assert loose > 2.0
    # a sensible minimum: a declaration claiming certainty still leaves room to learn
    assert q95(0.0) == pytest.approx(tight)
    assert q95(0.0) > 1.1


def test_weight_rel_sd_is_opt_in() -> None:
    # without weight_rel_sd the weights keep their wide prior (time profiles); with it they follow it
    wide = LinearPosterior.prior_from(1000.0, 10.0, 0.1, 8, 0.05)
    assert wide == LinearPosterior.prior_from(1000.0, 10.0, 0.1, 8, 0.05, weight_rel_sd=0.5)
    narrow = LinearPosterior.prior_from(1000.0, 10.0, 0.1, 8, 0.05, weight_rel_sd=0.1)
    assert narrow.quantile(8, Q) < wide.quantile(8, Q)
    assert narrow.mean(8) == pytest.approx(wide.mean(8))
    # a 2x-pessimistic memory prior with a narrow width is still corrected by observations
    p = JobProfile.from_declaration(
        MemoryDecl(base_mib=200.0, per_unit_mib=20.0, rel_sd=0.1),
        TimeDecl(warmup_s=1.0, per_unit_s=0.1, rel_sd=0.5),
        typical_units=16,
    )
    rng = random.Random(3)
    for _ in range(20):
        k = rng.randint(5, 100)
        p.observe_memory(k, true_mem(k) * (1 + rng.gauss(0.0, 0.02)))
    assert p.mem.mean(50) == pytest.approx(true_mem(50), rel=0.05)
    assert p.mem_quantile(50, Q) >= true_mem(50)


# --- censored observations only tighten --------------------------------------------------------

QS = (0.5, 0.8, 0.9, 0.95, 0.99)
PROFILES = ("1g", "2g", "3g", "7g")


def _never_lower(before: float, after: float) -> bool:
    return after >= before - 1e-9 * max(abs(before), 1.0)


@st.composite
def histories(draw: st.DrawFn) -> tuple[JobProfile, list[tuple[str, int, float, float, int]]]:
    profile = JobProfile.from_declaration(
        MemoryDecl(
            base_mib=draw(st.floats(0.0, 5000.0)),
            per_unit_mib=draw(st.floats(0.0, 200.0)),
            rel_sd=draw(st.floats(0.0, 1.0)),
        ),
        TimeDecl(
            warmup_s=draw(st.floats(0.0, 5.0)),
            per_unit_s=draw(st.floats(1e-3, 1.0)),
            rel_sd=draw(st.floats(0.0, 1.0)),
        ),
        typical_units=draw(st.integers(1, 300)),
    )
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["ok", "ok", "oom", "timeout"]),
                st.integers(1, 400),
                st.floats(1.0, 60_000.0),
                st.floats(0.01, 300.0),
                st.integers(1, 7),
            ),
            max_size=12,
        )
    )
    return profile, ops


def _replay(profile: JobProfile, ops: list[tuple[str, int, float, float, int]]) -> None:
    for kind, k, mem, seconds, share7 in ops:
        if kind == "ok":
            profile.observe(k, mem, seconds, PROFILES[min(share7, 4) - 1], share7 / 7)
        elif kind == "oom":
            profile.observe_oom(k, mem)
        else:
            profile.observe_timeout(k, seconds, PROFILES[min(share7, 4) - 1], share7 / 7)


CENSORED = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@CENSORED
@given(
    history=histories(), k=st.integers(1, 400), cap=st.floats(1.0, 60_000.0), seen=st.floats(0.0, 70_000.0)
)
def test_an_oom_never_lowers_the_memory_quantile_at_its_size_or_above(
    history: tuple[JobProfile, list[tuple[str, int, float, float, int]]], k: int, cap: float, seen: float
) -> None:
    profile, ops = history
    _replay(profile, ops)
    sizes = [k, k + 1, 2 * k, k + 50, 1000]
    before = {(x, q): profile.mem_quantile(x, q) for x in sizes for q in QS}
    fit_before = {x: profile.mem_fit_probability(x, cap) for x in sizes}
    profile.observe_oom(k, cap, seen)
    for (x, q), b in before.items():
        assert _never_lower(b, profile.mem_quantile(x, q)), (x, q, b, profile.mem_quantile(x, q))
    for x, p in fit_before.items():
        assert profile.mem_fit_probability(x, cap) <= p + 1e-9
    # the OOM says the peak at k exceeded the cap: its median says so too
    assert profile.mem_quantile(k, 0.5) >= max(cap, seen) * (1 - 1e-9)


@CENSORED
@given(history=histories(), k=st.integers(1, 400), cap_s=st.floats(0.01, 300.0), share7=st.integers(1, 7))
def test_a_timeout_never_lowers_the_duration_quantile_at_its_size_or_above(
    history: tuple[JobProfile, list[tuple[str, int, float, float, int]]], k: int, cap_s: float, share7: int
) -> None:
    profile, ops = history
    _replay(profile, ops)
    name, share = PROFILES[min(share7, 4) - 1], share7 / 7
    sizes = [k, k + 1, 2 * k, 1000]
    where = [(name, share), ("7g", 1.0), ("1g", 1 / 7)]
    before = {(x, q, w): profile.duration_quantile(x, q, *w) for x in sizes for q in QS for w in where}
    profile.observe_timeout(k, cap_s, name, share)
    for (x, q, w), b in before.items():
        after = profile.duration_quantile(x, q, *w)
        assert _never_lower(b, after), (x, q, w, b, after)
    assert profile.max_size_under_bounds(1e12, cap_s, share) is not None


def test_an_oom_below_what_the_model_expects_does_not_lower_it() -> None:
    # a completion at 4500 MiB at k = 100, then an OOM at a 2000 MiB cap: it confirms, never lowers
    p = JobProfile.from_declaration(
        MemoryDecl(base_mib=500.0, per_unit_mib=20.0, rel_sd=0.25),
        TimeDecl(warmup_s=0.1, per_unit_s=0.01, rel_sd=0.3),
        typical_units=100,
    )
    p.observe_memory(100, 4500.0)
    for k in (40, 60, 100):
        q = p.copy()
        median, q95 = q.mem_quantile(100, 0.5), q.mem_quantile(100, 0.95)
        q.observe_oom(k, 2000.0)
        assert q.mem_quantile(100, 0.5) >= median
        assert q.mem_quantile(100, 0.95) >= q95


def test_censored_observations_outlive_the_observation_window() -> None:
    p = overestimating_profile()
    p.observe_oom(80, 3000.0)
    p.observe_timeout(80, 12.0, "1g", 1 / 7)
    rng = random.Random(1)
    for _ in range(3 * MAX_OBSERVATIONS):
        k = rng.randint(1, 20)
        p.observe(k, true_mem(k), true_full_time(k) * 7, "1g", 1 / 7)
    assert len(p.mem.obs) == MAX_OBSERVATIONS
    # the exact observations say ~900 MiB at 80; the OOM says more than 3000, and it still does
    assert p.mem.mean(80) < 1500.0
    assert p.mem_quantile(80, 0.05) >= 3000.0
    assert p.mem_quantile(120, 0.05) >= 3000.0
    assert p.mem_quantile(79, 0.95) < 3000.0
    assert p.max_size_under_bounds(3000.0, 1e9, 1.0) == 79
    assert p.max_size_under_bounds(1e9, 12.0, 1 / 7) == 79
    # and through the job state
    restored = JobProfile.from_state(p.to_state())
    assert restored.mem_quantile(80, 0.05) == p.mem_quantile(80, 0.05)
    assert restored == p


def test_a_completion_that_contradicts_a_lower_bound_drops_it() -> None:
    p = overestimating_profile()
    p.observe_oom(50, 1000.0)
    assert p.mem.lower_bound(60) == 1000.0
    p.observe_memory(60, 950.0)  # a larger size fitted under that cap: the OOM was noise
    assert p.mem.lower_bound(60) is None
    assert p.mem.held == []
    assert p.max_size_under_bounds(1000.0, 1e9, 1.0) == 49, "an OOM bound stays"


def test_quantiles_are_student_t() -> None:
    post = LinearPosterior.prior_from(1000.0, 10.0, 0.1, 8, 0.05)
    assert post.dof == 4.0
    m, sd = post.mean(8), post.sd(8)
    for q in (0.8, 0.95, 0.99):
        assert post.quantile(8, q) == pytest.approx(m + float(stdtrit(4.0, q)) * sd, rel=1e-12)
        # the model's own exceedance at its quantile is exactly 1 - q (a normal with the t
        # variance gave 1.5 % at q = 0.99 with 4 degrees of freedom)
        assert 1.0 - post.cdf(8, post.quantile(8, q)) == pytest.approx(1.0 - q, rel=1e-9)
    assert post.quantile(8, 0.99) > m + z_of(0.99) * sd * math.sqrt(2.0)
    post.update(8, 1080.0)
    assert post.dof == 5.0


def test_memory_that_stops_growing_is_followed_near_the_latest_size() -> None:
    # peak memory grows 10 MiB per unit up to 100 units, then stays flat at 1100 MiB
    def plateau(k: int) -> float:
        return 100.0 + 10.0 * min(k, 100)

    p = overestimating_profile()
    line = overestimating_profile()
    line.mem.locality = 0.0
    for k in [*range(10, 101, 10), *range(150, 231, 10)]:
        p.observe_memory(k, plateau(k))
        line.observe_memory(k, plateau(k))
    # one line through every point keeps the steep part's slope and asks for far more at 260; the
    # fit weighted near the latest sizes is at least twice as close to the plateau
    assert line.mem.mean(260) > 1500.0
    assert abs(p.mem.mean(260) - plateau(260)) < 0.5 * abs(line.mem.mean(260) - plateau(260))
    assert p.mem.mu1 < 0.6 * line.mem.mu1
    assert p.mem_quantile(260, Q) < 0.8 * line.mem_quantile(260, Q)
    assert p.mem_quantile(260, Q) >= plateau(260)
    # a far-away size is still predicted, by the prior and the down-weighted points
    assert p.mem.locality > 0.0 and JobProfile.from_state(p.to_state()) == p


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    runs=st.lists(
        st.tuples(st.integers(1, 64), st.floats(100.0, 20_000.0), st.floats(0.01, 30.0)), max_size=6
    ),
    oom=st.one_of(st.none(), st.tuples(st.integers(1, 64), st.floats(100.0, 20_000.0))),
    asks=st.lists(
        st.tuples(st.integers(1, 64), st.floats(0.5, 0.999), st.floats(0.01, 60.0)), min_size=1, max_size=8
    ),
)
def test_a_frozen_profile_answers_as_before_and_cannot_be_updated(
    runs: list[tuple[int, float, float]], oom: tuple[int, float] | None, asks: list[tuple[int, float, float]]
) -> None:
    """A frozen profile remembers its predictions: asked again (and again), it answers exactly what
    the same profile unfrozen answers; updating it raises, and a copy of it updates normally."""
    p = overestimating_profile()
    for k, mem, dur in runs:
        p.observe(k, mem, dur, "1g.10gb", 1 / 7)
    if oom is not None:
        p.observe_oom(oom[0], oom[1])
    plain = p.copy()
    frozen = p.copy().freeze()

    def answers(q: JobProfile) -> list[float]:
        return [
            v
            for k, level, length in asks
            for v in (
                q.mem_quantile(k, level),
                q.mem_fit_probability(k, length * 1000.0),
                q.duration_quantile(k, level, "1g.10gb", 1 / 7),
                q.time_fit_probability(k, length, "2g.20gb", 2 / 7),
            )
        ]

    expected = answers(plain)
    assert answers(frozen) == expected
    assert answers(frozen) == expected, "remembered: the same answers again"
    with pytest.raises(RuntimeError):
        frozen.observe(1, 100.0, 0.1, "1g.10gb", 1 / 7)
    with pytest.raises(RuntimeError):
        frozen.observe_oom(1, 100.0)
    updated = frozen.copy()
    updated.observe(1, 100.0, 0.1, "1g.10gb", 1 / 7)
    assert updated.observations == frozen.observations + 1
