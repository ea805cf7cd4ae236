"""``sla``: least slack to deadline (deadline minus now minus expected remaining work); jobs without
a deadline come after, by submission time."""

from __future__ import annotations

import math
from collections.abc import Callable

from sja.core.policies.base import Bid, BidOrder, Keyed, PolicyConfig, Ranked
from sja.core.policies.defaults import MonotonePolicy
from sja.core.policies.ledger import Ledger
from sja.core.policies.ranking import best_candidate
from sja.protocol.messages import JobState, Offer, Proposal


def sla_order(offer: Offer, p: Proposal, cfg: PolicyConfig) -> tuple[object, ...]:
    # slack = deadline - now - remaining; ``now`` is the same for every bid of an offer.
    if p.deadline_at is None:
        return (math.inf, p.submitted_at, p.job_id)
    return (p.deadline_at - p.expected_remaining_s, p.submitted_at, p.job_id)


class Sla(MonotonePolicy):
    def __init__(self) -> None:
        super().__init__("sla", BidOrder(per_tenant=False, key=sla_order, static=True), reads_deadline=True)

    def key(self, offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed]:
        now = offer.issued_at

        def key(b: Bid) -> Keyed:
            p = b.proposal
            cand = best_candidate(offer, p, cfg.horizon_s)
            if p.deadline_at is None:
                return (math.inf, p.submitted_at), cand, "no deadline"
            slack = p.deadline_at - now - p.expected_remaining_s
            return (slack, p.submitted_at), cand, f"slack {slack:.1f}s"

        return key

    def score(self, k: Keyed) -> float:
        return k[0][0] if math.isfinite(k[0][0]) else -1.0

    def rank(self, offer: Offer, b: Bid, ledger: Ledger, cfg: PolicyConfig) -> Ranked:
        p = b.proposal
        cand = best_candidate(offer, p, cfg.horizon_s)
        if p.deadline_at is None:
            return (math.inf, p.submitted_at), cand
        return (p.deadline_at - offer.issued_at - p.expected_remaining_s, p.submitted_at), cand

    def queue_key(self, job: JobState, ledger: Ledger) -> tuple[float, ...]:
        due = job.submitted_at + job.spec.deadline_s if job.spec.deadline_s is not None else math.inf
        return (due, job.submitted_at)

    def queue_order(self) -> str:
        return "the earliest deadline first, jobs without one after, by submission"
