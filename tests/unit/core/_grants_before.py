"""What the clearer and the simulator each did with a winner before ``sja.core.grants`` (kept, frozen,
for ``test_grants``' equivalence tests; not imported by the code)."""

from __future__ import annotations

from typing import Any

import msgspec

from sja.core import leases
from sja.core.policies import Decision, Ledger, grant_cost
from sja.protocol.messages import Grant, Offer, SliceState, Verdict


def clearer_charge(ledger: Ledger, offer: Offer, d: Decision, lease_until: float, sign: float = 1.0) -> None:
    """``ClearerService._charge``."""
    assert d.winner is not None and d.candidate is not None
    p = d.winner.proposal
    ledger.charge(p.tenant, p.job_id, sign * grant_cost(offer, d.candidate))
    if sign > 0:
        ledger.record_grant(p.job_id, lease_until)
        ledger.spend(p.tenant, d.price)
    else:
        ledger.forget_grant(p.job_id, lease_until)
        ledger.refund(p.tenant, d.price)


def clearer_fast(offer: Offer) -> bool:
    """``ClearerService._grant``: whether the compare-and-set goes against the offered revision."""
    snap, w = offer.slice_state, offer.window
    return (
        snap is not None
        and offer.slice_revision > 0
        and snap.slice_id == offer.window.slice_id
        and snap.status == "free"
        and snap.fence == offer.slice_fence
        and (snap.node, snap.pool, snap.profile, snap.mem_mib, snap.compute_share)
        == (w.node, w.pool, w.profile, w.mem_mib, w.compute_share)
    )


def clearer_grant(
    current: SliceState,
    offer: Offer,
    decision: Decision,
    grant_id: str,
    lease_until: float,
    lease_s: float,
    new_rev: int,
) -> Grant:
    """``ClearerService._grant`` once its compare-and-set (``new_rev``) won."""
    assert decision.winner is not None and decision.candidate is not None
    win = decision.winner
    now = lease_until - lease_s
    leased = leases.grant(
        current,
        offered_fence=offer.slice_fence,
        job_id=win.proposal.job_id,
        grant_id=grant_id,
        now=now,
        lease_s=lease_s,
    )
    return Grant(
        grant_id=grant_id,
        offer_id=offer.offer_id,
        round=offer.round,
        job_id=win.proposal.job_id,
        tenant=win.proposal.tenant,
        agent_id=win.agent_id,
        window=offer.window,
        candidate=decision.candidate,
        fence=leased.fence,
        lease_until=leased.lease_until,
        policy=decision.policy,
        granted_at=now,
        slice_revision=new_rev,
        slice_state=leased,
    )


def clearer_verdicts(decision: Decision, granted: bool, note: str) -> list[Verdict]:
    """``ClearerService._record``'s verdicts."""
    verdicts = list(decision.verdicts)
    if not granted and decision.winner is not None:
        verdicts = [v if not v.won else msgspec.structs.replace(v, won=False, reason=note) for v in verdicts]
    return verdicts


def clearer_outcome(decision: Decision, granted: bool, bids: list[Any]) -> str:
    """``ClearerService._clear_one``'s outcome."""
    if granted:
        return "granted"
    if decision.winner is not None:
        return "lost_cas"
    return "no_winner" if bids else "no_bids"


def sim_grant(
    ledger: Ledger,
    state: SliceState,
    offer: Offer,
    decision: Decision,
    tenant: str,
    now: float,
    lease_s: float,
) -> tuple[Grant, SliceState]:
    """``SjaEngine._grant`` up to its subjob (``tenant``: the job's)."""
    assert decision.winner is not None and decision.candidate is not None
    job_id = decision.winner.proposal.job_id
    grant_id = f"g{offer.round}"
    leased = leases.grant(
        state, offered_fence=offer.slice_fence, job_id=job_id, grant_id=grant_id, now=now, lease_s=lease_s
    )
    grant = Grant(
        grant_id=grant_id,
        offer_id=offer.offer_id,
        round=offer.round,
        job_id=job_id,
        tenant=tenant,
        agent_id="sim",
        window=offer.window,
        candidate=decision.candidate,
        fence=leased.fence,
        lease_until=leased.lease_until,
        policy=decision.policy,
        granted_at=now,
    )
    ledger.charge(grant.tenant, grant.job_id, grant_cost(offer, decision.candidate))
    ledger.record_grant(grant.job_id, grant.lease_until)
    ledger.spend(grant.tenant, decision.price)
    return grant, leased
