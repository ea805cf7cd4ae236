"""Batched clearing is clearing one offer at a time: ``clear_batch`` gives every offer of a batch
the winner, candidate and price that ``clear`` gives it when the offers are cleared in canonical
order and each winner is charged before the next; every bid gets a verdict on every offer it bid
on (from verdicts shared by like offers, not one object per offer and bid); a slice offered twice
in a batch never has two winners; and the round records carry it all."""

from __future__ import annotations

import itertools
import math
from collections import Counter

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sja.bus.codec import encode
from sja.bus.rounds import decode_rounds
from sja.core.policies import (
    NO_BID,
    POLICIES,
    Bid,
    Decision,
    Ledger,
    PolicyConfig,
    clear,
    clear_batch,
    grant_cost,
)
from sja.core.rounds import RECORD_ITEMS, fresh_offers, outcome_verdicts, pack_records, whole_record
from sja.protocol.messages import Candidate, Offer, Proposal, RoundRecord, Verdict, Window

NOW = 5_000.0
SHAPES = [(10_000, 1 / 7, 8.0), (20_000, 3 / 7, 8.0), (10_000, 1 / 7, 4.0)]


def offer(i: int, shape: int, slice_no: int | None = None) -> Offer:
    mem, share, length = SHAPES[shape]
    w = Window(
        slice_id=f"s{i if slice_no is None else slice_no:03d}",
        node="n", pool="p", gpu_model="H100-80GB", profile="1g.10gb",
        mem_mib=mem, compute_share=share, start_s=NOW, end_s=NOW + length,
    )  # fmt: skip
    return Offer(
        offer_id=f"o{i}", round=i, window=w, slice_fence=1, slice_revision=1,
        issued_at=NOW, reply_by=NOW + 0.05, reply_to="r",
    )  # fmt: skip


def proposal(job: int, tenant: str, dur: float, mem: float, bid: float, capacity: int, seen: int) -> Proposal:
    c = Candidate(
        size=1 + job % 5, mem_q_mib=mem, p_fit_mem=0.99, duration_q_s=dur * 1.3,
        duration_mean_s=dur, p_fit_time=0.97, bid=bid,
    )  # fmt: skip
    return Proposal(
        job_id=f"j{job:03d}", tenant=tenant, mode="sja", candidates=[c], submitted_at=float(job % 7),
        remaining_units=10, total_units=10, capacity=capacity, grants_seen=seen,
        deadline_at=NOW + 50 + 7 * job if job % 3 else None, expected_remaining_s=dur * 2,
    )  # fmt: skip


bid_st = st.tuples(
    st.integers(0, 30),  # job
    st.sampled_from(["a", "b", "c"]),
    st.floats(0.5, 10.0),  # duration
    st.floats(100.0, 9_000.0),  # memory
    st.floats(0.0, 5.0),  # bid
    st.integers(0, 3),  # capacity
    st.integers(0, 2),  # grants seen
)


@settings(max_examples=200, deadline=None)
@given(
    name=st.sampled_from(sorted(POLICIES)),
    shapes=st.lists(st.integers(0, len(SHAPES) - 1), min_size=1, max_size=12),
    groups=st.lists(st.lists(bid_st, max_size=12), min_size=1, max_size=3),
    attained=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.floats(0.0, 30.0)),
    budgets=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.floats(0.0, 8.0)),
    prior_grants=st.dictionaries(st.integers(0, 30), st.integers(0, 3)),
)
def test_a_batch_clears_like_its_offers_one_by_one(
    name: str,
    shapes: list[int],
    groups: list[list[tuple[int, str, float, float, float, int, int]]],
    attained: dict[str, float],
    budgets: dict[str, float],
    prior_grants: dict[int, int],
) -> None:
    offers = [offer(i, s) for i, s in enumerate(shapes)]
    bid_lists = [[Bid(agent_id=f"ag{j % 2}", proposal=proposal(*b)) for j, b in enumerate(g)] for g in groups]
    # Offers of one shape share one bid list (as an agent's reply groups them); shapes cycle lists.
    bids_of = {o.offer_id: bid_lists[shapes[i] % len(bid_lists)] for i, o in enumerate(offers)}

    def ledger() -> Ledger:
        lg = Ledger(tenant_shares={"a": 2.0}, tenant_attained=dict(attained), tenant_budgets=dict(budgets))
        for job, n in prior_grants.items():
            for k in range(n):  # some leases still running, some lapsed
                lg.record_grant(f"j{job:03d}", NOW + (10.0 if k % 2 else -10.0))
        return lg

    cfg = PolicyConfig(horizon_s=8.0)
    batch_ledger = ledger()
    before = (dict(batch_ledger.tenant_attained), {k: list(v) for k, v in batch_ledger.job_grants.items()})
    batch = clear_batch(name, offers, lambda o: bids_of[o.offer_id], batch_ledger, cfg, REPLIED)
    assert (batch_ledger.tenant_attained, batch_ledger.job_grants) == before, "the ledger is untouched"

    seq = ledger()
    order = sorted(offers, key=lambda o: (o.window.start_s, o.window.slice_id, o.offer_id))
    assert [o.offer_id for o, _ in batch] == [o.offer_id for o in order]
    for o, got in batch:
        want = clear(name, o, bids_of[o.offer_id], seq, config=cfg)
        assert (got.winner is None) == (want.winner is None), o.offer_id
        if want.winner is not None:
            assert got.winner is not None and got.candidate == want.candidate
            assert got.winner.proposal.job_id == want.winner.proposal.job_id
            assert got.price == pytest.approx(want.price)
            assert want.candidate is not None
            p = want.winner.proposal
            seq.charge(p.tenant, p.job_id, grant_cost(o, want.candidate))
            seq.record_grant(p.job_id, math.inf)
            seq.spend(p.tenant, want.price)
            winners = [v for v in got.verdicts if v.won]
            assert [v.job_id for v in winners] == [p.job_id]
            assert winners[0] == next(v for v in want.verdicts if v.won)

    # Every bid has exactly one verdict on every offer it bid on, and so has every agent that
    # replied without one; the verdicts of like offers are shared, not made per offer and bid.
    for o, d in batch:
        check_every_bid_has_a_verdict(o, d, bids_of[o.offer_id], REPLIED)
    assert len({id(d.shared) for _, d in batch}) <= len(shapes)
    distinct = {id(v) for _, d in batch for v in d.all_verdicts()}
    bound = sum(len(bl) + len(REPLIED) for bl in bid_lists) * len(SHAPES) + len(offers)
    assert len(distinct) <= bound


REPLIED = ("ag0", "ag1", "ag2")
"""Agents that replied; ``ag2`` never bids."""


def check_every_bid_has_a_verdict(o: Offer, d: Decision, bids: list[Bid], replied: tuple[str, ...]) -> None:
    verdicts = d.all_verdicts()
    bidders = {b.agent_id for b in bids}
    want = Counter((b.proposal.job_id, b.agent_id) for b in bids)
    want.update(("", a) for a in replied if a not in bidders)
    assert Counter((v.job_id, v.agent_id) for v in verdicts) == want, o.offer_id
    won = [v for v in verdicts if v.won]
    if d.winner is None:
        assert won == []
    else:
        assert [v.job_id for v in won] == [d.winner.proposal.job_id]
    standing = Counter(v.job_id for v in verdicts if v.job_id and not v.reason.startswith("invalid:"))
    assert set(standing.values()) <= {1}, standing
    for v in verdicts:
        assert v.reason.strip()
        if not v.won:
            assert v.reason.startswith(("lost", "no winner: ", "excluded: ", "invalid: ", "no bid: ")), (
                v.reason
            )
        if not v.job_id:
            assert v.reason == NO_BID


def test_a_large_fair_batch_spreads_over_jobs_and_tenants() -> None:
    offers = [offer(i, 0) for i in range(64)]
    bids = [
        Bid("ag", proposal(j, "abc"[j % 3], dur=1.0, mem=5000.0, bid=0.0, capacity=1, seen=0))
        for j in range(300)
    ]
    out = clear_batch("fair", offers, lambda o: bids, Ledger(), PolicyConfig(horizon_s=8.0))
    winners = [d.winner.proposal for _, d in out if d.winner is not None]
    assert len(winners) == 64 and len({p.job_id for p in winners}) == 64, "one window per job (capacity 1)"
    per_tenant = {t: sum(1 for p in winners if p.tenant == t) for t in "abc"}
    assert max(per_tenant.values()) - min(per_tenant.values()) <= 1, per_tenant
    verdicts = [v for _, d in out for v in d.all_verdicts()]
    assert len(verdicts) == 64 * 300 and sum(v.won for v in verdicts) == 64
    # 300 shared verdicts and one per winner: not one per offer and bid
    assert len({id(v) for v in verdicts}) == 300 + 64
    lost = {v.reason.split(":")[0] for v in verdicts if not v.won}
    assert lost == {"lost to better-ranked bids", "lost"}, lost
    for _, d in out:
        assert d.winner is not None
        took = next(v for v in d.shared if v.job_id == d.winner.proposal.job_id)
        assert (
            took.reason
            == f"lost: took {next(o.offer_id for o, e in out if e.winner == d.winner)} in this batch"
        )


slice_st = st.lists(st.tuples(st.integers(0, len(SHAPES) - 1), st.integers(0, 3)), min_size=1, max_size=10)


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(POLICIES)),
    offered=slice_st,
    groups=st.lists(st.lists(bid_st, max_size=10), min_size=1, max_size=2),
)
def test_a_slice_offered_twice_in_a_batch_has_one_winner_at_most(
    name: str,
    offered: list[tuple[int, int]],
    groups: list[list[tuple[int, str, float, float, float, int, int]]],
) -> None:
    offers = [offer(i, shape, slice_no) for i, (shape, slice_no) in enumerate(offered)]
    bid_lists = [[Bid(agent_id=f"ag{j % 2}", proposal=proposal(*b)) for j, b in enumerate(g)] for g in groups]
    bids_of = {o.offer_id: bid_lists[i % len(bid_lists)] for i, o in enumerate(offers)}
    cfg = PolicyConfig(horizon_s=8.0)
    batch = clear_batch(name, offers, lambda o: bids_of[o.offer_id], Ledger(), cfg, REPLIED)
    winners = Counter(o.window.slice_id for o, d in batch if d.winner is not None)
    assert all(n == 1 for n in winners.values()), winners
    # The first offer of each slice is cleared as if the others were not there...
    first = fresh_offers(sorted(offers, key=lambda o: (o.window.start_s, o.window.slice_id, o.offer_id)), ())
    alone = dict(clear_batch(name, first, lambda o: bids_of[o.offer_id], Ledger(), cfg, REPLIED))
    for o, d in batch:
        check_every_bid_has_a_verdict(o, d, bids_of[o.offer_id], REPLIED)
        if o in alone:
            assert d.all_verdicts() == alone[o].all_verdicts()
        else:
            # ...and the others are not cleared at all: every bid on them is invalid.
            assert d.winner is None
            assert all(v.reason.startswith("invalid: slice ") for v in d.all_verdicts() if v.job_id)


def test_fresh_offers_skip_slices_in_open_rounds_and_repeats() -> None:
    offers = [offer(0, 0, 1), offer(1, 0, 2), offer(2, 1, 1), offer(3, 0, 3)]
    assert [o.offer_id for o in fresh_offers(offers, {"s003": "batch-1"})] == ["o0", "o1"]
    assert [o.offer_id for o in fresh_offers(offers, {})] == ["o0", "o1", "o3"]
    assert fresh_offers(offers, {"s001", "s002", "s003"}) == []


def record_of(o: Offer, d: Decision) -> RoundRecord:
    return RoundRecord(
        offer_id=o.offer_id, round=o.round, window=o.window, policy=d.policy, replies_from=list(REPLIED),
        verdicts=list(d.verdicts), winner_job=d.winner.proposal.job_id if d.winner else "", batch_id="b",
    )  # fmt: skip


@settings(max_examples=60, deadline=None)
@given(
    name=st.sampled_from(["fair", "auction", "efficiency"]),
    shapes=st.lists(st.integers(0, len(SHAPES) - 1), min_size=1, max_size=9),
    groups=st.lists(st.lists(bid_st, max_size=8), min_size=1, max_size=2),
    max_items=st.integers(1, 40),
)
def test_round_records_read_back_with_every_verdict(
    name: str,
    shapes: list[int],
    groups: list[list[tuple[int, str, float, float, float, int, int]]],
    max_items: int,
) -> None:
    offers = [offer(i, s) for i, s in enumerate(shapes)]
    bid_lists = [[Bid(agent_id=f"ag{j % 2}", proposal=proposal(*b)) for j, b in enumerate(g)] for g in groups]
    bids_of = {o.offer_id: bid_lists[shapes[i] % len(bid_lists)] for i, o in enumerate(offers)}
    batch = clear_batch(
        name, offers, lambda o: bids_of[o.offer_id], Ledger(), PolicyConfig(horizon_s=8.0), REPLIED
    )
    records = [record_of(o, d) for o, d in batch]
    shared = [(d.shared, d.skip) for _, d in batch]
    packed = pack_records("b", records, shared, max_items)
    assert [first for first, _ in packed] == [
        0,
        *itertools.accumulate(len(b.records) for _, b in packed[:-1]),
    ]
    for _, b in packed:  # within the budget, unless one record alone exceeds it
        weight = RECORD_ITEMS * len(b.records) + sum(map(len, b.shared))
        assert weight <= max_items or len(b.records) == 1
    messages = [encode(b) for _, b in packed]
    read = [rec for m in messages for rec in decode_rounds(m)]
    assert [r.offer_id for r in read] == [o.offer_id for o, _ in batch]
    for rec, (_o, d) in zip(read, batch, strict=True):
        assert rec.verdicts == list(d.all_verdicts())
        assert rec.shared == -1
    # Written: each message carries a group's shared verdicts once, not once per record.
    for m in messages:
        raw = msgspec.msgpack.decode(m)
        assert len(raw["shared"]) <= len({id(d.shared) for _, d in batch if d.shared})
    # A reader that wants only the winners reads the records as written.
    own = [rec for m in messages for rec in decode_rounds(m, whole=False)]
    assert [r.verdicts for r in own] == [list(d.verdicts) for _, d in batch]
    # A lone offer's record is written whole.
    d = batch[0][1]
    assert whole_record(records[0], shared[0]).verdicts == list(d.all_verdicts())
    # Outcomes: each agent hears of each of its wins, once per group of each other verdict of its
    # bids (the offers a winner took are told by its wins), and of replying without a bid.
    sent = outcome_verdicts([r.verdicts for r in records], shared)
    for agent in REPLIED:
        mine = Counter((v.job_id, v.reason) for v in sent.get(agent, []))
        wins = Counter((v.job_id, v.reason) for _, d in batch for v in d.verdicts if v.agent_id == agent)
        rest = Counter(
            (v.job_id, v.reason)
            for shared_verdicts in {id(d.shared): d.shared for _, d in batch}.values()
            for v in shared_verdicts
            if v.agent_id == agent and not v.reason.startswith("lost: took ")
        )
        assert mine == wins + rest, agent


def test_a_verdict_list_is_shared_by_like_offers_but_each_has_its_own_winner() -> None:
    offers = [offer(i, 0) for i in range(3)]
    bids = [Bid("ag0", proposal(j, "a", dur=2.0, mem=1000.0, bid=0.0, capacity=1, seen=0)) for j in range(5)]
    out = clear_batch("fair", offers, lambda o: bids, Ledger(), PolicyConfig(horizon_s=8.0), ["ag0", "ag9"])
    assert len({id(d.shared) for _, d in out}) == 1
    for _o, d in out:
        assert d.winner is not None
        vs: tuple[Verdict, ...] = d.all_verdicts()
        assert [v.job_id for v in vs if v.won] == [d.winner.proposal.job_id]
        assert len(vs) == 5 + 1, "five bids and the agent that sent none"
        others = {v.job_id: v.reason for v in vs if not v.won and v.job_id}
        took = {j for j, r in others.items() if r.startswith("lost: took ")}
        assert len(took) == 2, "the other two winners took another window"
