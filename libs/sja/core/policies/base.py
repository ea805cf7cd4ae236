"""What every clearing policy shares: bids, decisions, the ledger, the canonical order, the capacity
rule, the explanation of a ranking, the ``ClearingPolicy`` protocol and the batch clearing built on it.

Pure and deterministic. Before any policy runs, bids are put in a canonical order and reduced to one
per job (``canonical``; a second bid for a job gets an ``invalid`` verdict), then bids from jobs that
already hold as many unstarted grants as they can use are excluded (``split_by_capacity``). Every tie
is broken by (submission time, job id). Every bid gets a verdict: won, lost (with the reason), or
invalid (with the reason); an agent that replied with no bid for the window gets one too (``job_id``
empty).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import msgspec
from mypy_extensions import mypyc_attr

from sja.protocol.messages import Candidate, Offer, Proposal, RoundRecord, Verdict, Window


class VerdictKind(StrEnum):
    """What a verdict says of its bid. A verdict's reason starts with its kind (``"<kind>: ..."``; a
    loss also ``"lost to ..."``, or ``"not granted: ..."`` when the winner's lease could not be
    written, see ``core.grants``), so a reader of the reason alone sees it; code that branches on it
    asks ``verdict_kind``."""

    WON = "won"
    LOST = "lost"
    EXCLUDED = "excluded"
    """Left out of the round: the job already holds as many unstarted grants as it may start."""
    INVALID = "invalid"
    """Not a bid the round could take: a second bid for one job, a slice offered twice."""
    NO_BID = "no bid"
    """An agent that answered with no job for the window (the verdict's ``job_id`` is empty)."""


def verdict_kind(v: Verdict) -> VerdictKind:
    """The kind of a verdict this module made (see ``VerdictKind``)."""
    if v.won:
        return VerdictKind.WON
    if not v.job_id:
        return VerdictKind.NO_BID
    for kind in (VerdictKind.EXCLUDED, VerdictKind.INVALID):
        if v.reason.startswith(f"{kind}:"):
            return kind
    return VerdictKind.LOST


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


def losing_verdict(b: Bid, reason: str) -> Verdict:
    """A verdict that grants ``b`` nothing (lost, excluded or invalid: ``reason`` says which and
    why), with the size of the bid's first candidate."""
    p = b.proposal
    return Verdict(
        job_id=p.job_id,
        tenant=p.tenant,
        agent_id=b.agent_id,
        won=False,
        reason=reason,
        size=p.candidates[0].size,
    )


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
        reason = (
            f"{VerdictKind.INVALID}: a second bid for job {p.job_id} (the bid from {first.agent_id} stands)"
        )
        invalid.append(losing_verdict(b, reason))
    return out, invalid


NO_BID = f"{VerdictKind.NO_BID}: the reply proposed no job for this window"


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
        f"{VerdictKind.EXCLUDED}: it holds {_count(pending, 'grant')} not yet started and may start only "
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
            out.append(excluded_verdict(b, pending))
        else:
            eligible.append(b)
    return eligible, sorted(out, key=lambda v: v.job_id)


# --- shared pieces --------------------------------------------------------------------------------


def window_len(offer: Offer, horizon_s: float) -> float:
    w = offer.window
    return (w.end_s - w.start_s) if w.end_s is not None else horizon_s


def efficiency_value(offer: Offer, cand: Candidate, horizon_s: float) -> float:
    """Useful work per slice-second with a best-fit term: how much of the window's time and memory
    the subjob is expected to use, weighted by its odds of fitting. An open-ended window (a free
    slice nothing reserves) is held only as long as the subjob runs, then offered again: no part of
    it is left idle, so every subjob fills its time (a short one, such as the last units of a job,
    is not ranked below a long one for being short)."""
    length = window_len(offer, horizon_s)
    if offer.window.end_s is None:
        fill_time = 1.0
    else:
        fill_time = min(cand.duration_mean_s / length, 1.0) if length > 0 else 0.0
    fill_mem = min(cand.mem_q_mib / offer.window.mem_mib, 1.0)
    return (0.7 * fill_time + 0.3 * fill_mem) * cand.p_fit_mem * cand.p_fit_time


def best_candidate(offer: Offer, p: Proposal, horizon_s: float) -> Candidate:
    """The job's most efficient candidate for ``offer`` (then the largest, then the least memory)."""
    return max(p.candidates, key=lambda c: (efficiency_value(offer, c, horizon_s), c.size, -c.mem_q_mib))


Keyed = tuple[tuple[float, ...], Candidate, str]
"""(sort key, candidate, explanation) for one bid: the smallest key wins."""

Ranked = tuple[tuple[float, ...], Candidate]
"""(sort key, candidate) for one bid: the part of its key a batch keeps in a heap."""

PolicyFn = Callable[[Offer, Sequence[Bid], Ledger, PolicyConfig], Decision]
"""A policy's clearing of one offer: ``(offer, eligible bids, ledger, config) -> decision``."""

SUBMISSION_TIME = "submission time"


def ranked_verdicts(
    keyed: Sequence[tuple[Keyed, Bid]],
    winner: Bid | None,
    win_why: str,
    score_of: Callable[[Keyed], float],
    tie_break: str = SUBMISSION_TIME,
) -> tuple[Verdict, ...]:
    """A verdict for every keyed bid: the winner's, and every other's reason against it."""
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
            reason = f"lost to {winner.proposal.job_id}: equal on {why}; ranked after it on {tie_break}"
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


def rank(
    name: str,
    bids: Sequence[Bid],
    key_of: Callable[[Bid], Keyed],
    score_of: Callable[[Keyed], float],
    tie_break: str = SUBMISSION_TIME,
) -> Decision:
    """The bid with the smallest key wins; every bid is explained against it."""
    if not bids:
        return Decision(name, None, None, ())
    keyed = [(key_of(b), b) for b in bids]
    (_k, best_cand, best_why), winner = min(keyed, key=lambda kb: kb[0][0])
    return Decision(name, winner, best_cand, ranked_verdicts(keyed, winner, best_why, score_of, tie_break))


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


def efficiency_order(offer: Offer, p: Proposal, cfg: PolicyConfig) -> tuple[object, ...]:
    """Most efficient best candidate first, then the oldest job (``efficiency``, and ``token``
    within a tenant)."""
    cand = best_candidate(offer, p, cfg.horizon_s)
    return (-efficiency_value(offer, cand, cfg.horizon_s), p.submitted_at, p.job_id)


# --- the protocol ------------------------------------------------------------------------------------


class ClearingPolicy(Protocol):
    """A clearing policy: what a policy module defines and registers once (``registry.register``).

    ``clear`` is the whole policy: it ranks the eligible bids of one offer and explains every one.
    The rest has defaults in ``Policy``: a batch clears offer by offer with ``clear`` unless the
    policy knows a faster exact way (``clear_in_batch``), and a bid that lost every offer of a batch
    is explained by ``explain`` ("not ranked" without one)."""

    @property
    def name(self) -> str: ...

    @property
    def bid_order(self) -> BidOrder | None:
        """How an agent can foresee the winners among its own bids; None: it cannot."""
        ...

    @property
    def explains_by_tenant(self) -> bool:
        """A bid's explanation depends on its tenant alone (one per tenant in a batch)."""
        ...

    def clear(self, offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
        """The winner among ``bids`` (canonical, one per job, none at capacity) and every verdict."""
        ...

    def candidate(self, offer: Offer, p: Proposal, cfg: PolicyConfig) -> Candidate:
        """The candidate the policy takes from the job for ``offer`` (from the job's own numbers)."""
        ...

    def explain(self, offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed] | None:
        """The key and explanation of a bid against the ledger; None: the policy gives none."""
        ...

    def clear_in_batch(
        self, offer: Offer, g: Group, scratch: Ledger, cfg: PolicyConfig, now: float
    ) -> Decision:
        """The winner of ``offer``, one of a group of like offers cleared in turn in a batch, exactly
        as ``clear`` would pick it against the batch's ledger so far (``scratch``)."""
        ...

    def lost_in_batch(self, b: Bid, why: str, g: Group, scratch: Ledger) -> str:
        """The reason of a bid that lost every offer of its group, some of which were won."""
        ...


@mypyc_attr(allow_interpreted_subclasses=True)
class Policy:
    """The defaults of a ``ClearingPolicy``: a subclass defines ``clear`` (and what it knows better).
    A policy defined outside the compiled core (a plug-in, a test's) may subclass it too."""

    def __init__(
        self, name: str, bid_order: BidOrder | None = None, explains_by_tenant: bool = False
    ) -> None:
        self.name = name
        self.bid_order = bid_order
        self.explains_by_tenant = explains_by_tenant

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
    ) -> None:
        super().__init__(name, bid_order, explains_by_tenant)
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


# --- batches ------------------------------------------------------------------------------------------


def excluded_verdict(b: Bid, pending: int) -> Verdict:
    """The verdict of a bid left out because its job holds ``pending`` grants it has not started."""
    return losing_verdict(b, capacity_reason(pending, b.proposal.capacity))


PolicyState = object
"""What a policy keeps for a group of like offers while a batch is cleared (``Group.state``). A
name of the module's own: the compiled dataclass looks its fields' types up among the module's."""


@dataclass
class Group:
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
    """``MonotonePolicy``: per partition, a heap of (bid part of the key, index, candidate)."""
    won: dict[str, list[str]] = field(default_factory=dict)
    """Job -> the offers of the group it won."""
    lost_reason: dict[int, str] = field(default_factory=dict)
    """Bid index -> the policy's reason at its last ranking (policies cleared offer by offer)."""
    excluded: dict[int, int] = field(default_factory=dict)
    """Bid index -> unstarted grants, for bids left out for capacity."""
    last_win_why: str = ""
    last_win_tenant: str = ""
    repush: int | None = None
    """A winner's index: back in the heap with its new key before the next offer (it may win again
    while it has capacity)."""
    state: PolicyState = None
    """What else a policy keeps for the group while the batch is cleared (``jasda``: its heaps)."""
    shared: tuple[Verdict, ...] = ()
    entry_of: dict[str, int] = field(default_factory=dict)
    """Job -> the index of its verdict in ``shared`` (jobs that won an offer of the group)."""

    def shared_verdicts(
        self, pol: ClearingPolicy, scratch: Ledger, cfg: PolicyConfig, agents: Sequence[str]
    ) -> tuple[Verdict, ...]:
        """The verdicts every offer of the group shares: each bid's reason for the batch (a job that
        won some of them: the offers it took), then the invalid bids, then the agents without a bid."""
        no_bid = no_bid_verdicts(agents, self.every)
        if self.duplicate_of:
            reason = (
                f"{VerdictKind.INVALID}: slice {self.offer.window.slice_id} is offered twice in this batch"
                f" (cleared on {self.duplicate_of})"
            )
            return (*[losing_verdict(b, reason) for b in self.every], *no_bid)
        out: list[Verdict] = []
        whys: dict[str, str] = {}
        for i, b in enumerate(self.bids):
            p = b.proposal
            took = self.won.get(p.job_id)
            if took is not None:
                self.entry_of[p.job_id] = len(out)
                out.append(losing_verdict(b, f"lost: took {', '.join(took)} in this batch"))
                continue
            pending = self.excluded.get(i, scratch.unseen_grants(p.job_id, p.grants_seen, self.now))
            if pending >= p.capacity:
                out.append(excluded_verdict(b, pending))
                continue
            if i in self.lost_reason:
                reason = self.lost_reason[i]
            else:
                # A policy that explains a bid by its tenant alone: one explanation per tenant.
                memo_key = p.tenant if pol.explains_by_tenant else None
                why = whys.get(memo_key) if memo_key is not None else None
                if why is None:
                    keyed = pol.explain(self.offer, scratch, cfg)
                    why = keyed(b)[2] if keyed is not None else "not ranked"
                    if memo_key is not None:
                        whys[memo_key] = why
                reason = pol.lost_in_batch(b, why, self, scratch) if self.won else f"no winner: {why}"
            out.append(losing_verdict(b, reason))
        return (*out, *self.invalid, *no_bid)


def lazy_best(
    pol: MonotonePolicy, offer: Offer, g: Group, scratch: Ledger, cfg: PolicyConfig, now: float
) -> tuple[list[tuple[tuple[float, ...], int, Candidate]], int, Candidate, list[str]] | None:
    """The smallest key among the eligible bids, taken out of its heap: per tenant (``by_tenant``;
    one partition otherwise) a heap of the bids' own key parts, the minimum over the tenants' heads.
    Keys can only grow during a batch, so a head is re-checked and pushed down when its key grew;
    a winner goes back into its heap with its new key before the next offer. Returns the winner's
    heap, index and candidate and the tenants its partition was weighed among; None: no bid can win."""
    if g.heaps is None:
        g.heaps = {}
        for i, b in enumerate(g.bids):
            k, cand = pol.rank(offer, b, scratch, cfg)
            g.heaps.setdefault(b.proposal.tenant if pol.by_tenant else "", []).append((k, i, cand))
        for h in g.heaps.values():
            heapq.heapify(h)
    if g.repush is not None:
        b = g.bids[g.repush]
        k, cand = pol.rank(offer, b, scratch, cfg)
        heapq.heappush(g.heaps[b.proposal.tenant if pol.by_tenant else ""], (k, g.repush, cand))
        g.repush = None
    live: list[str] = []
    for part, h in g.heaps.items():
        settle(pol, offer, g, h, scratch, cfg, now)
        if h:
            live.append(part)
    tenants = pol.tenants(scratch, live)
    best: tuple[tuple[float, ...], tuple[float, ...], int] | None = None
    best_part = ""
    for part in live:
        h = g.heaps[part]
        cand_key = (pol.partition_key(part, scratch, cfg, tenants), h[0][0], h[0][1])
        if best is None or cand_key < best:
            best, best_part = cand_key, part
    if best is None:
        return None
    heap = g.heaps[best_part]
    _k, i, cand = heapq.heappop(heap)
    g.repush = i
    return heap, i, cand, tenants


def settle(
    pol: MonotonePolicy,
    offer: Offer,
    g: Group,
    h: list[tuple[tuple[float, ...], int, Candidate]],
    scratch: Ledger,
    cfg: PolicyConfig,
    now: float,
) -> None:
    """Drop the heap's head while it cannot win: its job at capacity, or the policy no longer
    admits it (which stays so for the batch); a head whose key grew goes back down."""
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
        if not pol.admits(stored_cand, p.tenant, scratch, cfg):
            heapq.heappop(h)
            continue
        # A win in another group of the batch may have raised this bid's key (never lowered
        # it): a head whose key is still what it was stored with is the partition's minimum.
        k, cand = pol.rank(offer, b, scratch, cfg)
        if k == stored:
            return
        heapq.heapreplace(h, (k, i, cand))


def clear_full(
    pol: ClearingPolicy, offer: Offer, g: Group, scratch: Ledger, cfg: PolicyConfig, now: float
) -> Decision:
    """Rank every eligible bid for this offer with the policy's ``clear`` (policies whose keys
    depend on everyone's share, and any policy without a faster exact way)."""
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
    d = pol.clear(offer, eligible, scratch, cfg)
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
