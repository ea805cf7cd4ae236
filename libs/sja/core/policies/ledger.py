"""What the clearer remembers across rounds (the ``Ledger``) and what a grant costs in it.

Pure and deterministic: every policy reads the ledger, ``clear`` and ``clear_batch`` never change
it (a batch charges a copy), the caller charges the grants it actually makes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from sja.protocol.messages import Candidate, Offer, RoundRecord, Window


@dataclass
class Ledger:
    """What the clearer remembers across rounds: attained service in GPU-seconds (slice-seconds times
    compute share) per tenant and job, tenant shares and budgets, and grants issued per job."""

    tenant_shares: dict[str, float] = field(default_factory=dict)
    """Target share per tenant (weights); tenants not listed weigh 1."""
    tenant_attained: dict[str, float] = field(default_factory=dict)
    job_attained: dict[str, float] = field(default_factory=dict)
    job_grants: dict[str, list[float]] = field(default_factory=dict)
    """Lease expiry of every grant issued per job, in issue order (the k-th grant is index k-1)."""
    tenant_budgets: dict[str, float] = field(default_factory=dict)
    """``auction``: credits left per tenant. A tenant not listed has an unlimited budget."""

    def share(self, tenant: str) -> float:
        return self.tenant_shares.get(tenant, 1.0)

    def normalized(self, tenant: str) -> float:
        return self.tenant_attained.get(tenant, 0.0) / self.share(tenant)

    def charge(self, tenant: str, job_id: str, gpu_seconds: float) -> None:
        self.tenant_attained[tenant] = self.tenant_attained.get(tenant, 0.0) + gpu_seconds
        self.job_attained[job_id] = self.job_attained.get(job_id, 0.0) + gpu_seconds

    def learn(self, tenant: str, job_id: str, attained_gpu_s: float) -> float:
        """The job has attained ``attained_gpu_s`` by its own count: what it had past what was
        charged here (time its open subjobs held their slices past their windows, which no grant
        charges) is charged now, to it and its tenant. Returns how much."""
        more = attained_gpu_s - self.job_attained.get(job_id, 0.0)
        if more <= 1e-9 or not tenant:
            return 0.0
        self.charge(tenant, job_id, more)
        return more

    def budget(self, tenant: str) -> float:
        return self.tenant_budgets.get(tenant, math.inf)

    def spend(self, tenant: str, amount: float) -> None:
        """Deduct an auction payment. Never below zero: the auction only lets affordable bids win."""
        if tenant in self.tenant_budgets:
            left = self.tenant_budgets[tenant] - amount
            if left < -1e-9:
                raise ValueError(f"tenant {tenant} cannot pay {amount:.4f}: budget {left + amount:.4f}")
            self.tenant_budgets[tenant] = max(left, 0.0)

    def refund(self, tenant: str, amount: float) -> None:
        """Give back an auction payment for a grant that was not made."""
        if tenant in self.tenant_budgets and amount > 0:
            self.tenant_budgets[tenant] += amount

    def record_grant(self, job_id: str, lease_until: float) -> None:
        self.job_grants.setdefault(job_id, []).append(lease_until)

    def forget_grant(self, job_id: str, lease_until: float) -> None:
        """Drop a recorded grant that was not made after all (its slice was lost)."""
        issued = self.job_grants.get(job_id, [])
        for i in range(len(issued) - 1, -1, -1):
            if issued[i] == lease_until:
                del issued[i]
                return

    def unseen_grants(self, job_id: str, grants_seen: int, now: float) -> int:
        """Grants issued to a job that its agent had not received when it replied and whose lease
        still runs (a grant lost on the way stops counting when its lease lapses)."""
        issued = self.job_grants.get(job_id, [])
        return sum(1 for lease_until in issued[grants_seen:] if lease_until > now)

    def replay_round(self, record: RoundRecord, lease_s: float) -> None:
        """Fold a recorded round into the ledger (a clearer rebuilding it at start): its winner's
        service, grant and payment. A payment is clamped to what the tenant has left: budgets may
        have been configured lower since, and a rebuilt ledger must not fail or go negative."""
        if not record.winner_job:
            return
        tenant = next((v.tenant for v in record.verdicts if v.won), "")
        self.charge(tenant, record.winner_job, record.charged_gpu_s)
        self.record_grant(record.winner_job, record.cleared_at + lease_s)
        self.spend(tenant, min(record.price, self.budget(tenant)))

    def attained_fraction(self, tenant: str, tenants: Sequence[str]) -> float:
        total = sum(self.tenant_attained.get(t, 0.0) for t in tenants)
        return self.tenant_attained.get(tenant, 0.0) / total if total > 0 else 0.0

    def target_fraction(self, tenant: str, tenants: Sequence[str]) -> float:
        total = sum(self.share(t) for t in tenants)
        return self.share(tenant) / total if total > 0 else 0.0


def grant_cost(offer: Offer, cand: Candidate) -> float:
    """GPU-seconds a grant is expected to consume: what the ledger charges."""
    return window_cost(offer.window, cand)


def window_cost(window: Window, cand: Candidate) -> float:
    """``grant_cost`` for a window (what an agent counts for a grant it took)."""
    return cand.duration_mean_s * window.compute_share
