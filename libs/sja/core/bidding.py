"""A job's side of bidding, as pure functions of its state: whether it bids for a window at all
(``may_bid_on``, ``resting``), what it proposes for an offer (``propose``), when it holds a
proposal back (``sits_out``, ``bidding_expired``) and the moment it plans from (``plan_time``).
``bidder.Bidder`` applies them to an agent's jobs (and the simulator's).
"""

from __future__ import annotations

import msgspec

from sja.core import continuation
from sja.core.jobs import balanced_units, can_take_more, capacity, next_range, plan_request, units_remaining
from sja.core.planner import PlanLimits, plan_candidates
from sja.core.profile_cache import ProfileCache, profile_of
from sja.core.profiles import JobProfile
from sja.protocol.messages import JobState, Offer, Proposal, Window

BIDDING_TIMEOUT_S = 1.0
"""How long a job likely to win in a batch sits out later batches when no outcome comes."""


def plan_time(now: float, window_start_s: float) -> float:
    """The moment a proposal is planned from: the window's start as offered, or now if that is
    earlier (so that an answer does not change with the offer's delay)."""
    return min(now, window_start_s)


def sits_out(proposal: Proposal, grants_in_hand: int, likely_wins: int) -> bool:
    """Whether a job holds back a proposal it could make: the grants it holds and is still
    materializing use up what it can take (``proposal.capacity``), or it is likely to win in
    ``likely_wins`` batches still being cleared (its bid would only take a better one's place)."""
    return grants_in_hand >= proposal.capacity or likely_wins > 0


def bidding_expired(answered_at: float, now: float, timeout_s: float = BIDDING_TIMEOUT_S) -> bool:
    """Whether a batch answered at ``answered_at`` whose outcome never came stops holding its likely
    winners back (the outcome was lost, or was not for this agent)."""
    return now - answered_at >= timeout_s


def resting(state: JobState, now: float) -> bool:
    """Whether the job is waiting out its back-off after timeouts (it sends no bid until
    ``state.bids_again_at``; ``Bidder`` holds it back and lets it bid again then)."""
    return now < state.bids_again_at


def expected_remaining_s(state: JobState, profile: JobProfile) -> float:
    left = units_remaining(state)
    return profile.duration_mean(left, "7g", 1.0) if left else 0.0


def may_bid_on(state: JobState, window: Window) -> bool:
    """Whether the job bids for ``window`` at all: a slice held past its window by an open subjob
    (``Window.held_by``) only when it is another job's and that job comes after this one in the
    order of service (``continuation.takes_held``); its own goes on there without a bid."""
    if not window.held_by:
        return True
    return window.held_by != state.job_id and continuation.takes_held(
        continuation.service_key(state.attained_gpu_s, state.submitted_at, state.due_at),
        continuation.service_key(window.held_attained_gpu_s, window.held_submitted_at, window.held_due_at),
    )


def propose(
    state: JobState, offer: Offer, now: float, limits: PlanLimits, *, profiles: ProfileCache | None = None
) -> Proposal | None:
    """The job's reply to an offer, or ``None`` when it cannot fit anything there (or the window is
    the slice its own open subjob holds: it goes on there without a bid)."""
    share = offer.window.compute_share
    if not can_take_more(state, share) or not may_bid_on(state, offer.window):
        return None
    rng = next_range(state)
    assert rng is not None
    profile = profile_of(state, profiles)
    req = plan_request(state, offer.window, now, balanced_units(state, rng[1], share))
    cands = plan_candidates(profile, req, limits, state.spec.mode)
    if not cands:
        return None
    cands = [
        msgspec.structs.replace(c, bid=round(state.spec.bid_per_gpu_s * c.duration_mean_s * share, 6))
        for c in cands
    ]
    deadline = state.submitted_at + state.spec.deadline_s if state.spec.deadline_s else None
    return Proposal(
        job_id=state.job_id,
        tenant=state.spec.tenant,
        mode=state.spec.mode,
        candidates=cands[: 1 if state.spec.mode == "sja" else 8],
        submitted_at=state.submitted_at,
        remaining_units=units_remaining(state),
        total_units=state.total_units,
        priority=state.spec.priority,
        deadline_at=deadline,
        expected_remaining_s=round(expected_remaining_s(state, profile), 6),
        capacity=capacity(state, share),
        grants_seen=state.grants_seen,
        attained_gpu_s=state.attained_gpu_s,
        due_at=state.due_at,
    )
