"""Shortlists: the bids an agent sends, foreseen from the registered policy's ``bid_order``."""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import msgspec

from sja.core.policies.base import BidOrder, PolicyConfig
from sja.core.policies.registry import BID_ORDERS, REGISTRY
from sja.protocol.messages import Offer, Proposal


def bid_for(name: str, offer: Offer, p: Proposal, config: PolicyConfig | None = None) -> Proposal:
    """The proposal cut to the one candidate the named policy would take from it for ``offer``
    (every policy picks a job's candidate from the job's own numbers): what an agent that knows
    the policy sends. Unchanged for a policy not known here."""
    pol = REGISTRY.get(name)
    if len(p.candidates) <= 1 or pol is None:
        return p
    cfg = config if config is not None else PolicyConfig()
    return msgspec.structs.replace(p, candidates=[pol.candidate(offer, p, cfg)])


def shortlist_size(like_offers: int) -> int:
    """Bids per tenant (or in all) to send for ``like_offers`` windows of one shape: every bid that
    could win one, and two more for a ledger that ranks a tenant's jobs a little differently."""
    return like_offers + 2


def shortlist(
    name: str,
    offer: Offer,
    proposals: Sequence[Proposal],
    like_offers: int,
    config: PolicyConfig | None = None,
) -> list[Proposal]:
    """The proposals worth sending for ``like_offers`` windows shaped like ``offer``: the best
    ``shortlist_size`` per tenant (or overall) in the policy's order; all of them for a policy that
    cannot be foreseen (``auction``, or a name not known here). Order of the input is kept."""
    order = BID_ORDERS.get(name)
    k = shortlist_size(like_offers)
    if order is None or len(proposals) <= k:
        return list(proposals)
    return [proposals[i] for i in sorted(_best_per_part(order, offer, proposals, k, config))]


def likely_winners(
    name: str,
    offer: Offer,
    proposals: Sequence[Proposal],
    like_offers: int,
    config: PolicyConfig | None = None,
) -> list[str]:
    """The jobs among ``proposals`` likely to win one of ``like_offers`` windows shaped like
    ``offer``: the best ``like_offers`` overall, in the policy's order; for a policy that ranks
    each tenant's bids apart (``fair``, ``token``, ``jasda``), the best of each tenant for an even
    split of the windows among the tenants bidding, and one more for a ledger that favours one
    (``likely_per_tenant``). Until the batch is cleared an agent leaves them out of its next
    answers: the clearer would leave out a job whose grant is on its way, and the bid would only
    take the place of one that can win. Empty for a policy that cannot be foreseen."""
    order = BID_ORDERS.get(name)
    if order is None:
        return []
    k = like_offers
    if order.per_tenant:
        k = likely_per_tenant(like_offers, len({p.tenant for p in proposals}))
    return [proposals[i].job_id for i in _best_per_part(order, offer, proposals, k, config)]


def likely_per_tenant(like_offers: int, tenants: int) -> int:
    """How many of each tenant's best bids may win one of ``like_offers`` windows when the clearer
    shares them among ``tenants`` tenants. At most ``like_offers`` jobs win a batch's windows of one
    shape: holding ``like_offers`` of every tenant back (``tenants`` times too many) left the
    agent's later batches without bids while windows went unanswered."""
    return min(like_offers, -(-like_offers // max(tenants, 1)) + 1)


def _best_per_part(
    order: BidOrder, offer: Offer, proposals: Sequence[Proposal], k: int, config: PolicyConfig | None
) -> list[int]:
    """Indices of the best ``k`` proposals per tenant (or overall) in ``order``."""
    cfg = config if config is not None else PolicyConfig()
    parts: dict[str, list[tuple[tuple[object, ...], int]]] = {}
    for i, p in enumerate(proposals):
        parts.setdefault(p.tenant if order.per_tenant else "", []).append((order.key(offer, p, cfg), i))
    return [i for ranked in parts.values() for _k, i in heapq.nsmallest(k, ranked)]
