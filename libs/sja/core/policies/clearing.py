"""Clearing a round, and a batch of rounds, under a registered policy."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence

from sja.core.policies.base import Bid, Decision, PolicyConfig
from sja.core.policies.batch import Group
from sja.core.policies.ledger import Ledger, grant_cost
from sja.core.policies.ranking import window_len
from sja.core.policies.registry import get
from sja.core.policies.rules import canonical_split, no_bid_verdicts, split_by_capacity
from sja.protocol.messages import Offer


def clear(
    name: str,
    offer: Offer,
    bids: Sequence[Bid],
    ledger: Ledger,
    horizon_s: float = 30.0,
    config: PolicyConfig | None = None,
    replied: Iterable[str] = (),
) -> Decision:
    """Clear one round under the named policy: canonical order, one bid per job, jobs at capacity
    excluded, then the policy. Every bid gets exactly one verdict, and so does every agent in
    ``replied`` that sent none."""
    pol = get(name)
    cfg = config if config is not None else PolicyConfig(horizon_s=horizon_s)
    ordered, invalid = canonical_split(bids)
    eligible, excluded = split_by_capacity(ordered, ledger, offer.reply_by)
    d = pol.clear(offer, eligible, ledger, cfg)
    rest = (*excluded, *invalid, *no_bid_verdicts(replied, bids))
    if not rest:
        return d
    return Decision(d.policy, d.winner, d.candidate, d.verdicts + rest, d.price)


def _shape(offer: Offer, horizon_s: float) -> tuple[object, ...]:
    """What a policy's key reads from an offer: offers of one shape rank the same bids alike."""
    w = offer.window
    return (w.mem_mib, w.compute_share, window_len(offer, horizon_s), offer.issued_at, offer.reply_by)


def _scratch(ledger: Ledger, jobs: set[str]) -> Ledger:
    """A copy of the ledger that a batch may charge without touching the original (grant lists are
    shared and replaced, never appended to, in the copy). Per job it holds only the ``jobs`` that
    bid in the batch, the only ones a policy reads: a batch costs its bids, not every job the ledger
    has ever charged."""
    attained, grants = ledger.job_attained, ledger.job_grants
    return Ledger(
        tenant_shares=ledger.tenant_shares,
        tenant_attained=dict(ledger.tenant_attained),
        job_attained={j: attained[j] for j in jobs if j in attained},
        job_grants={j: grants[j] for j in jobs if j in grants},
        tenant_budgets=dict(ledger.tenant_budgets),
    )


def _charge_scratch(scratch: Ledger, offer: Offer, d: Decision) -> None:
    assert d.winner is not None and d.candidate is not None
    p = d.winner.proposal
    scratch.charge(p.tenant, p.job_id, grant_cost(offer, d.candidate))
    scratch.job_grants[p.job_id] = [*scratch.job_grants.get(p.job_id, []), math.inf]
    scratch.spend(p.tenant, d.price)


def clear_batch(
    name: str,
    offers: Sequence[Offer],
    bids_for: Callable[[Offer], Sequence[Bid]],
    ledger: Ledger,
    config: PolicyConfig | None = None,
    replied: Iterable[str] = (),
) -> list[tuple[Offer, Decision]]:
    """Clear a batch of offers under the named policy: exactly what ``clear`` gives for each offer
    in turn, in canonical order (window start, slice), when every winner is charged to the ledger
    before the next offer is cleared. The ledger itself is not changed: the caller charges the
    grants it actually makes.

    Only the first offer for a slice (in that order) is cleared: any other offer for the same slice
    in the batch has no winner and its bids are ``invalid``, so a slice never has two winners.

    Every bid gets a verdict on every offer it bid on, and every agent in ``replied`` one on every
    offer it sent no bid for, without a verdict object per offer and bid: an offer's ``verdicts``
    hold its winner's, and its ``shared`` tuple, one for a whole group of like offers (same bids,
    same shape), gives every bid of the group the batch's reason (``Decision.all_verdicts``). A
    batch of W windows and J bids costs O(W log J + J) for ``efficiency``, ``fair``, ``sla`` and
    ``token`` (plus the tenants for every window), O(W log J + J) for ``auction`` and for ``jasda``
    (plus, per window, the tenants squared and the bids whose scores tie with the best to within
    rounding); a policy without its own ``clear_in_batch`` ranks every eligible bid per window.
    """
    cfg = config if config is not None else PolicyConfig()
    pol = get(name)
    agents = sorted(set(replied))
    order = sorted(offers, key=lambda o: (o.window.start_s, o.window.slice_id, o.offer_id))
    groups: dict[tuple[object, ...], list[Offer]] = {}
    bid_lists: dict[int, Sequence[Bid]] = {}
    first_of_slice: dict[str, str] = {}
    for o in order:
        bids = bids_for(o)
        bid_lists[id(bids)] = bids
        first = first_of_slice.setdefault(o.window.slice_id, o.offer_id)
        if first != o.offer_id:
            groups.setdefault((id(bids), "duplicate of", first), []).append(o)
        else:
            groups.setdefault((id(bids), *_shape(o, cfg.horizon_s)), []).append(o)
    group_of = {o.offer_id: key for key, g in groups.items() for o in g}
    scratch = _scratch(ledger, {b.proposal.job_id for bids in bid_lists.values() for b in bids})
    state: dict[tuple[object, ...], Group] = {}
    cleared: list[tuple[Offer, Decision, Group]] = []
    for o in order:
        gkey = group_of[o.offer_id]
        g = state.get(gkey)
        if g is None:
            every = bid_lists[gkey[0]]  # type: ignore[index]
            ordered, invalid = canonical_split(every)
            duplicate_of = str(gkey[2]) if gkey[1] == "duplicate of" else ""
            g = state[gkey] = Group(ordered, o, every=every, invalid=invalid, duplicate_of=duplicate_of)
        now = g.now = o.reply_by
        if g.duplicate_of:
            cleared.append((o, Decision(name, None, None, ()), g))
            continue
        d = pol.clear_in_batch(o, g, scratch, cfg, now)
        if d.winner is not None:
            _charge_scratch(scratch, o, d)
            g.won.setdefault(d.winner.proposal.job_id, []).append(o.offer_id)
        cleared.append((o, d, g))
    for g in state.values():
        g.shared = g.shared_verdicts(pol, scratch, cfg, agents)
    out: list[tuple[Offer, Decision]] = []
    for o, d, g in cleared:
        skip = g.entry_of[d.winner.proposal.job_id] if d.winner is not None else -1
        out.append((o, Decision(d.policy, d.winner, d.candidate, d.verdicts, d.price, g.shared, skip)))
    return out
