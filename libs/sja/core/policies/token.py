"""``token``: fair-share tokens in the style of GPU time-sharing quota schedulers: the tenant furthest
below its target share holds the token and wins; a tenant above its target by more than the overuse
tolerance has its token revoked (it can win only when no tenant within its share bids)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sja.core.policies.base import Bid, BidOrder, Decision, Keyed, PolicyConfig, Ranked
from sja.core.policies.defaults import MonotonePolicy
from sja.core.policies.efficiency import efficiency_rank
from sja.core.policies.ledger import Ledger
from sja.core.policies.ranking import best_candidate, efficiency_order, efficiency_value, rank
from sja.protocol.messages import Offer


def token_part(
    tenant: str, ledger: Ledger, cfg: PolicyConfig, tenants: Sequence[str]
) -> tuple[tuple[float, float], str]:
    """The tenant's part of the key (its token revoked, then how far below its target share it is,
    among ``tenants``) and its explanation."""
    have = ledger.attained_fraction(tenant, tenants)
    want = ledger.target_fraction(tenant, tenants)
    deficit = want - have
    revoked = have > want * (1.0 + cfg.token_overuse) and have - want > 1e-9
    why = f"tenant {tenant} holds {have:.1%} of service, target {want:.1%}" + (
        " (token revoked: overuse)" if revoked else ""
    )
    return (1.0 if revoked else 0.0, -deficit), why


def token_keyer(
    offer: Offer, ledger: Ledger, cfg: PolicyConfig, tenants: Sequence[str]
) -> Callable[[Bid], Keyed]:
    """``token``'s sort key of a bid: the tenant's part (among ``tenants``), then the bid's
    (efficiency, then age)."""

    def key(b: Bid) -> Keyed:
        p = b.proposal
        cand = best_candidate(offer, p, cfg.horizon_s)
        part, why = token_part(p.tenant, ledger, cfg, tenants)
        eff = efficiency_value(offer, cand, cfg.horizon_s)
        return (*part, -eff, p.submitted_at), cand, why

    return key


class Token(MonotonePolicy):
    """The tenant furthest below its target share (among the bidding and already served tenants)
    holds the token. Tenants above target by more than ``token_overuse`` have their token revoked.
    A losing bid is explained among the tenants served so far."""

    def __init__(self) -> None:
        super().__init__(
            "token", BidOrder(per_tenant=True, key=efficiency_order, static=True), by_tenant=True
        )

    def clear(self, offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
        tenants = sorted({*ledger.tenant_attained, *(b.proposal.tenant for b in bids)})
        return rank(self.name, bids, token_keyer(offer, ledger, cfg, tenants), self.score)

    def key(self, offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed]:
        return token_keyer(offer, ledger, cfg, sorted(ledger.tenant_attained))

    def score(self, k: Keyed) -> float:
        return -k[0][1]

    def rank(self, offer: Offer, b: Bid, ledger: Ledger, cfg: PolicyConfig) -> Ranked:
        return efficiency_rank(offer, b, cfg)

    def tenants(self, scratch: Ledger, live: Sequence[str]) -> list[str]:
        # As ``clear`` ranks them: among the tenants bidding and those served so far.
        return sorted({*scratch.tenant_attained, *live})

    def partition_key(
        self, part: str, scratch: Ledger, cfg: PolicyConfig, tenants: Sequence[str]
    ) -> tuple[float, ...]:
        return token_part(part, scratch, cfg, tenants)[0]

    def winner_key(
        self, offer: Offer, scratch: Ledger, cfg: PolicyConfig, tenants: Sequence[str]
    ) -> Callable[[Bid], Keyed]:
        return token_keyer(offer, scratch, cfg, tenants)
