"""``fair``: least attained service normalized by the tenant's share; within a tenant, the job first
in the order of service (``continuation.service_key``: a job due against the rigid reference first,
``core.shadow``; then least attained service, less ``AGEING`` for the time it has been in the
system)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sja.core.continuation import AGEING, service_key
from sja.core.policies.base import Bid, BidOrder, Keyed, PolicyConfig, Ranked
from sja.core.policies.batch import Group
from sja.core.policies.defaults import MonotonePolicy
from sja.core.policies.ledger import Ledger
from sja.core.policies.ranking import best_candidate
from sja.protocol.messages import JobState, Offer, Proposal


def fair_order(offer: Offer, p: Proposal, cfg: PolicyConfig) -> tuple[object, ...]:
    # The clearer's key within a tenant is the job's service key, then submitted_at: the agent counts
    # the same GPU-seconds for its job (``JobState.attained_gpu_s``).
    return (service_key(p.attained_gpu_s, p.submitted_at, p.due_at), p.submitted_at, p.job_id)


class Fair(MonotonePolicy):
    """The tenant part of the key is its normalized attained service, the bid's part the job's own
    service key (attained service less ``continuation.AGEING`` per second in the system), then its
    submission. A bid is explained by its tenant alone."""

    def __init__(self) -> None:
        super().__init__(
            "fair",
            BidOrder(per_tenant=True, key=fair_order, static=True),
            explains_by_tenant=True,
            by_tenant=True,
            tie_break=(
                "a job due against the rigid reference first (earliest to finish by), then the job's own"
                f" attained GPU-seconds less {AGEING:g} per second since its submission, then submission time"
            ),
        )

    def key(self, offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed]:
        def key(b: Bid) -> Keyed:
            p = b.proposal
            cand = best_candidate(offer, p, cfg.horizon_s)
            norm = ledger.normalized(p.tenant)
            job = service_key(ledger.job_attained.get(p.job_id, 0.0), p.submitted_at, p.due_at)
            why = (
                f"tenant {p.tenant} attained {ledger.tenant_attained.get(p.tenant, 0.0):.2f} GPU-s"
                f" / share {ledger.share(p.tenant):g} = {norm:.2f}"
            )
            return (norm, job, p.submitted_at), cand, why

        return key

    def score(self, k: Keyed) -> float:
        return k[0][0]

    def rank(self, offer: Offer, b: Bid, ledger: Ledger, cfg: PolicyConfig) -> Ranked:
        p = b.proposal
        key = service_key(ledger.job_attained.get(p.job_id, 0.0), p.submitted_at, p.due_at)
        return (key, p.submitted_at), best_candidate(offer, p, cfg.horizon_s)

    def partition_key(
        self, part: str, scratch: Ledger, cfg: PolicyConfig, tenants: Sequence[str]
    ) -> tuple[float, ...]:
        return (scratch.normalized(part),)

    def queue_key(self, job: JobState, ledger: Ledger) -> tuple[float, ...]:
        return (
            ledger.normalized(job.spec.tenant),
            service_key(ledger.job_attained.get(job.job_id, 0.0), job.submitted_at, job.due_at),
            job.submitted_at,
        )

    def queue_order(self) -> str:
        # where ``sja explain`` shows it, the ledger holds the jobs' own service and no shares
        return (
            "the tenant with the least GPU-seconds first (shares taken as equal), then its jobs due against "
            "the rigid reference, earliest to finish by first, then its job with the least GPU-seconds, less "
            f"{AGEING:g} GPU-s per second since its submission, then the earliest submitted"
        )

    def lost_in_batch(self, b: Bid, why: str, g: Group, scratch: Ledger) -> str:
        p = b.proposal
        if p.tenant == g.last_win_tenant:
            # Its own tenant's jobs won: within a tenant, fair serves the least attained job.
            attained = scratch.job_attained.get(p.job_id, 0.0)
            return (
                f"lost to better-ranked bids: jobs of its own tenant {p.tenant}, which fair "
                f"serves least-attained first, older jobs forgiven {AGEING:g} GPU-s a second"
                f" (this job: {attained:.2f} GPU-s)"
            )
        return super().lost_in_batch(b, why, g, scratch)
