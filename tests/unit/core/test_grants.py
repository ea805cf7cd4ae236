"""``sja.core.grants``: a winner charged when its batch is cleared, its slice's lease, its grant, a
refund when the lease is not written, and the verdicts and round outcome that say so. The clearer
and the simulator each did this themselves before (kept, frozen, as ``_grants_before``): on drawn
batches the module charges, refunds, grants and rewrites exactly as they did."""

from __future__ import annotations

import copy
import importlib.util
import sys
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sja.core import grants, leases
from sja.core.policies import POLICIES, Bid, Decision, Ledger, PolicyConfig, clear_batch, grant_cost
from sja.protocol.messages import Candidate, Offer, Proposal, SliceState, Verdict, Window


def _frozen(name: str) -> Any:
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


before = _frozen("_grants_before")

NOW = 1_790_000_000.0
TENANTS = ["a", "b", "c"]


def slice_state(n: int, fence: int = 2, status: str = "free") -> SliceState:
    return SliceState(
        slice_id=f"s{n:02d}", node="n0", pool="p", gpu_index=0, gpu_model="A100-80GB", profile="1g.10gb",
        mem_mib=10_000 * (1 + n % 2), compute_slots=1, compute_share=(1 + n % 2) / 7, fence=fence,
        status=status,  # type: ignore[arg-type]
    )  # fmt: skip


def offer_of(s: SliceState, n: int, carry: bool = True, revision: int = 7) -> Offer:
    w = Window(
        slice_id=s.slice_id, node=s.node, pool=s.pool, gpu_model=s.gpu_model, profile=s.profile,
        mem_mib=s.mem_mib, compute_share=s.compute_share, start_s=NOW + n % 3, end_s=NOW + 30.0,
    )  # fmt: skip
    return Offer(
        offer_id=f"o{n}", round=n + 1, window=w, slice_fence=s.fence, slice_revision=revision if carry else 0,
        slice_state=s if carry else None, issued_at=NOW, reply_by=NOW + 0.05, reply_to="r",
    )  # fmt: skip


def proposal(job: int, tenant: str, dur: float, bid: float, capacity: int = 3) -> Proposal:
    c = Candidate(
        size=1 + job % 3, mem_q_mib=2_000.0, p_fit_mem=0.99, duration_q_s=dur * 1.3, duration_mean_s=dur,
        p_fit_time=0.97, bid=bid,
    )  # fmt: skip
    return Proposal(
        job_id=f"j{job:02d}", tenant=tenant, mode="sja", candidates=[c], submitted_at=float(job % 5),
        remaining_units=10, total_units=10, capacity=capacity, grants_seen=0, expected_remaining_s=dur * 2,
    )  # fmt: skip


def won(job: str = "j01", tenant: str = "a", price: float = 0.0, dur: float = 10.0) -> tuple[Offer, Decision]:
    p = proposal(int(job[1:]), tenant, dur, 1.0)
    v = Verdict(job_id=job, tenant=tenant, agent_id="ag", won=True, reason="least attained", size=1)
    lost = Verdict(job_id="j99", tenant="b", agent_id="ag", won=False, reason="outranked", size=1)
    d = Decision("fair", Bid(agent_id="ag", proposal=p), p.candidates[0], (v, lost), price)
    return offer_of(slice_state(1), 1), d


def gid(o: Offer) -> str:
    return f"g{o.round}"


# --- unit behaviour -----------------------------------------------------------------------------------


def test_no_winner_no_award_and_nothing_charged() -> None:
    o, _ = won()
    lg = Ledger(tenant_budgets={"a": 3.0})
    assert grants.award(lg, o, Decision("fair", None, None, ()), gid, NOW, 5.0) is None
    assert lg == Ledger(tenant_budgets={"a": 3.0})


def test_an_award_charges_service_grant_and_payment_and_a_refund_undoes_exactly_that() -> None:
    o, d = won(price=1.5)
    lg = Ledger(tenant_budgets={"a": 4.0})
    lg.charge("a", "j01", 2.0)
    lg.record_grant("j01", NOW + 5.0)  # an earlier grant of the same job, same lease end
    a = grants.award(lg, o, d, gid, NOW, 5.0)
    assert a is not None
    cost = grant_cost(o, d.candidate)  # type: ignore[arg-type]
    assert (a.job_id, a.tenant, a.grant_id, a.lease_until, a.cost) == ("j01", "a", "g2", NOW + 5.0, cost)
    assert lg.job_attained == {"j01": 2.0 + cost} and lg.tenant_attained == {"a": 2.0 + cost}
    assert lg.job_grants == {"j01": [NOW + 5.0, NOW + 5.0]}
    assert lg.tenant_budgets == {"a": 2.5}
    grants.refund(lg, a)
    assert lg.job_attained == {"j01": pytest.approx(2.0)} and lg.tenant_attained == {"a": pytest.approx(2.0)}
    assert lg.job_grants == {"j01": [NOW + 5.0]}  # the earlier grant stays
    assert lg.tenant_budgets == {"a": 4.0}


def test_the_lease_and_the_grant() -> None:
    o, d = won()
    a = grants.award(Ledger(), o, d, gid, NOW, 5.0)
    assert a is not None
    leased = grants.lease(slice_state(1), a)
    assert (leased.status, leased.fence, leased.holder_job, leased.grant_id) == ("leased", 3, "j01", "g2")
    assert (leased.lease_until, leased.updated_at) == (NOW + 5.0, NOW)
    g = grants.grant(a, leased, 11)
    assert (g.grant_id, g.offer_id, g.round, g.job_id, g.tenant, g.agent_id) == (
        "g2",
        "o1",
        2,
        "j01",
        "a",
        "ag",
    )
    assert (g.fence, g.lease_until, g.granted_at, g.policy) == (3, NOW + 5.0, NOW, "fair")
    assert (g.window, g.candidate) == (o.window, d.candidate)
    assert (g.slice_revision, g.slice_state) == (11, leased)
    bare = grants.grant(a, leased)  # no store: the grant carries no lease
    assert (bare.slice_revision, bare.slice_state) == (0, None)


@pytest.mark.parametrize(
    ("current", "message"),
    [
        (slice_state(1, status="leased"), "slice s01 is leased"),
        (slice_state(1, status="offline"), "slice s01 is offline"),
        (slice_state(1, fence=4), "slice s01 fence moved 2 -> 4"),
    ],
)
def test_a_slice_no_longer_free_at_the_offered_fence_cannot_be_leased(
    current: SliceState, message: str
) -> None:
    o, d = won()
    a = grants.award(Ledger(), o, d, gid, NOW, 5.0)
    assert a is not None
    with pytest.raises(leases.LeaseConflict, match=message):
        grants.lease(current, a)


def test_the_offered_slice_is_used_only_when_it_is_the_offered_one_free_at_the_offered_fence() -> None:
    s = slice_state(1)
    assert grants.offered_slice(offer_of(s, 1)) == s
    assert grants.offered_slice(offer_of(s, 1, carry=False)) is None
    assert grants.offered_slice(offer_of(s, 1, revision=0)) is None
    assert grants.offered_slice(offer_of(slice_state(1, status="leased"), 1)) is None
    o = offer_of(s, 1)
    assert grants.offered_slice(msgspec.structs.replace(o, slice_fence=3)) is None
    assert grants.offered_slice(msgspec.structs.replace(o, slice_state=slice_state(3))) is None
    assert (
        grants.offered_slice(msgspec.structs.replace(o, slice_state=msgspec.structs.replace(s, pool="q")))
        is None
    )


def test_what_a_refusal_says() -> None:
    gone = grants.NotGranted(grants.Refusal.SLICE_GONE)
    conflict = grants.NotGranted(grants.Refusal.CONFLICT, "slice s01 is leased")
    lost = grants.NotGranted(grants.Refusal.LOST_CAS)
    assert [r.note for r in (gone, conflict, lost)] == [
        "slice vanished",
        "not granted: slice s01 is leased",
        "not granted: slice changed while clearing",
    ]
    assert [r.trace_note for r in (gone, conflict, lost)] == [
        "",
        "slice s01 is leased",
        "lost the compare-and-set",
    ]


def test_unwon_turns_the_win_into_a_loss_with_the_reason() -> None:
    _, d = won()
    out = grants.unwon(d.verdicts, "slice vanished")
    assert [(v.job_id, v.won, v.reason) for v in out] == [
        ("j01", False, "slice vanished"),
        ("j99", False, "outranked"),
    ]
    assert out[1] is d.verdicts[1]


def test_round_end() -> None:
    _, d = won()
    none = Decision("fair", None, None, ())
    assert grants.round_end(d, True, 2) is grants.RoundEnd.GRANTED
    assert grants.round_end(d, False, 2) is grants.RoundEnd.LOST_CAS
    assert grants.round_end(none, False, 2) is grants.RoundEnd.NO_WINNER
    assert grants.round_end(none, False, 0) is grants.RoundEnd.NO_BIDS
    assert [e.value for e in grants.RoundEnd] == ["granted", "lost_cas", "no_winner", "no_bids"]


# --- the same as before, on drawn batches ---------------------------------------------------------------

bid_st = st.tuples(
    st.integers(0, 12),  # job
    st.sampled_from(TENANTS),
    st.floats(0.5, 20.0),  # mean duration
    st.floats(0.0, 5.0),  # bid
    st.integers(0, 3),  # capacity
)


@settings(max_examples=150, deadline=None)
@given(
    name=st.sampled_from(sorted(POLICIES)),
    n_slices=st.integers(1, 8),
    carry=st.lists(st.booleans(), min_size=8, max_size=8),
    raw=st.lists(bid_st, max_size=12),
    attained=st.dictionaries(st.sampled_from(TENANTS), st.floats(0.0, 30.0)),
    budgets=st.dictionaries(st.sampled_from(TENANTS), st.floats(0.0, 8.0)),
    lost=st.lists(st.booleans(), min_size=8, max_size=8),
    now=st.floats(1.6e9, 2.0e9),
    lease_s=st.sampled_from([0.5, 2.0, 3.0, 5.0, 60.0]),
)
def test_grants_charge_refund_and_rewrite_as_the_clearer_and_simulator_did(
    name: str,
    n_slices: int,
    carry: list[bool],
    raw: list[tuple[int, str, float, float, int]],
    attained: dict[str, float],
    budgets: dict[str, float],
    lost: list[bool],
    now: float,
    lease_s: float,
) -> None:
    slices = [slice_state(i) for i in range(n_slices)]
    offers = [offer_of(s, i, carry=carry[i]) for i, s in enumerate(slices)]
    state_of = {o.offer_id: s for o, s in zip(offers, slices, strict=True)}
    # One agent, named as the simulator's bids are (its grants name that agent).
    bids = [Bid(agent_id="sim", proposal=proposal(j, t, dur, b, cap)) for j, t, dur, b, cap in raw]
    ledger = Ledger(tenant_attained=dict(attained), tenant_budgets=dict(budgets))
    decisions = clear_batch(name, offers, lambda o: bids, ledger, PolicyConfig(horizon_s=30.0), ["sim"])

    # The simulator: each winner leased, granted and charged in turn.
    old_lg, new_lg = copy.deepcopy(ledger), copy.deepcopy(ledger)
    for o, d in decisions:
        a = grants.award(new_lg, o, d, gid, now, lease_s)
        if d.winner is None or d.candidate is None:
            assert a is None
            continue
        assert a is not None
        old_grant, old_leased = before.sim_grant(
            old_lg, state_of[o.offer_id], o, d, d.winner.proposal.tenant, now, lease_s
        )
        leased = grants.lease(state_of[o.offer_id], a)
        assert (grants.grant(a, leased), leased) == (old_grant, old_leased)
    assert new_lg == old_lg

    # The clearer: every winner charged, then each lease written or lost (refunded, verdict rewritten).
    old_lg, new_lg = copy.deepcopy(ledger), copy.deepcopy(ledger)
    lease_until = now + lease_s
    for o, d in decisions:
        if d.winner is not None and d.candidate is not None:
            before.clearer_charge(old_lg, o, d, lease_until)
    awarded = grants.awards(new_lg, decisions, gid, now, lease_s)
    assert new_lg == old_lg
    for i, ((o, d), a) in enumerate(zip(decisions, awarded, strict=True)):
        assert (a is None) == (d.winner is None)
        assert grants.offered_slice(o) is (state_of[o.offer_id] if before.clearer_fast(o) else None)
        n_bids = len(bids)
        if a is None:
            assert grants.round_end(d, False, n_bids).value == before.clearer_outcome(d, False, bids)
            assert grants.unwon(d.verdicts, "x") == before.clearer_verdicts(d, True, "x")
            continue
        if lost[i % len(lost)]:
            note = grants.NotGranted(grants.Refusal.LOST_CAS).note
            before.clearer_charge(old_lg, o, d, lease_until, sign=-1.0)
            grants.refund(new_lg, a)
            assert grants.unwon(d.verdicts, note) == before.clearer_verdicts(d, False, note)
            assert grants.round_end(d, False, n_bids).value == before.clearer_outcome(d, False, bids)
        else:
            old_grant = before.clearer_grant(state_of[o.offer_id], o, d, a.grant_id, lease_until, lease_s, 9)
            assert grants.grant(a, grants.lease(state_of[o.offer_id], a), 9) == old_grant
            assert grants.round_end(d, True, n_bids).value == before.clearer_outcome(d, True, bids)
        assert new_lg == old_lg
