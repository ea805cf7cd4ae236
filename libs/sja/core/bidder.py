"""Which jobs bid for an offer: the agent's bidding as a pure object, shared with the simulator.

A ``Bidder`` holds a set of jobs (their latest states) and answers offers for them:

1. each job's proposal is planned once per (job state, window shape, policy) and remembered
   (``bidding.propose``, cut by ``policies.bid_for`` to the candidate the pool's policy would take);
2. a job sits out while the grants it holds fill its capacity, or while it is likely to win in a
   batch not yet cleared (``bidding.sits_out``);
3. only the bids that could win one of ``like_offers`` windows of a shape are sent
   (``policies.shortlist``), kept ranked between batches for a policy whose order does not depend
   on time (``BidBook``), so a batch costs the jobs that changed since the last one;
4. after a batch is answered, its likely winners (``policies.likely_winners``) are held back until
   its outcome comes, or ``bidding.BIDDING_TIMEOUT_S`` after;
5. a job backing off after timeouts (``bidding.resting``) sends no bid until its back-off ends, and is
   ranked again then (``wake``).

The agent service moves messages around it; the simulator drives it in virtual time, so what is
evaluated is what the services run.
"""

from __future__ import annotations

from collections.abc import Iterable

from sja.core.bidbook import BidBook
from sja.core.bidding import bidding_expired, may_bid_on, plan_time, propose, resting, sits_out
from sja.core.planner import PlanLimits
from sja.core.policies import BID_ORDERS, PolicyConfig, bid_for, likely_winners, shortlist, shortlist_size
from sja.core.profile_cache import ProfileCache
from sja.core.windows import unheld
from sja.protocol.messages import JobState, Offer, Proposal

PLAN_CACHE_LIMIT = 64
"""Window shapes whose proposal is remembered per job state (past it they are forgotten)."""

Shape = tuple[object, ...]


def _count(counts: dict[str, int], key: str, delta: int) -> None:
    """Add ``delta`` to a count, dropping it at zero (the dict holds only jobs counted)."""
    n = counts.get(key, 0) + delta
    if n > 0:
        counts[key] = n
    else:
        counts.pop(key, None)


class Bidder:
    """The bids of a set of jobs (see the module docstring)."""

    def __init__(
        self, limits: PlanLimits, config: PolicyConfig, profiles: ProfileCache | None = None
    ) -> None:
        self.limits = limits
        self.config = config
        self.profiles = profiles if profiles is not None else ProfileCache()
        """The jobs' profiles, shared with the owner's other uses of them (materializing, calibrating)."""
        self.states: dict[str, JobState] = {}
        self.plans: dict[str, dict[tuple[object, ...], Proposal | None]] = {}
        """job id -> its answer per (window shape, policy) at its current state."""
        self.books: dict[str, BidBook] = {}
        """policy -> the jobs ranked by the policy's bid order (static orders only)."""
        self.granted: dict[str, int] = {}
        """job id -> grants it holds and is still materializing."""
        self.likely: dict[str, int] = {}
        """job id -> open batches where it is likely to win."""
        self.bidding: dict[str, tuple[float, list[str]]] = {}
        """Batches answered and not yet cleared: key -> (when, the jobs likely to win there)."""
        self.resting: dict[str, float] = {}
        """job id -> when its back-off after timeouts ends (it sends no bid until then)."""

    # --- the jobs ---------------------------------------------------------------------------------

    def own(self, state: JobState) -> None:
        """The job's latest state (new, or changed: it is planned and ranked again)."""
        held = self.states.get(state.job_id)
        self.states[state.job_id] = state
        if held is state:
            return  # the same state: its plans and ranking still hold
        self.plans.pop(state.job_id, None)
        self.changed(state.job_id)

    def drop(self, job_id: str) -> None:
        """The job is no longer bid for (over, or no longer this bidder's)."""
        self.states.pop(job_id, None)
        self.plans.pop(job_id, None)
        self.resting.pop(job_id, None)
        for book in self.books.values():
            book.drop(job_id)

    def changed(self, job_id: str) -> None:
        """The job's bid may have changed (its grants or likely wins did): rank it again."""
        if job_id in self.states:
            for book in self.books.values():
                book.mark(job_id)

    def grant_started(self, job_id: str) -> None:
        """A grant for the job arrived and is being materialized."""
        _count(self.granted, job_id, +1)
        self.changed(job_id)

    def grant_done(self, job_id: str) -> None:
        """A grant for the job was materialized or declined."""
        _count(self.granted, job_id, -1)
        self.changed(job_id)

    # --- answering ------------------------------------------------------------------------------------

    def shape(self, offer: Offer) -> Shape:
        """What a job's answer to an offer depends on besides the job's state: the slice's kind, the
        window's length as offered, and the pool's largest slice (a measuring job's answer)."""
        w = offer.window
        length = (w.end_s - w.start_s) if w.end_s is not None else self.limits.horizon_s
        return (w.profile, w.mem_mib, w.compute_share, round(length, 3), w.largest_mib)

    def proposal(
        self, job_id: str, offer: Offer, now: float, policy: str, shape: Shape | None = None
    ) -> Proposal | None:
        """The job's answer for windows shaped like ``offer`` (memoized), or ``None`` when it has
        none, sits out, or does not bid for this window (a slice held past its window,
        ``bidding.may_bid_on``)."""
        state = self.states.get(job_id)
        if state is None or not may_bid_on(state, offer.window):
            return None
        return self._shaped(job_id, offer, now, policy, shape)

    def _shaped(
        self, job_id: str, offer: Offer, now: float, policy: str, shape: Shape | None = None
    ) -> Proposal | None:
        """``proposal`` for any window of the offer's shape: what depends on the job's state and the
        window's shape alone (memoized, and what the bid books rank), not on who holds the slice."""
        state = self.states.get(job_id)
        if state is None:
            return None
        if resting(state, now):
            self.resting[job_id] = state.bids_again_at
            return None
        plans = self.plans.get(job_id)
        if plans is None:
            plans = self.plans[job_id] = {}
        key = (shape if shape is not None else self.shape(offer), policy)
        p = plans.get(key)
        if p is None and key not in plans:
            offer = unheld(offer)  # the answer for the shape, whoever holds this slice
            p = propose(
                state, offer, plan_time(now, offer.window.start_s), self.limits, profiles=self.profiles
            )
            if p is not None and policy:
                p = bid_for(policy, offer, p, self.config)
            if len(plans) >= PLAN_CACHE_LIMIT:
                plans.clear()
            plans[key] = p
        if p is not None and sits_out(p, self.granted.get(job_id, 0), self.likely.get(job_id, 0)):
            return None
        return p

    def proposals_for(
        self, offer: Offer, now: float, like_offers: int = 1, policy: str = ""
    ) -> list[Proposal]:
        """The proposals to send for ``like_offers`` windows shaped like ``offer`` under ``policy``
        (``""``: not known yet, every job's proposal)."""
        self.wake(now)
        shape = self.shape(offer)

        def proposal_of(job_id: str) -> Proposal | None:
            return self._shaped(job_id, offer, now, policy, shape)

        # A held slice is bid for by fewer jobs than a free one of its shape (``bidding.may_bid_on``): those
        # are dropped from the shape's answer, not from what the books keep for the shape.
        held = offer.window.held_by

        def mine(p: Proposal) -> bool:
            state = self.states.get(p.job_id)
            return not held or (state is not None and may_bid_on(state, offer.window))

        order = BID_ORDERS.get(policy)
        if order is not None and order.static:
            book = self.books.get(policy)
            if book is None:
                book = self.books[policy] = BidBook(order, self.config)
                for job_id in self.states:
                    book.mark(job_id)
            best = book.best(shape, offer, shortlist_size(like_offers), proposal_of)
            return [p for p in best if mine(p)] if held else best
        out = [p for p in map(proposal_of, list(self.states)) if p is not None and mine(p)]
        return shortlist(policy, offer, out, like_offers, self.config) if policy else out

    def wake(self, now: float) -> list[str]:
        """The jobs whose back-off after timeouts has ended by ``now``: ranked again (they bid).
        Returns them."""
        woken = [job_id for job_id, until in self.resting.items() if now >= until]
        for job_id in woken:
            del self.resting[job_id]
            self.changed(job_id)
        return woken

    # --- batches in flight --------------------------------------------------------------------------

    def answered(self, key: str, now: float, sent: Iterable[tuple[Offer, int, list[Proposal], str]]) -> None:
        """A batch was answered with ``(offer, like offers, proposals, policy)`` per group: its likely
        winners sit out until ``cleared(key)``."""
        likely: list[str] = []
        for offer, like, proposals, policy in sent:
            if policy and proposals:
                likely.extend(likely_winners(policy, offer, proposals, like, self.config))
        if not likely:
            return
        self.bidding[key] = (now, likely)
        for job_id in likely:
            _count(self.likely, job_id, +1)
            self.changed(job_id)

    def cleared(self, key: str) -> None:
        """A batch's outcome came: its likely winners bid again (the winners hold grants now)."""
        got = self.bidding.pop(key, None)
        if got is None:
            return
        for job_id in got[1]:
            _count(self.likely, job_id, -1)
            self.changed(job_id)

    def expire(self, now: float) -> None:
        """Batches whose outcome never came (lost, or not for this bidder) stop holding jobs back."""
        while self.bidding:
            key, (at, _) = next(iter(self.bidding.items()))
            if not bidding_expired(at, now):
                break
            self.cleared(key)
