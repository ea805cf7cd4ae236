"""Subjob planning: which sizes fit a window with the stated probability.

For a window of memory ``M`` (minus a reserve for driver/context overhead) and length ``T`` (minus the
per-subjob start overhead), a size ``k`` is *safe* when the job's ``1 - eps_mem`` memory quantile is at
most ``M - reserve`` and its ``1 - eps_time`` duration quantile is at most ``T - overhead``, and no
past OOM or timeout forbids it. SJA interest is "is there a safe ``k``"; JASDA proposes several safe
sizes, each scored.

Three rules make sure a job a rigid scheduler would run is never left waiting for ever:

- the memory quantile is capped by the job's ceiling (its declaration, and the slices it completed
  on: ``JobProfile.mem_ceiling``), so a job whose declared peak at ``min_units`` fits a slice's usable
  memory is always safe there memory-wise;
- an open-ended window (a free slice no reservation bounds) is as long as the planning horizon, or
  as the job's smallest subjob needs at its ``1 - eps_time`` quantile when that is longer, and
  ``CENSORED_INFLATION`` times longer than any it ran out of (``plan_length``): a rigid scheduler
  would hold the slice for the whole job;
- a job with no declared memory and no measured peak (``JobProfile.measuring``) is planned at its
  smallest size only, on a slice at least as large as any of its pool (``Window.largest_mib``): a
  measuring subjob, after which its measured peak plans it by quantile.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sja.core import defaults
from sja.core.profiles import CENSORED_INFLATION, JobProfile
from sja.protocol.messages import Candidate, Window


@dataclass(frozen=True)
class PlanLimits:
    """Cluster-wide planning settings."""

    mem_reserve_mib: float = 256.0
    """Driver/context overhead on every slice, not available to the subjob."""
    start_overhead_s: float = defaults.START_OVERHEAD_S
    """Per-subjob start and checkpoint cost, taken off the window."""
    horizon_s: float = defaults.HORIZON_S
    """Length assumed for an open-ended window."""
    candidate_fractions: tuple[float, ...] = (1.0, 0.75, 0.5, 0.25)


@dataclass(frozen=True)
class PlanRequest:
    window: Window
    now: float
    eps_mem: float
    eps_time: float
    max_units: int
    """Largest contiguous range the job can hand out now."""
    min_units: int = 1
    remaining_units: int = 0
    """All work left (for scoring a candidate that finishes the job)."""


def usable_memory(window: Window, limits: PlanLimits) -> float:
    return window.mem_mib - limits.mem_reserve_mib


def usable_time(window: Window, now: float, limits: PlanLimits) -> float:
    end = window.end_s if window.end_s is not None else max(now, window.start_s) + limits.horizon_s
    return end - max(now, window.start_s) - limits.start_overhead_s


def plan_length(profile: JobProfile, req: PlanRequest, limits: PlanLimits) -> float:
    """Seconds of the window a subjob may use (start overhead taken off). A bounded window gives
    what is left of it; an open-ended one the planning horizon, or what the job's smallest subjob
    needs at its ``1 - eps_time`` quantile when that is longer."""
    w = req.window
    length = usable_time(w, req.now, limits)
    if w.end_s is None and req.min_units >= 1:
        need = profile.duration_quantile(req.min_units, 1.0 - req.eps_time, w.profile, w.compute_share)
        length = max(length, need)
        # and longer than any window the smallest subjob ran out of (at this compute share)
        for size, bound in profile.timeout_bounds:
            if size <= req.min_units:
                length = max(length, bound / w.compute_share * CENSORED_INFLATION)
    return length


def first_unit_s(profile: JobProfile, req: PlanRequest) -> float:
    """What a subjob on ``req``'s window needs before it can have done anything: its start-up and
    one unit, at the ``1 - eps_time`` quantile (declared, then measured)."""
    w = req.window
    return profile.duration_quantile(1, 1.0 - req.eps_time, w.profile, w.compute_share)


def is_largest(window: Window) -> bool:
    """Whether the window's slice is as large as any of its pool (``True`` when that is not known)."""
    return window.largest_mib <= 0 or window.mem_mib >= window.largest_mib


def is_safe(
    profile: JobProfile, k: int, req: PlanRequest, limits: PlanLimits, length: float | None = None
) -> bool:
    """Whether size ``k`` fits the window with the stated probabilities (``length``: the window's
    ``plan_length``, when the caller has it already)."""
    w = req.window
    mem_cap = usable_memory(w, limits)
    if length is None:
        length = plan_length(profile, req, limits)
    if mem_cap <= 0 or length <= 0:
        return False
    bound = profile.max_size_under_bounds(mem_cap, length, w.compute_share)
    if bound is not None and k > bound:
        return False
    q_time = 1.0 - req.eps_time
    if profile.duration_above(k, q_time, w.profile, w.compute_share, length):
        return False  # far too long for the window: no quantile needed to say so
    if profile.measuring:
        if k > req.min_units or not is_largest(w):
            return False
    elif profile.mem_ceiling(k) > mem_cap and profile.mem_quantile(k, 1.0 - req.eps_mem) > mem_cap:
        return False  # (the quantile is never above the ceiling: one within the cap fits)
    return profile.duration_quantile(k, q_time, w.profile, w.compute_share) <= length


def largest_safe_size(profile: JobProfile, req: PlanRequest, limits: PlanLimits) -> int | None:
    """The largest safe ``k`` in ``[min_units, max_units]``, or ``None``.

    Quantiles grow with ``k`` over the range that matters, so a binary search finds the boundary; the
    answer is re-checked so a non-monotone corner can only make the plan smaller, never unsafe.
    """
    lo, hi = req.min_units, req.max_units
    length = plan_length(profile, req, limits)
    if hi < lo or not is_safe(profile, lo, req, limits, length):
        return None
    if profile.measuring:
        return lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if is_safe(profile, mid, req, limits, length):
            lo = mid
        else:
            hi = mid - 1
    return lo


def candidate(profile: JobProfile, k: int, req: PlanRequest, limits: PlanLimits) -> Candidate:
    w = req.window
    mem_cap = usable_memory(w, limits)
    length = plan_length(profile, req, limits)
    duration_mean = profile.duration_mean(k, w.profile, w.compute_share)
    mem_q = profile.mem_quantile(k, 1.0 - req.eps_mem)
    if profile.measuring:  # unknown until measured: it may use all of the slice
        mem_q = max(mem_cap, 0.0)
    p_mem = profile.mem_fit_probability(k, mem_cap)
    p_time = profile.time_fit_probability(k, length, w.profile, w.compute_share)
    fill_time = min(duration_mean / length, 1.0) if length > 0 else 0.0
    fill_mem = min(mem_q / w.mem_mib, 1.0)
    finishes = 1.0 if req.remaining_units and k >= req.remaining_units else 0.0
    # The job's own view of how good this cut is: use of the window, odds of fitting, and a bonus
    # for finishing the job (no further cut, no further start overhead).
    score = (0.7 * fill_time + 0.3 * fill_mem) * p_mem * p_time + 0.1 * finishes
    return Candidate(
        size=k,
        mem_q_mib=round(mem_q, 3),
        p_fit_mem=round(p_mem, 6),
        duration_q_s=round(profile.duration_quantile(k, 1.0 - req.eps_time, w.profile, w.compute_share), 6),
        duration_mean_s=round(duration_mean, 6),
        p_fit_time=round(p_time, 6),
        score=round(score, 6),
    )


def plan_candidates(profile: JobProfile, req: PlanRequest, limits: PlanLimits, mode: str) -> list[Candidate]:
    """SJA: one candidate (the largest safe size). JASDA: several safe sizes, best score first."""
    k_max = largest_safe_size(profile, req, limits)
    if k_max is None:
        return []
    if mode == "sja":
        return [candidate(profile, k_max, req, limits)]
    sizes = _candidate_sizes(k_max, req.min_units, limits.candidate_fractions)
    # Quantiles need not be monotone in k after learning: every proposed size is checked itself.
    length = plan_length(profile, req, limits)
    cands = [candidate(profile, k, req, limits) for k in sizes if is_safe(profile, k, req, limits, length)]
    cands.sort(key=lambda c: (-c.score, -c.size))
    return cands


def _candidate_sizes(k_max: int, k_min: int, fractions: Sequence[float]) -> list[int]:
    sizes: list[int] = []
    for f in fractions:
        k = max(k_min, int(k_max * f))
        if k not in sizes:
            sizes.append(k)
    return sizes


def materialize_size(profile: JobProfile, req: PlanRequest, limits: PlanLimits, proposed: int) -> int | None:
    """Size of the subjob for a granted window: recomputed with the latest profile, never larger
    than what was proposed, never unsafe."""
    bounded = PlanRequest(
        window=req.window,
        now=req.now,
        eps_mem=req.eps_mem,
        eps_time=req.eps_time,
        max_units=min(req.max_units, proposed),
        min_units=req.min_units,
        remaining_units=req.remaining_units,
    )
    return largest_safe_size(profile, bounded, limits)
