"""Batched clearing is clearing one offer at a time: ``clear_batch`` gives every offer of a batch
the winner, candidate and price that ``clear`` gives it when the offers are cleared in canonical
order and each winner is charged before the next; and every bid still gets a verdict."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sja.core.policies import POLICIES, Bid, Ledger, PolicyConfig, clear, clear_batch, grant_cost
from sja.protocol.messages import Candidate, Offer, Proposal, Window

NOW = 5_000.0
SHAPES = [(10_000, 1 / 7, 8.0), (20_000, 3 / 7, 8.0), (10_000, 1 / 7, 4.0)]


def offer(i: int, shape: int) -> Offer:
    mem, share, length = SHAPES[shape]
    w = Window(
        slice_id=f"s{i:03d}", node="n", pool="p", gpu_model="H100-80GB", profile="1g.10gb",
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
    batch = clear_batch(name, offers, lambda o: bids_of[o.offer_id], batch_ledger, cfg)
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

    # Every bid has a verdict: on each offer it won, else once in its group's last offer.
    last_of_list: dict[int, Offer] = {}
    for o, _ in batch:
        last_of_list[id(bids_of[o.offer_id])] = o
    for blist in bid_lists:
        if id(blist) not in last_of_list:
            continue
        offers_of = {o.offer_id for o, _ in batch if bids_of[o.offer_id] is blist}
        jobs = {b.proposal.job_id for b in blist}
        seen: dict[str, int] = {}
        for o, d in batch:
            if o.offer_id in offers_of:
                for v in d.verdicts:
                    assert v.job_id in jobs
                    seen[v.job_id] = seen.get(v.job_id, 0) + 1
        assert set(seen) == jobs


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
    verdicts = [v for _, d in out for v in d.verdicts]
    assert len(verdicts) == 300 and sum(v.won for v in verdicts) == 64
    assert all(v.reason.startswith("lost to better-ranked bids") for v in verdicts if not v.won)
