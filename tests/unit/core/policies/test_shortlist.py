"""Agents send only the bids that can win: for every policy an agent can foresee, clearing a batch
with each agent's shortlist (``policies.shortlist``, each bid cut by ``bid_for``) gives the winners
and candidates that clearing with every bid gives; ``BidBook`` keeps the same shortlist between
batches; jobs likely to win sit out later batches; counted demand re-offers waiting windows."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from sja.core.bidbook import BidBook
from sja.core.policies import (
    BID_ORDERS,
    POLICIES,
    Bid,
    Ledger,
    PolicyConfig,
    bid_for,
    clear_batch,
    likely_winners,
    shortlist,
)
from sja.core.windows import OfferPacer
from sja.protocol.messages import Candidate, Offer, Proposal, Window

NOW = 5_000.0
CFG = PolicyConfig(horizon_s=8.0)


def offer(i: int, end: float | None = NOW + 8.0) -> Offer:
    w = Window(
        slice_id=f"s{i:03d}", node="n", pool="p", gpu_model="H100-80GB", profile="1g.10gb",
        mem_mib=10_000, compute_share=1 / 7, start_s=NOW, end_s=end,
    )  # fmt: skip
    return Offer(
        offer_id=f"o{i}", round=i, window=w, slice_fence=1, slice_revision=1,
        issued_at=NOW, reply_by=NOW + 0.05, reply_to="r",
    )  # fmt: skip


def proposal(
    job: int, tenant: str, cands: list[tuple[float, float, float]], capacity: int, attained: float
) -> Proposal:
    cs = [
        Candidate(
            size=1 + k,
            mem_q_mib=mem,
            p_fit_mem=0.99,
            duration_q_s=dur * 1.3,
            duration_mean_s=dur,
            p_fit_time=0.97,
            bid=bid,
        )
        for k, (dur, mem, bid) in enumerate(cands)
    ]
    return Proposal(
        job_id=f"j{job:03d}", tenant=tenant, mode="jasda", candidates=cs, submitted_at=NOW - 30 + job % 7,
        remaining_units=10, total_units=10, capacity=capacity, grants_seen=0, attained_gpu_s=attained,
        deadline_at=NOW + 50 + 7 * job if job % 3 else None, expected_remaining_s=float(job % 11),
    )  # fmt: skip


cand_st = st.tuples(st.floats(0.5, 10.0), st.floats(100.0, 9_000.0), st.floats(0.0, 5.0))
job_st = st.tuples(
    st.sampled_from(["a", "b", "c"]),
    st.lists(cand_st, min_size=1, max_size=4),
    st.integers(1, 3),  # capacity
    st.sampled_from([0.0, 0.5, 1.0, 2.5, 7.0]),  # attained GPU-seconds
)


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(POLICIES)),
    n_offers=st.integers(1, 10),
    jobs=st.lists(job_st, min_size=0, max_size=40),
    tenant_attained=st.dictionaries(st.sampled_from(["a", "b", "c"]), st.floats(0.0, 30.0)),
)
def test_clearing_the_shortlists_gives_what_clearing_every_bid_gives(
    name: str,
    n_offers: int,
    jobs: list[tuple[str, list[tuple[float, float, float]], int, float]],
    tenant_attained: dict[str, float],
) -> None:
    offers = [offer(i) for i in range(n_offers)]
    props = [proposal(i, t, c, cap, att) for i, (t, c, cap, att) in enumerate(jobs)]
    agent_of = {p.job_id: f"ag{i % 2}" for i, p in enumerate(props)}

    def ledger() -> Ledger:
        # The clearer's job attained service is what the agents counted.
        return Ledger(
            tenant_shares={"a": 2.0},
            tenant_attained=dict(tenant_attained),
            job_attained={p.job_id: p.attained_gpu_s for p in props},
        )

    every = [Bid(agent_id=agent_of[p.job_id], proposal=p) for p in props]
    sent: list[Bid] = []
    for agent in ("ag0", "ag1"):
        mine = [bid_for(name, offers[0], p, CFG) for p in props if agent_of[p.job_id] == agent]
        sent += [Bid(agent_id=agent, proposal=p) for p in shortlist(name, offers[0], mine, n_offers, CFG)]
    assert all(len(b.proposal.candidates) == 1 for b in sent)
    if name in BID_ORDERS:
        per = len({p.tenant for p in props}) if BID_ORDERS[name].per_tenant else 1
        assert len(sent) <= 2 * per * (n_offers + 2)

    def winners(bids: list[Bid]) -> list[tuple[str, str, int, float]]:
        out = []
        for o, d in clear_batch(name, offers, lambda _o: bids, ledger(), CFG):
            w = d.winner.proposal.job_id if d.winner else ""
            c = d.candidate
            out.append((o.offer_id, w, c.size if c else 0, round(d.price, 9)))
        return out

    assert winners(sent) == winners(every)


@settings(max_examples=100, deadline=None)
@given(
    name=st.sampled_from(sorted(n for n, o in BID_ORDERS.items() if o.static)),
    jobs=st.lists(job_st, min_size=0, max_size=30),
    changes=st.lists(st.tuples(st.integers(0, 29), st.sampled_from(["drop", "attain", "none"])), max_size=30),
    k=st.integers(1, 6),
)
def test_a_bid_book_keeps_the_shortlist_between_batches(
    name: str,
    jobs: list[tuple[str, list[tuple[float, float, float]], int, float]],
    changes: list[tuple[int, str]],
    k: int,
) -> None:
    o = offer(0, end=None)
    props = {f"j{i:03d}": proposal(i, t, c, cap, att) for i, (t, c, cap, att) in enumerate(jobs)}
    book = BidBook(BID_ORDERS[name], CFG)
    for job_id in props:
        book.mark(job_id)
    shape = ("1g.10gb", 10_000)

    def best() -> set[str]:
        return {p.job_id for p in book.best(shape, o, k, props.get)}

    def expected() -> set[str]:
        order = BID_ORDERS[name]
        parts: dict[str, list[tuple[tuple[object, ...], str]]] = {}
        for p in props.values():
            parts.setdefault(p.tenant if order.per_tenant else "", []).append(
                (order.key(o, p, CFG), p.job_id)
            )
        return {j for ranked in parts.values() for _k, j in sorted(ranked)[:k]}

    assert best() == expected()
    for i, what in changes:
        job_id = f"j{i:03d}"
        if job_id not in props:
            continue
        if what == "drop":
            del props[job_id]
            book.drop(job_id)
        elif what == "attain":
            p = props[job_id]
            props[job_id] = Proposal(
                **{**{f: getattr(p, f) for f in p.__struct_fields__}, "attained_gpu_s": 99.0}
            )
            book.mark(job_id)
        assert best() == expected()


def test_likely_winners_are_the_best_per_tenant() -> None:
    props = [proposal(i, "ab"[i % 2], [(2.0, 1000.0, 1.0)], 1, float(i)) for i in range(8)]
    got = likely_winners("fair", offer(0), props, 2, CFG)
    assert sorted(got) == ["j000", "j001", "j002", "j003"]
    assert likely_winners("auction", offer(0), props, 2, CFG) == []


def test_counted_demand_reoffers_that_many_waiting_windows_besides_new_ones() -> None:
    pacer = OfferPacer(min_s=0.5, max_s=2.0, floor_s=0.05)
    ws = [offer(i).window for i in range(4)]
    fences = {w.slice_id: 1 for w in ws}
    assert len(pacer.due(ws, fences, 0.0)) == 4
    assert pacer.due(ws, fences, 0.1) == []  # backing off
    pacer.demand_changed(2)
    again = pacer.due(ws, fences, 0.1)
    assert [w.slice_id for w in again] == ["s000", "s001"]
    pacer.demand_changed(5)
    assert [w.slice_id for w in pacer.due(ws, fences, 0.12)] == ["s002", "s003"], "not sooner than floor_s"
    # A newly freed slice is offered at once, and counted demand still goes to the waiting ones.
    fences["s000"] = 2
    pacer.demand_changed(1)
    got = [w.slice_id for w in pacer.due(ws, fences, 0.2)]
    assert got == ["s000", "s001"]


def test_a_held_new_window_meets_the_demand_that_follows_it_in_one_offer() -> None:
    pacer = OfferPacer(min_s=0.5, max_s=2.0, floor_s=0.05, hold_s=0.1)
    ws = [offer(i).window for i in range(3)]
    fences = {w.slice_id: 1 for w in ws}
    pacer.demand_changed(2)  # two jobs ready
    assert [w.slice_id for w in pacer.due(ws, fences, 0.0)] == ["s000", "s001"]
    assert pacer.due(ws, fences, 0.05) == []  # s002: no job for it yet, held
    pacer.demand_changed(1)
    assert [w.slice_id for w in pacer.due(ws, fences, 0.06)] == ["s002"]
    # A slice frees (its subjob ended): held until its job is ready again, then one offer.
    fences["s000"] = 2
    assert pacer.due(ws, fences, 0.2) == []
    pacer.demand_changed(1)
    assert [w.slice_id for w in pacer.due(ws, fences, 0.21)] == ["s000"]
    # No demand comes: offered anyway once the hold is over.
    fences["s001"] = 2
    assert pacer.due(ws, fences, 0.3) == []
    assert pacer.due(ws, fences, 0.35) == []
    assert [w.slice_id for w in pacer.due(ws, fences, 0.41)] == ["s001"]


def test_demand_beyond_the_free_windows_is_kept_for_windows_freed_later_until_it_is_stale() -> None:
    pacer = OfferPacer(min_s=0.5, max_s=2.0, floor_s=0.05, hold_s=0.1)
    w0, w1, w2 = (offer(i).window for i in range(3))
    fences = {w.slice_id: 1 for w in (w0, w1, w2)}
    pacer.demand_changed(5)
    assert len(pacer.due([w0, w1, w2], fences, 0.0)) == 3  # three of five jobs get one; all taken
    fences["s000"] = 2  # freed: the fourth job's, at once
    assert [w.slice_id for w in pacer.due([w0], fences, 0.2)] == ["s000"]
    fences["s001"] = 2  # the fifth's (s000 taken meanwhile)
    assert [w.slice_id for w in pacer.due([w1], fences, 0.3)] == ["s001"]
    fences["s002"] = 2  # demand used up: held
    assert pacer.due([w2], fences, 0.35) == []
    assert [w.slice_id for w in pacer.due([w2], fences, 0.46)] == ["s002"]  # hold over: offered anyway
    pacer.demand_changed(1)
    assert pacer.due([], fences, 0.5) == []  # a job ready, no free window
    fences["s000"] = 3
    assert pacer.due([w0], fences, 3.0) == []  # that demand is stale after max_s: s000 is held
    pacer.demand_changed(1)
    assert [w.slice_id for w in pacer.due([w0], fences, 3.01)] == ["s000"]


def test_uncounted_demand_offers_held_windows_at_once() -> None:
    pacer = OfferPacer(min_s=0.5, max_s=2.0, floor_s=0.05, hold_s=0.1)
    ws = [offer(i).window for i in range(2)]
    fences = {w.slice_id: 1 for w in ws}
    assert pacer.due(ws, fences, 0.0) == []
    pacer.demand_changed()
    assert len(pacer.due(ws, fences, 0.01)) == 2


def test_likely_winners_of_a_shared_batch_are_an_even_split_and_one_more_per_tenant() -> None:
    """Ten windows among four tenants: at most ten jobs can win, so an agent holds back four of
    each tenant (ten split evenly, rounded up, and one more), not ten of each."""
    props = [proposal(i, "abcd"[i % 4], [(2.0, 1000.0, 1.0)], 1, float(i)) for i in range(60)]
    got = likely_winners("fair", offer(0), props, 10, CFG)
    per_tenant = {t: sum(1 for j in got if props[int(j[1:])].tenant == t) for t in "abcd"}
    assert per_tenant == {"a": 4, "b": 4, "c": 4, "d": 4}
    # The best of each tenant: the clearer's order within a tenant is the policy's own.
    order = BID_ORDERS["fair"]
    for t in "abcd":
        mine = [p for p in props if p.tenant == t]
        best = sorted(mine, key=lambda p: order.key(offer(0), p, CFG))[:4]
        assert {p.job_id for p in best} == {j for j in got if props[int(j[1:])].tenant == t}
    # One window: the one best of each tenant, as before; an overall order: ten in all.
    assert len(likely_winners("fair", offer(0), props, 1, CFG)) == 4
    assert len(likely_winners("efficiency", offer(0), props, 10, CFG)) == 10
