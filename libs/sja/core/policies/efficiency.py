"""``efficiency``: most useful work per slice-second, best fit (time and memory fill of the window,
weighted by the odds of fitting)."""

from __future__ import annotations

from collections.abc import Callable

from sja.core.policies.base import Bid, BidOrder, Keyed, PolicyConfig, Ranked
from sja.core.policies.defaults import MonotonePolicy
from sja.core.policies.ledger import Ledger
from sja.core.policies.ranking import best_candidate, efficiency_order, efficiency_value
from sja.protocol.messages import Offer


def efficiency_rank(offer: Offer, b: Bid, cfg: PolicyConfig) -> Ranked:
    """The most efficient first, then the oldest (``efficiency``'s key; ``token``'s within a tenant)."""
    cand = best_candidate(offer, b.proposal, cfg.horizon_s)
    return (-efficiency_value(offer, cand, cfg.horizon_s), b.proposal.submitted_at), cand


class Efficiency(MonotonePolicy):
    def __init__(self) -> None:
        super().__init__("efficiency", BidOrder(per_tenant=False, key=efficiency_order, static=True))

    def key(self, offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed]:
        def key(b: Bid) -> Keyed:
            cand = best_candidate(offer, b.proposal, cfg.horizon_s)
            v = efficiency_value(offer, cand, cfg.horizon_s)
            return (-v, b.proposal.submitted_at), cand, f"efficiency {v:.3f} (size {cand.size})"

        return key

    def score(self, k: Keyed) -> float:
        return -k[0][0]

    def rank(self, offer: Offer, b: Bid, ledger: Ledger, cfg: PolicyConfig) -> Ranked:
        return efficiency_rank(offer, b, cfg)
