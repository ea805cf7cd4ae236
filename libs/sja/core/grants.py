"""Grants: what becomes of a cleared decision's winner, for the clearer and the simulator alike.

A winner is charged to the fairness ledger as soon as its batch is cleared (``award``), before its
slice is taken, so a batch cleared meanwhile sees it (a job never wins more windows than it can
use). The caller then writes the slice's lease (``lease``, the slice's state as leased to the
winner) with a compare-and-set; only once that write won is the ``Grant`` made (``grant``). A write
that did not win (``NotGranted``: the slice is gone, no longer free, or changed before the
compare-and-set) is refunded (``refund``), and the winner's verdict says why it holds no grant
(``unwon``). ``round_end`` names how a round ended, as the clearer counts it.

Pure: no I/O; the compare-and-set itself is the caller's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import msgspec

from sja.core import leases
from sja.core.policies.base import Bid, Decision
from sja.core.policies.ledger import Ledger, grant_cost
from sja.protocol.messages import Candidate, Grant, Offer, SliceState, Verdict


class RoundEnd(enum.Enum):
    """How a round ended (the clearer's ``sja_rounds`` outcome label is the value)."""

    GRANTED = "granted"
    """Its winner holds the slice: the grant was made."""
    LOST_CAS = "lost_cas"
    """A winner, but its slice could not be leased to it (``NotGranted``)."""
    NO_WINNER = "no_winner"
    """Bids, none of them eligible."""
    NO_BIDS = "no_bids"
    """No bid at all."""


def round_end(decision: Decision, granted: bool, bids: int) -> RoundEnd:
    """How the round of ``decision`` ended, given whether its grant was made and how many bids it had."""
    if granted:
        return RoundEnd.GRANTED
    if decision.winner is not None:
        return RoundEnd.LOST_CAS
    return RoundEnd.NO_WINNER if bids else RoundEnd.NO_BIDS


class Refusal(enum.Enum):
    """Why a winner's slice could not be leased to it."""

    SLICE_GONE = "slice_gone"
    """The slice has no entry any more."""
    CONFLICT = "conflict"
    """The slice is no longer free, or its fence moved since the offer (``leases.LeaseConflict``)."""
    LOST_CAS = "lost_cas"
    """Another writer changed the slice between its read and the compare-and-set."""


@dataclass(frozen=True)
class NotGranted:
    """A winner whose grant was not made, and why."""

    refusal: Refusal
    detail: str = ""
    """``CONFLICT``: the conflict, in words."""

    @property
    def note(self) -> str:
        """What the round's record and the winner's verdict say."""
        if self.refusal is Refusal.SLICE_GONE:
            return "slice vanished"
        if self.refusal is Refusal.CONFLICT:
            return f"not granted: {self.detail}"
        return "not granted: slice changed while clearing"

    @property
    def trace_note(self) -> str:
        """What the ``sja.grant`` span notes ("" for nothing)."""
        if self.refusal is Refusal.CONFLICT:
            return self.detail
        if self.refusal is Refusal.LOST_CAS:
            return "lost the compare-and-set"
        return ""


@dataclass(frozen=True)
class Award:
    """A decision's winner, charged to the ledger, its slice not leased yet."""

    offer: Offer
    decision: Decision
    winner: Bid
    candidate: Candidate
    grant_id: str
    now: float
    """When it was awarded: the grant's ``granted_at`` and the start of its lease."""
    lease_s: float
    lease_until: float
    """``now + lease_s``: the lease's end, as the ledger recorded the grant."""

    @property
    def job_id(self) -> str:
        return self.winner.proposal.job_id

    @property
    def tenant(self) -> str:
        return self.winner.proposal.tenant

    @property
    def cost(self) -> float:
        """GPU-seconds charged for it (``grant_cost``)."""
        return grant_cost(self.offer, self.candidate)


def award(
    ledger: Ledger,
    offer: Offer,
    decision: Decision,
    grant_id: Callable[[Offer], str],
    now: float,
    lease_s: float,
) -> Award | None:
    """The decision's winner charged to ``ledger`` (its service, its grant until the lease ends, its
    payment), under a grant id from ``grant_id``; ``None`` when the decision has no winner (nothing
    charged)."""
    if decision.winner is None or decision.candidate is None:
        return None
    a = Award(
        offer=offer,
        decision=decision,
        winner=decision.winner,
        candidate=decision.candidate,
        grant_id=grant_id(offer),
        now=now,
        lease_s=lease_s,
        lease_until=now + lease_s,
    )
    ledger.charge(a.tenant, a.job_id, a.cost)
    ledger.record_grant(a.job_id, a.lease_until)
    ledger.spend(a.tenant, a.decision.price)
    return a


def learn_service(ledger: Ledger, offers: Iterable[Offer], bids: Iterable[Bid]) -> float:
    """Charge ``ledger`` with the service its jobs had that no grant charged: the time open subjobs
    held their slices past their windows (``core.continuation``), as the jobs count it themselves
    (``Proposal.attained_gpu_s``, folded in from their completions) and as a held slice's window
    says of its holder now (``Window.held_attained_gpu_s``). A policy that orders by attained service
    then sees a tenant whose jobs hold slices past their windows as served. Called before clearing a
    batch; returns how much was charged."""
    more = 0.0
    for o in offers:
        w = o.window
        if w.held_by:
            more += ledger.learn(w.held_tenant, w.held_by, w.held_attained_gpu_s)
    for b in bids:
        p = b.proposal
        more += ledger.learn(p.tenant, p.job_id, p.attained_gpu_s)
    return more


def awards(
    ledger: Ledger,
    decisions: Iterable[tuple[Offer, Decision]],
    grant_id: Callable[[Offer], str],
    now: float,
    lease_s: float,
) -> list[Award | None]:
    """``award`` for every decision of a batch, in order."""
    return [award(ledger, o, d, grant_id, now, lease_s) for o, d in decisions]


def refund(ledger: Ledger, a: Award) -> None:
    """Undo ``award``'s charges: the grant was not made."""
    ledger.charge(a.tenant, a.job_id, -a.cost)
    ledger.forget_grant(a.job_id, a.lease_until)
    ledger.refund(a.tenant, a.decision.price)


def offered_slice(offer: Offer) -> SliceState | None:
    """The slice as the offer carries it (``slice_state`` at ``slice_revision``) when that can be
    leased without reading the slice first: it is the offered slice, free, at the offered fence, and
    its window's. ``None`` otherwise: the caller reads the slice."""
    snap, w = offer.slice_state, offer.window
    if (
        snap is not None
        and offer.slice_revision > 0
        and snap.slice_id == w.slice_id
        and snap.status == "free"
        and snap.fence == offer.slice_fence
        and (snap.node, snap.pool, snap.profile, snap.mem_mib, snap.compute_share)
        == (w.node, w.pool, w.profile, w.mem_mib, w.compute_share)
    ):
        return snap
    return None


def lease(current: SliceState, a: Award) -> SliceState:
    """The slice leased to the award's winner (fence bumped), to be written with a compare-and-set
    against ``current``'s revision. Raises ``leases.LeaseConflict`` when ``current`` is not free
    or its fence moved since the offer."""
    return leases.grant(
        current,
        offered_fence=a.offer.slice_fence,
        job_id=a.job_id,
        grant_id=a.grant_id,
        now=a.now,
        lease_s=a.lease_s,
    )


def grant(a: Award, leased: SliceState, revision: int | None = None) -> Grant:
    """The grant of an award whose lease (``leased``) was written. ``revision``: the slice's store
    revision holding that lease; the grant then carries the lease, so the executor starts the
    subjob with one compare-and-set against it. ``None``: there is no store (the simulator)."""
    return Grant(
        grant_id=a.grant_id,
        offer_id=a.offer.offer_id,
        round=a.offer.round,
        job_id=a.job_id,
        tenant=a.tenant,
        agent_id=a.winner.agent_id,
        window=a.offer.window,
        candidate=a.candidate,
        fence=leased.fence,
        lease_until=leased.lease_until,
        policy=a.decision.policy,
        granted_at=a.now,
        slice_revision=revision if revision is not None else 0,
        slice_state=leased if revision is not None else None,
    )


def unwon(verdicts: Iterable[Verdict], note: str) -> list[Verdict]:
    """The verdicts of a round whose winner holds no grant: its win becomes a loss, ``note`` its
    reason."""
    return [v if not v.won else msgspec.structs.replace(v, won=False, reason=note) for v in verdicts]
