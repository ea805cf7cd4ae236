"""What a policy inherits: ``Policy``, the defaults of a ``ClearingPolicy`` (a batch cleared offer
by offer with ``clear``), and ``MonotonePolicy``, for a policy whose keys only grow while a batch
is cleared (a batch then keeps the bids in heaps instead of ranking every bid for every window).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from mypy_extensions import mypyc_attr

from sja.core.policies.base import Bid, BidOrder, Decision, Keyed, PolicyConfig, Ranked, VerdictKind
from sja.core.policies.batch import Group, clear_full, lazy_best
from sja.core.policies.ledger import Ledger
from sja.core.policies.ranking import SUBMISSION_TIME, best_candidate, rank
from sja.protocol.messages import Candidate, JobState, Offer, Proposal, Verdict

BY_SUBMISSION = (
    "by submission (this policy ranks the bids of each window by how well they fit it, so the order "
    "changes from one window to the next)"
)
"""The queue order of a policy that ranks each window's bids by what the window is: no order a
user can foresee but the jobs' submission."""


@mypyc_attr(allow_interpreted_subclasses=True)
class Policy:
    """The defaults of a ``ClearingPolicy``: a subclass defines ``clear`` (and what it knows better).
    A policy defined outside the compiled core (a plug-in, a test's) may subclass it too."""

    def __init__(
        self,
        name: str,
        bid_order: BidOrder | None = None,
        explains_by_tenant: bool = False,
        reads_deadline: bool = False,
    ) -> None:
        self.name = name
        self.bid_order = bid_order
        self.explains_by_tenant = explains_by_tenant
        self.reads_deadline = reads_deadline

    def clear(self, offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
        raise NotImplementedError(f"policy {self.name} does not clear")

    def candidate(self, offer: Offer, p: Proposal, cfg: PolicyConfig) -> Candidate:
        return best_candidate(offer, p, cfg.horizon_s)

    def explain(self, offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed] | None:
        return None

    def clear_in_batch(
        self, offer: Offer, g: Group, scratch: Ledger, cfg: PolicyConfig, now: float
    ) -> Decision:
        return clear_full(self, offer, g, scratch, cfg, now)

    def lost_in_batch(self, b: Bid, why: str, g: Group, scratch: Ledger) -> str:
        return f"lost to better-ranked bids: {why} vs {g.last_win_why}"

    def queue_key(self, job: JobState, ledger: Ledger) -> tuple[float, ...]:
        return (job.submitted_at,)

    def queue_order(self) -> str:
        return BY_SUBMISSION


class MonotonePolicy(Policy):
    """A policy whose sort key of a bid can only grow while a batch is cleared (a grant raises the
    winner's attained service, never lowers anyone's), split into ``(tenant part, bid part)``: the
    tenant part (``partition_key``) is worked out afresh for every window from the ledger, and the
    bid part (``rank``) changes only for the winner, so a heap per tenant (one heap in all, when
    not ``by_tenant``) and a scan over tenants find the minimum exactly, instead of ranking every
    bid again for every window (``clear_lazy``)."""

    def __init__(
        self,
        name: str,
        bid_order: BidOrder | None = None,
        explains_by_tenant: bool = False,
        by_tenant: bool = False,
        tie_break: str = SUBMISSION_TIME,
        reads_deadline: bool = False,
    ) -> None:
        super().__init__(name, bid_order, explains_by_tenant, reads_deadline)
        self.by_tenant = by_tenant
        self.tie_break = tie_break
        """What decides between bids the policy explains alike (``ranked_verdicts``)."""

    def key(self, offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed]:
        """A bid's whole key against the ledger, its best candidate and its explanation."""
        raise NotImplementedError

    def score(self, k: Keyed) -> float:
        """The number a verdict shows for a bid's key."""
        raise NotImplementedError

    def rank(self, offer: Offer, b: Bid, ledger: Ledger, cfg: PolicyConfig) -> Ranked:
        """The bid's own part of its key (what a batch keeps in its heaps)."""
        raise NotImplementedError

    def tenants(self, scratch: Ledger, live: Sequence[str]) -> list[str]:
        """The tenants ``partition_key`` weighs a tenant against (none by default)."""
        return []

    def partition_key(
        self, part: str, scratch: Ledger, cfg: PolicyConfig, tenants: Sequence[str]
    ) -> tuple[float, ...]:
        """The tenant part of the key of the bids in partition ``part``."""
        return ()

    def admits(self, cand: Candidate, tenant: str, scratch: Ledger, cfg: PolicyConfig) -> bool:
        """Whether the bid can win at all (it stays out for the rest of the batch if not)."""
        return True

    def winner_key(
        self, offer: Offer, scratch: Ledger, cfg: PolicyConfig, tenants: Sequence[str]
    ) -> Callable[[Bid], Keyed]:
        """The key that explains a batch's winner."""
        return self.key(offer, scratch, cfg)

    def clear(self, offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
        return rank(self.name, bids, self.key(offer, ledger, cfg), self.score, self.tie_break)

    def explain(self, offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed] | None:
        return self.key(offer, ledger, cfg)

    def clear_in_batch(
        self, offer: Offer, g: Group, scratch: Ledger, cfg: PolicyConfig, now: float
    ) -> Decision:
        best = lazy_best(self, offer, g, scratch, cfg, now)
        if best is None:
            return Decision(self.name, None, None, ())
        heap, i, cand, tenants = best
        return self.batch_winner(offer, g, heap, i, cand, scratch, cfg, now, tenants)

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
        """The decision for the bid ``i`` that ``lazy_best`` found (``heap``: its partition's)."""
        b = g.bids[i]
        p = b.proposal
        keyed = self.winner_key(offer, scratch, cfg, tenants)(b)
        g.last_win_why = keyed[2]
        g.last_win_tenant = p.tenant
        v = Verdict(
            job_id=p.job_id, tenant=p.tenant, agent_id=b.agent_id, won=True,
            reason=f"{VerdictKind.WON}: {keyed[2]}", score=round(self.score(keyed), 6), size=cand.size,
        )  # fmt: skip
        return Decision(self.name, b, cand, (v,))
