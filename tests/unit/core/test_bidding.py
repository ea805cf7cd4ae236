"""A job's side of bidding: what it proposes for an offer, when it sits out a batch or stops being
held back, the moment it plans from, and no bid while it backs off after timeouts."""

from __future__ import annotations

from sja.core.bidder import Bidder
from sja.core.bidding import bidding_expired, plan_time, propose, resting, sits_out
from sja.core.jobs import apply_completion, new_job, timeout_backoff_s
from sja.core.policies import PolicyConfig
from tests.unit.core._jobs_in_process import LIMITS, T0, execute, offer_for, spec, win_window, window


def test_proposal_describes_the_job() -> None:
    state = new_job("j1", spec(deadline_s=60.0, priority=3, max_parallel=2), T0)
    offer = offer_for(window(T0), T0)
    p = propose(state, offer, T0, LIMITS)
    assert p is not None
    assert (p.job_id, p.tenant, p.mode, p.priority) == ("j1", "alice", "sja", 3)
    assert p.deadline_at == T0 + 60.0
    assert p.remaining_units == p.total_units == 48
    assert p.capacity == 2
    assert len(p.candidates) == 1
    assert 1 <= p.candidates[0].size < 48
    assert p.candidates[0].mem_q_mib <= 4864 - LIMITS.mem_reserve_mib


def test_no_proposal_for_a_window_too_small() -> None:
    state = new_job("j1", spec(), T0)
    tiny = window(T0, mem_mib=300)
    assert propose(state, offer_for(tiny, T0), T0, LIMITS) is None


def test_a_job_backing_off_sends_no_bid_until_its_back_off_ends() -> None:
    """The agent's and the simulator's bidder hold a resting job back, and let it bid once its
    back-off ends (ranked again: its earlier answer is not kept)."""
    state = new_job("j1", spec(), T0)
    now = T0
    for _ in range(2):
        state, sj = win_window(state, now)
        now += 1.0
        state, _ = apply_completion(state, execute(sj, now, status="timeout"), now)
    assert resting(state, now) and state.bids_again_at == now + timeout_backoff_s(2)
    bidder = Bidder(LIMITS, PolicyConfig())
    bidder.own(state)
    offer = offer_for(window(now), now)
    assert bidder.proposals_for(offer, now, 1, "fair") == []
    assert bidder.proposals_for(offer, state.bids_again_at - 0.01, 1, "fair") == []
    bids = bidder.proposals_for(offer, state.bids_again_at, 1, "fair")
    assert [p.job_id for p in bids] == ["j1"]


def test_a_job_sits_out_while_its_grants_fill_its_capacity_or_it_is_likely_to_win() -> None:
    state = new_job("j1", spec(max_parallel=2), T0)
    p = propose(state, offer_for(window(T0), T0), T0, LIMITS)
    assert p is not None and p.capacity == 2
    assert not sits_out(p, grants_in_hand=0, likely_wins=0)
    assert not sits_out(p, grants_in_hand=1, likely_wins=0)
    assert sits_out(p, grants_in_hand=2, likely_wins=0)
    assert sits_out(p, grants_in_hand=0, likely_wins=1)


def test_a_batch_stops_holding_jobs_back_after_the_bidding_timeout() -> None:
    assert not bidding_expired(T0, T0 + 0.5, timeout_s=1.0)
    assert bidding_expired(T0, T0 + 1.0, timeout_s=1.0)
    assert bidding_expired(T0, T0 + 3.0)


def test_a_proposal_is_planned_from_the_windows_start_unless_the_offer_came_early() -> None:
    assert plan_time(T0 + 2.0, T0) == T0, "a late offer is answered as of the window's start"
    assert plan_time(T0, T0 + 2.0) == T0, "a window starting later is planned from now"
