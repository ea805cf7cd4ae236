"""Clearing policies: ``(offer, bids, ledger) -> decision`` with a reason for every bid.

Pure and deterministic: bids are put in a canonical order before anything else, and every tie is
broken by (submission time, job id). A policy picks one (bid, candidate) pair or none.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sja.protocol.messages import Candidate, Offer, Proposal, Verdict


@dataclass(frozen=True)
class Bid:
    """One job's proposal to an offer, with the agent that speaks for it."""

    agent_id: str
    proposal: Proposal


@dataclass(frozen=True)
class Decision:
    policy: str
    winner: Bid | None
    candidate: Candidate | None
    verdicts: tuple[Verdict, ...]


@dataclass
class Ledger:
    """Attained service, in GPU-seconds (slice-seconds times compute share), per tenant and job."""

    tenant_shares: dict[str, float] = field(default_factory=dict)
    """Target share per tenant (weights); tenants not listed weigh 1."""
    tenant_attained: dict[str, float] = field(default_factory=dict)
    job_attained: dict[str, float] = field(default_factory=dict)
    job_grants: dict[str, list[float]] = field(default_factory=dict)
    """Lease expiry of every grant issued per job, in issue order (the k-th grant is index k-1)."""

    def share(self, tenant: str) -> float:
        return self.tenant_shares.get(tenant, 1.0)

    def normalized(self, tenant: str) -> float:
        return self.tenant_attained.get(tenant, 0.0) / self.share(tenant)

    def charge(self, tenant: str, job_id: str, gpu_seconds: float) -> None:
        self.tenant_attained[tenant] = self.tenant_attained.get(tenant, 0.0) + gpu_seconds
        self.job_attained[job_id] = self.job_attained.get(job_id, 0.0) + gpu_seconds

    def record_grant(self, job_id: str, lease_until: float) -> None:
        self.job_grants.setdefault(job_id, []).append(lease_until)

    def unseen_grants(self, job_id: str, grants_seen: int, now: float) -> int:
        """Grants issued to a job that its agent had not received when it replied and whose lease
        still runs (a grant lost on the way stops counting when its lease lapses)."""
        issued = self.job_grants.get(job_id, [])
        return sum(1 for lease_until in issued[grants_seen:] if lease_until > now)


def split_by_capacity(bids: Sequence[Bid], ledger: Ledger, now: float) -> tuple[list[Bid], list[Verdict]]:
    """Bids whose job can still start a subjob, and a verdict for each that cannot."""
    eligible: list[Bid] = []
    out: list[Verdict] = []
    for b in bids:
        p = b.proposal
        pending = ledger.unseen_grants(p.job_id, p.grants_seen, now)
        if pending >= p.capacity:
            out.append(
                Verdict(
                    job_id=p.job_id,
                    tenant=p.tenant,
                    agent_id=b.agent_id,
                    won=False,
                    reason=f"excluded: already holds {pending} grant(s) not yet started "
                    f"(can run {p.capacity} more)",
                    size=p.candidates[0].size,
                )
            )
        else:
            eligible.append(b)
    return eligible, sorted(out, key=lambda v: v.job_id)


def grant_cost(offer: Offer, cand: Candidate) -> float:
    """GPU-seconds a grant is expected to consume: what the ledger charges."""
    return cand.duration_mean_s * offer.window.compute_share


def _canonical(bids: Sequence[Bid]) -> list[Bid]:
    seen: set[str] = set()
    out: list[Bid] = []
    for b in sorted(bids, key=lambda b: (b.proposal.submitted_at, b.proposal.job_id, b.agent_id)):
        if b.proposal.job_id in seen:  # one voice per job; duplicates are ignored deterministically
            continue
        seen.add(b.proposal.job_id)
        out.append(b)
    return out


def _window_len(offer: Offer, horizon_s: float) -> float:
    w = offer.window
    return (w.end_s - w.start_s) if w.end_s is not None else horizon_s


def efficiency_value(offer: Offer, cand: Candidate, horizon_s: float) -> float:
    """Useful work per slice-second with a best-fit term: how much of the window's time and memory
    the subjob is expected to use, weighted by its odds of fitting."""
    length = _window_len(offer, horizon_s)
    fill_time = min(cand.duration_mean_s / length, 1.0) if length > 0 else 0.0
    fill_mem = min(cand.mem_q_mib / offer.window.mem_mib, 1.0)
    return (0.7 * fill_time + 0.3 * fill_mem) * cand.p_fit_mem * cand.p_fit_time


def _best_candidate(offer: Offer, p: Proposal, horizon_s: float) -> Candidate:
    return max(p.candidates, key=lambda c: (efficiency_value(offer, c, horizon_s), c.size))


Keyed = tuple[tuple[float, ...], Candidate, str]
"""(sort key, candidate, explanation) for one bid: the smallest key wins."""


def _rank(
    policy: str,
    offer: Offer,
    bids: Sequence[Bid],
    key_of: Callable[[Bid], Keyed],
) -> Decision:
    ordered = _canonical(bids)
    if not ordered:
        return Decision(policy, None, None, ())
    keyed = [(key_of(b), b) for b in ordered]
    (_best_key, best_cand, best_why), winner = min(keyed, key=lambda kb: kb[0][0])
    verdicts = []
    for (key, cand, why), b in keyed:
        p = b.proposal
        won = b is winner
        reason = f"won: {best_why}" if won else f"lost to {winner.proposal.job_id}: {why} vs {best_why}"
        verdicts.append(
            Verdict(
                job_id=p.job_id,
                tenant=p.tenant,
                agent_id=b.agent_id,
                won=won,
                reason=reason,
                score=round(-key[0] if policy == "efficiency" else key[0], 6),
                size=cand.size,
            )
        )
    return Decision(policy, winner, best_cand, tuple(verdicts))


def clear_efficiency(offer: Offer, bids: Sequence[Bid], ledger: Ledger, horizon_s: float) -> Decision:
    def key(b: Bid) -> Keyed:
        cand = _best_candidate(offer, b.proposal, horizon_s)
        v = efficiency_value(offer, cand, horizon_s)
        return (-v, b.proposal.submitted_at), cand, f"efficiency {v:.3f} (size {cand.size})"

    return _rank("efficiency", offer, bids, key)


def clear_fair(offer: Offer, bids: Sequence[Bid], ledger: Ledger, horizon_s: float) -> Decision:
    """Least attained service normalized by tenant share; within a tenant, least attained job."""

    def key(b: Bid) -> Keyed:
        p = b.proposal
        cand = _best_candidate(offer, p, horizon_s)
        norm = ledger.normalized(p.tenant)
        job = ledger.job_attained.get(p.job_id, 0.0)
        why = (
            f"tenant {p.tenant} attained {ledger.tenant_attained.get(p.tenant, 0.0):.2f} GPU-s"
            f" / share {ledger.share(p.tenant):g} = {norm:.2f}"
        )
        return (norm, job, p.submitted_at), cand, why

    return _rank("fair", offer, bids, key)


def clear_sla(offer: Offer, bids: Sequence[Bid], ledger: Ledger, horizon_s: float) -> Decision:
    """Least slack to deadline first; jobs without a deadline come after, by submission time."""
    now = offer.issued_at

    def key(b: Bid) -> Keyed:
        p = b.proposal
        cand = _best_candidate(offer, p, horizon_s)
        if p.deadline_at is None:
            return (float("inf"), p.submitted_at), cand, "no deadline"
        slack = p.deadline_at - now - p.expected_remaining_s
        return (slack, p.submitted_at), cand, f"slack {slack:.1f}s"

    return _rank("sla", offer, bids, key)


PolicyFn = Callable[[Offer, Sequence[Bid], Ledger, float], Decision]

POLICIES: dict[str, PolicyFn] = {
    "efficiency": clear_efficiency,
    "fair": clear_fair,
    "sla": clear_sla,
}


def policy(name: str) -> PolicyFn:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None


def clear(name: str, offer: Offer, bids: Sequence[Bid], ledger: Ledger, horizon_s: float = 30.0) -> Decision:
    """Clear one round under the named policy (after removing bids from jobs at capacity)."""
    fn = policy(name)
    eligible, excluded = split_by_capacity(bids, ledger, offer.reply_by)
    d = fn(offer, eligible, ledger, horizon_s)
    if not excluded:
        return d
    return Decision(d.policy, d.winner, d.candidate, d.verdicts + tuple(excluded))
