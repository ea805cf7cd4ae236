"""Clearing policies: one winner per window, a reason for every bid, deterministic decisions."""

from __future__ import annotations

import math
from collections import Counter

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sja.core.policies import (
    NO_BID,
    POLICIES,
    Bid,
    Decision,
    Ledger,
    PolicyConfig,
    clear,
    clear_batch,
    efficiency_value,
    grant_cost,
    policy,
    split_by_capacity,
)
from sja.core.policies.base import VerdictKind, verdict_kind
from sja.protocol.messages import Candidate, Offer, Proposal, RoundRecord, Verdict, Window

NOW = 1000.0


def make_offer(mem_mib: int = 20_000, length_s: float | None = 30.0, share: float = 3 / 7) -> Offer:
    window = Window(
        slice_id="n-g0-3g.20gb-4",
        node="n",
        pool="p",
        gpu_model="A100-40GB",
        profile="3g.20gb",
        mem_mib=mem_mib,
        compute_share=share,
        start_s=NOW,
        end_s=None if length_s is None else NOW + length_s,
    )
    return Offer(
        offer_id="o-1",
        round=1,
        window=window,
        slice_fence=0,
        slice_revision=0,
        issued_at=NOW,
        reply_by=NOW + 0.5,
        reply_to="_INBOX.x",
    )


def cand(
    size: int = 10,
    mem: float = 1000.0,
    dur: float = 10.0,
    p_mem: float = 1.0,
    p_time: float = 1.0,
    price: float = 0.0,
) -> Candidate:
    return Candidate(
        size=size,
        mem_q_mib=mem,
        p_fit_mem=p_mem,
        duration_q_s=dur * 1.2,
        duration_mean_s=dur,
        p_fit_time=p_time,
        bid=price,
    )


def bid(
    job_id: str,
    *,
    tenant: str = "t",
    agent: str = "agent-1",
    submitted_at: float = 0.0,
    candidates: list[Candidate] | None = None,
    deadline_at: float | None = None,
    expected_remaining_s: float = 0.0,
    capacity: int = 1,
    grants_seen: int = 0,
) -> Bid:
    return Bid(
        agent_id=agent,
        proposal=Proposal(
            job_id=job_id,
            tenant=tenant,
            mode="jasda",
            candidates=candidates or [cand()],
            submitted_at=submitted_at,
            remaining_units=100,
            total_units=100,
            deadline_at=deadline_at,
            expected_remaining_s=expected_remaining_s,
            capacity=capacity,
            grants_seen=grants_seen,
        ),
    )


def check_well_formed(d: Decision, bids: list[Bid]) -> None:
    """At most one winner, a verdict for every bid: exactly one standing verdict per distinct job
    and an ``invalid`` one for each further bid of a job, a reason for each."""
    jobs = {b.proposal.job_id for b in bids}
    assert len(d.verdicts) == len(bids)
    assert Counter((v.job_id, v.agent_id) for v in d.verdicts) == Counter(
        (b.proposal.job_id, b.agent_id) for b in bids
    )
    standing = [v for v in d.verdicts if verdict_kind(v) is not VerdictKind.INVALID]
    counts = Counter(v.job_id for v in standing)
    assert set(counts) == jobs
    assert all(n == 1 for n in counts.values()), counts
    winners = [v for v in d.verdicts if v.won]
    assert len(winners) <= 1
    if d.winner is None:
        assert winners == []
        assert d.candidate is None
    else:
        assert [v.job_id for v in winners] == [d.winner.proposal.job_id]
        assert d.candidate in d.winner.proposal.candidates
        assert winners[0].size == d.candidate.size
    for v in d.verdicts:
        assert v.reason.strip()
        kind = verdict_kind(v)
        assert (kind is VerdictKind.WON) == v.won
        assert v.reason.startswith(str(kind)), (kind, v.reason)  # the reason names its kind


# --- the three policies ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_no_bids_no_winner(name: str) -> None:
    d = clear(name, make_offer(), [], Ledger())
    assert d.winner is None and d.candidate is None and d.verdicts == ()
    assert d.policy == name


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_single_winner_and_one_verdict_per_job(name: str) -> None:
    bids = [
        bid("a", tenant="alice", submitted_at=3.0, candidates=[cand(10, dur=5.0)]),
        bid("b", tenant="bob", submitted_at=1.0, candidates=[cand(20, dur=20.0), cand(5)]),
        bid("c", tenant="alice", submitted_at=2.0, deadline_at=NOW + 60.0),
    ]
    d = clear(name, make_offer(), bids, Ledger())
    assert d.winner is not None
    check_well_formed(d, bids)


def test_efficiency_picks_the_best_filling_candidate() -> None:
    offer = make_offer(mem_mib=20_000, length_s=30.0)
    small = bid("small", submitted_at=0.0, candidates=[cand(5, mem=2000.0, dur=3.0)])
    filling = bid(
        "filling",
        submitted_at=5.0,
        candidates=[
            cand(8, mem=4000.0, dur=8.0),
            cand(30, mem=18_000.0, dur=27.0),
        ],
    )
    risky = bid("risky", submitted_at=1.0, candidates=[cand(32, mem=19_000.0, dur=29.0, p_time=0.3)])
    d = clear("efficiency", offer, [small, filling, risky], Ledger())
    assert d.winner is filling
    assert d.candidate is not None and d.candidate.size == 30
    check_well_formed(d, [small, filling, risky])
    by_job = {v.job_id: v for v in d.verdicts}
    assert by_job["filling"].score == pytest.approx(
        efficiency_value(offer, filling.proposal.candidates[1], 30.0), abs=1e-6
    )
    assert "lost to filling" in by_job["small"].reason


def test_efficiency_ties_go_to_the_earliest_submission() -> None:
    same = [cand(10, mem=5000.0, dur=10.0)]
    late = bid("late", submitted_at=9.0, candidates=same)
    early = bid("early", submitted_at=2.0, candidates=same)
    d = clear("efficiency", make_offer(), [late, early], Ledger())
    assert d.winner is early


def test_fair_picks_least_attained_service_per_share() -> None:
    ledger = Ledger(
        tenant_shares={"alice": 4.0, "bob": 1.0},
        tenant_attained={"alice": 100.0, "bob": 30.0, "carol": 40.0},
    )
    bids = [
        bid("bob-1", tenant="bob", submitted_at=0.0),
        bid("carol-1", tenant="carol", submitted_at=1.0),
        bid("alice-1", tenant="alice", submitted_at=2.0),
    ]
    d = clear("fair", make_offer(), bids, ledger)
    # alice has used the most but her share is 4: 100 / 4 = 25 < 30 (bob) < 40 (carol)
    assert d.winner is not None and d.winner.proposal.job_id == "alice-1"
    check_well_formed(d, bids)
    scores = {v.job_id: v.score for v in d.verdicts}
    assert scores == {"alice-1": 25.0, "bob-1": 30.0, "carol-1": 40.0}


def test_fair_within_a_tenant_favours_the_least_served_job() -> None:
    ledger = Ledger(job_attained={"j-old": 50.0, "j-new": 5.0})
    bids = [bid("j-old", submitted_at=0.0), bid("j-new", submitted_at=10.0)]
    d = clear("fair", make_offer(), bids, ledger)
    assert d.winner is not None and d.winner.proposal.job_id == "j-new"


def test_fair_alternates_tenants_as_the_ledger_charges_winners() -> None:
    ledger = Ledger()
    offer = make_offer()
    bids = [
        bid("a", tenant="alice", submitted_at=0.0, candidates=[cand(dur=10.0)]),
        bid("b", tenant="bob", submitted_at=1.0, candidates=[cand(dur=10.0)]),
    ]
    winners = []
    for _ in range(6):
        d = clear("fair", offer, bids, ledger)
        assert d.winner is not None and d.candidate is not None
        winners.append(d.winner.proposal.tenant)
        ledger.charge(d.winner.proposal.tenant, d.winner.proposal.job_id, grant_cost(offer, d.candidate))
    assert winners == ["alice", "bob"] * 3
    assert ledger.tenant_attained["alice"] == pytest.approx(3 * 10.0 * 3 / 7)


def test_sla_picks_least_slack() -> None:
    offer = make_offer()
    urgent = bid("urgent", submitted_at=5.0, deadline_at=NOW + 100.0, expected_remaining_s=95.0)
    early_deadline = bid("early", submitted_at=4.0, deadline_at=NOW + 50.0, expected_remaining_s=10.0)
    none = bid("none", submitted_at=0.0)
    late = bid("late", submitted_at=1.0, deadline_at=NOW + 1000.0)
    bids = [none, late, early_deadline, urgent]
    d = clear("sla", offer, bids, Ledger())
    assert d.winner is urgent  # slack 5 s beats slack 40 s despite the later deadline
    check_well_formed(d, bids)
    by_job = {v.job_id: v for v in d.verdicts}
    assert by_job["urgent"].score == pytest.approx(5.0)
    assert "no deadline" in by_job["none"].reason


def test_sla_without_deadlines_is_first_come_first_served() -> None:
    bids = [bid("second", submitted_at=2.0), bid("first", submitted_at=1.0)]
    d = clear("sla", make_offer(), bids, Ledger())
    assert d.winner is not None and d.winner.proposal.job_id == "first"


def test_unknown_policy_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'fifo' \(known: ") as exc:
        clear("fifo", make_offer(), [bid("a")], Ledger())
    for known in ("efficiency", "fair", "sla"):
        assert known in str(exc.value)
    with pytest.raises(ValueError, match="unknown policy"):
        policy("")


def test_auction_highest_affordable_bid_wins_and_pays_the_second_price() -> None:
    bids = [
        bid("a", tenant="alice", submitted_at=0.0, candidates=[cand(price=3.0)]),
        bid("b", tenant="bob", submitted_at=1.0, candidates=[cand(price=5.0)]),
        bid("c", tenant="carol", submitted_at=2.0, candidates=[cand(price=4.0)]),
    ]
    d = clear("auction", make_offer(), bids, Ledger())
    assert d.winner is bids[1]
    assert d.price == pytest.approx(4.0)
    check_well_formed(d, bids)
    # bob cannot afford his bid: carol wins and pays alice's bid
    poor_bob = Ledger(tenant_budgets={"bob": 4.5})
    d = clear("auction", make_offer(), bids, poor_bob)
    assert d.winner is bids[2]
    assert d.price == pytest.approx(3.0)
    assert "budget" in next(v for v in d.verdicts if v.job_id == "b").reason
    check_well_formed(d, bids)
    # a lone bid pays nothing above the reserve
    d = clear("auction", make_offer(), bids[:1], Ledger())
    assert d.winner is bids[0] and d.price == 0.0


def test_token_goes_to_the_tenant_furthest_below_its_share() -> None:
    ledger = Ledger(tenant_attained={"alice": 90.0, "bob": 10.0})
    bids = [
        bid("a", tenant="alice", submitted_at=0.0, candidates=[cand(dur=29.0, mem=19_000.0)]),
        bid("b", tenant="bob", submitted_at=5.0, candidates=[cand(dur=1.0)]),
    ]
    d = clear("token", make_offer(), bids, ledger)
    assert d.winner is bids[1]
    assert "revoked" in next(v for v in d.verdicts if v.job_id == "a").reason
    check_well_formed(d, bids)


def like_offers(n: int) -> list[Offer]:
    """``n`` offers of one shape, each for a slice of its own."""
    base = make_offer()
    return [
        msgspec.structs.replace(
            base, offer_id=f"o-{i}", window=msgspec.structs.replace(base.window, slice_id=f"s-{i}")
        )
        for i in range(n)
    ]


def clear_one_by_one(name: str, offers: list[Offer], bids: list[Bid], ledger: Ledger) -> list[Decision]:
    out = []
    for o in offers:
        d = clear(name, o, bids, ledger)
        out.append(d)
        if d.winner is not None and d.candidate is not None:
            p = d.winner.proposal
            ledger.charge(p.tenant, p.job_id, grant_cost(o, d.candidate))
            ledger.record_grant(p.job_id, float("inf"))
    return out


def test_jasda_batch_breaks_equal_scores_by_submission_then_canonical_order() -> None:
    """Equal scores, across tenants and within one: the earliest submission wins, then the first
    in canonical order (job id); a charged tenant's fairness drops, so the next window goes to
    another tenant, and a tenant back at its share ties again with the others."""
    bids = [
        bid("a-1", tenant="a", submitted_at=2.0),
        bid("b-2", tenant="b", submitted_at=1.0),
        bid("c-1", tenant="c", submitted_at=1.0),
        bid("b-1", tenant="b", submitted_at=1.0),
    ]
    offers = like_offers(4)
    batch = clear_batch("jasda", offers, lambda o: bids, Ledger())
    want = clear_one_by_one("jasda", offers, bids, Ledger())
    assert [w.winner.proposal.job_id if w.winner else None for w in want] == ["b-1", "c-1", "a-1", "b-2"]
    for (_o, got), w in zip(batch, want, strict=True):
        assert got.winner is not None and w.winner is not None
        assert got.winner.proposal.job_id == w.winner.proposal.job_id
        assert got.candidate == w.candidate
        assert [v for v in got.verdicts if v.won] == [v for v in w.verdicts if v.won]
    scores = {v.score for w in want for v in w.verdicts if v.won}
    assert len(scores) == 2, "the first and the last window are won at one score, the others at another"


def test_jasda_batch_ranks_by_the_score_as_summed_not_its_parts() -> None:
    """Two bids of one tenant whose utilization and responsiveness terms add up one ulp higher
    for ``j0``, but whose whole scores, the tenant's term added between the two, come out one ulp
    higher for ``j1``: the batch picks ``j1``, as clearing the offer alone does."""
    ledger = Ledger(tenant_attained={"t": 1.0, "u": 2.0})
    bids = [
        bid("j0", submitted_at=NOW - 40.0, candidates=[cand(dur=3.0, mem=13_000.0)], capacity=5),
        bid("j1", submitted_at=NOW - 21.0, candidates=[cand(dur=11.0, mem=9_000.0)], capacity=5),
    ]
    offers = like_offers(1)
    w_u, _w_f, w_r = PolicyConfig().jasda_weights
    parts = [
        w_u * efficiency_value(offers[0], b.proposal.candidates[0], 30.0)
        + w_r * ((NOW - b.proposal.submitted_at) / 60.0)
        for b in bids
    ]
    assert parts[0] > parts[1], "the tenant-free parts rank j0 first"
    want = clear("jasda", offers[0], bids, ledger)
    assert want.winner is not None and want.winner.proposal.job_id == "j1"
    ((_o, got),) = clear_batch("jasda", offers, lambda o: bids, ledger)
    assert got.winner is not None and got.winner.proposal.job_id == "j1"
    assert [v for v in got.verdicts if v.won] == [v for v in want.verdicts if v.won]


def test_jasda_batch_with_a_score_that_is_not_a_number_clears_like_offer_by_offer() -> None:
    """A candidate whose odds of fitting are NaN (its score is NaN, which ranks only by where it
    stands among the bids): the batch gives each window the winner clearing it alone gives."""
    bids = [
        bid("j0", tenant="a", submitted_at=0.0, candidates=[cand(p_mem=math.nan)], capacity=2),
        bid("j1", tenant="a", submitted_at=5.0, candidates=[cand(dur=29.0)], capacity=2),
        bid("j2", tenant="b", submitted_at=3.0, candidates=[cand(dur=20.0)], capacity=2),
    ]
    offers = like_offers(4)
    batch = clear_batch("jasda", offers, lambda o: bids, Ledger())
    want = clear_one_by_one("jasda", offers, bids, Ledger())
    assert [d.winner.proposal.job_id if d.winner else None for _o, d in batch] == [
        w.winner.proposal.job_id if w.winner else None for w in want
    ]


# --- capacity: no job holds more unstarted grants than it can run ----------------------------------


def test_split_by_capacity_excludes_a_job_holding_unseen_grants() -> None:
    ledger = Ledger()
    ledger.record_grant("busy", lease_until=NOW + 10.0)
    bids = [bid("busy", capacity=1, grants_seen=0), bid("idle", capacity=1)]
    eligible, excluded = split_by_capacity(bids, ledger, NOW)
    assert [b.proposal.job_id for b in eligible] == ["idle"]
    assert [v.job_id for v in excluded] == ["busy"]
    assert not excluded[0].won
    assert "1 grant" in excluded[0].reason


def test_split_by_capacity_counts_only_grants_the_agent_has_not_seen() -> None:
    ledger = Ledger()
    ledger.record_grant("j", lease_until=NOW + 10.0)
    ledger.record_grant("j", lease_until=NOW + 10.0)
    cases = [
        (dict(capacity=1, grants_seen=2), True),
        (dict(capacity=1, grants_seen=1), False),
        (dict(capacity=2, grants_seen=1), True),
        (dict(capacity=2, grants_seen=0), False),
        (dict(capacity=3, grants_seen=0), True),
    ]
    for kwargs, eligible_expected in cases:
        eligible, excluded = split_by_capacity([bid("j", **kwargs)], ledger, NOW)  # type: ignore[arg-type]
        assert (len(eligible) == 1) is eligible_expected, kwargs
        assert len(excluded) == (0 if eligible_expected else 1)


def test_exclusion_lapses_with_the_lease() -> None:
    ledger = Ledger()
    ledger.record_grant("j", lease_until=NOW + 10.0)
    b = [bid("j")]
    assert split_by_capacity(b, ledger, NOW + 9.9)[0] == []
    assert split_by_capacity(b, ledger, NOW + 10.0)[0] == b
    assert split_by_capacity(b, ledger, NOW + 60.0)[0] == b


def test_clear_excludes_at_capacity_and_grants_to_the_next() -> None:
    ledger = Ledger()
    offer = make_offer()
    ledger.record_grant("a", lease_until=offer.reply_by + 5.0)
    bids = [bid("a", submitted_at=0.0), bid("b", submitted_at=1.0)]
    for name in POLICIES:
        d = clear(name, offer, bids, ledger)
        assert d.winner is not None and d.winner.proposal.job_id == "b", name
        check_well_formed(d, bids)
        assert verdict_kind(next(v for v in d.verdicts if v.job_id == "a")) is VerdictKind.EXCLUDED
    # once the lease lapses (before the round closes) the job competes again
    expired = Ledger(job_grants={"a": [offer.reply_by - 0.1]})
    d = clear("sla", offer, bids, expired)
    assert d.winner is not None and d.winner.proposal.job_id == "a"


def test_clear_with_everyone_excluded_has_no_winner() -> None:
    ledger = Ledger(job_grants={"a": [NOW + 100.0], "b": [NOW + 100.0]})
    bids = [bid("a"), bid("b")]
    d = clear("fair", make_offer(), bids, ledger)
    assert d.winner is None and d.candidate is None
    check_well_formed(d, bids)


# --- duplicates and determinism ------------------------------------------------------------------


def test_duplicate_bids_for_one_job_give_one_voice() -> None:
    bids = [
        bid("a", agent="agent-2", submitted_at=0.0),
        bid("a", agent="agent-1", submitted_at=0.0),
        bid("b", submitted_at=1.0),
    ]
    d = clear("sla", make_offer(), bids, Ledger())
    check_well_formed(d, bids)
    assert d.winner is not None and d.winner.agent_id == "agent-1"
    second = next(v for v in d.verdicts if v.agent_id == "agent-2")
    assert second.job_id == "a" and not second.won
    assert second.reason == "invalid: a second bid for job a (the bid from agent-1 stands)"
    assert verdict_kind(second) is VerdictKind.INVALID


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_an_agent_that_replied_without_a_bid_gets_a_verdict(name: str) -> None:
    bids = [bid("a", agent="agent-1"), bid("b", agent="agent-2", submitted_at=1.0)]
    d = clear(name, make_offer(), bids, Ledger(), replied=["agent-3", "agent-1", "agent-2"])
    no_bid = [v for v in d.verdicts if not v.job_id]
    assert [(v.agent_id, v.won, v.reason) for v in no_bid] == [("agent-3", False, NO_BID)]
    check_well_formed(
        Decision(d.policy, d.winner, d.candidate, tuple(v for v in d.verdicts if v.job_id)), bids
    )


@pytest.mark.parametrize("capacities", [(1, 1), (1, 2)])
def test_duplicate_bids_of_a_job_at_capacity_get_one_verdict(capacities: tuple[int, int]) -> None:
    ledger = Ledger(job_grants={"a": [NOW + 100.0]})
    bids = [
        bid("a", agent="agent-1", capacity=capacities[0]),
        bid("a", agent="agent-2", capacity=capacities[1]),
        bid("b", agent="agent-1", submitted_at=1.0),
    ]
    d = clear("fair", make_offer(), bids, ledger)
    check_well_formed(d, bids)


def test_duplicate_proposals_from_one_agent_are_resolved_independently_of_order() -> None:
    x = bid("a", agent="agent-1", candidates=[cand(10, mem=2000.0, dur=5.0)])
    y = bid("a", agent="agent-1", candidates=[cand(25, mem=9000.0, dur=20.0)])
    d1 = clear("efficiency", make_offer(), [x, y], Ledger())
    d2 = clear("efficiency", make_offer(), [y, x], Ledger())
    assert d1.candidate == d2.candidate


candidates_st = st.lists(
    st.builds(
        cand,
        size=st.integers(1, 64),
        mem=st.floats(0.0, 30_000.0),
        dur=st.floats(0.0, 60.0),
        p_mem=st.sampled_from([0.5, 0.9, 1.0]),
        p_time=st.sampled_from([0.5, 0.9, 1.0]),
    ),
    min_size=1,
    max_size=4,
)


@st.composite
def bid_sets(draw: st.DrawFn) -> list[Bid]:
    n = draw(st.integers(1, 6))
    out = []
    for i in range(n):
        out.append(
            bid(
                f"job-{i}",
                tenant=draw(st.sampled_from(["alice", "bob", "carol"])),
                agent=draw(st.sampled_from(["agent-1", "agent-2"])),
                submitted_at=float(draw(st.integers(0, 3))),  # ties are likely
                candidates=draw(candidates_st),
                deadline_at=draw(st.none() | st.floats(NOW, NOW + 300.0)),
                expected_remaining_s=draw(st.floats(0.0, 200.0)),
                capacity=draw(st.integers(1, 2)),
                grants_seen=draw(st.integers(0, 2)),
            )
        )
    return out


ledgers = st.builds(
    Ledger,
    tenant_shares=st.dictionaries(st.sampled_from(["alice", "bob"]), st.floats(0.5, 4.0)),
    tenant_attained=st.dictionaries(
        st.sampled_from(["alice", "bob", "carol"]), st.sampled_from([0.0, 10.0, 20.0, 40.0])
    ),
    job_attained=st.dictionaries(st.sampled_from([f"job-{i}" for i in range(6)]), st.floats(0, 50)),
    job_grants=st.dictionaries(
        st.sampled_from([f"job-{i}" for i in range(6)]),
        st.lists(st.floats(NOW - 10.0, NOW + 10.0), max_size=3),
    ),
)


@settings(max_examples=150, deadline=None)
@given(
    bids=bid_sets(),
    ledger=ledgers,
    name=st.sampled_from(sorted(POLICIES)),
    data=st.data(),
    open_ended=st.booleans(),
)
def test_decision_is_well_formed_and_independent_of_bid_order(
    bids: list[Bid], ledger: Ledger, name: str, data: st.DataObject, open_ended: bool
) -> None:
    offer = make_offer(length_s=None if open_ended else 30.0)
    d = clear(name, offer, bids, ledger)
    check_well_formed(d, bids)
    shuffled = data.draw(st.permutations(bids))
    again = clear(name, offer, shuffled, ledger)
    assert again == d
    # the winner, if any, is a job that was not at capacity
    if d.winner is not None:
        p = d.winner.proposal
        assert ledger.unseen_grants(p.job_id, p.grants_seen, offer.reply_by) < p.capacity
    else:
        eligible, _ = split_by_capacity(bids, ledger, offer.reply_by)
        assert eligible == []


# --- rebuilding the ledger -------------------------------------------------------------------------


def won_record(job_id: str, tenant: str, price: float, charged: float, cleared_at: float) -> RoundRecord:
    offer = make_offer()
    won = Verdict(job_id=job_id, tenant=tenant, agent_id="agent-1", won=True, reason="won: highest bid")
    return RoundRecord(
        offer_id=f"o-{job_id}", round=1, window=offer.window, policy="auction", replies_from=["agent-1"],
        verdicts=[won], winner_job=job_id, charged_gpu_s=charged, price=price, cleared_at=cleared_at,
    )  # fmt: skip


def test_replaying_rounds_rebuilds_service_grants_and_budgets_clamped_at_zero() -> None:
    ledger = Ledger(tenant_budgets={"a": 5.0})
    ledger.replay_round(won_record("a-1", "a", price=3.0, charged=10.0, cleared_at=NOW), lease_s=5.0)
    assert ledger.tenant_budgets["a"] == pytest.approx(2.0)
    # Budgets configured lower since the payment was made: the rebuilt budget stops at zero.
    ledger.replay_round(won_record("a-2", "a", price=4.0, charged=6.0, cleared_at=NOW + 1), lease_s=5.0)
    assert ledger.tenant_budgets["a"] == 0.0
    ledger.replay_round(won_record("b-1", "b", price=7.0, charged=2.0, cleared_at=NOW + 2), lease_s=5.0)
    assert "b" not in ledger.tenant_budgets, "an unlisted tenant's budget stays unlimited"
    assert ledger.tenant_attained == {"a": 16.0, "b": 2.0}
    assert ledger.job_grants == {"a-1": [NOW + 5.0], "a-2": [NOW + 6.0], "b-1": [NOW + 7.0]}
    # A round without a winner changes nothing.
    empty = msgspec.structs.replace(won_record("c-1", "c", 1.0, 1.0, NOW), winner_job="", verdicts=[])
    ledger.replay_round(empty, lease_s=5.0)
    assert ledger.tenant_attained == {"a": 16.0, "b": 2.0}


# --- wording: what `sja trace` and `sja explain` show -----------------------------------------------


def test_a_job_at_capacity_is_told_why_in_plain_words() -> None:
    ledger = Ledger()
    ledger.record_grant("busy", lease_until=NOW + 10.0)
    _, (v,) = split_by_capacity([bid("busy", capacity=1, grants_seen=0)], ledger, NOW)
    assert v.reason == (
        "excluded: it holds 1 grant not yet started and may start only 1 subjob more now "
        "(its max_parallel less the subjobs it runs)"
    )


def test_fair_never_compares_a_tenant_with_itself() -> None:
    """Two jobs of one tenant: one offer names the tie-break; in a batch, the loser is told that its
    own tenant's jobs won, not the tenant's attained service at two values."""
    ledger = Ledger()
    ledger.charge("t", "a", 3.0)
    bids = [bid("a"), bid("b", submitted_at=1.0)]
    d = clear("fair", make_offer(), bids, ledger)
    assert d.winner is not None and d.winner.proposal.job_id == "b"
    (lost,) = [v for v in d.verdicts if not v.won]
    assert lost.reason.startswith("lost to b: equal on tenant t attained 3.00 GPU-s"), lost.reason
    assert "then the job's own attained GPU-seconds" in lost.reason
    offers = [
        msgspec.structs.replace(make_offer(), offer_id=f"o{i}", window=msgspec.structs.replace(
            make_offer().window, slice_id=f"n-g0-3g.20gb-{i}"))
        for i in range(2)
    ]  # fmt: skip
    three = [bid("a"), bid("b", submitted_at=1.0), bid("c", submitted_at=2.0)]
    batch = clear_batch("fair", offers, lambda o: three, ledger)
    losers = {v.job_id: v.reason for _, d in batch for v in d.all_verdicts() if not v.won}
    assert losers["a"].startswith("lost to better-ranked bids: jobs of its own tenant t"), losers["a"]
    assert "this job: 3.00 GPU-s" in losers["a"]
