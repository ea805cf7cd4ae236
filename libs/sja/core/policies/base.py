"""What every clearing policy shares: the words of a round (bids, verdicts and their kinds,
decisions, the configuration) and the ``ClearingPolicy`` protocol a policy module implements.

Pure and deterministic. The rest of a round lives beside it: the ledger (``ledger``), the rules
applied before any policy ranks (``rules``: canonical order, one bid per job, capacity), ranking
and its explanation (``ranking``), the defaults a policy inherits (``defaults``) and the batch
engine (``batch``, used by ``clearing.clear_batch``). Every tie is broken by (submission time, job
id). Every bid gets a verdict: won, lost (with the reason), or invalid (with the reason); an agent
that replied with no bid for the window gets one too (``job_id`` empty).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Protocol

from sja.core.policies.ledger import Ledger
from sja.protocol.messages import Candidate, JobState, Offer, Proposal, Verdict

if TYPE_CHECKING:
    from sja.core.policies.batch import Group


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
    """The kind of a verdict a round made (see ``VerdictKind``)."""
    if v.won:
        return VerdictKind.WON
    if not v.job_id:
        return VerdictKind.NO_BID
    for kind in (VerdictKind.EXCLUDED, VerdictKind.INVALID):
        if v.reason.startswith(f"{kind}:"):
            return kind
    return VerdictKind.LOST


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


Keyed = tuple[tuple[float, ...], Candidate, str]
"""(sort key, candidate, explanation) for one bid: the smallest key wins."""

Ranked = tuple[tuple[float, ...], Candidate]
"""(sort key, candidate) for one bid: the part of its key a batch keeps in a heap."""

PolicyFn = Callable[[Offer, Sequence[Bid], Ledger, PolicyConfig], Decision]
"""A policy's clearing of one offer: ``(offer, eligible bids, ledger, config) -> decision``."""


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


# --- the protocol ------------------------------------------------------------------------------------


class ClearingPolicy(Protocol):
    """A clearing policy: what a policy module defines and registers once (``registry.register``).

    ``clear`` is the whole policy: it ranks the eligible bids of one offer and explains every one.
    The rest has defaults in ``Policy``: a batch clears offer by offer with ``clear`` unless the
    policy knows a faster exact way (``clear_in_batch``), a bid that lost every offer of a batch
    is explained by ``explain`` ("not ranked" without one), and waiting jobs are served by
    submission as far as a user can foresee (``queue_key``) unless the policy says otherwise.
    Code outside the policy modules asks the policy what it needs rather than branching on its
    name."""

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

    @property
    def reads_deadline(self) -> bool:
        """A job's deadline counts in the ranking (a submitter is told when the policy in use
        ignores it)."""
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

    def queue_key(self, job: JobState, ledger: Ledger) -> tuple[float, ...]:
        """Where a waiting ``job`` stands in the order the policy would likely serve the waiting
        jobs, from the job's own numbers and the service ``ledger`` holds: the smallest key first,
        ties left to the caller. Whatever orders waiting jobs by policy asks this (``core.explain``
        with a ledger of the jobs' own service, shares taken as equal)."""
        ...

    def queue_order(self) -> str:
        """The order of ``queue_key`` in words, as ``sja explain`` shows it to a user."""
        ...
