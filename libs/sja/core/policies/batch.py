"""The batch engine: what ``clearing.clear_batch`` keeps for a group of like offers while it clears
them in turn (``Group``), the exact lazy minimum of a ``MonotonePolicy`` over per-tenant heaps
(``lazy_best``, ``settle``), the offer-by-offer clearing of any other policy (``clear_full``), and
the verdicts a group's offers share.

Pure and deterministic: a batch gives every offer exactly what ``clear`` gives it against the
batch's ledger so far.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sja.core.policies.base import Bid, ClearingPolicy, Decision, PolicyConfig, VerdictKind, losing_verdict
from sja.core.policies.ledger import Ledger
from sja.core.policies.rules import excluded_verdict, no_bid_verdicts
from sja.protocol.messages import Candidate, Offer, Verdict

if TYPE_CHECKING:
    from sja.core.policies.defaults import MonotonePolicy


PolicyState = object
"""What a policy keeps for a group of like offers while a batch is cleared (``Group.state``). A
name of the module's own: the compiled dataclass looks its fields' types up among the module's."""


@dataclass
class Group:
    """The bids of a group of like offers while a batch is cleared."""

    bids: list[Bid]
    """The group's bids in canonical order, one per job."""
    offer: Offer
    """The group's first offer (every offer of a group ranks the bids alike)."""
    every: Sequence[Bid] = ()
    """Every bid as received (duplicates included)."""
    invalid: list[Verdict] = field(default_factory=list)
    """Verdicts of the bids ``canonical`` left out."""
    duplicate_of: str = ""
    """The offer this group's offers repeat the slice of (they are not cleared); empty: none."""
    now: float = 0.0
    """The reply deadline of the group's latest offer."""
    heaps: dict[str, list[tuple[tuple[float, ...], int, Candidate]]] | None = None
    """``MonotonePolicy``: per partition, a heap of (bid part of the key, index, candidate)."""
    won: dict[str, list[str]] = field(default_factory=dict)
    """Job -> the offers of the group it won."""
    lost_reason: dict[int, str] = field(default_factory=dict)
    """Bid index -> the policy's reason at its last ranking (policies cleared offer by offer)."""
    excluded: dict[int, int] = field(default_factory=dict)
    """Bid index -> unstarted grants, for bids left out for capacity."""
    last_win_why: str = ""
    last_win_tenant: str = ""
    repush: int | None = None
    """A winner's index: back in the heap with its new key before the next offer (it may win again
    while it has capacity)."""
    state: PolicyState = None
    """What else a policy keeps for the group while the batch is cleared (``jasda``: its heaps)."""
    shared: tuple[Verdict, ...] = ()
    entry_of: dict[str, int] = field(default_factory=dict)
    """Job -> the index of its verdict in ``shared`` (jobs that won an offer of the group)."""

    def shared_verdicts(
        self, pol: ClearingPolicy, scratch: Ledger, cfg: PolicyConfig, agents: Sequence[str]
    ) -> tuple[Verdict, ...]:
        """The verdicts every offer of the group shares: each bid's reason for the batch (a job that
        won some of them: the offers it took), then the invalid bids, then the agents without a bid."""
        no_bid = no_bid_verdicts(agents, self.every)
        if self.duplicate_of:
            reason = (
                f"{VerdictKind.INVALID}: slice {self.offer.window.slice_id} is offered twice in this batch"
                f" (cleared on {self.duplicate_of})"
            )
            return (*[losing_verdict(b, reason) for b in self.every], *no_bid)
        out: list[Verdict] = []
        whys: dict[str, str] = {}
        for i, b in enumerate(self.bids):
            p = b.proposal
            took = self.won.get(p.job_id)
            if took is not None:
                self.entry_of[p.job_id] = len(out)
                out.append(losing_verdict(b, f"lost: took {', '.join(took)} in this batch"))
                continue
            pending = self.excluded.get(i, scratch.unseen_grants(p.job_id, p.grants_seen, self.now))
            if pending >= p.capacity:
                out.append(excluded_verdict(b, pending))
                continue
            if i in self.lost_reason:
                reason = self.lost_reason[i]
            else:
                # A policy that explains a bid by its tenant alone: one explanation per tenant.
                memo_key = p.tenant if pol.explains_by_tenant else None
                why = whys.get(memo_key) if memo_key is not None else None
                if why is None:
                    keyed = pol.explain(self.offer, scratch, cfg)
                    why = keyed(b)[2] if keyed is not None else "not ranked"
                    if memo_key is not None:
                        whys[memo_key] = why
                reason = pol.lost_in_batch(b, why, self, scratch) if self.won else f"no winner: {why}"
            out.append(losing_verdict(b, reason))
        return (*out, *self.invalid, *no_bid)


def lazy_best(
    pol: MonotonePolicy, offer: Offer, g: Group, scratch: Ledger, cfg: PolicyConfig, now: float
) -> tuple[list[tuple[tuple[float, ...], int, Candidate]], int, Candidate, list[str]] | None:
    """The smallest key among the eligible bids, taken out of its heap: per tenant (``by_tenant``;
    one partition otherwise) a heap of the bids' own key parts, the minimum over the tenants' heads.
    Keys can only grow during a batch, so a head is re-checked and pushed down when its key grew;
    a winner goes back into its heap with its new key before the next offer. Returns the winner's
    heap, index and candidate and the tenants its partition was weighed among; None: no bid can win."""
    if g.heaps is None:
        g.heaps = {}
        for i, b in enumerate(g.bids):
            k, cand = pol.rank(offer, b, scratch, cfg)
            g.heaps.setdefault(b.proposal.tenant if pol.by_tenant else "", []).append((k, i, cand))
        for h in g.heaps.values():
            heapq.heapify(h)
    if g.repush is not None:
        b = g.bids[g.repush]
        k, cand = pol.rank(offer, b, scratch, cfg)
        heapq.heappush(g.heaps[b.proposal.tenant if pol.by_tenant else ""], (k, g.repush, cand))
        g.repush = None
    live: list[str] = []
    for part, h in g.heaps.items():
        settle(pol, offer, g, h, scratch, cfg, now)
        if h:
            live.append(part)
    tenants = pol.tenants(scratch, live)
    best: tuple[tuple[float, ...], tuple[float, ...], int] | None = None
    best_part = ""
    for part in live:
        h = g.heaps[part]
        cand_key = (pol.partition_key(part, scratch, cfg, tenants), h[0][0], h[0][1])
        if best is None or cand_key < best:
            best, best_part = cand_key, part
    if best is None:
        return None
    heap = g.heaps[best_part]
    _k, i, cand = heapq.heappop(heap)
    g.repush = i
    return heap, i, cand, tenants


def settle(
    pol: MonotonePolicy,
    offer: Offer,
    g: Group,
    h: list[tuple[tuple[float, ...], int, Candidate]],
    scratch: Ledger,
    cfg: PolicyConfig,
    now: float,
) -> None:
    """Drop the heap's head while it cannot win: its job at capacity, or the policy no longer
    admits it (which stays so for the batch); a head whose key grew goes back down."""
    while h:
        stored, i, stored_cand = h[0]
        b = g.bids[i]
        p = b.proposal
        pending = scratch.unseen_grants(p.job_id, p.grants_seen, now)
        if pending >= p.capacity:
            heapq.heappop(h)
            if p.job_id not in g.won:
                g.excluded[i] = pending
            continue
        if not pol.admits(stored_cand, p.tenant, scratch, cfg):
            heapq.heappop(h)
            continue
        # A win in another group of the batch may have raised this bid's key (never lowered
        # it): a head whose key is still what it was stored with is the partition's minimum.
        k, cand = pol.rank(offer, b, scratch, cfg)
        if k == stored:
            return
        heapq.heapreplace(h, (k, i, cand))


def clear_full(
    pol: ClearingPolicy, offer: Offer, g: Group, scratch: Ledger, cfg: PolicyConfig, now: float
) -> Decision:
    """Rank every eligible bid for this offer with the policy's ``clear`` (policies whose keys
    depend on everyone's share, and any policy without a faster exact way)."""
    eligible: list[Bid] = []
    index = {id(b): i for i, b in enumerate(g.bids)}
    for i, b in enumerate(g.bids):
        if i in g.excluded:
            continue
        p = b.proposal
        pending = scratch.unseen_grants(p.job_id, p.grants_seen, now)
        if pending >= p.capacity:
            if p.job_id not in g.won:
                g.excluded[i] = pending
            continue
        eligible.append(b)
    d = pol.clear(offer, eligible, scratch, cfg)
    for v in d.verdicts:
        if not v.won:
            continue
        g.last_win_why = v.reason.removeprefix("won: ")
        g.last_win_tenant = v.tenant
    for b, v in zip(eligible, d.verdicts, strict=False):
        if not v.won:
            g.lost_reason[index[id(b)]] = v.reason
    if d.winner is None:
        # every bid's reason is in ``lost_reason``: the group's shared verdicts carry it
        return Decision(d.policy, None, None, ())
    won = tuple(v for v in d.verdicts if v.won)
    return Decision(d.policy, d.winner, d.candidate, won, d.price)
