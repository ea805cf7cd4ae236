"""Clearer: collects the replies to each offer batch, clears it by policy (``clear_batch``), takes
each won slice with a compare-and-set on its KV entry, and publishes the grants, the outcomes and a
round record per offer. A lone ``Offer`` is a batch of one. What a winner is charged, its lease and
grant, its refund and its verdict when the slice is not taken are the core's (``core.grants``)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from dataclasses import dataclass, field

import msgspec
from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import trace

from sja.bus.codec import decode, encode
from sja.bus.rounds import iter_rounds
from sja.bus.service import Service
from sja.bus.settings import BaseSettings, Pools, TenantBudgets, TenantShares, Weights3
from sja.bus.tracing import child_span, extract, inject, publish, trace_id_hex
from sja.core import grants, leases
from sja.core.policies import POLICIES, Bid, Decision, Ledger, PolicyConfig, clear_batch, grant_cost
from sja.core.rounds import (
    Shared,
    all_replied,
    close_by,
    fresh_offers,
    live_agents,
    outcome_verdicts,
    pack_records,
    whole_record,
)
from sja.protocol import subjects
from sja.protocol.ids import new_id
from sja.protocol.messages import (
    AgentHeartbeat,
    BatchReply,
    ErrorReply,
    Grant,
    GrantBatch,
    Offer,
    OfferBatch,
    Outcome,
    Reply,
    RoundBatch,
    RoundRecord,
    SliceState,
    Verdict,
)
from sja.telemetry.metrics import LATENCY_BUCKETS_S

log = logging.getLogger(__name__)
tracer = trace.get_tracer("sja.clearer")


MAX_EARLY_REPLIES = 4096
"""Replies that overtook their offer are kept (one per round and agent) until the reply window
has passed; bounded so a flood cannot grow memory."""
ROUND_ITEMS_PER_MESSAGE = 2048
"""Round records (weighing two) and shared verdicts (one) per ``SJA_ROUNDS`` message: a batch's
records, split so a message stays small (well under 1 MB)."""
RECORD_RETRY_S = 60.0
"""How long a batch's round records are tried again in the background when ``SJA_ROUNDS`` cannot take
them (a stream with no leader for a few seconds after a server is lost): within the stream's
two-minute duplicate window, so a try that was stored but not acknowledged is not stored twice."""
MAX_RECORD_RETRIES = 10_000
"""Record messages being tried again at once; past this a message is counted lost at once (memory
stays bounded while JetStream is down)."""
MAX_CLOSED_REMEMBERED = 20_000
"""Rounds recently closed: a reply that arrives after its round closed is dropped, not taken for
one that overtook its offer."""


class ClearerSettings(BaseSettings, frozen=True, kw_only=True):
    pools: Pools = ()
    """Pools this replica clears (``SJA_POOLS``, comma-separated); empty: all. Pools must not
    overlap between replicas (a slice is still never granted twice: the KV compare-and-set
    decides)."""
    policy: str = "fair"
    tenant_shares: TenantShares = msgspec.field(default_factory=dict)
    """``tenant=weight,...`` target shares for fairness policies (each weight positive)."""
    tenant_budgets: TenantBudgets = msgspec.field(default_factory=dict)
    """``tenant=credits,...`` budgets for the ``auction`` policy (unlisted tenants: unlimited)."""
    jasda_weights: Weights3 = (0.5, 0.3, 0.2)
    """``jasda`` policy: weights of utilization, fairness, responsiveness (three, non-negative)."""
    token_overuse: float = 0.10
    offer_queue: str = "sja-clearers"
    """NATS queue group for offers: replicas on the same pools share the rounds (each offer is
    cleared by one of them). Empty: every replica clears every offer it sees, and the KV
    compare-and-set picks one grant per slice."""
    lease_s: float = 5.0
    """How long a winner has to start its subjob before the slice returns to the pool."""
    agent_liveness_s: float = 3.0
    reply_grace_s: float = 0.2
    """How long past an offer's reply deadline a round may wait for a live agent that has not
    answered yet (it closes as soon as every live agent has)."""
    horizon_s: float = 8.0


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


class ClearerService(Service):
    name = "clearer"

    def __init__(self, settings: ClearerSettings) -> None:
        super().__init__(settings)
        self.cfg = settings
        if settings.policy not in POLICIES:
            raise ValueError(f"unknown policy {settings.policy!r} (known: {', '.join(POLICIES)})")
        self.policy = settings.policy
        self.pools = list(settings.pools)
        # Copies: the ledger charges budgets in place; the settings stay as they were read.
        self.ledger = Ledger(
            tenant_shares=dict(settings.tenant_shares),
            tenant_budgets=dict(settings.tenant_budgets),
        )
        self.policy_config = PolicyConfig(
            horizon_s=settings.horizon_s,
            jasda_weights=settings.jasda_weights,
            token_overuse=settings.token_overuse,
        )
        self.rounds: dict[str, OpenRound] = {}
        self.early: dict[tuple[str, str], tuple[float, Reply | BatchReply]] = {}
        """(round key, agent) -> (when it came, reply) for replies that overtook their offer."""
        self.open_slices: dict[str, str] = {}
        """slice id -> the key of the open round offering it."""
        self.closed: dict[str, float] = {}
        """Round key -> when it closed, for the last ``MAX_CLOSED_REMEMBERED`` rounds."""
        self.agents: dict[str, float] = {}
        self.grants = 0
        self.cleared = 0
        self.m_rounds = self.metrics.counter(
            "sja_rounds",
            "Rounds cleared, by outcome: granted, no_bids (no proposal at all), no_winner (proposals, "
            "none eligible), lost_cas (a winner, but the slice changed before the compare-and-set), "
            "duplicate (an offer for a slice already in an open round, or offered twice in one batch: "
            "not opened).",
            unit="{round}",
        )
        self.m_grants = self.metrics.counter(
            "sja_grants", "Grants issued (slice taken by compare-and-set, grant published).", unit="{grant}"
        )
        self.m_records_lost = self.metrics.counter(
            "sja_round_records_lost",
            "Round-record messages SJA_ROUNDS never took (tried again for RECORD_RETRY_S): their "
            "grants stand, their audit trail is missing.",
            unit="{message}",
        )
        self._record_retries = 0
        self.m_offer_to_grant = self.metrics.histogram(
            "sja_offer_to_grant_seconds",
            "Time from an offer's issue (advertiser clock) to its grant (clearer clock).",
            unit="s",
            buckets=LATENCY_BUCKETS_S,
        )

    async def on_start(self) -> None:
        # The series exists from the start, so a dashboard reads 0 lost rather than "no data".
        self.m_records_lost.add(0)
        await self.replay_ledger()
        pools = self.pools or ["*"]
        for pool in pools:
            await self.subscribe(subjects.offer_opened(pool), self.on_offer, queue=self.cfg.offer_queue)
            await self.subscribe(subjects.offer_replied(pool), self.on_reply)
        await self.subscribe(subjects.AGENT_HEARTBEAT, self.on_heartbeat)

    async def on_stop(self) -> None:
        """Open rounds die with the service: their timers must not fire on a closed connection
        (their offers are re-offered; the slices were never taken)."""
        for rnd in self.rounds.values():
            if rnd.timer is not None:
                rnd.timer.cancel()
        self.rounds.clear()
        self.open_slices.clear()

    async def add_endpoints(self, micro: object) -> None:
        async def set_policy(req: object) -> None:
            name = req.data.decode(errors="replace").strip()  # type: ignore[attr-defined]
            if name not in POLICIES:
                err = ErrorReply(
                    code="bad_request",
                    message=f"unknown policy {name[:64]!r} (known: {', '.join(POLICIES)})",
                    field="policy",
                )
                await req.respond(encode(err))  # type: ignore[attr-defined]
                return
            self.policy = name
            log.info("policy switched to %s", name)
            await req.respond(name.encode())  # type: ignore[attr-defined]

        await micro.add_endpoint(  # type: ignore[attr-defined]
            name="policy", subject=f"{subjects.PREFIX}.clearer.policy", handler=set_policy
        )

    async def replay_ledger(self) -> None:
        """Rebuild attained service from the durable round records, so a restart keeps fairness."""
        n = 0
        # A record's own verdicts name its winner: the shared ones are not needed here.
        async for rec in iter_rounds(self.jetstream, whole=False):
            if not self.pools or rec.window.pool in self.pools:
                self.ledger.replay_round(rec, self.cfg.lease_s)
            n += 1
        log.info("ledger rebuilt from %d round records", n)

    async def on_heartbeat(self, msg: Msg) -> None:
        hb = decode(msg.data, AgentHeartbeat)
        self.agents[hb.agent_id] = time.time()

    def live_agents(self, now: float) -> set[str]:
        return live_agents(self.agents, now, self.cfg.agent_liveness_s)

    async def on_offer(self, msg: Msg) -> None:
        got = decode(msg.data, Offer | OfferBatch)  # type: ignore[arg-type]
        now = time.time()
        if isinstance(got, OfferBatch):
            key, offers, reply_by = got.batch_id, list(got.offers), got.reply_by
        else:
            key, offers, reply_by = got.offer_id, [got], got.reply_by
        if key in self.rounds or key in self.closed:
            # The same offer delivered twice (a replay): said, so that it is seen to be handled.
            log.warning("offer %s delivered again: ignored", key)
            return
        # A slice already in an open round here (offered again before that round closed) waits for
        # it: two rounds for one slice clear it twice for at most one grant.
        fresh = fresh_offers(offers, self.open_slices)
        if len(fresh) < len(offers):
            self.m_rounds.add(
                len(offers) - len(fresh), pool=offers[0].window.pool, policy=self.policy, outcome="duplicate"
            )
            if not fresh:
                return
            offers = fresh
        rnd = OpenRound(key=key, offers=offers, ctx=extract(msg), opened_at=now)
        if isinstance(got, OfferBatch) and got.trace_contexts:
            # Missing entries (a shorter list) have the message's context, as empty ones do.
            pairs = zip(got.offers, got.trace_contexts, strict=False)
            rnd.carriers = {o.offer_id: c for o, c in pairs if c}
        self.rounds[key] = rnd
        for o in offers:
            self.open_slices[o.window.slice_id] = key
        for agent_id in list(self.agents):
            early = self.early.pop((key, agent_id), None)
            if early is not None:
                rnd.replies[agent_id] = early[1]
        issued_at = got.issued_at
        closes = close_by(
            reply_by, self.cfg.reply_grace_s, self.live_agents(now), issued_at=issued_at, received_at=now
        )
        delay = max(0.0, closes - now)
        rnd.timer = asyncio.get_running_loop().call_later(
            delay, lambda: self.spawn(self.close(key, "deadline"))
        )
        await self._maybe_close_early(rnd)

    async def on_reply(self, msg: Msg) -> None:
        reply = decode(msg.data, Reply | BatchReply)  # type: ignore[arg-type]
        key = reply.batch_id if isinstance(reply, BatchReply) else reply.offer_id
        rnd = self.rounds.get(key)
        if rnd is None:
            if key in self.closed:
                return  # too late: its round is over
            # The reply overtook its offer (no ordering across publishers): keep it briefly.
            now = time.time()
            self.early[(key, reply.agent_id)] = (now, reply)
            if len(self.early) > MAX_EARLY_REPLIES:
                horizon = now - 2.0
                for k2 in [k2 for k2, (at, _) in self.early.items() if at < horizon]:
                    del self.early[k2]
                while len(self.early) > MAX_EARLY_REPLIES:
                    self.early.pop(next(iter(self.early)))
            return
        if rnd.closed:
            return
        rnd.replies[reply.agent_id] = reply
        await self._maybe_close_early(rnd)

    async def _maybe_close_early(self, rnd: OpenRound) -> None:
        if all_replied(rnd.replies, self.live_agents(time.time())):
            await self.close(rnd.key, "all_replied")

    async def close(self, key: str, because: str) -> None:
        rnd = self.rounds.pop(key, None)
        if rnd is None or rnd.closed:
            return
        rnd.closed = True
        if rnd.timer is not None:
            rnd.timer.cancel()
        self.closed[key] = time.time()
        while len(self.closed) > MAX_CLOSED_REMEMBERED:
            self.closed.pop(next(iter(self.closed)))
        cleared = self.decide(rnd)
        token = otel_context.attach(rnd.ctx)
        try:
            # The batch's slices stay marked as in a round until their grants are made: an offer of
            # one of them meanwhile would only lose the compare-and-set.
            results = await self.settle(rnd, cleared, because)
            ended = collections.Counter((rec.window.pool, rec.policy, how) for rec, how in results)
            for (pool, policy_, how), n in ended.items():
                self.m_rounds.add(n, pool=pool, policy=policy_, outcome=how.value)
            await self._send_grants(rnd)
            self.bus.flush_now()  # the grants are the round's answer: out before the bookkeeping
            records = [rec for rec, _ in results]
            shared = [(d.shared, d.skip) for _, d in cleared.decisions]
            await self._publish_records(rnd, records, shared)
            await self._send_outcomes(rnd, outcome_verdicts((rec.verdicts for rec in records), shared))
        finally:
            otel_context.detach(token)
            for o in rnd.offers:
                if self.open_slices.get(o.window.slice_id) == key:
                    del self.open_slices[o.window.slice_id]

    def decide(self, rnd: OpenRound) -> Cleared:
        """Clear a closed round's batch under the current policy and charge every winner now,
        before anything awaits: a batch closing meanwhile sees these grants (a job never wins more
        windows than it can use). A grant that is not made is refunded by ``settle``."""
        bids = rnd.bids()
        policy = rnd.policy = self.policy
        decisions = clear_batch(
            policy, rnd.offers, lambda o: bids[o.offer_id], self.ledger, self.policy_config, rnd.replies
        )
        awarded = grants.awards(self.ledger, decisions, _new_grant_id, time.time(), self.cfg.lease_s)
        return Cleared(bids=bids, decisions=decisions, awards=awarded)

    async def settle(
        self, rnd: OpenRound, cleared: Cleared, because: str
    ) -> list[tuple[RoundRecord, grants.RoundEnd]]:
        """Take every won slice of the batch with a compare-and-set and make its grant (in
        ``rnd.granted``, sent by ``close``), all concurrently. Returns each offer's round record and
        how its round ended."""
        return await asyncio.gather(
            *(
                self._clear_one(rnd, o, d, a, cleared.bids[o.offer_id], because)
                for (o, d), a in zip(cleared.decisions, cleared.awards, strict=True)
            )
        )

    async def _clear_one(
        self,
        rnd: OpenRound,
        offer: Offer,
        decision: Decision,
        award: grants.Award | None,
        bids: list[Bid],
        because: str,
    ) -> tuple[RoundRecord, grants.RoundEnd]:
        """One offer of the batch: take the slice for its winner (``award``, charged already) and
        make the grant, or refund the award. Returns the round's record (published with the
        batch's; its verdicts go to the agents' outcomes) and how the round ended (counted once per
        batch)."""
        with child_span(
            tracer,
            "sja.clear",
            context=rnd.context_of(offer),
            kind=trace.SpanKind.CONSUMER,
            attributes={
                "sja.offer_id": offer.offer_id,
                "sja.batch_id": rnd.key if len(rnd.offers) > 1 else "",
                "sja.slice": offer.window.slice_id,
                "sja.policy": decision.policy,
                "sja.replies": len(rnd.replies),
                "sja.bids": len(bids),
                "sja.closed_because": because,
            },
        ) as span:
            grant: Grant | None = None
            note = ""
            if award is not None:
                got = await self._grant(award, rnd.granted)
                if isinstance(got, grants.NotGranted):
                    grants.refund(self.ledger, award)
                    note = got.note
                else:
                    grant = got
            if span.is_recording():
                won = next((v for v in decision.verdicts if v.won), None) if grant else None
                span.set_attribute("sja.job_id", grant.job_id if grant else "")
                if won is not None:
                    span.set_attribute("sja.score", won.score)
                    span.set_attribute("sja.tenant", won.tenant)
                # Why this round ended as it did: the winner's reason, else why nobody won.
                span.set_attribute(
                    "sja.reason", won.reason if won else note or ("no eligible bid" if bids else "no bids")
                )
                span.set_attribute(
                    "sja.reasons", "; ".join(f"{v.job_id}: {v.reason}" for v in decision.verdicts[:16])
                )
                if note:
                    span.set_attribute("sja.note", note)
            record = self._record(rnd, offer, decision, grant, note, because, len(bids))
        self.cleared += 1
        return record, grants.round_end(decision, grant is not None, len(bids))

    async def _grant(
        self, award: grants.Award, granted: list[tuple[Grant, dict[str, str]]]
    ) -> Grant | grants.NotGranted:
        """CAS the slice from free to leased; only then does the winner hold it. The grant joins
        ``granted`` (sent with the batch's other grants to the same agent by ``_send_grants``)."""
        offer = award.offer
        with child_span(
            tracer,
            "sja.grant",
            attributes={
                "sja.offer_id": offer.offer_id,
                "sja.job_id": award.job_id,
                "sja.slice": offer.window.slice_id,
                "sja.grant_id": award.grant_id,
                "sja.size": award.candidate.size,
            },
        ) as span:
            taken = await self._take(award)
            if isinstance(taken, grants.NotGranted):
                if taken.trace_note:
                    span.set_attribute("sja.note", taken.trace_note)
                return taken
            leased, revision = taken
            span.set_attribute("sja.fence", leased.fence)
            grant = grants.grant(award, leased, revision)
            self.grants += 1
            granted.append((grant, inject()))
            labels = {"pool": offer.window.pool, "policy": grant.policy}
            self.m_grants.add(1, tenant=grant.tenant, **labels)
            # Clocks of two hosts: a small skew must not make a negative latency.
            self.m_offer_to_grant.record(max(0.0, time.time() - offer.issued_at), **labels)
            return grant

    async def _take(self, award: grants.Award) -> tuple[SliceState, int] | grants.NotGranted:
        """Write the slice's lease to the award's winner: the slice leased and its new revision.
        The offer carries the slice as offered: one compare-and-set against that revision, and a
        read only when the slice changed since (a stale offer, or a touched entry)."""
        slices, offer = self.slices, award.offer
        assert slices is not None
        offered = grants.offered_slice(offer)
        if offered is not None:
            leased = grants.lease(offered, award)
            revision = await slices.cas(offered.slice_id, leased, offer.slice_revision)
            if revision is not None:
                return leased, revision
        got = await slices.get(offer.window.slice_id)
        if got is None:
            return grants.NotGranted(grants.Refusal.SLICE_GONE)
        current, rev = got
        try:
            leased = grants.lease(current, award)
        except leases.LeaseConflict as e:
            return grants.NotGranted(grants.Refusal.CONFLICT, str(e))
        revision = await slices.cas(current.slice_id, leased, rev)
        if revision is None:
            return grants.NotGranted(grants.Refusal.LOST_CAS)
        return leased, revision

    async def _send_grants(self, rnd: OpenRound) -> None:
        """The batch's grants, one message per agent: a ``Grant`` (under its ``sja.grant`` span) when
        the agent won one window, a ``GrantBatch`` carrying each grant's trace context when more."""
        by_agent: dict[str, list[tuple[Grant, dict[str, str]]]] = {}
        for grant, carrier in rnd.granted:
            by_agent.setdefault(grant.agent_id, []).append((grant, carrier))
        for agent_id, got in sorted(by_agent.items()):
            subject = subjects.grant_issued(agent_id)
            if len(got) == 1:
                grant, carrier = got[0]
                await self.bus.publish(subject, encode(grant), headers=carrier)
                continue
            batch = GrantBatch(
                batch_id=rnd.key, grants=[g for g, _ in got], trace_contexts=[c for _, c in got]
            )
            await publish(self.bus, subject, batch)

    async def _send_outcomes(self, rnd: OpenRound, by_agent: dict[str, list[Verdict]]) -> None:
        """One outcome per agent that replied, per batch: what happened to each of its jobs' bids
        (or that it sent none)."""
        for agent_id, vs in sorted(by_agent.items()):
            outcome = Outcome(
                offer_id=rnd.key, verdicts=vs, pool=rnd.offers[0].window.pool, policy=rnd.policy
            )
            await publish(self.bus, subjects.outcome_sent(agent_id), outcome)

    def _record(
        self,
        rnd: OpenRound,
        offer: Offer,
        decision: Decision,
        grant: Grant | None,
        note: str,
        because: str,
        bids: int,
    ) -> RoundRecord:
        verdicts = list(decision.verdicts)
        if grant is None and decision.winner is not None:
            verdicts = grants.unwon(verdicts, note)
        record = RoundRecord(
            offer_id=offer.offer_id,
            round=offer.round,
            window=offer.window,
            policy=decision.policy,
            replies_from=sorted(rnd.replies),
            verdicts=verdicts,
            winner_job=grant.job_id if grant else "",
            grant_id=grant.grant_id if grant else "",
            fence=grant.fence if grant else 0,
            closed_because=because,  # type: ignore[arg-type]
            note=note,
            trace_id=trace_id_hex(),
            opened_at=rnd.opened_at,
            cleared_at=time.time(),
            charged_gpu_s=grant_cost(offer, grant.candidate) if grant else 0.0,
            price=decision.price if grant else 0.0,
            batch_id=rnd.key if len(rnd.offers) > 1 else "",
            bids=bids,
        )
        return record

    async def _publish_records(
        self, rnd: OpenRound, records: list[RoundRecord], shared: list[Shared]
    ) -> None:
        """The batch's round records in ``SJA_ROUNDS`` messages of ``ROUND_ITEMS_PER_MESSAGE`` (a
        lone offer's record on its own, whole), de-duplicated by batch (or offer) id. A message
        carries each group's shared verdicts once (``RoundBatch.shared``)."""
        pool = rnd.offers[0].window.pool
        if len(rnd.offers) == 1 and rnd.key == rnd.offers[0].offer_id:
            parts: list[tuple[str, RoundRecord | RoundBatch]] = [
                (rnd.key, whole_record(records[0], shared[0]))
            ]
        else:
            batches = pack_records(rnd.key, records, shared, ROUND_ITEMS_PER_MESSAGE)
            parts = [(f"{rnd.key}:{first}", b) for first, b in batches]
        subject = subjects.round_cleared(pool)
        for msg_id, payload in parts:
            data, headers = encode(payload), inject({"Nats-Msg-Id": msg_id})
            try:
                await self.jetstream.publish(subject, data, headers=headers)
            except Exception as e:
                # The grants are out: their records follow when the stream takes them, without
                # holding the round's outcomes back.
                if self._record_retries >= MAX_RECORD_RETRIES:
                    self.m_records_lost.add(1)
                    log.error("round records %s not stored (%r; too many waiting already)", msg_id, e)
                    continue
                log.warning("round records %s not stored yet (%r): trying again", msg_id, e)
                self._record_retries += 1
                self.spawn(self._store_records_later(subject, data, headers, msg_id))

    async def _store_records_later(
        self, subject: str, data: bytes, headers: dict[str, str], msg_id: str
    ) -> None:
        try:
            await self.jetstream.publish_until(
                subject, data, headers, until=time.time() + RECORD_RETRY_S, first_delay_s=0.1
            )
            log.info("round records %s stored", msg_id)
        except asyncio.CancelledError:
            log.error("round records %s lost: the clearer stopped before SJA_ROUNDS took them", msg_id)
            raise
        except Exception as e:
            self.m_records_lost.add(1)
            log.error(
                "round records %s lost: SJA_ROUNDS did not take them in %.0fs (%r)", msg_id, RECORD_RETRY_S, e
            )
        finally:
            self._record_retries -= 1


def _new_grant_id(_offer: Offer) -> str:
    return new_id("g")
