"""Job agents: many jobs per process. Claims submitted jobs, answers offers from each job's
profiles, materializes a subjob on grant, and folds completions back into the job (calibrating its
profiles). Every decision is a call into ``sja.core`` (``jobs``, ``bidder``); this module handles
the messages and wires the rest: job writes with deferred acknowledgement (``sja.bus.persist``),
heartbeats and takeover (``takeover``), reaping (``reaping``), demand signals (``demand``) and the
agent's own spans (``spans``)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Callable

from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import context as otel_context
from opentelemetry import trace

from services.agent.demand import Demand
from services.agent.reaping import Reaper
from services.agent.reference import DueKeeper
from services.agent.settings import AgentSettings
from services.agent.spans import JobSpans, batch_reply_spans, reply_attributes
from services.agent.takeover import Takeover
from sja.bus.codec import DecodeError, decode, encode
from sja.bus.jetstream import Fetcher
from sja.bus.persist import DeferredWriter
from sja.bus.service import Service
from sja.bus.tracing import child_span, extract, inject, is_sampled, item_contexts, publish
from sja.core import jobs as J
from sja.core import leases, ownership, proofs
from sja.core.bidder import Bidder
from sja.core.planner import PlanLimits
from sja.core.policies import POLICIES, PolicyConfig
from sja.core.profile_cache import ProfileCache
from sja.protocol import subjects
from sja.protocol.messages import (
    BatchReply,
    Completion,
    ErrorReply,
    Grant,
    GrantBatch,
    InFlight,
    JobCancel,
    JobState,
    LeaseRelease,
    LeaseReleased,
    Offer,
    OfferBatch,
    Outcome,
    Proposal,
    Reply,
    ReplyGroup,
    Subjob,
)
from sja.telemetry.metrics import RATIO_BUCKETS, watch_consumers

log = logging.getLogger(__name__)
tracer = trace.get_tracer("sja.agent")

JOBS_CONSUMER = "agents"
MAX_POOLS = 10_000
"""Pools whose policy an agent remembers (bounded against outcomes naming made-up pools)."""
COMPLETIONS_ACK_PENDING = 50_000
"""Completions an agent may hold unacknowledged (delivered, waiting to be written with their job)."""


class AgentService(Service):
    name = "agent"

    def __init__(self, settings: AgentSettings) -> None:
        super().__init__(settings)
        self.cfg = settings
        self.agent_id = self.instance
        self.limits = PlanLimits(
            mem_reserve_mib=settings.mem_reserve_mib,
            start_overhead_s=settings.start_overhead_s,
            horizon_s=settings.horizon_s,
        )
        self.owned: dict[str, tuple[JobState, int]] = {}
        self.policy_config = PolicyConfig(horizon_s=settings.horizon_s)
        self.profiles = ProfileCache()
        """The profiles of the jobs this agent plans for (dropped when it no longer does)."""
        self.bidder = Bidder(self.limits, self.policy_config, self.profiles)
        """What the jobs this agent owns bid (``core.bidder``): memoized plans, shortlists, the jobs
        that sit out."""
        self.policy_of: dict[str, str] = {}
        """pool -> the policy its clearer clears with, as the last outcome from it said."""
        self.writer: DeferredWriter[JobState, Completion] = DeferredWriter(
            lambda: self.jobs,
            self.owned,
            refold=self._refold,
            still_mine=self._mine,
            on_saved=self.remember,
            on_reloaded=self._own,
            on_lost=self._lost,
        )
        """Writes the jobs to ``sja-jobs``; completions folded into a job here are deferred to its
        next write, and acknowledged once written."""
        self.takeover = Takeover(self)
        self.reaper = Reaper(self)
        self.demand = Demand(self)
        self.dues = DueKeeper(self)
        self.spans = JobSpans(self.agent_id)
        """The ``sja.job`` span of each job, from when this process took the job."""
        self.m_subjobs = self.metrics.counter(
            "sja_subjobs",
            "Subjob outcomes folded into their jobs, by status (ok, oom, timeout, failed, cancelled, lost).",
            unit="{subjob}",
        )
        self.m_mem_ratio = self.metrics.histogram(
            "sja_subjob_memory_ratio",
            "Measured peak memory of a successful subjob over its planned memory quantile "
            "(above 1: the plan was exceeded).",
            unit="1",
            buckets=RATIO_BUCKETS,
        )

    # --- start-up ----------------------------------------------------------------------------------

    async def on_start(self) -> None:
        await self.recover()
        # Answered as soon as read: the round waits for the reply (Service.subscribe, eager).
        await self.subscribe(subjects.offer_opened("*"), self.on_offer, eager=True)
        await self.subscribe(subjects.grant_issued(self.agent_id), self.on_grant)
        await self.subscribe(subjects.outcome_sent(self.agent_id), self.on_outcome)
        await self.subscribe(subjects.JOB_CANCEL_REQUESTED, self.on_cancel)
        self.takeover.heard_since = time.time()
        await self.subscribe(subjects.AGENT_HEARTBEAT, self.takeover.on_heartbeat)
        js = self.jetstream
        self._jobs_fetch = await js.pull_consumer(
            f"{subjects.PREFIX}.job.submitted.>",
            durable=JOBS_CONSUMER,
            stream=subjects.STREAM_JOBS.name,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_deliver=-1),
        )
        durable = "agent-" + subjects._key(self.agent_id)
        self._done_fetch = await js.pull_consumer(
            f"{subjects.PREFIX}.subjob.completed.>",
            durable=durable,
            stream=subjects.STREAM_COMPLETIONS.name,
            config=ConsumerConfig(
                ack_policy=AckPolicy.EXPLICIT,
                ack_wait=30,
                deliver_policy=DeliverPolicy.NEW,
                max_deliver=-1,
                # Completions stay unacknowledged until written with their job (up to
                # completion_flush_s): at thousands a second the server's default of 1000 would
                # hold deliveries back.
                max_ack_pending=COMPLETIONS_ACK_PENDING,
                inactive_threshold=self.cfg.completions_inactive_s,
            ),
        )
        await self.dues.start()
        self.loop(self.dues.forever())
        self.loop(self._pull_forever(self._jobs_fetch, self.on_submitted, batch=16))
        self.loop(self._pull_forever(self._done_fetch, self.on_completed, batch=self.cfg.completion_batch))
        self.loop(self.takeover.heartbeat_forever())
        self.loop(self.demand.forever())
        self.loop(self.reaper.reap_forever())
        if self.cfg.takeover_after_s > 0:
            self.loop(self.takeover.takeover_forever())
        if self.cfg.completion_flush_s > 0:
            self.loop(self.writer.flush_forever(self.cfg.completion_flush_s))
        self.loop(
            watch_consumers(
                js,
                [(subjects.STREAM_JOBS.name, JOBS_CONSUMER), (subjects.STREAM_COMPLETIONS.name, durable)],
                self.metrics,
            )
        )

    async def on_stop(self) -> None:
        # Completions folded in and not yet written: write them (and acknowledge) while connected.
        with contextlib.suppress(Exception):
            await self.writer.flush_all()
        with contextlib.suppress(Exception):
            await self.dues.stop()
        # See ExecutorService.on_stop: pull subscriptions go before the connection drains.
        for fetcher in (getattr(self, "_jobs_fetch", None), getattr(self, "_done_fetch", None)):
            if fetcher is not None:
                with contextlib.suppress(Exception):
                    await fetcher.stop()

    async def recover(self) -> None:
        """Take back the jobs this agent owned before a restart."""
        assert self.jobs is not None
        for state, rev in await self.jobs.all():
            assert isinstance(state, JobState)
            if state.owner_agent == self.agent_id and not J.is_terminal(state):
                self._own(state, rev)
                self.spans.taken(state.job_id, recovered=True)
        if self.owned:
            log.info("recovered %d jobs", len(self.owned))

    async def _pull_forever(self, fetcher: Fetcher, handler: Callable[[Msg], object], batch: int) -> None:
        while True:
            try:
                msgs = await fetcher.fetch(batch, timeout=1.0)
            except TimeoutError:
                continue
            except Exception as e:
                if self.stopping.is_set():
                    return
                log.warning("fetch failed: %s", e)
                await asyncio.sleep(0.2)
                continue
            # A fetched batch is handled concurrently (each job's messages still in order: they
            # take the job's lock in turn), so one slow write does not hold up the others.
            await asyncio.gather(*(self._handle_pulled(handler, msg) for msg in msgs))

    async def _handle_pulled(self, handler: Callable[[Msg], object], msg: Msg) -> None:
        try:
            await handler(msg)  # type: ignore[misc]
        except Exception:
            log.exception("handling %s failed", msg.subject)
            with contextlib.suppress(Exception):
                await msg.nak(delay=1.0)

    def ready(self, windows: int) -> None:
        """Jobs here can take ``windows`` more windows: tell the advertisers (coalesced)."""
        self.demand.ready(windows)

    def lock(self, job_id: str) -> asyncio.Lock:
        return self.writer.lock(job_id)

    # --- state persistence (sja.bus.persist) ---------------------------------------------------------

    async def save(
        self, job_id: str, transition: Callable[[JobState], JobState | None], force: bool = False
    ) -> JobState | None:
        """Apply ``transition`` to the job and write it by compare-and-set, with the completions
        folded in and not yet written (``DeferredWriter.save``)."""
        return await self.writer.save(job_id, transition, force)

    async def flush(self, job_id: str) -> None:
        """Write the job's completions folded in here and not yet written."""
        await self.writer.flush(job_id)

    def _refold(self, state: JobState, c: Completion) -> JobState:
        return J.apply_completion(state, c, time.time(), profiles=self.profiles)[0]

    def _mine(self, state: JobState) -> bool:
        return ownership.is_owned_by(state, self.agent_id)

    def _lost(self, job_id: str, state: JobState | None) -> None:
        if state is not None:
            # Taken over while this agent was silent: it is the new owner's now. Completions
            # folded in here reach the new owner too (or their subjobs are given up there).
            log.warning("job %s is owned by %s now: disowned", job_id, state.owner_agent)
        else:
            log.warning("job %s not found in the store: disowned", job_id)
        self._disown(job_id)

    def remember(self, state: JobState, rev: int) -> None:
        """The job as written at ``rev``: held, or let go if it is over."""
        if J.is_terminal(state):
            self.spans.ended(state)
            self._disown(state.job_id)
            self.writer.forget(state.job_id)
        else:
            self._own(state, rev)

    def _own(self, state: JobState, rev: int) -> None:
        held = self.owned.get(state.job_id)
        self.owned[state.job_id] = (state, rev)
        if held is not None and held[0] is state:
            # The same state written again (completions flushed): only the revision moved, and a
            # job's proposals depend on its state alone, so its plans and ranking still hold.
            return
        self.bidder.own(state)

    def _disown(self, job_id: str) -> None:
        self.owned.pop(job_id, None)
        self.bidder.drop(job_id)
        self.profiles.forget(job_id)
        self.spans.drop(job_id)

    # --- handlers ----------------------------------------------------------------------------------

    async def on_submitted(self, msg: Msg) -> None:
        """Claim a newly submitted job (shared durable consumer: one agent gets each)."""
        assert self.jobs is not None
        try:
            submitted = decode(msg.data, JobState)
        except DecodeError as e:
            log.error("dropping malformed submission: %s", e)
            self.metrics.rejected(f"{subjects.PREFIX}.job.submitted.>", e)
            await msg.term()
            return
        if len(self.owned) >= self.cfg.max_jobs:
            await msg.nak(delay=1.0)
            return
        got = await self.jobs.get(submitted.job_id)
        if got is None:
            # The gateway writes the state before publishing; recreate it if the write was lost.
            rev = await self.jobs.create(submitted.job_id, submitted)
            got = (submitted, rev) if rev else await self.jobs.get(submitted.job_id)
        if got is not None:
            state, rev = got
            assert isinstance(state, JobState)
            claimed = ownership.claim(state, self.agent_id, time.time())
            if claimed is not None:
                new_rev = await self.jobs.cas(state.job_id, claimed, rev)
                if new_rev is not None:
                    self.remember(claimed, new_rev)
                    self.spans.taken(state.job_id, recovered=False)
                    self.ready(J.slots_left(claimed))
                    log.info(
                        "claimed job %s (%s, %d units)",
                        state.job_id,
                        state.spec.workload,
                        state.total_units,
                    )
        await msg.ack()

    async def on_offer(self, msg: Msg) -> None:
        got = decode(msg.data, Offer | OfferBatch)  # type: ignore[arg-type]
        batch = got if isinstance(got, OfferBatch) else None
        offers: list[Offer] = got.offers if isinstance(got, OfferBatch) else [got]
        reply_to = offers[0].reply_to if batch is None else batch.reply_to
        pool = offers[0].window.pool
        if reply_to != subjects.offer_replied(pool) or any(
            o.window.pool != pool or o.reply_to != reply_to for o in offers
        ):
            # Replies go only where clearers listen: an offer cannot make agents publish elsewhere.
            log.warning("ignoring offer %s with reply subject %r", offers[0].offer_id, reply_to)
            return
        now = time.time()
        self.bidder.expire(now)
        self.reaper.saw(offers)
        ctx = extract(msg)
        if batch is None:
            with child_span(
                tracer,
                "sja.reply",
                context=ctx,
                kind=trace.SpanKind.CONSUMER,
                attributes={"sja.offer_id": offers[0].offer_id, "sja.agent": self.agent_id},
            ) as span:
                proposals = self.proposals_for(offers[0], now, 1)
                self.bidder.answered(offers[0].offer_id, now, [(offers[0], 1, proposals, self._policy(pool))])
                if span.is_recording():
                    span.set_attributes(reply_attributes(proposals))
                reply = Reply(offer_id=offers[0].offer_id, agent_id=self.agent_id, proposals=proposals)
                await publish(self.bus, reply_to, reply)
                self.bus.flush_now()  # the round waits for it
            return
        started_ns = time.time_ns()
        # Offers of one shape get one answer: the reply grows with jobs x shapes, not x offers.
        groups: dict[tuple[object, ...], list[Offer]] = {}
        for o in offers:
            groups.setdefault(self.bidder.shape(o), []).append(o)
        out = []
        sent: list[tuple[Offer, int, list[Proposal], str]] = []
        for like in groups.values():
            proposals = self.proposals_for(like[0], now, len(like))
            out.append(ReplyGroup(offer_ids=[o.offer_id for o in like], proposals=proposals))
            sent.append((like[0], len(like), proposals, self._policy(pool)))
        self.bidder.answered(batch.batch_id, now, sent)
        token = otel_context.attach(ctx)
        try:
            await publish(
                self.bus, reply_to, BatchReply(batch_id=batch.batch_id, agent_id=self.agent_id, groups=out)
            )
            self.bus.flush_now()  # the round waits for it
        finally:
            otel_context.detach(token)
        # Each offer is a round with a trace of its own: a sampled one gets its own sja.reply
        # span (spanning the whole batch's answer), an unsampled one nothing.
        if not batch.trace_contexts and not is_sampled(ctx):
            return  # no offer of the batch is traced
        contexts = item_contexts(batch.trace_contexts, len(offers), ctx)
        sampled = {o.offer_id: c for o, c in zip(offers, contexts, strict=True) if is_sampled(c)}
        if not sampled:
            return
        groups_sent = [(group, proposals) for group, (_, _, proposals, _) in zip(out, sent, strict=True)]
        batch_reply_spans(batch.batch_id, len(offers), self.agent_id, groups_sent, sampled, started_ns)

    def _policy(self, pool: str) -> str:
        return self.policy_of.get(pool, "")

    def proposals_for(self, offer: Offer, now: float, like_offers: int = 1) -> list[Proposal]:
        """The proposals this agent sends for ``like_offers`` windows shaped like ``offer``: once the
        pool's policy is known (from its clearer's outcomes), only the bids that could win one of
        them, else every owned job's proposal (``core.bidder.Bidder``). The answer is for the
        window as offered (planned from its start, not from the moment the offer arrived);
        materialization re-plans with the time actually left and never cuts more than the
        proposal, so a memoized answer can never make a subjob unsafe."""
        return self.bidder.proposals_for(offer, now, like_offers, self._policy(offer.window.pool))

    async def on_outcome(self, msg: Msg) -> None:
        outcome = decode(msg.data, Outcome)
        if outcome.pool and outcome.policy in POLICIES:
            if outcome.pool not in self.policy_of and len(self.policy_of) >= MAX_POOLS:
                self.policy_of.clear()
            self.policy_of[outcome.pool] = outcome.policy
        self.bidder.cleared(outcome.offer_id)
        if log.isEnabledFor(logging.DEBUG):
            for v in outcome.verdicts:
                if not v.won:
                    log.debug("job %s lost offer %s: %s", v.job_id, outcome.offer_id, v.reason)

    async def on_grant(self, msg: Msg) -> None:
        got = decode(msg.data, Grant | GrantBatch)  # type: ignore[arg-type]
        if isinstance(got, Grant):
            todo = [(got, extract(msg))]
        else:
            # Each grant under its own sja.grant span (the message's headers carry the batch's).
            contexts = item_contexts(got.trace_contexts, len(got.grants), extract(msg))
            todo = list(zip(got.grants, contexts, strict=True))
        for grant, ctx in todo:
            self.bidder.grant_started(grant.job_id)
            self.spans.granted(grant.job_id, ctx)
        try:
            if len(todo) == 1:
                await self._materialize(*todo[0])
            else:
                await asyncio.gather(*(self._materialize_logged(g, ctx) for g, ctx in todo))
        finally:
            for grant, _ in todo:
                self.bidder.grant_done(grant.job_id)

    async def _materialize_logged(self, grant: Grant, ctx: otel_context.Context) -> None:
        """One grant of a batch: its failure is logged and does not stop the others."""
        try:
            await self._materialize(grant, ctx)
        except Exception:
            log.exception("materializing grant %s for %s failed", grant.grant_id, grant.job_id)

    async def _materialize(self, grant: Grant, ctx: otel_context.Context) -> None:
        async with self.lock(grant.job_id):
            with child_span(
                tracer,
                "sja.materialize",
                context=ctx,
                attributes={
                    "sja.job_id": grant.job_id,
                    "sja.grant_id": grant.grant_id,
                    "sja.slice": grant.window.slice_id,
                    "sja.fence": grant.fence,
                },
            ) as span:
                if grant.job_id not in self.owned:
                    span.set_attribute("sja.note", str(J.Declined.NOT_OWNED))
                    await self.release(grant, J.Declined.NOT_OWNED)
                    return
                # A grant is only as good as its lease. The grant carries the lease the clearer
                # wrote: one that disagrees with it is refused here; one that agrees but has since
                # lapsed (a replay) becomes a subjob the executor refuses by compare-and-set
                # (reported lost, its units planned again). Only a grant without a lease is read.
                w = grant.window
                ok = leases.carried_lease(
                    grant.grant_id, grant.fence, w.slice_id, grant.job_id, grant.slice_state
                )
                if ok is None:
                    assert self.slices is not None
                    got = await self.slices.get(w.slice_id)
                    ok = got is not None and leases.carried_lease(
                        grant.grant_id, grant.fence, w.slice_id, grant.job_id, got[0]
                    )
                if not ok:
                    span.set_attribute("sja.note", "stale grant: the slice's lease moved on")
                    log.warning(
                        "ignoring stale grant %s for %s on %s (fence %d)",
                        grant.grant_id,
                        grant.job_id,
                        grant.window.slice_id,
                        grant.fence,
                    )
                    return
                now = time.time()
                made: list[J.Materialized] = []
                key = secrets.token_bytes(proofs.PROOF_KEY_BYTES)

                def transition(state: JobState) -> JobState | None:
                    m = J.materialize(
                        state, grant, now, self.limits, self.agent_id, profiles=self.profiles, proof_key=key
                    )
                    made[:] = [m]
                    return m.state

                saved = await self.save(grant.job_id, transition)
                m = made[0] if made and saved is not None else None
                if m is None or m.subjob is None:
                    reason = m.reason if m is not None and m.reason is not None else J.Declined.JOB_GONE
                    span.set_attribute("sja.note", str(reason))
                    if J.gives_slice_back(reason):
                        await self.release(grant, reason)
                    else:  # a replay
                        log.warning("ignoring grant %s for %s: %s", grant.grant_id, grant.job_id, reason)
                    return
                sj = m.subjob
                span.set_attribute("sja.subjob_id", sj.subjob_id)
                span.set_attribute("sja.units", sj.units)
                span.set_attribute("sja.planned_mem_q_mib", sj.planned_mem_q_mib)
                span.set_attribute("sja.planned_duration_q_s", sj.planned_duration_q_s)
                await self.dispatch(sj, grant.lease_until)

    async def dispatch(self, sj: Subjob, until: float) -> None:
        """Publish a subjob to ``SJA_SUBJOBS``, retrying (the same ``Nats-Msg-Id``: JetStream keeps
        one) while JetStream cannot take it, until its lease would have lapsed. A subjob that never
        gets through is given up by ``reap`` and its units planned again."""
        try:
            await self.jetstream.publish_until(
                subjects.subjob_dispatched(sj.node, sj.job_id),
                encode(sj),
                inject({"Nats-Msg-Id": sj.subjob_id}),
                until=until,
            )
        except Exception as e:
            log.warning("could not dispatch subjob %s before its lease lapsed: %r", sj.subjob_id, e)

    async def release(self, grant: Grant, reason: str) -> bool:
        """Give a granted slice back at once instead of letting its lease run out: a request to the
        inventory (``sja.v1.lease.release``), which frees the slice if it still holds the grant at
        its fence. Returns whether it was freed; unanswered, the lease runs out as it would have."""
        req = LeaseRelease(
            slice_id=grant.window.slice_id,
            grant_id=grant.grant_id,
            fence=grant.fence,
            job_id=grant.job_id,
            reason=reason[:200],
        )
        try:
            resp = await self.bus.request(
                subjects.LEASE_RELEASE, encode(req), timeout=self.cfg.release_timeout_s
            )
            got = decode(resp.data, LeaseReleased | ErrorReply)  # type: ignore[arg-type]
        except Exception as e:
            log.warning("could not give %s back (%r): its lease runs out instead", grant.window.slice_id, e)
            return False
        if isinstance(got, ErrorReply):
            log.warning("giving %s back refused: %s %s", grant.window.slice_id, got.code, got.message)
            return False
        if got.released:
            log.info("released %s for %s: %s", grant.window.slice_id, grant.job_id, reason)
        return bool(got.released)

    async def on_completed(self, msg: Msg) -> None:
        try:
            c = decode(msg.data, Completion)
        except DecodeError as e:
            log.error("dropping malformed completion: %s", e)
            self.metrics.rejected(f"{subjects.PREFIX}.subjob.completed.>", e)
            await msg.term()
            return
        if c.job_id not in self.owned:
            await msg.ack()
            return
        async with self.lock(c.job_id):
            with child_span(
                tracer,
                "sja.complete",
                context=extract(msg),
                kind=trace.SpanKind.CONSUMER,
                attributes={
                    "sja.job_id": c.job_id,
                    "sja.subjob_id": c.subjob_id,
                    "sja.status": c.status,
                    "sja.units": c.units,
                    "sja.peak_mem_mib": c.peak_mem_mib,
                    "sja.duration_s": c.duration_s,
                },
            ) as span:
                if c.job_id not in self.owned:
                    await msg.ack()
                    return
                current, rev = self.owned[c.job_id]
                unproven = proofs.verify_completion(current, c)
                if unproven is not None and unproven is not proofs.Unproven.NOT_IN_FLIGHT:
                    # Not from the executor that holds the grant: a forgery, or a subjob made
                    # before completions were proven (given up when overdue and planned again).
                    span.set_attribute("sja.note", f"unproven: {unproven.value}")
                    self.drop_unproven(c, unproven)
                    await msg.term()
                    return
                with child_span(tracer, "sja.calibrate", attributes={"sja.job_id": c.job_id}):
                    new, ok = J.apply_completion(current, c, time.time(), profiles=self.profiles)
                span.set_attribute("sja.applied", ok)
                if not ok:
                    pending = self.writer.pending(c.job_id)
                    if any(u.subjob_id == c.subjob_id and u.grant_id == c.grant_id for _, u in pending):
                        # Delivered again before its first delivery was written (the write is
                        # late): acknowledged with that write, never before it.
                        self.writer.defer(c.job_id, msg, c)
                        return
                    await msg.ack()  # a duplicate, or for a subjob no longer in flight: nothing to do
                    return
                flight = next((f for f in current.in_flight if f.subjob_id == c.subjob_id), None)
                self.record_completion(c, flight, current.spec.workload)
                # Folded in here at once (the job bids on it); written with the job's next write or
                # by the flusher, and acknowledged then. A finished job is written at once.
                self._own(new, rev)
                self.writer.defer(c.job_id, msg, c)
                if J.is_terminal(new) or self.cfg.completion_flush_s <= 0:
                    state = await self.writer.write_deferred(c.job_id)
                    if state is not None and J.is_terminal(state):
                        log.info("job %s %s after %d subjobs", c.job_id, state.status, state.next_seq)
                        return
                if J.can_take_more(new):
                    self.ready(1)
                    rest_s = new.bids_again_at - time.time()
                    if rest_s > 0:  # backing off after timeouts: offers are asked for again at its end
                        asyncio.get_running_loop().call_later(rest_s, self.ready, 1)

    def drop_unproven(self, c: Completion, why: proofs.Unproven) -> None:
        """Count and report a completion dropped because it does not prove its grant."""
        log.warning(
            "dropping completion of %s (grant %s, fence %d, %s from executor %r): %s",
            c.subjob_id,
            c.grant_id,
            c.fence,
            c.status,
            c.executor_id[:80],
            why.value,
        )
        self.metrics.rejected(f"{subjects.PREFIX}.subjob.completed.>", "unproven")

    def record_completion(self, c: Completion, flight: InFlight | None, workload: str) -> None:
        """Count an applied completion (a duplicate is not applied, so not counted twice)."""
        self.m_subjobs.add(1, status=c.status)
        if c.status == "ok" and flight is not None and flight.planned_mem_q_mib > 0 and c.peak_mem_mib > 0:
            self.m_mem_ratio.record(
                c.peak_mem_mib / flight.planned_mem_q_mib, workload=workload, profile=flight.profile
            )

    async def on_cancel(self, msg: Msg) -> None:
        req = decode(msg.data, JobCancel)
        if req.job_id not in self.owned:
            return
        async with self.lock(req.job_id):
            if req.job_id in self.owned:
                await self.save(req.job_id, lambda s: J.request_cancel(s, time.time()))
