"""``auction``: sealed-bid second price with per-tenant budgets: the highest affordable bid wins and
pays the second-highest bid (or the reserve); budgets never go negative."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sja.core.policies.base import Bid, Decision, Keyed, PolicyConfig, Ranked, VerdictKind
from sja.core.policies.batch import Group, settle
from sja.core.policies.defaults import MonotonePolicy
from sja.core.policies.ledger import Ledger
from sja.core.policies.ranking import efficiency_value
from sja.protocol.messages import Candidate, Offer, Proposal, Verdict


class Auction(MonotonePolicy):
    """Sealed-bid second price (Vickrey) with budgets: each job bids with its best candidate; bids the
    tenant cannot afford are out; the highest remaining bid wins and pays the second-highest
    affordable bid (or the reserve price), never more than its own bid. An agent cannot foresee
    the winners (no ``bid_order``): a tenant's budget, which only the clearer knows, decides which
    of its bids are affordable."""

    def __init__(self) -> None:
        super().__init__("auction")

    def candidate(self, offer: Offer, p: Proposal, cfg: PolicyConfig) -> Candidate:
        """The job's highest bid (then the most efficient, then the largest)."""
        return max(p.candidates, key=lambda c: (c.bid, efficiency_value(offer, c, cfg.horizon_s), c.size))

    def clear(self, offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
        if not bids:
            return Decision(self.name, None, None, ())
        entries = []
        for b in bids:
            p = b.proposal
            entries.append((b, self.candidate(offer, p, cfg), ledger.budget(p.tenant)))
        affordable = [
            (b, c) for b, c, budget in entries if c.bid <= budget + 1e-12 and c.bid >= cfg.reserve_price
        ]
        affordable.sort(key=lambda bc: (-bc[1].bid, bc[0].proposal.submitted_at, bc[0].proposal.job_id))
        winner, wcand = affordable[0] if affordable else (None, None)
        price = 0.0
        if winner is not None and wcand is not None:
            price = affordable[1][1].bid if len(affordable) > 1 else cfg.reserve_price
            price = min(price, wcand.bid)
        out = []
        for b, cand, budget in entries:
            p = b.proposal
            if b is winner:
                reason = f"won: highest bid {cand.bid:.4f}, pays second price {price:.4f}"
            elif cand.bid > budget + 1e-12:
                reason = f"lost: bid {cand.bid:.4f} exceeds tenant {p.tenant}'s budget {budget:.4f}"
            elif cand.bid < cfg.reserve_price:
                reason = f"lost: bid {cand.bid:.4f} below the reserve {cfg.reserve_price:.4f}"
            else:
                top = wcand.bid if wcand is not None else 0.0
                reason = f"lost: bid {cand.bid:.4f} < {top:.4f}"
            out.append(
                Verdict(
                    job_id=p.job_id,
                    tenant=p.tenant,
                    agent_id=b.agent_id,
                    won=b is winner,
                    reason=reason,
                    score=round(cand.bid, 6),
                    size=cand.size,
                )
            )
        return Decision(self.name, winner, wcand, tuple(out), price=price)

    def key(self, offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed]:
        def key(b: Bid) -> Keyed:
            p = b.proposal
            cand = self.candidate(offer, p, cfg)
            budget = ledger.budget(p.tenant)
            why = f"bid {cand.bid:.4f}"
            if cand.bid > budget + 1e-12:
                why += f" exceeds tenant {p.tenant}'s budget {budget:.4f}"
            elif cand.bid < cfg.reserve_price:
                why += f" below the reserve {cfg.reserve_price:.4f}"
            return (-cand.bid,), cand, why

        return key

    def score(self, k: Keyed) -> float:
        return -k[0][0]

    def rank(self, offer: Offer, b: Bid, ledger: Ledger, cfg: PolicyConfig) -> Ranked:
        cand = self.candidate(offer, b.proposal, cfg)
        return (-cand.bid,), cand

    def admits(self, cand: Candidate, tenant: str, scratch: Ledger, cfg: PolicyConfig) -> bool:
        # A bid beyond its tenant's budget or below the reserve stays so for the batch: budgets
        # only go down.
        return cfg.reserve_price <= cand.bid <= scratch.budget(tenant) + 1e-12

    def batch_winner(
        self,
        offer: Offer,
        g: Group,
        heap: list[tuple[tuple[float, ...], int, Candidate]],
        i: int,
        cand: Candidate,
        scratch: Ledger,
        cfg: PolicyConfig,
        now: float,
        tenants: Sequence[str],
    ) -> Decision:
        b = g.bids[i]
        p = b.proposal
        # Second price: the best bid left that could have won (one heap: every tenant's bids).
        settle(self, offer, g, heap, scratch, cfg, now)
        price = min(heap[0][2].bid if heap else cfg.reserve_price, cand.bid)
        g.last_win_why = f"highest bid {cand.bid:.4f}, pays second price {price:.4f}"
        g.last_win_tenant = p.tenant
        v = Verdict(
            job_id=p.job_id, tenant=p.tenant, agent_id=b.agent_id, won=True,
            reason=f"{VerdictKind.WON}: {g.last_win_why}", score=round(cand.bid, 6), size=cand.size,
        )  # fmt: skip
        return Decision(self.name, b, cand, (v,), price=price)
