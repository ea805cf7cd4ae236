"""An agent's jobs kept ranked by a policy's bid order, so that answering a batch of offers costs
O(changed jobs + bids sent) instead of O(jobs owned).

Pure: the caller says which jobs changed (``mark``) or went away (``drop``) and supplies each job's
proposal for a window shape (``proposal_of``, memoized by the caller); the book re-ranks only the
jobs marked since it last answered for that shape and returns the best ``k`` per tenant (or overall)
in the policy's order (``policies.BID_ORDERS``). Only orders that do not depend on the offer's time
(``BidOrder.static``) can be kept between batches; for the others use ``policies.shortlist``.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from sja.core.policies import BidOrder, PolicyConfig
from sja.protocol.messages import Offer, Proposal

Key = tuple[object, ...]
"""A bid order's key; its last element is the job id, so keys are unique."""


@dataclass
class _ShapeIndex:
    dirty: set[str]
    entries: dict[str, tuple[str, Key]] = field(default_factory=dict)
    """job id -> (part, key) of the job's current entry."""
    parts: dict[str, list[Key]] = field(default_factory=dict)
    """part (tenant, or "" when the order is not per tenant) -> keys, sorted."""


class BidBook:
    """The jobs of one agent ranked, per window shape, by one policy's bid order."""

    def __init__(self, order: BidOrder, config: PolicyConfig, max_shapes: int = 8) -> None:
        if not order.static:
            raise ValueError("a bid book needs an order that does not depend on the offer's time")
        self.order = order
        self.config = config
        self.max_shapes = max_shapes
        self.jobs: set[str] = set()
        self._shapes: OrderedDict[Hashable, _ShapeIndex] = OrderedDict()

    def mark(self, job_id: str) -> None:
        """The job is new or its state changed: rank it again before the next answer."""
        self.jobs.add(job_id)
        for idx in self._shapes.values():
            idx.dirty.add(job_id)

    def drop(self, job_id: str) -> None:
        """The job is gone (finished, or no longer this agent's)."""
        self.jobs.discard(job_id)
        for idx in self._shapes.values():
            idx.dirty.add(job_id)

    def best(
        self,
        shape: Hashable,
        offer: Offer,
        k: int,
        proposal_of: Callable[[str], Proposal | None],
    ) -> list[Proposal]:
        """The best ``k`` proposals per part for windows of ``shape`` (``offer`` is one of them),
        in the order's ranking, best first within each part; parts in name order."""
        idx = self._shapes.get(shape)
        if idx is None:
            idx = self._shapes[shape] = _ShapeIndex(dirty=set(self.jobs))
            while len(self._shapes) > self.max_shapes:
                self._shapes.popitem(last=False)
        else:
            self._shapes.move_to_end(shape)
        for job_id in idx.dirty:
            old = idx.entries.pop(job_id, None)
            if old is not None:
                keys = idx.parts[old[0]]
                i = bisect.bisect_left(keys, old[1])
                if i < len(keys) and keys[i] == old[1]:
                    del keys[i]
            p = proposal_of(job_id) if job_id in self.jobs else None
            if p is None:
                continue
            part = p.tenant if self.order.per_tenant else ""
            key = self.order.key(offer, p, self.config)
            bisect.insort(idx.parts.setdefault(part, []), key)
            idx.entries[job_id] = (part, key)
        idx.dirty.clear()
        out: list[Proposal] = []
        for part in sorted(idx.parts):
            for key in idx.parts[part][:k]:
                p = proposal_of(str(key[-1]))
                if p is not None:
                    out.append(p)
        return out
