"""Clearing policies: ``(offer, bids, ledger) -> decision`` with a reason for every bid.

Pure and deterministic. Before any policy runs, bids are put in a canonical order and reduced to one
per job (``canonical``; a second bid for a job gets an ``invalid`` verdict), then bids from jobs that
already hold as many unstarted grants as they can use are excluded (``split_by_capacity``). Every tie
is broken by (submission time, job id). Every bid gets a verdict: won, lost (with the reason), or
invalid (with the reason); an agent that replied with no bid for the window gets one too (``job_id``
empty).

Policies (selected by name, swappable at runtime):

- ``efficiency`` — most useful work per slice-second, best fit (time and memory fill of the window,
  weighted by the odds of fitting).
- ``fair`` — least attained service normalized by the tenant's share; within a tenant, least
  attained job.
- ``sla`` — least slack to deadline (deadline minus now minus expected remaining work); jobs without
  a deadline come after, by submission time.
- ``auction`` — sealed-bid second price with per-tenant budgets: the highest affordable bid wins and
  pays the second-highest bid (or the reserve); budgets never go negative.
- ``token`` — fair-share tokens in the style of GPU time-sharing quota schedulers: the tenant furthest
  below its target share holds the token and wins; a tenant above its target by more than the
  overuse tolerance has its token revoked (it can win only when no tenant within its share bids).
- ``jasda`` — a weighted score of utilization (efficiency), fairness (share deficit) and
  responsiveness (waiting time, deadline urgency), with configurable weights.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import msgspec

from sja.core.continuation import AGEING, service_key  # fair: the order of service, kept in step
from sja.protocol.messages import Candidate, Offer, Proposal, RoundRecord, Verdict, Window

_encode = msgspec.msgpack.Encoder().encode


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
    price: float = 0.0
    """What the winner's tenant pays (auction); 0 under the other policies."""
    shared: tuple[Verdict, ...] = ()
    """``clear_batch``: the verdicts this offer shares with the other offers of its group (like
    offers with the same bids): one per bid of the group, the batch's reason for it, and one per agent
    that replied without a bid for them. The same tuple for every offer of the group."""
    skip: int = -1
    """The entry of ``shared`` that ``verdicts`` replaces for this offer (its winner's), -1: none."""

    def all_verdicts(self) -> tuple[Verdict, ...]:
        """Every verdict of this offer: one per bid (and per agent without one)."""
        if not self.shared:
            return self.verdicts
        if self.skip < 0:
            return self.verdicts + self.shared
        return self.verdicts + self.shared[: self.skip] + self.shared[self.skip + 1 :]


@dataclass(frozen=True)
class PolicyConfig:
    horizon_s: float = 30.0
    """Length assumed for an open-ended window."""
    jasda_weights: tuple[float, float, float] = (0.5, 0.3, 0.2)
    """(utilization, fairness, responsiveness) weights of the ``jasda`` score."""
    responsiveness_scale_s: float = 60.0
    """Waiting this long (or having this little slack) counts as fully urgent in ``jasda``."""
    token_overuse: float = 0.10
    """``token``: a tenant whose attained fraction exceeds its target fraction by this much (relative)
    loses its token."""
    reserve_price: float = 0.0
    """``auction``: the price paid when there is a single affordable bid."""


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


# --- canonical order and capacity --------------------------------------------------------------------


def canonical(bids: Sequence[Bid]) -> list[Bid]:
    """Bids in a canonical order, one per job. Which duplicate survives depends only on the bids'
    contents (never on arrival order)."""
    return canonical_split(bids)[0]


def canonical_split(bids: Sequence[Bid]) -> tuple[list[Bid], list[Verdict]]:
    """``canonical``, and an ``invalid`` verdict for every bid it leaves out (a second bid for a job
    already bid for, by another agent or the same one)."""
    kept: dict[str, Bid] = {}
    out: list[Bid] = []
    invalid: list[Verdict] = []
    for b in sorted(
        bids,
        key=lambda b: (b.proposal.submitted_at, b.proposal.job_id, b.agent_id, _encode(b.proposal)),
    ):
        p = b.proposal
        first = kept.get(p.job_id)
        if first is None:
            kept[p.job_id] = b
            out.append(b)
            continue
        invalid.append(
            Verdict(
                job_id=p.job_id,
                tenant=p.tenant,
                agent_id=b.agent_id,
                won=False,
                reason=f"invalid: a second bid for job {p.job_id} (the bid from {first.agent_id} stands)",
                size=p.candidates[0].size,
            )
        )
    return out, invalid


NO_BID = "no bid: the reply proposed no job for this window"


def no_bid_verdicts(replied: Iterable[str], bids: Sequence[Bid]) -> list[Verdict]:
    """A verdict (with an empty ``job_id``) for each agent in ``replied`` without a bid in ``bids``:
    it answered, with nothing for this window."""
    bidders = {b.agent_id for b in bids}
    return [
        Verdict(job_id="", tenant="", agent_id=a, won=False, reason=NO_BID)
        for a in sorted(set(replied) - bidders)
    ]


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def capacity_reason(pending: int, capacity: int) -> str:
    """Why a job at capacity is left out of a round: the grants it holds and has not started yet
    already take every subjob it may start now."""
    return (
        f"excluded: it holds {_count(pending, 'grant')} not yet started and may start only "
        f"{_count(capacity, 'subjob')} more now (its max_parallel less the subjobs it runs)"
    )


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
                    reason=capacity_reason(pending, p.capacity),
                    size=p.candidates[0].size,
                )
            )
        else:
            eligible.append(b)
    return eligible, sorted(out, key=lambda v: v.job_id)


# --- shared pieces --------------------------------------------------------------------------------


def _window_len(offer: Offer, horizon_s: float) -> float:
    w = offer.window
    return (w.end_s - w.start_s) if w.end_s is not None else horizon_s


def efficiency_value(offer: Offer, cand: Candidate, horizon_s: float) -> float:
    """Useful work per slice-second with a best-fit term: how much of the window's time and memory
    the subjob is expected to use, weighted by its odds of fitting. An open-ended window (a free
    slice nothing reserves) is held only as long as the subjob runs, then offered again: no part of
    it is left idle, so every subjob fills its time (a short one, such as the last units of a job,
    is not ranked below a long one for being short)."""
    length = _window_len(offer, horizon_s)
    if offer.window.end_s is None:
        fill_time = 1.0
    else:
        fill_time = min(cand.duration_mean_s / length, 1.0) if length > 0 else 0.0
    fill_mem = min(cand.mem_q_mib / offer.window.mem_mib, 1.0)
    return (0.7 * fill_time + 0.3 * fill_mem) * cand.p_fit_mem * cand.p_fit_time


def _best_candidate(offer: Offer, p: Proposal, horizon_s: float) -> Candidate:
    return max(p.candidates, key=lambda c: (efficiency_value(offer, c, horizon_s), c.size, -c.mem_q_mib))


Keyed = tuple[tuple[float, ...], Candidate, str]
"""(sort key, candidate, explanation) for one bid: the smallest key wins."""


TIE_BREAKS = {
    "fair": (
        "a job due against the rigid reference first (earliest to finish by), then the job's own"
        f" attained GPU-seconds less {AGEING:g} per second since its submission, then submission time"
    ),
}
"""What decides between bids a policy explains alike (default: submission time, then job id)."""


def _verdicts(
    keyed: Sequence[tuple[Keyed, Bid]],
    winner: Bid | None,
    win_why: str,
    score_of: Callable[[Keyed], float],
    name: str = "",
) -> tuple[Verdict, ...]:
    out = []
    for k, b in keyed:
        (_, cand, why) = k
        p = b.proposal
        won = b is winner
        if won:
            reason = f"won: {win_why}"
        elif winner is None:
            reason = f"no winner: {why}"
        elif why == win_why:
            # Equal on what the policy explains (two jobs of one tenant under ``fair``): the rest of
            # the key decided, never a comparison of a thing with itself.
            reason = (
                f"lost to {winner.proposal.job_id}: equal on {why}; ranked after it on "
                f"{TIE_BREAKS.get(name, 'submission time')}"
            )
        else:
            reason = f"lost to {winner.proposal.job_id}: {why} vs {win_why}"
        out.append(
            Verdict(
                job_id=p.job_id,
                tenant=p.tenant,
                agent_id=b.agent_id,
                won=won,
                reason=reason,
                score=round(score_of(k), 6),
                size=cand.size,
            )
        )
    return tuple(out)


def _rank(
    name: str, bids: Sequence[Bid], key_of: Callable[[Bid], Keyed], score_of: Callable[[Keyed], float]
) -> Decision:
    if not bids:
        return Decision(name, None, None, ())
    keyed = [(key_of(b), b) for b in bids]
    (_k, best_cand, best_why), winner = min(keyed, key=lambda kb: kb[0][0])
    return Decision(name, winner, best_cand, _verdicts(keyed, winner, best_why, score_of, name))


# --- the policies ---------------------------------------------------------------------------------

PolicyFn = Callable[[Offer, Sequence[Bid], Ledger, PolicyConfig], Decision]


_MONOTONE_KEYS: dict[str, Callable[[Offer, Ledger, PolicyConfig], Callable[[Bid], Keyed]]] = {}
"""Policies whose sort key of a bid can only grow while a batch is cleared (a grant raises the
winner's attained service, never lowers anyone's): their batches clear with one key per bid and a
lazily re-checked heap instead of ranking every bid again for every window."""

_SCORES: dict[str, Callable[[Keyed], float]] = {
    "efficiency": lambda k: -k[0][0],
    "fair": lambda k: k[0][0],
    "sla": lambda k: k[0][0] if math.isfinite(k[0][0]) else -1.0,
    "token": lambda k: -k[0][1],
    "auction": lambda k: -k[0][0],
}


def _efficiency_key(offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed]:
    def key(b: Bid) -> Keyed:
        cand = _best_candidate(offer, b.proposal, cfg.horizon_s)
        v = efficiency_value(offer, cand, cfg.horizon_s)
        return (-v, b.proposal.submitted_at), cand, f"efficiency {v:.3f} (size {cand.size})"

    return key


def _fair_key(offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed]:
    def key(b: Bid) -> Keyed:
        p = b.proposal
        cand = _best_candidate(offer, p, cfg.horizon_s)
        norm = ledger.normalized(p.tenant)
        job = service_key(ledger.job_attained.get(p.job_id, 0.0), p.submitted_at, p.due_at)
        why = (
            f"tenant {p.tenant} attained {ledger.tenant_attained.get(p.tenant, 0.0):.2f} GPU-s"
            f" / share {ledger.share(p.tenant):g} = {norm:.2f}"
        )
        return (norm, job, p.submitted_at), cand, why

    return key


def _sla_key(offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed]:
    now = offer.issued_at

    def key(b: Bid) -> Keyed:
        p = b.proposal
        cand = _best_candidate(offer, p, cfg.horizon_s)
        if p.deadline_at is None:
            return (math.inf, p.submitted_at), cand, "no deadline"
        slack = p.deadline_at - now - p.expected_remaining_s
        return (slack, p.submitted_at), cand, f"slack {slack:.1f}s"

    return key


_MONOTONE_KEYS.update(efficiency=_efficiency_key, fair=_fair_key, sla=_sla_key)
_MONOTONE_KEYS["auction"] = lambda offer, ledger, cfg: _auction_key(offer, ledger, cfg)
_MONOTONE_KEYS["token"] = lambda offer, ledger, cfg: _token_keyer(
    offer, ledger, cfg, sorted(ledger.tenant_attained)
)
"""(``token`` explains a losing bid among the tenants served so far; its batch clearing ranks the
tenants among those bidding, as ``clear_token`` does.)"""


def clear_efficiency(offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
    return _rank("efficiency", bids, _efficiency_key(offer, ledger, cfg), _SCORES["efficiency"])


def clear_fair(offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
    return _rank("fair", bids, _fair_key(offer, ledger, cfg), _SCORES["fair"])


def clear_sla(offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
    return _rank("sla", bids, _sla_key(offer, ledger, cfg), _SCORES["sla"])


def clear_auction(offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
    """Sealed-bid second price (Vickrey) with budgets: each job bids with its best candidate; bids the
    tenant cannot afford are out; the highest remaining bid wins and pays the second-highest
    affordable bid (or the reserve price), never more than its own bid."""
    if not bids:
        return Decision("auction", None, None, ())
    entries = []
    for b in bids:
        p = b.proposal
        cand = max(p.candidates, key=lambda c: (c.bid, efficiency_value(offer, c, cfg.horizon_s), c.size))
        entries.append((b, cand, ledger.budget(p.tenant)))
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
    return Decision("auction", winner, wcand, tuple(out), price=price)


def _token_keyer(
    offer: Offer, ledger: Ledger, cfg: PolicyConfig, tenants: Sequence[str]
) -> Callable[[Bid], Keyed]:
    """``token``'s sort key of a bid: the tenant's part (its token revoked, then how far below its
    target share it is, among ``tenants``), then the bid's (efficiency, then age)."""

    def key(b: Bid) -> Keyed:
        p = b.proposal
        cand = _best_candidate(offer, p, cfg.horizon_s)
        part, why = _token_part(p.tenant, ledger, cfg, tenants)
        eff = efficiency_value(offer, cand, cfg.horizon_s)
        return (*part, -eff, p.submitted_at), cand, why

    return key


def _token_part(
    tenant: str, ledger: Ledger, cfg: PolicyConfig, tenants: Sequence[str]
) -> tuple[tuple[float, float], str]:
    have = ledger.attained_fraction(tenant, tenants)
    want = ledger.target_fraction(tenant, tenants)
    deficit = want - have
    revoked = have > want * (1.0 + cfg.token_overuse) and have - want > 1e-9
    why = f"tenant {tenant} holds {have:.1%} of service, target {want:.1%}" + (
        " (token revoked: overuse)" if revoked else ""
    )
    return (1.0 if revoked else 0.0, -deficit), why


def clear_token(offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
    """The tenant furthest below its target share (among the bidding and already served tenants)
    holds the token. Tenants above target by more than ``token_overuse`` have their token revoked."""
    tenants = sorted({*ledger.tenant_attained, *(b.proposal.tenant for b in bids)})
    key = _token_keyer(offer, ledger, cfg, tenants)

    def rank_key(k: Keyed) -> float:
        return -k[0][1]

    if not bids:
        return Decision("token", None, None, ())
    keyed = [(key(b), b) for b in bids]
    (_k, best_cand, best_why), winner = min(keyed, key=lambda kb: kb[0][0])
    return Decision("token", winner, best_cand, _verdicts(keyed, winner, best_why, rank_key, "token"))


def clear_jasda(offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
    """Weighted score over every (job, candidate): utilization, fairness, responsiveness."""
    tenants = sorted({*ledger.tenant_attained, *(b.proposal.tenant for b in bids)})
    return _rank("jasda", bids, _jasda_keyer(offer, ledger, cfg, tenants), lambda k: -k[0][0])


def _jasda_keyer(
    offer: Offer, ledger: Ledger, cfg: PolicyConfig, tenants: Sequence[str]
) -> Callable[[Bid], Keyed]:
    """``jasda``'s sort key of a bid: minus its best score (fairness among ``tenants``), then age."""
    w_u, w_f, w_r = cfg.jasda_weights
    fairness: dict[str, float] = {}

    def key(b: Bid) -> Keyed:
        p = b.proposal
        f = fairness.get(p.tenant)
        if f is None:
            f = fairness[p.tenant] = _jasda_fairness(p.tenant, ledger, tenants)
        r = _jasda_resp(p, offer.issued_at, cfg)
        s, c, u = _jasda_best(offer, p, cfg, f, r)
        why = f"score {s:.3f} = {w_u:g}*util {u:.2f} + {w_f:g}*fair {f:.2f} + {w_r:g}*resp {r:.2f}"
        return (-s, p.submitted_at), c, why

    return key


def _jasda_fairness(tenant: str, ledger: Ledger, tenants: Sequence[str]) -> float:
    """The tenant's share deficit among ``tenants``, mapped to [0, 1] (0.5: at its target)."""
    deficit = ledger.target_fraction(tenant, tenants) - ledger.attained_fraction(tenant, tenants)
    return 0.5 + 0.5 * max(-1.0, min(1.0, deficit))


def _jasda_resp(p: Proposal, now: float, cfg: PolicyConfig) -> float:
    """Responsiveness in [0, 1]: how long the job waited, or how little slack it has left."""
    waited = max(0.0, now - p.submitted_at) / cfg.responsiveness_scale_s
    urgency = 0.0
    if p.deadline_at is not None:
        slack = p.deadline_at - now - p.expected_remaining_s
        urgency = 1.0 - max(0.0, min(1.0, slack / cfg.responsiveness_scale_s))
    return min(1.0, max(waited, urgency))


def _jasda_best(
    offer: Offer, p: Proposal, cfg: PolicyConfig, f: float, r: float
) -> tuple[float, Candidate, float]:
    """The job's best candidate by (score, size), the first of equals, with its score and
    utilization, for fairness ``f`` and responsiveness ``r``. The one place the score is summed:
    batch clearing ranks by these very floats."""
    w_u, w_f, w_r = cfg.jasda_weights
    best: tuple[float, Candidate, float] | None = None
    for c in p.candidates:
        u = efficiency_value(offer, c, cfg.horizon_s)
        s = w_u * u + w_f * f + w_r * r
        if best is None or (s, c.size) > (best[0], best[1].size):
            best = (s, c, u)
    assert best is not None
    return best


POLICIES: dict[str, PolicyFn] = {
    "efficiency": clear_efficiency,
    "fair": clear_fair,
    "sla": clear_sla,
    "auction": clear_auction,
    "token": clear_token,
    "jasda": clear_jasda,
}


def policy(name: str) -> PolicyFn:
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(sorted(POLICIES))})") from None


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
    fn = policy(name)
    cfg = config if config is not None else PolicyConfig(horizon_s=horizon_s)
    ordered, invalid = canonical_split(bids)
    eligible, excluded = split_by_capacity(ordered, ledger, offer.reply_by)
    d = fn(offer, eligible, ledger, cfg)
    rest = (*excluded, *invalid, *no_bid_verdicts(replied, bids))
    if not rest:
        return d
    return Decision(d.policy, d.winner, d.candidate, d.verdicts + rest, d.price)


# --- shortlists: the bids an agent sends -----------------------------------------------------------


@dataclass(frozen=True)
class BidOrder:
    """How a policy ranks the bids of one tenant (``per_tenant``) or all bids against each other,
    from what the bidding job itself knows: the smaller key wins. A batch of ``n`` like windows is
    won by at most ``n`` bids per tenant (per policy rank), so an agent that sends only its best
    bids in this order sends every bid that could win."""

    per_tenant: bool
    key: Callable[[Offer, Proposal, PolicyConfig], tuple[object, ...]]
    static: bool
    """The key depends on the job and the window's shape only, not on when the offer was made:
    an agent may keep its jobs sorted by it between batches."""


def _eff_order(offer: Offer, p: Proposal, cfg: PolicyConfig) -> tuple[object, ...]:
    cand = _best_candidate(offer, p, cfg.horizon_s)
    return (-efficiency_value(offer, cand, cfg.horizon_s), p.submitted_at, p.job_id)


def _fair_order(offer: Offer, p: Proposal, cfg: PolicyConfig) -> tuple[object, ...]:
    # The clearer's key within a tenant is (job attained, submitted_at): the agent counts the same
    # GPU-seconds for its job (``JobState.attained_gpu_s``).
    return (service_key(p.attained_gpu_s, p.submitted_at), p.submitted_at, p.job_id)


def _sla_order(offer: Offer, p: Proposal, cfg: PolicyConfig) -> tuple[object, ...]:
    # slack = deadline - now - remaining; ``now`` is the same for every bid of an offer.
    if p.deadline_at is None:
        return (math.inf, p.submitted_at, p.job_id)
    return (p.deadline_at - p.expected_remaining_s, p.submitted_at, p.job_id)


def _jasda_order(offer: Offer, p: Proposal, cfg: PolicyConfig) -> tuple[object, ...]:
    # Within a tenant the fairness term is the same for every bid: utilization and responsiveness
    # order them (responsiveness grows with waiting: the key depends on the offer's time).
    w_u, _w_f, w_r = cfg.jasda_weights
    now = offer.issued_at
    best = -math.inf
    for c in p.candidates:
        util = efficiency_value(offer, c, cfg.horizon_s)
        waited = max(0.0, now - p.submitted_at) / cfg.responsiveness_scale_s
        urgency = 0.0
        if p.deadline_at is not None:
            slack = p.deadline_at - now - p.expected_remaining_s
            urgency = 1.0 - max(0.0, min(1.0, slack / cfg.responsiveness_scale_s))
        best = max(best, w_u * util + w_r * min(1.0, max(waited, urgency)))
    return (-best, p.submitted_at, p.job_id)


BID_ORDERS: dict[str, BidOrder] = {
    "efficiency": BidOrder(per_tenant=False, key=_eff_order, static=True),
    "fair": BidOrder(per_tenant=True, key=_fair_order, static=True),
    "sla": BidOrder(per_tenant=False, key=_sla_order, static=True),
    "token": BidOrder(per_tenant=True, key=_eff_order, static=True),
    "jasda": BidOrder(per_tenant=True, key=_jasda_order, static=False),
}
"""Policies whose winners an agent can foresee within a tenant. ``auction`` is not among them: a
tenant's budget, which only the clearer knows, decides which of its bids are affordable."""


def bid_for(name: str, offer: Offer, p: Proposal, config: PolicyConfig | None = None) -> Proposal:
    """The proposal cut to the one candidate the named policy would take from it for ``offer``
    (every policy picks a job's candidate from the job's own numbers): what an agent that knows
    the policy sends. Unchanged for a policy not known here."""
    if len(p.candidates) <= 1 or name not in POLICIES:
        return p
    cfg = config if config is not None else PolicyConfig()
    if name == "auction":
        cand = max(p.candidates, key=lambda c: (c.bid, efficiency_value(offer, c, cfg.horizon_s), c.size))
    else:
        cand = _best_candidate(offer, p, cfg.horizon_s)
    return msgspec.structs.replace(p, candidates=[cand])


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


# --- batches ------------------------------------------------------------------------------------------


def _shape(offer: Offer, horizon_s: float) -> tuple[object, ...]:
    """What a policy's key reads from an offer: offers of one shape rank the same bids alike."""
    w = offer.window
    return (w.mem_mib, w.compute_share, _window_len(offer, horizon_s), offer.issued_at, offer.reply_by)


def _scratch(ledger: Ledger) -> Ledger:
    """A copy of the ledger that a batch may charge without touching the original (grant lists are
    shared and replaced, never appended to, in the copy)."""
    return Ledger(
        tenant_shares=ledger.tenant_shares,
        tenant_attained=dict(ledger.tenant_attained),
        job_attained=dict(ledger.job_attained),
        job_grants=dict(ledger.job_grants),
        tenant_budgets=dict(ledger.tenant_budgets),
    )


def _charge_scratch(scratch: Ledger, offer: Offer, d: Decision) -> None:
    assert d.winner is not None and d.candidate is not None
    p = d.winner.proposal
    scratch.charge(p.tenant, p.job_id, grant_cost(offer, d.candidate))
    scratch.job_grants[p.job_id] = [*scratch.job_grants.get(p.job_id, []), math.inf]
    scratch.spend(p.tenant, d.price)


def _excluded(b: Bid, pending: int) -> Verdict:
    p = b.proposal
    return Verdict(
        job_id=p.job_id,
        tenant=p.tenant,
        agent_id=b.agent_id,
        won=False,
        reason=capacity_reason(pending, p.capacity),
        size=p.candidates[0].size,
    )


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
    rounding).
    """
    cfg = config if config is not None else PolicyConfig()
    fn = policy(name)
    scratch = _scratch(ledger)
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
    state: dict[tuple[object, ...], _Group] = {}
    cleared: list[tuple[Offer, Decision, _Group]] = []
    for o in order:
        gkey = group_of[o.offer_id]
        g = state.get(gkey)
        if g is None:
            every = bid_lists[gkey[0]]  # type: ignore[index]
            ordered, invalid = canonical_split(every)
            duplicate_of = str(gkey[2]) if gkey[1] == "duplicate of" else ""
            g = state[gkey] = _Group(ordered, o, every=every, invalid=invalid, duplicate_of=duplicate_of)
        now = g.now = o.reply_by
        if g.duplicate_of:
            cleared.append((o, Decision(name, None, None, ()), g))
            continue
        if name in _MONOTONE_KEYS:
            d = _clear_lazy(name, o, g, scratch, cfg, now)
        elif name == "jasda" and _jasda_heaps(o, g, cfg):
            d = _clear_jasda_lazy(o, g, scratch, cfg, now)
        else:
            d = _clear_full(fn, o, g, scratch, cfg, now)
        if d.winner is not None:
            _charge_scratch(scratch, o, d)
            g.won.setdefault(d.winner.proposal.job_id, []).append(o.offer_id)
        cleared.append((o, d, g))
    for g in state.values():
        g.shared = g.shared_verdicts(name, scratch, cfg, agents)
    out: list[tuple[Offer, Decision]] = []
    for o, d, g in cleared:
        skip = g.entry_of[d.winner.proposal.job_id] if d.winner is not None else -1
        out.append((o, Decision(d.policy, d.winner, d.candidate, d.verdicts, d.price, g.shared, skip)))
    return out


@dataclass
class _Group:
    """The bids of a group of like offers while a batch is cleared."""

    bids: list[Bid]
    """The group's bids in canonical order, one per job."""
    offer: Offer
    """The group's first offer (every offer of a group ranks the bids alike)."""
    every: Sequence[Bid] = ()
    """Every bid as received (duplicates included)."""
    invalid: list[Verdict] = field(default_factory=list)
    """Verdicts of the bids ``canonical`` left out."""
    duplicate_of: str = ""
    """The offer this group's offers repeat the slice of (they are not cleared); empty: none."""
    now: float = 0.0
    """The reply deadline of the group's latest offer."""
    heaps: dict[str, list[tuple[tuple[float, ...], int, Candidate]]] | None = None
    won: dict[str, list[str]] = field(default_factory=dict)
    """Job -> the offers of the group it won."""
    lost_reason: dict[int, str] = field(default_factory=dict)
    """Bid index -> the policy's reason at its last ranking (the other policies)."""
    excluded: dict[int, int] = field(default_factory=dict)
    """Bid index -> unstarted grants, for bids left out for capacity."""
    last_win_why: str = ""
    last_win_tenant: str = ""
    repush: int | None = None
    """A winner's index: back in the heap with its new key before the next offer (it may win again
    while it has capacity)."""
    jasda_heaps: dict[str, list[tuple[float, int]]] | None = None
    """``jasda``: per tenant, a heap of (minus the best score without the tenant's part, index in
    ``jasda_alike``); None until the group's first offer, and for a group cleared offer by offer."""
    jasda_alike: list[list[int]] = field(default_factory=list)
    """``jasda``: bids of one tenant whose scores are equal whatever the tenant's part (the same
    terms, float for float), latest in canonical order first: only the last can win among them."""
    jasda_tol: float = 0.0
    """``jasda``: how far a bid's key may lie beyond its heap's head and the bid still rank first
    once its tenant's part is added (the two sums round differently)."""
    jasda_full: bool = False
    """``jasda``: the group clears offer by offer (its scores are not all finite)."""
    shared: tuple[Verdict, ...] = ()
    entry_of: dict[str, int] = field(default_factory=dict)
    """Job -> the index of its verdict in ``shared`` (jobs that won an offer of the group)."""

    def shared_verdicts(
        self, name: str, scratch: Ledger, cfg: PolicyConfig, agents: Sequence[str]
    ) -> tuple[Verdict, ...]:
        """The verdicts every offer of the group shares: each bid's reason for the batch (a job that
        won some of them: the offers it took), then the invalid bids, then the agents without a bid."""
        no_bid = no_bid_verdicts(agents, self.every)
        if self.duplicate_of:
            reason = (
                f"invalid: slice {self.offer.window.slice_id} is offered twice in this batch"
                f" (cleared on {self.duplicate_of})"
            )
            dup = [
                Verdict(
                    job_id=b.proposal.job_id, tenant=b.proposal.tenant, agent_id=b.agent_id, won=False,
                    reason=reason, size=b.proposal.candidates[0].size,
                )
                for b in self.every
            ]  # fmt: skip
            return (*dup, *no_bid)
        out: list[Verdict] = []
        whys: dict[str, str] = {}
        for i, b in enumerate(self.bids):
            p = b.proposal
            took = self.won.get(p.job_id)
            if took is not None:
                self.entry_of[p.job_id] = len(out)
                reason = f"lost: took {', '.join(took)} in this batch"
                out.append(
                    Verdict(
                        job_id=p.job_id, tenant=p.tenant, agent_id=b.agent_id, won=False,
                        reason=reason, size=p.candidates[0].size,
                    )
                )  # fmt: skip
                continue
            pending = self.excluded.get(i, scratch.unseen_grants(p.job_id, p.grants_seen, self.now))
            if pending >= p.capacity:
                out.append(_excluded(b, pending))
                continue
            if i in self.lost_reason:
                reason = self.lost_reason[i]
            else:
                # fair explains a bid by its tenant alone: one explanation per tenant.
                memo_key = p.tenant if name == "fair" else None
                why = whys.get(memo_key) if memo_key is not None else None
                if why is None:
                    keyed = _MONOTONE_KEYS.get(name) or _EXPLAINED.get(name)
                    why = keyed(self.offer, scratch, cfg)(b)[2] if keyed else "not ranked"
                    if memo_key is not None:
                        whys[memo_key] = why
                if self.won and name == "fair" and p.tenant == self.last_win_tenant:
                    # Its own tenant's jobs won: within a tenant, fair serves the least attained job.
                    attained = scratch.job_attained.get(p.job_id, 0.0)
                    reason = (
                        f"lost to better-ranked bids: jobs of its own tenant {p.tenant}, which fair "
                        f"serves least-attained first, older jobs forgiven {AGEING:g} GPU-s a second"
                        f" (this job: {attained:.2f} GPU-s)"
                    )
                elif self.won:
                    reason = f"lost to better-ranked bids: {why} vs {self.last_win_why}"
                else:
                    reason = f"no winner: {why}"
            out.append(
                Verdict(
                    job_id=p.job_id, tenant=p.tenant, agent_id=b.agent_id, won=False,
                    reason=reason, size=p.candidates[0].size,
                )
            )  # fmt: skip
        return (*out, *self.invalid, *no_bid)


def _efficiency_rank(
    offer: Offer, b: Bid, ledger: Ledger, cfg: PolicyConfig
) -> tuple[tuple[float, ...], Candidate]:
    cand = _best_candidate(offer, b.proposal, cfg.horizon_s)
    return (-efficiency_value(offer, cand, cfg.horizon_s), b.proposal.submitted_at), cand


def _fair_rank(
    offer: Offer, b: Bid, ledger: Ledger, cfg: PolicyConfig
) -> tuple[tuple[float, ...], Candidate]:
    p = b.proposal
    key = service_key(ledger.job_attained.get(p.job_id, 0.0), p.submitted_at)
    return (key, p.submitted_at), _best_candidate(offer, p, cfg.horizon_s)


def _sla_rank(offer: Offer, b: Bid, ledger: Ledger, cfg: PolicyConfig) -> tuple[tuple[float, ...], Candidate]:
    p = b.proposal
    cand = _best_candidate(offer, p, cfg.horizon_s)
    if p.deadline_at is None:
        return (math.inf, p.submitted_at), cand
    return (p.deadline_at - offer.issued_at - p.expected_remaining_s, p.submitted_at), cand


def _token_rank(
    offer: Offer, b: Bid, ledger: Ledger, cfg: PolicyConfig
) -> tuple[tuple[float, ...], Candidate]:
    p = b.proposal
    cand = _best_candidate(offer, p, cfg.horizon_s)
    return (-efficiency_value(offer, cand, cfg.horizon_s), p.submitted_at), cand


def _auction_rank(
    offer: Offer, b: Bid, ledger: Ledger, cfg: PolicyConfig
) -> tuple[tuple[float, ...], Candidate]:
    cand = _auction_candidate(offer, b.proposal, cfg)
    return (-cand.bid,), cand


def _auction_candidate(offer: Offer, p: Proposal, cfg: PolicyConfig) -> Candidate:
    return max(p.candidates, key=lambda c: (c.bid, efficiency_value(offer, c, cfg.horizon_s), c.size))


def _auction_key(offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed]:
    def key(b: Bid) -> Keyed:
        p = b.proposal
        cand = _auction_candidate(offer, p, cfg)
        budget = ledger.budget(p.tenant)
        why = f"bid {cand.bid:.4f}"
        if cand.bid > budget + 1e-12:
            why += f" exceeds tenant {p.tenant}'s budget {budget:.4f}"
        elif cand.bid < cfg.reserve_price:
            why += f" below the reserve {cfg.reserve_price:.4f}"
        return (-cand.bid,), cand, why

    return key


_PARTITIONED: dict[
    str, tuple[bool, Callable[[Offer, Bid, Ledger, PolicyConfig], tuple[tuple[float, ...], Candidate]]]
] = {
    "efficiency": (False, _efficiency_rank),
    "fair": (True, _fair_rank),
    "sla": (False, _sla_rank),
    "token": (True, _token_rank),
    "auction": (False, _auction_rank),
}
"""Policies whose key is ``(tenant part, bid part)``: the tenant part (``fair``: the tenant's
normalized attained service; ``token``: the tenant's token and deficit, among the tenants bidding)
is worked out afresh for every window from the ledger, and the bid part changes only for the
winner, so a heap per tenant and a scan over tenants find the minimum exactly."""


def _clear_lazy(
    name: str, offer: Offer, g: _Group, scratch: Ledger, cfg: PolicyConfig, now: float
) -> Decision:
    """The smallest key among the eligible bids: per tenant (``fair``; one partition for the
    others) a heap of the bids' own key parts, the minimum over the tenants' heads. Keys can only
    grow during a batch, so a head is re-checked and pushed down when its key grew; a winner goes
    back into its heap with its new key."""
    by_tenant, rank = _PARTITIONED[name]
    if g.heaps is None:
        g.heaps = {}
        for i, b in enumerate(g.bids):
            k, cand = rank(offer, b, scratch, cfg)
            g.heaps.setdefault(b.proposal.tenant if by_tenant else "", []).append((k, i, cand))
        for h in g.heaps.values():
            heapq.heapify(h)
    if g.repush is not None:
        b = g.bids[g.repush]
        k, cand = rank(offer, b, scratch, cfg)
        heapq.heappush(g.heaps[b.proposal.tenant if by_tenant else ""], (k, g.repush, cand))
        g.repush = None
    auction = name == "auction"

    def settle(h: list[tuple[tuple[float, ...], int, Candidate]]) -> None:
        """Drop the heap's head while it cannot win: its job at capacity (``auction``: or its bid
        beyond its tenant's budget or below the reserve, which stays so for the batch: budgets only
        go down); a head whose key grew goes back down."""
        while h:
            stored, i, stored_cand = h[0]
            b = g.bids[i]
            p = b.proposal
            pending = scratch.unseen_grants(p.job_id, p.grants_seen, now)
            if pending >= p.capacity:
                heapq.heappop(h)
                if p.job_id not in g.won:
                    g.excluded[i] = pending
                continue
            if auction and not (cfg.reserve_price <= stored_cand.bid <= scratch.budget(p.tenant) + 1e-12):
                heapq.heappop(h)
                continue
            # A win in another group of the batch may have raised this bid's key (never lowered
            # it): a head whose key is still what it was stored with is the partition's minimum.
            k, cand = rank(offer, b, scratch, cfg)
            if k == stored:
                return
            heapq.heapreplace(h, (k, i, cand))

    live: list[str] = []
    for part, h in g.heaps.items():
        settle(h)
        if h:
            live.append(part)
    tenants = sorted({*scratch.tenant_attained, *live}) if name == "token" else []
    best: tuple[tuple[float, ...], tuple[float, ...], int] | None = None
    best_part = ""
    for part in live:
        h = g.heaps[part]
        if name == "token":
            prio: tuple[float, ...] = _token_part(part, scratch, cfg, tenants)[0]
        elif by_tenant:
            prio = (scratch.normalized(part),)
        else:
            prio = ()
        cand_key = (prio, h[0][0], h[0][1])
        if best is None or cand_key < best:
            best, best_part = cand_key, part
    if best is None:
        return Decision(name, None, None, ())
    heap = g.heaps[best_part]
    _k, i, cand = heapq.heappop(heap)
    g.repush = i
    b = g.bids[i]
    p = b.proposal
    if auction:
        # Second price: the best bid left that could have won (one heap: every tenant's bids).
        settle(heap)
        price = min(heap[0][2].bid if heap else cfg.reserve_price, cand.bid)
        g.last_win_why = f"highest bid {cand.bid:.4f}, pays second price {price:.4f}"
        g.last_win_tenant = p.tenant
        v = Verdict(
            job_id=p.job_id, tenant=p.tenant, agent_id=b.agent_id, won=True,
            reason=f"won: {g.last_win_why}", score=round(cand.bid, 6), size=cand.size,
        )  # fmt: skip
        return Decision(name, b, cand, (v,), price=price)
    if name == "token":
        keyed = _token_keyer(offer, scratch, cfg, tenants)(b)
    else:
        keyed = _MONOTONE_KEYS[name](offer, scratch, cfg)(b)
    g.last_win_why = keyed[2]
    g.last_win_tenant = p.tenant
    v = Verdict(
        job_id=p.job_id, tenant=p.tenant, agent_id=b.agent_id, won=True, reason=f"won: {keyed[2]}",
        score=round(_SCORES[name](keyed), 6), size=cand.size,
    )  # fmt: skip
    return Decision(name, b, cand, (v,))


def _jasda_explained(offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed]:
    """``jasda``'s key of a losing bid in a batch: fairness among the tenants served so far and
    the bid's own."""

    def key(b: Bid) -> Keyed:
        tenants = sorted({*ledger.tenant_attained, b.proposal.tenant})
        return _jasda_keyer(offer, ledger, cfg, tenants)(b)

    return key


_EXPLAINED: dict[str, Callable[[Offer, Ledger, PolicyConfig], Callable[[Bid], Keyed]]] = {
    "jasda": _jasda_explained
}
"""How a batch explains a losing bid, for the lazily cleared policies not in ``_MONOTONE_KEYS``."""

_JASDA_ROUNDING = 2.0**-48
"""``jasda``: a bound, relative to the magnitude of the terms, on how far a bid's score
``(u + f) + r`` can lie from its heap key ``u + r`` plus ``f`` (each addition rounds by at most
2**-53 of its operands' magnitude: three additions, under 4 x 2**-53; two bids compared, under
8 x 2**-53; 2**-48 is 32 x 2**-53)."""


def _jasda_heaps(offer: Offer, g: _Group, cfg: PolicyConfig) -> bool:
    """Build the group's ``jasda`` heaps at its first offer; False: the group clears offer by offer.

    A bid's score is ``w_u*util + w_f*fairness + w_r*resp``: util depends on the window's shape
    and resp on the offer's ``issued_at``, both the same for every offer of a group, so only the
    fairness term moves during the batch, and it is the same for every bid of a tenant. A heap per
    tenant ordered by ``w_u*util + w_r*resp`` (best candidate) holds the bids; the tenant's term is
    worked out afresh for each window. Bids of a tenant with the same terms, float for float, share
    one heap entry (their scores tie for any fairness, and the first in canonical order wins ties).
    Only a group whose terms are all finite clears this way: with a NaN or an infinity the sums do
    not order like their parts, and the group is cleared offer by offer (``_clear_full``), which
    gives the same answer by definition."""
    if g.jasda_heaps is not None:
        return True
    if g.jasda_full:
        return False
    w_u, w_f, w_r = cfg.jasda_weights
    heaps: dict[str, list[tuple[float, int]]] = {}
    alike: dict[tuple[object, ...], int] = {}
    magnitude = abs(w_f)
    finite = all(math.isfinite(w) for w in cfg.jasda_weights)
    for i, b in enumerate(g.bids):
        p = b.proposal
        resp = w_r * _jasda_resp(p, offer.issued_at, cfg)
        part = -math.inf
        terms: list[object] = [p.tenant, resp]
        for c in p.candidates:
            util = w_u * efficiency_value(offer, c, cfg.horizon_s)
            part = max(part, util + resp)
            magnitude = max(magnitude, abs(util) + abs(resp) + abs(w_f))
            terms += (util, c.size)
        finite = finite and math.isfinite(part) and math.isfinite(p.submitted_at)
        k = alike.setdefault(tuple(terms), len(g.jasda_alike))
        if k == len(g.jasda_alike):
            g.jasda_alike.append([])
            heaps.setdefault(p.tenant, []).append((-part, k))
        g.jasda_alike[k].append(i)
    if not (finite and math.isfinite(4.0 * magnitude)):
        g.jasda_full = True
        return False
    for h in heaps.values():
        heapq.heapify(h)
    for members in g.jasda_alike:
        members.reverse()
    g.jasda_heaps = heaps
    g.jasda_tol = magnitude * _JASDA_ROUNDING
    return True


def _clear_jasda_lazy(offer: Offer, g: _Group, scratch: Ledger, cfg: PolicyConfig, now: float) -> Decision:
    """``jasda``'s winner among the eligible bids, exactly as ``clear_jasda`` ranks them.

    The exact score adds the tenant's term between the other two, so it need not order a tenant's
    bids exactly as the heap does where their keys are within rounding of each other: every bid of
    the tenant whose key lies within ``jasda_tol`` of the head's is scored exactly, the rest cannot
    rank first (their exact score is lower by more than rounding can make up). Ties then break as
    ``clear_jasda`` breaks them: submission time, then canonical order."""
    heaps = g.jasda_heaps
    assert heaps is not None

    def first_eligible(k: int) -> int | None:
        """The first bid of ``jasda_alike[k]`` that can still win; bids at capacity leave for good
        (grants only accumulate in a batch); a winner stays, it may win again."""
        members = g.jasda_alike[k]
        while members:
            i = members[-1]
            p = g.bids[i].proposal
            pending = scratch.unseen_grants(p.job_id, p.grants_seen, now)
            if pending < p.capacity:
                return i
            members.pop()
            if p.job_id not in g.won:
                g.excluded[i] = pending
        return None

    live: list[str] = []
    for tenant, h in heaps.items():
        while h and first_eligible(h[0][1]) is None:
            heapq.heappop(h)
        if h:
            live.append(tenant)
    if not live:
        return Decision("jasda", None, None, ())
    tenants = sorted({*scratch.tenant_attained, *live})
    best: tuple[tuple[float, float, int], Candidate] | None = None
    for tenant in live:
        h = heaps[tenant]
        f = _jasda_fairness(tenant, scratch, tenants)
        limit = h[0][0] + g.jasda_tol
        # The heap's entries within ``limit`` of its head form a subtree at the root.
        stack = [0]
        while stack:
            j = stack.pop()
            if j >= len(h) or h[j][0] > limit:
                continue
            stack += (2 * j + 1, 2 * j + 2)
            i = first_eligible(h[j][1])
            if i is None:
                continue  # an emptied entry below the head: dropped when it comes to the head
            p = g.bids[i].proposal
            s, c, _u = _jasda_best(offer, p, cfg, f, _jasda_resp(p, offer.issued_at, cfg))
            k = (-s, p.submitted_at, i)
            if best is None or k < best[0]:
                best = (k, c)
    assert best is not None
    (_s, _at, i), cand = best
    b = g.bids[i]
    p = b.proposal
    key, _cand, why = _jasda_keyer(offer, scratch, cfg, tenants)(b)
    g.last_win_why = why
    g.last_win_tenant = p.tenant
    v = Verdict(
        job_id=p.job_id, tenant=p.tenant, agent_id=b.agent_id, won=True, reason=f"won: {why}",
        score=round(-key[0], 6), size=cand.size,
    )  # fmt: skip
    return Decision("jasda", b, cand, (v,))


def _clear_full(
    fn: PolicyFn, offer: Offer, g: _Group, scratch: Ledger, cfg: PolicyConfig, now: float
) -> Decision:
    """Rank every eligible bid for this offer (policies whose keys depend on everyone's share)."""
    eligible: list[Bid] = []
    index = {id(b): i for i, b in enumerate(g.bids)}
    for i, b in enumerate(g.bids):
        if i in g.excluded:
            continue
        p = b.proposal
        pending = scratch.unseen_grants(p.job_id, p.grants_seen, now)
        if pending >= p.capacity:
            if p.job_id not in g.won:
                g.excluded[i] = pending
            continue
        eligible.append(b)
    d = fn(offer, eligible, scratch, cfg)
    for v in d.verdicts:
        if not v.won:
            continue
        g.last_win_why = v.reason.removeprefix("won: ")
        g.last_win_tenant = v.tenant
    for b, v in zip(eligible, d.verdicts, strict=False):
        if not v.won:
            g.lost_reason[index[id(b)]] = v.reason
    if d.winner is None:
        # every bid's reason is in ``lost_reason``: the group's shared verdicts carry it
        return Decision(d.policy, None, None, ())
    won = tuple(v for v in d.verdicts if v.won)
    return Decision(d.policy, d.winner, d.candidate, won, d.price)
