"""The clearer's open rounds: an offer batch waiting for its replies, and the batch as cleared."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from opentelemetry import context as otel_context

from sja.bus.tracing import extract
from sja.core import grants
from sja.core.policies import Bid, Decision
from sja.protocol.messages import BatchReply, Grant, Offer, Reply


@dataclass
class OpenRound:
    """An offer batch (or a lone offer) waiting for its replies."""

    key: str
    """The batch id, or the offer id of a lone offer."""
    offers: list[Offer]
    ctx: otel_context.Context
    """The trace context of the message's headers (a lone offer's round; in a batch, that of every
    offer without a context of its own)."""
    opened_at: float
    replies: dict[str, Reply | BatchReply] = field(default_factory=dict)
    closed: bool = False
    timer: asyncio.TimerHandle | None = None
    policy: str = ""
    """The policy it was cleared with."""
    granted: list[tuple[Grant, dict[str, str]]] = field(default_factory=list)
    """Its grants so far, each with the trace context of its ``sja.grant`` span (sent per agent
    once the batch's compare-and-sets are done)."""
    carriers: dict[str, dict[str, str]] = field(default_factory=dict)
    """offer id -> the trace context of its own ``sja.round`` (offers of a batch that have one)."""

    def context_of(self, offer: Offer) -> otel_context.Context:
        """The trace context of one offer's round."""
        carrier = self.carriers.get(offer.offer_id)
        return extract(carrier=carrier) if carrier else self.ctx

    def bids(self) -> dict[str, list[Bid]]:
        """offer id -> its bids. Offers with the same contributing reply groups share one list, so
        the clearing ranks them once."""
        ids = {o.offer_id for o in self.offers}
        parts: dict[str, list[int]] = {}
        groups: list[list[Bid]] = []
        for agent_id, r in sorted(self.replies.items()):
            if isinstance(r, Reply):
                if r.offer_id in ids:
                    groups.append([Bid(agent_id=agent_id, proposal=p) for p in r.proposals])
                    parts.setdefault(r.offer_id, []).append(len(groups) - 1)
                continue
            for g in r.groups:
                groups.append([Bid(agent_id=agent_id, proposal=p) for p in g.proposals])
                for offer_id in g.offer_ids:
                    if offer_id in ids:
                        parts.setdefault(offer_id, []).append(len(groups) - 1)
        joined: dict[tuple[int, ...], list[Bid]] = {}
        out: dict[str, list[Bid]] = {}
        empty: list[Bid] = []
        for o in self.offers:
            key = tuple(parts.get(o.offer_id, ()))
            if not key:
                out[o.offer_id] = empty
                continue
            if key not in joined:
                joined[key] = [b for k in key for b in groups[k]]
            out[o.offer_id] = joined[key]
        return out


@dataclass
class Cleared:
    """A closed round's batch as cleared (``ClearerService.decide``), its winners charged."""

    bids: dict[str, list[Bid]]
    """offer id -> its bids."""
    decisions: list[tuple[Offer, Decision]]
    awards: list[grants.Award | None]
    """Per decision, its winner as charged (``None``: no winner)."""
