"""``jasda``: a weighted score of utilization (efficiency), fairness (share deficit) and
responsiveness (waiting time, deadline urgency), with configurable weights."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sja.core.policies.base import Bid, BidOrder, Decision, Keyed, PolicyConfig, VerdictKind
from sja.core.policies.batch import Group, clear_full
from sja.core.policies.defaults import Policy
from sja.core.policies.ledger import Ledger
from sja.core.policies.ranking import efficiency_value, rank
from sja.protocol.messages import Candidate, Offer, Proposal, Verdict

ROUNDING = 2.0**-48
"""A bound, relative to the magnitude of the terms, on how far a bid's score ``(u + f) + r`` can
lie from its heap key ``u + r`` plus ``f`` (each addition rounds by at most 2**-53 of its operands'
magnitude: three additions, under 4 x 2**-53; two bids compared, under 8 x 2**-53; 2**-48 is
32 x 2**-53)."""


def jasda_fairness(tenant: str, ledger: Ledger, tenants: Sequence[str]) -> float:
    """The tenant's share deficit among ``tenants``, mapped to [0, 1] (0.5: at its target)."""
    deficit = ledger.target_fraction(tenant, tenants) - ledger.attained_fraction(tenant, tenants)
    return 0.5 + 0.5 * max(-1.0, min(1.0, deficit))


def jasda_resp(p: Proposal, now: float, cfg: PolicyConfig) -> float:
    """Responsiveness in [0, 1]: how long the job waited, or how little slack it has left."""
    waited = max(0.0, now - p.submitted_at) / cfg.responsiveness_scale_s
    urgency = 0.0
    if p.deadline_at is not None:
        slack = p.deadline_at - now - p.expected_remaining_s
        urgency = 1.0 - max(0.0, min(1.0, slack / cfg.responsiveness_scale_s))
    return min(1.0, max(waited, urgency))


def jasda_best(
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


def jasda_keyer(
    offer: Offer, ledger: Ledger, cfg: PolicyConfig, tenants: Sequence[str]
) -> Callable[[Bid], Keyed]:
    """``jasda``'s sort key of a bid: minus its best score (fairness among ``tenants``), then age."""
    w_u, w_f, w_r = cfg.jasda_weights
    fairness: dict[str, float] = {}

    def key(b: Bid) -> Keyed:
        p = b.proposal
        f = fairness.get(p.tenant)
        if f is None:
            f = fairness[p.tenant] = jasda_fairness(p.tenant, ledger, tenants)
        r = jasda_resp(p, offer.issued_at, cfg)
        s, c, u = jasda_best(offer, p, cfg, f, r)
        why = f"score {s:.3f} = {w_u:g}*util {u:.2f} + {w_f:g}*fair {f:.2f} + {w_r:g}*resp {r:.2f}"
        return (-s, p.submitted_at), c, why

    return key


def jasda_order(offer: Offer, p: Proposal, cfg: PolicyConfig) -> tuple[object, ...]:
    # Within a tenant the fairness term is the same for every bid: utilization and responsiveness
    # order them (responsiveness grows with waiting: the key depends on the offer's time).
    w_u, _w_f, w_r = cfg.jasda_weights
    resp = jasda_resp(p, offer.issued_at, cfg)
    best = -math.inf
    for c in p.candidates:
        util = efficiency_value(offer, c, cfg.horizon_s)
        best = max(best, w_u * util + w_r * resp)
    return (-best, p.submitted_at, p.job_id)


@dataclass
class JasdaHeaps:
    """A group's ``jasda`` heaps while a batch is cleared (``Group.state``)."""

    heaps: dict[str, list[tuple[float, int]]] | None = None
    """Per tenant, a heap of (minus the best score without the tenant's part, index in ``alike``);
    None until the group's first offer, and for a group cleared offer by offer."""
    alike: list[list[int]] = field(default_factory=list)
    """Bids of one tenant whose scores are equal whatever the tenant's part (the same terms, float
    for float), latest in canonical order first: only the last can win among them."""
    tol: float = 0.0
    """How far a bid's key may lie beyond its heap's head and the bid still rank first once its
    tenant's part is added (the two sums round differently)."""
    full: bool = False
    """The group clears offer by offer (its scores are not all finite)."""


class Jasda(Policy):
    """Weighted score over every (job, candidate): utilization, fairness, responsiveness."""

    def __init__(self) -> None:
        super().__init__(
            "jasda", BidOrder(per_tenant=True, key=jasda_order, static=False), reads_deadline=True
        )

    def clear(self, offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
        tenants = sorted({*ledger.tenant_attained, *(b.proposal.tenant for b in bids)})
        return rank(self.name, bids, jasda_keyer(offer, ledger, cfg, tenants), lambda k: -k[0][0])

    def explain(self, offer: Offer, ledger: Ledger, cfg: PolicyConfig) -> Callable[[Bid], Keyed] | None:
        """A losing bid in a batch: fairness among the tenants served so far and the bid's own."""

        def key(b: Bid) -> Keyed:
            tenants = sorted({*ledger.tenant_attained, b.proposal.tenant})
            return jasda_keyer(offer, ledger, cfg, tenants)(b)

        return key

    def clear_in_batch(
        self, offer: Offer, g: Group, scratch: Ledger, cfg: PolicyConfig, now: float
    ) -> Decision:
        st = g.state
        if not isinstance(st, JasdaHeaps):
            st = g.state = JasdaHeaps()
        if heaps_for(offer, g, st, cfg):
            return self.clear_lazy(offer, g, st, scratch, cfg, now)
        return clear_full(self, offer, g, scratch, cfg, now)

    def clear_lazy(
        self, offer: Offer, g: Group, st: JasdaHeaps, scratch: Ledger, cfg: PolicyConfig, now: float
    ) -> Decision:
        """The winner among the eligible bids, exactly as ``clear`` ranks them.

        The exact score adds the tenant's term between the other two, so it need not order a
        tenant's bids exactly as the heap does where their keys are within rounding of each other:
        every bid of the tenant whose key lies within ``tol`` of the head's is scored exactly, the
        rest cannot rank first (their exact score is lower by more than rounding can make up). Ties
        then break as ``clear`` breaks them: submission time, then canonical order."""
        heaps = st.heaps
        assert heaps is not None

        def first_eligible(k: int) -> int | None:
            """The first bid of ``alike[k]`` that can still win; bids at capacity leave for good
            (grants only accumulate in a batch); a winner stays, it may win again."""
            members = st.alike[k]
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
            return Decision(self.name, None, None, ())
        tenants = sorted({*scratch.tenant_attained, *live})
        best: tuple[tuple[float, float, int], Candidate] | None = None
        for tenant in live:
            h = heaps[tenant]
            f = jasda_fairness(tenant, scratch, tenants)
            limit = h[0][0] + st.tol
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
                s, c, _u = jasda_best(offer, p, cfg, f, jasda_resp(p, offer.issued_at, cfg))
                k = (-s, p.submitted_at, i)
                if best is None or k < best[0]:
                    best = (k, c)
        assert best is not None
        (_s, _at, i), cand = best
        b = g.bids[i]
        p = b.proposal
        key, _cand, why = jasda_keyer(offer, scratch, cfg, tenants)(b)
        g.last_win_why = why
        g.last_win_tenant = p.tenant
        v = Verdict(
            job_id=p.job_id, tenant=p.tenant, agent_id=b.agent_id, won=True,
            reason=f"{VerdictKind.WON}: {why}", score=round(-key[0], 6), size=cand.size,
        )  # fmt: skip
        return Decision(self.name, b, cand, (v,))


def heaps_for(offer: Offer, g: Group, st: JasdaHeaps, cfg: PolicyConfig) -> bool:
    """Build the group's heaps at its first offer; False: the group clears offer by offer.

    A bid's score is ``w_u*util + w_f*fairness + w_r*resp``: util depends on the window's shape
    and resp on the offer's ``issued_at``, both the same for every offer of a group, so only the
    fairness term moves during the batch, and it is the same for every bid of a tenant. A heap per
    tenant ordered by ``w_u*util + w_r*resp`` (best candidate) holds the bids; the tenant's term is
    worked out afresh for each window. Bids of a tenant with the same terms, float for float, share
    one heap entry (their scores tie for any fairness, and the first in canonical order wins ties).
    Only a group whose terms are all finite clears this way: with a NaN or an infinity the sums do
    not order like their parts, and the group is cleared offer by offer (``clear_full``), which
    gives the same answer by definition."""
    if st.heaps is not None:
        return True
    if st.full:
        return False
    w_u, w_f, w_r = cfg.jasda_weights
    heaps: dict[str, list[tuple[float, int]]] = {}
    alike: dict[tuple[object, ...], int] = {}
    magnitude = abs(w_f)
    finite = all(math.isfinite(w) for w in cfg.jasda_weights)
    for i, b in enumerate(g.bids):
        p = b.proposal
        resp = w_r * jasda_resp(p, offer.issued_at, cfg)
        part = -math.inf
        terms: list[object] = [p.tenant, resp]
        for c in p.candidates:
            util = w_u * efficiency_value(offer, c, cfg.horizon_s)
            part = max(part, util + resp)
            magnitude = max(magnitude, abs(util) + abs(resp) + abs(w_f))
            terms += (util, c.size)
        finite = finite and math.isfinite(part) and math.isfinite(p.submitted_at)
        k = alike.setdefault(tuple(terms), len(st.alike))
        if k == len(st.alike):
            st.alike.append([])
            heaps.setdefault(p.tenant, []).append((-part, k))
        st.alike[k].append(i)
    if not (finite and math.isfinite(4.0 * magnitude)):
        st.full = True
        return False
    for h in heaps.values():
        heapq.heapify(h)
    for members in st.alike:
        members.reverse()
    st.heaps = heaps
    st.tol = magnitude * ROUNDING
    return True
