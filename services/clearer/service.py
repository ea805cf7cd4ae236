"""Clearer: collects the replies to each offer batch, clears it by policy (``clear_batch``), takes
each won slice with a compare-and-set on its KV entry, and publishes the grants, the outcomes and a
round record per offer. A lone ``Offer`` is a batch of one. What a winner is charged, its lease and
grant, its refund and its verdict when the slice is not taken are the core's (``core.grants``)."""

from __future__ import annotations

import asyncio
import collections
import logging
import time

from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import trace

from services.clearer.records import RecordWriter, round_record
from services.clearer.rounds import Cleared, OpenRound
from services.clearer.settings import ClearerSettings
from sja.bus.codec import decode, encode
from sja.bus.rounds import iter_rounds
from sja.bus.service import Service
from sja.bus.tracing import child_span, extract, inject, publish
from sja.core import grants, leases
from sja.core.policies import POLICIES, Bid, Decision, Ledger, PolicyConfig, clear_batch
from sja.core.rounds import (
    all_replied,
    close_by,
    fresh_offers,
    live_agents,
    outcome_verdicts,
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
    RoundRecord,
    SliceState,
    Verdict,
    YieldRequest,
)
from sja.telemetry.metrics import LATENCY_BUCKETS_S

log = logging.getLogger(__name__)
tracer = trace.get_tracer("sja.clearer")


MAX_EARLY_REPLIES = 4096
"""Replies that overtook their offer are kept (one per round and agent) until the reply window
has passed; bounded so a flood cannot grow memory."""
MAX_CLOSED_REMEMBERED = 20_000
"""Rounds recently closed: a reply that arrives after its round closed is dropped, not taken for
one that overtook its offer."""


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
        self.yields_asked = 0
        """Grants that took a slice from a holder past its window (``core.continuation``)."""
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
        self.records = RecordWriter(lambda: self.jetstream, self.spawn, self.m_records_lost)
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
            await self.records.publish(rnd, records, shared)
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
        grants.learn_service(self.ledger, rnd.offers, (b for bs in bids.values() for b in bs))
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
            record = round_record(rnd, offer, decision, grant, note, because, len(bids))
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
            leased, revision, preempted = taken
            span.set_attribute("sja.fence", leased.fence)
            if preempted is not None:
                # Its holder went on past its window (core.continuation): it yields to the winner.
                span.set_attribute("sja.preempted_grant", preempted.grant_id)
                await self._ask_yield(preempted, leased)
            grant = grants.grant(award, leased, revision)
            self.grants += 1
            granted.append((grant, inject()))
            labels = {"pool": offer.window.pool, "policy": grant.policy}
            self.m_grants.add(1, tenant=grant.tenant, **labels)
            # Clocks of two hosts: a small skew must not make a negative latency.
            self.m_offer_to_grant.record(max(0.0, time.time() - offer.issued_at), **labels)
            return grant

    async def _ask_yield(self, preempted: SliceState, leased: SliceState) -> None:
        """Ask the executor of a slice taken from a holder past its window to make it yield."""
        self.yields_asked += 1
        req = YieldRequest(
            slice_id=leased.slice_id,
            node=leased.node,
            holder_grant_id=preempted.grant_id,
            grant_id=leased.grant_id,
            fence=leased.fence,
            issued_at=time.time(),
        )
        await self.bus.publish(subjects.slice_yield(leased.node), encode(req))

    async def _take(
        self, award: grants.Award
    ) -> tuple[SliceState, int, SliceState | None] | grants.NotGranted:
        """Write the slice's lease to the award's winner: the slice leased, its new revision, and the
        slice as it was when the grant takes it from a holder past its window (else ``None``).
        The offer carries the slice as offered: one compare-and-set against that revision, and a
        read only when the slice changed since (a stale offer, or a touched entry)."""
        slices, offer = self.slices, award.offer
        assert slices is not None
        offered = grants.offered_slice(offer)
        if offered is not None:
            leased = grants.lease(offered, award)
            revision = await slices.cas(offered.slice_id, leased, offer.slice_revision)
            if revision is not None:
                return leased, revision, None
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
        return leased, revision, (current if current.status != "free" else None)

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


def _new_grant_id(_offer: Offer) -> str:
    return new_id("g")
