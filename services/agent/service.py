"""Job agents: many jobs per process. Claims submitted jobs, answers offers from each job's
profiles, materializes a subjob on grant, and folds completions back into the job (calibrating its
profiles). Every decision is a call into ``sja.core.jobs``; this module only moves state."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated

import msgspec
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from sja.bus.codec import DecodeError, decode, encode
from sja.bus.completions import iter_completions
from sja.bus.jetstream import Fetcher
from sja.bus.service import Service
from sja.bus.settings import BaseSettings
from sja.bus.tracing import ROOT, child_span, extract, inject, is_sampled, item_contexts, publish
from sja.core import jobs as J
from sja.core import leases
from sja.core.bidder import Bidder
from sja.core.planner import PlanLimits
from sja.core.policies import POLICIES, PolicyConfig
from sja.protocol import subjects
from sja.protocol.messages import (
    AgentHeartbeat,
    BatchReply,
    Completion,
    DemandChanged,
    ErrorReply,
    Grant,
    GrantBatch,
    InFlight,
    JobCancel,
    JobHead,
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
    Window,
)
from sja.telemetry.metrics import RATIO_BUCKETS, watch_consumers

log = logging.getLogger(__name__)
tracer = trace.get_tracer("sja.agent")

JOBS_CONSUMER = "agents"
MAX_POOLS = 10_000
"""Pools whose policy an agent remembers (bounded against outcomes naming made-up pools)."""
MAX_AGENTS_SEEN = 10_000
"""Agents whose last heartbeat an agent remembers (bounded against heartbeats naming made-up agents)."""
COMPLETIONS_ACK_PENDING = 50_000
"""Completions an agent may hold unacknowledged (delivered, waiting to be written with their job)."""
MAX_JOB_LINKS = 128
"""Links to rounds a job's ``sja.job`` span keeps (the rest are counted: ``sja.links_dropped``)."""


class AgentSettings(BaseSettings, frozen=True, kw_only=True):
    mem_reserve_mib: float = 256.0
    start_overhead_s: float = 0.3
    horizon_s: float = 8.0
    heartbeat_s: float = 1.0
    max_jobs: int = 10_000
    lease_s: float = 5.0
    """The clearers' lease (``SJA_LEASE_S``): a subjob with no completion two leases past its time
    cap, whose slice moved on, is given up (``reap``)."""
    reap_every_s: float = 1.0
    takeover_after_s: float = 10.0
    """Liveness bound: the jobs of an agent not heard from (``AgentHeartbeat``) for this long are
    taken over by the live agents (a job by one agent: compare-and-set on its owner). Keep it many
    heartbeats long, so that an agent that is merely slow keeps its jobs. 0: no takeover."""
    takeover_scan_s: float = 60.0
    """Besides whenever an agent falls silent, the job store is scanned this often for jobs whose
    owner was never heard from (an agent gone before this one started)."""
    completions_inactive_s: float = 600.0
    """An agent's own ``SJA_COMPLETIONS`` consumer is deleted by the server once nobody has pulled
    from it this long (a recreated or scaled-down agent's, whose id never comes back)."""
    release_timeout_s: float = 1.0
    """How long a request to give a grant back (``sja.v1.lease.release``) waits for the inventory;
    unanswered, the lease simply runs out."""
    demand_coalesce_s: float = 0.005
    """Jobs that became able to take a window (claimed, or a subjob done) are announced to the
    advertisers (``DemandChanged.ready``) after this pause, so a burst is one message."""
    completion_batch: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    """Completions fetched (and folded in) at a time. Larger batches cost less per completion; while
    a batch is folded in, offers wait, so smaller ones answer offers sooner (CHANGELOG.md, items 24 and 29: at
    (1000, 512), 16 gives more grants a second and a shorter offer-to-grant p50 than 32 did before
    completions were fetched by ``Fetcher``; 32 now gives more grants a second still, for a p50
    about 10 ms longer)."""
    completion_flush_s: float = 0.25
    """A completion is folded into its job at once, and written to ``sja-jobs`` with the job's next
    write (its next subjob, usually) or after this long, whichever comes first; it is acknowledged
    only once written (a crash in between redelivers it). A job's last completion is written at
    once. 0: every completion is written on its own."""


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
        self.profiles = J.ProfileCache()
        """The profiles of the jobs this agent plans for (dropped when it no longer does)."""
        self.bidder = Bidder(self.limits, self.policy_config, self.profiles)
        """What the jobs this agent owns bid (``core.bidder``): memoized plans, shortlists, the jobs
        that sit out."""
        self.policy_of: dict[str, str] = {}
        """pool -> the policy its clearer clears with, as the last outcome from it said."""
        self.locks: dict[str, asyncio.Lock] = {}
        self._best_window: Window | None = None
        """The largest window offered since start (see ``J.hopeless``)."""
        self._ready_new = 0
        """Windows this agent's jobs became able to take since the last ``DemandChanged``."""
        self._demand = asyncio.Event()
        self._unsaved: dict[str, list[tuple[Msg, Completion]]] = {}
        """job id -> completions folded into its state here and not yet written to ``sja-jobs``
        (acknowledged once written)."""
        self._unsaved_since: dict[str, float] = {}
        self._last_seen: dict[str, float] = {}
        """agent id -> when its last heartbeat arrived here (this host's clock)."""
        self._heard_since = time.time()
        """When this agent started listening to heartbeats (its first scan for jobs of silent
        agents is a bound later)."""
        self._job_traces: dict[str, JobTrace] = {}
        """job id -> what its ``sja.job`` span will hold (from when this process took the job)."""
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
        self._heard_since = time.time()
        await self.subscribe(subjects.AGENT_HEARTBEAT, self.on_heartbeat)
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
        self.loop(self._pull_forever(self._jobs_fetch, self.on_submitted, batch=16))
        self.loop(self._pull_forever(self._done_fetch, self.on_completed, batch=self.cfg.completion_batch))
        self.loop(self._heartbeat_forever())
        self.loop(self._demand_forever())
        self.loop(self._reap_forever())
        if self.cfg.takeover_after_s > 0:
            self.loop(self._takeover_forever())
        if self.cfg.completion_flush_s > 0:
            self.loop(self._flush_forever())
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
            await self.flush_all()
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
                self._job_taken(state.job_id, recovered=True)
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

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.reap_every_s)
            try:
                await self.reap(time.time())
            except Exception:
                log.exception("reaping overdue subjobs failed")

    async def reap(self, now: float) -> int:
        """Give up in-flight subjobs that will never complete (see ``J.overdue``): their units go
        back to their jobs, like a subjob reported lost."""
        assert self.slices is not None
        lease_s = self.cfg.lease_s
        suspects = [
            (job_id, f)
            for job_id, (state, _) in list(self.owned.items())
            for f in J.past_due(state, now, lease_s)
        ]
        reaped = 0
        holders: dict[str, str | None] = {}
        for _, f in suspects:
            if f.slice_id not in holders:
                got = await self.slices.get(f.slice_id)
                holders[f.slice_id] = got[0].grant_id or None if got is not None else None
        for job_id in sorted({j for j, _ in suspects}):
            async with self.lock(job_id):
                made: list[tuple[Completion, InFlight]] = []

                def transition(
                    state: JobState, made: list[tuple[Completion, InFlight]] = made
                ) -> JobState | None:
                    made.clear()
                    new = state
                    for f in J.overdue(state, holders, now, lease_s):
                        c = J.lost_completion(state, f, now, "no completion, and its slice moved on")
                        new, ok = J.apply_completion(new, c, now, profiles=self.profiles)
                        if ok:
                            made.append((c, f))
                    return new if made else None

                if job_id not in self.owned:
                    continue
                workload = self.owned[job_id][0].spec.workload
                if await self.save(job_id, transition) is None:
                    made.clear()  # the job is gone, or another agent's now: nothing was written
                for c, f in made:
                    log.warning("subjob %s of %s given up: %s", c.subjob_id, job_id, c.error)
                    self._record_completion(c, f, workload)
                    reaped += 1
                self.ready(len(made))
        await self._give_up_hopeless(now)
        return reaped

    async def _give_up_hopeless(self, now: float) -> None:
        """Fail the jobs that can never run again (``J.hopeless``) instead of leaving them pending."""
        best = self._best_window
        if best is None:
            return
        for job_id, (state, _) in list(self.owned.items()):
            if J.hopeless(state, best, now, self.limits, profiles=self.profiles) is None:
                continue
            async with self.lock(job_id):
                why: list[str] = []

                def transition(state: JobState, why: list[str] = why) -> JobState | None:
                    reason = J.hopeless(state, best, now, self.limits, profiles=self.profiles)
                    if reason is None:
                        return None
                    why[:] = [reason]
                    return J.give_up(state, reason, now)

                if await self.save(job_id, transition, force=True) is not None and why:
                    log.warning("job %s failed: %s", job_id, why[0])

    async def _heartbeat_forever(self) -> None:
        while True:
            hb = AgentHeartbeat(
                agent_id=self.agent_id,
                jobs=len(self.owned),
                sent_at=time.time(),
                interval_s=self.cfg.heartbeat_s,
            )
            with contextlib.suppress(Exception):
                await self.bus.publish(subjects.AGENT_HEARTBEAT, encode(hb))
            await asyncio.sleep(self.cfg.heartbeat_s)

    async def on_heartbeat(self, msg: Msg) -> None:
        hb = decode(msg.data, AgentHeartbeat)
        if hb.agent_id == self.agent_id:
            return
        if hb.agent_id not in self._last_seen and len(self._last_seen) >= MAX_AGENTS_SEEN:
            return
        self._last_seen[hb.agent_id] = time.time()

    async def _takeover_forever(self) -> None:
        liveness_s = self.cfg.takeover_after_s
        every = max(liveness_s / 4, 0.1)
        next_scan = self._heard_since + liveness_s + every
        while True:
            await asyncio.sleep(every)
            now = time.time()
            silent = any(now - t > liveness_s for t in self._last_seen.values())
            if not silent and now < next_scan:
                continue
            try:
                taken = await self.take_over(now)
                if taken:
                    log.info("took over %d jobs of silent agents", taken)
            except Exception:
                log.exception("taking over the jobs of silent agents failed")
            if now >= next_scan:
                next_scan = now + self.cfg.takeover_scan_s

    async def take_over(self, now: float) -> int:
        """Take over the jobs of agents silent for longer than ``takeover_after_s`` (``J.takeover``:
        this agent takes the ones it is heir to at once, any after twice the bound), each by
        compare-and-set on its revision; returns how many. An agent silent that long with no job
        left is forgotten."""
        assert self.jobs is not None
        liveness_s = self.cfg.takeover_after_s
        live = [a for a, t in self._last_seen.items() if now - t <= liveness_s]
        live.append(self.agent_id)
        still_owning: set[str] = set()
        taken = 0
        # Only the jobs of silent owners are decoded whole: a scan of a store of thousands of jobs
        # owned by live agents reads three fields of each.
        for head, raw, rev in await self.jobs.heads(JobHead):
            owner = head.owner_agent
            if not owner or owner == self.agent_id or head.status in J.TERMINAL:
                continue
            if len(self.owned) >= self.cfg.max_jobs:
                still_owning.add(owner)
                continue
            seen = self._last_seen.get(owner)
            if seen is None:
                # Never heard from: gone before this agent started, or just started with its first
                # heartbeat on its way. Counted as heard now, so taken over a full bound from now.
                if len(self._last_seen) < MAX_AGENTS_SEEN:
                    self._last_seen[owner] = now
                still_owning.add(owner)
                continue
            if now - seen <= liveness_s:
                still_owning.add(owner)
                continue
            try:
                state = self.jobs.load(raw)
            except DecodeError as e:
                log.warning("job %s unreadable, not taken over: %s", head.job_id, e)
                continue
            new = J.takeover(state, self.agent_id, seen, now, liveness_s, live_agents=live)
            if new is None:
                still_owning.add(owner)
                continue
            new_rev = await self.jobs.cas(state.job_id, new, rev)
            if new_rev is None:
                continue  # another agent took it first (or its owner wrote it: alive after all)
            log.warning(
                "took over job %s of %s (silent %.1fs, %d subjobs in flight)",
                state.job_id,
                owner,
                now - seen,
                len(new.in_flight),
            )
            self._remember(new, new_rev)
            self._job_taken(new.job_id, recovered=True)  # its rounds before were another agent's
            await self.replay_completions(new.job_id)
            now_state = self.owned.get(new.job_id)
            if now_state is not None and J.can_take_more(now_state[0]):
                self.ready(now_state[0].spec.max_parallel - len(now_state[0].in_flight))
            taken += 1
        for agent, t in list(self._last_seen.items()):
            if now - t > liveness_s and agent not in still_owning:
                del self._last_seen[agent]
        return taken

    async def replay_completions(self, job_id: str) -> int:
        """Fold in the completions of a job just taken over that reached this agent before the job
        was its own (acknowledged and dropped then; its old owner never acknowledges them now): read
        back from ``SJA_COMPLETIONS``, for the subjobs still in flight. Returns how many were
        applied. Without this they would be given up as overdue and run again."""
        got = self.owned.get(job_id)
        if got is None or not got[0].in_flight:
            return 0
        try:
            found = [c async for c in iter_completions(self.jetstream, job_id)]
        except Exception as e:
            log.warning(
                "could not read back the completions of %s (%r): overdue subjobs are given up", job_id, e
            )
            return 0
        async with self.lock(job_id):
            before = self.owned.get(job_id)
            if before is None:
                return 0
            made: list[Completion] = []

            def transition(state: JobState, made: list[Completion] = made) -> JobState | None:
                made.clear()
                new = state
                for c in found:
                    new, ok = J.apply_completion(new, c, time.time(), profiles=self.profiles)
                    if ok:
                        made.append(c)
                return new if made else None

            if await self.save(job_id, transition) is None:
                made.clear()  # nothing to apply, or the job is gone or another agent's now
            flights = {f.subjob_id: f for f in before[0].in_flight}
            for c in made:
                self._record_completion(c, flights.get(c.subjob_id), before[0].spec.workload)
            if made:
                log.info("job %s taken over: %d completions read back", job_id, len(made))
        return len(made)

    def ready(self, windows: int) -> None:
        """Jobs here can take ``windows`` more windows: tell the advertisers (coalesced)."""
        if windows > 0:
            self._ready_new += windows
            self._demand.set()

    async def _demand_forever(self) -> None:
        while True:
            await self._demand.wait()
            await asyncio.sleep(self.cfg.demand_coalesce_s)
            self._demand.clear()
            n, self._ready_new = self._ready_new, 0
            if n <= 0:
                continue
            demand = DemandChanged(agent_id=self.agent_id, jobs=len(self.owned), ready=min(n, 1_000_000))
            with contextlib.suppress(Exception):
                await self.bus.publish(subjects.DEMAND_CHANGED, encode(demand))

    def lock(self, job_id: str) -> asyncio.Lock:
        return self.locks.setdefault(job_id, asyncio.Lock())

    # --- state persistence -------------------------------------------------------------------------

    async def save(
        self, job_id: str, transition: Callable[[JobState], JobState | None], force: bool = False
    ) -> JobState | None:
        """Apply ``transition`` to the job and CAS it (with the completions folded in and not yet
        written); on conflict reload, fold those completions in again, and apply it again.
        ``force``: write even if the transition changes nothing (to write those completions)."""
        assert self.jobs is not None
        for _ in range(20):
            if job_id not in self.owned:
                return None
            state, rev = self.owned[job_id]
            new = transition(state)
            if new is None or new == state:
                if not (force and self._unsaved.get(job_id)):
                    return new
                new = state
            new_rev = await self.jobs.cas(job_id, new, rev)
            if new_rev is not None:
                await self._written(job_id)
                self._remember(new, new_rev)
                return new
            got = await self.jobs.get(job_id)
            if got is None:
                await self._written(job_id)  # the job is gone: nothing to fold them into
                self._disown(job_id)
                return None
            fresh, fresh_rev = got
            if not J.is_owned_by(fresh, self.agent_id):
                # Taken over while this agent was silent: it is the new owner's now. Completions
                # folded in here reach the new owner too (or their subjobs are given up there).
                log.warning("job %s is owned by %s now: disowned", job_id, fresh.owner_agent)
                await self._written(job_id)
                self._disown(job_id)
                self.locks.pop(job_id, None)
                return None
            for _msg, c in self._unsaved.get(job_id, []):
                fresh, _ = J.apply_completion(fresh, c, time.time(), profiles=self.profiles)
            self._own(fresh, fresh_rev)
        raise RuntimeError(f"could not update job {job_id}: too much contention")

    async def _written(self, job_id: str) -> None:
        """The job's unwritten completions are in ``sja-jobs`` now: acknowledge them."""
        self._unsaved_since.pop(job_id, None)
        for msg, _ in self._unsaved.pop(job_id, []):
            with contextlib.suppress(Exception):
                await msg.ack()

    async def _write_unsaved(self, job_id: str) -> JobState | None:
        """Write the job as it is here, with its completions not yet written (caller holds its lock)."""
        return await self.save(job_id, lambda s: None, force=True)

    async def flush(self, job_id: str) -> None:
        """Write the job's completions folded in here and not yet written."""
        async with self.lock(job_id):
            if self._unsaved.get(job_id):
                await self._write_unsaved(job_id)

    async def flush_all(self) -> None:
        await asyncio.gather(*(self.flush(j) for j in list(self._unsaved)), return_exceptions=True)

    async def _flush_forever(self) -> None:
        every = self.cfg.completion_flush_s
        while True:
            await asyncio.sleep(every / 2)
            due = time.monotonic() - every
            jobs = [j for j, since in list(self._unsaved_since.items()) if since <= due]
            if jobs:
                results = await asyncio.gather(*(self.flush(j) for j in jobs), return_exceptions=True)
                for job_id, r in zip(jobs, results, strict=True):
                    if isinstance(r, Exception):
                        log.warning("writing the completions of %s failed: %r", job_id, r)

    def _remember(self, state: JobState, rev: int) -> None:
        if J.is_terminal(state):
            self._job_ended(state)
            self._disown(state.job_id)
            self.locks.pop(state.job_id, None)
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
        self._job_traces.pop(job_id, None)

    # --- the job-level span ------------------------------------------------------------------------

    def _job_taken(self, job_id: str, recovered: bool) -> None:
        """This process took the job (claimed it, or took it back after a restart): its
        ``sja.job`` span starts now."""
        self._job_traces.setdefault(job_id, JobTrace(time.time_ns(), recovered))

    def _job_granted(self, job_id: str, ctx: otel_context.Context) -> None:
        """A grant for the job came: its ``sja.job`` span links to the grant's round (if traced)."""
        jt = self._job_traces.get(job_id)
        if jt is None:
            return
        jt.grants += 1
        sc = trace.get_current_span(ctx).get_span_context()
        if not (sc.is_valid and sc.trace_flags.sampled):
            return  # a round not traced: nothing to link to
        if len(jt.links) < MAX_JOB_LINKS:
            jt.links.append(trace.Link(sc))
        else:
            jt.links_dropped += 1

    def _job_ended(self, state: JobState) -> None:
        """The job reached a final state: emit its ``sja.job`` span, a trace of its own that links to
        the rounds it took part in."""
        jt = self._job_traces.pop(state.job_id, None)
        if jt is None:
            return
        span = tracer.start_span(
            "sja.job",
            context=ROOT,
            links=jt.links,
            start_time=jt.started_ns,
            attributes={
                "sja.job_id": state.job_id,
                "sja.tenant": state.spec.tenant,
                "sja.workload": state.spec.workload,
                "sja.status": state.status,
                "sja.units": state.total_units,
                "sja.units_done": state.units_done,
                "sja.subjobs": state.next_seq,
                "sja.grants": jt.grants,
                "sja.links_dropped": jt.links_dropped,
                "sja.recovered": jt.recovered,
                "sja.agent": self.agent_id,
            },
        )
        if state.status == "failed":
            span.set_status(trace.Status(trace.StatusCode.ERROR, state.error[:200]))
        span.end()

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
            claimed = J.claim(state, self.agent_id, time.time())
            if claimed is not None:
                new_rev = await self.jobs.cas(state.job_id, claimed, rev)
                if new_rev is not None:
                    self._remember(claimed, new_rev)
                    self._job_taken(state.job_id, recovered=False)
                    self.ready(claimed.spec.max_parallel)
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
        self._saw_window(offers)
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
                    span.set_attributes(_reply_attributes(proposals))
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
        for group, (_, _, proposals, _) in zip(out, sent, strict=True):
            attributes: dict[str, AttributeValue] | None = None
            for offer_id in group.offer_ids:
                parent = sampled.get(offer_id)
                if parent is None:
                    continue
                if attributes is None:
                    attributes = {
                        "sja.batch_id": batch.batch_id,
                        "sja.offers": len(offers),
                        "sja.like_offers": len(group.offer_ids),
                        "sja.agent": self.agent_id,
                        **_reply_attributes(proposals),
                    }
                span = tracer.start_span(
                    "sja.reply",
                    context=parent,
                    kind=trace.SpanKind.CONSUMER,
                    start_time=started_ns,
                    attributes={"sja.offer_id": offer_id, **attributes},
                )
                span.end()

    def _saw_window(self, offers: list[Offer]) -> None:
        """Keep the largest window offered (the most memory, then compute share), open-ended."""
        best = self._best_window
        for o in offers:
            w = o.window
            if best is None or (w.mem_mib, w.compute_share) > (best.mem_mib, best.compute_share):
                best = msgspec.structs.replace(w, end_s=None)
        self._best_window = best

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
            self._job_granted(grant.job_id, ctx)
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
                    span.set_attribute("sja.note", "job not owned here")
                    await self.release(grant, "job not owned here")
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

                def transition(state: JobState) -> JobState | None:
                    m = J.materialize(state, grant, now, self.limits, self.agent_id, profiles=self.profiles)
                    made[:] = [m]
                    return m.state

                saved = await self.save(grant.job_id, transition)
                m = made[0] if made and saved is not None else None
                if m is None or m.subjob is None:
                    reason = m.reason if m else "job gone"
                    span.set_attribute("sja.note", reason)
                    if reason not in ("grant already materialized", "grant already declined"):
                        await self.release(grant, reason)
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
                with child_span(tracer, "sja.calibrate", attributes={"sja.job_id": c.job_id}):
                    new, ok = J.apply_completion(current, c, time.time(), profiles=self.profiles)
                span.set_attribute("sja.applied", ok)
                if not ok:
                    pending = self._unsaved.get(c.job_id, [])
                    if any(u.subjob_id == c.subjob_id and u.grant_id == c.grant_id for _, u in pending):
                        # Delivered again before its first delivery was written (the write is
                        # late): acknowledged with that write, never before it.
                        pending.append((msg, c))
                        return
                    await msg.ack()  # a duplicate, or for a subjob no longer in flight: nothing to do
                    return
                flight = next((f for f in current.in_flight if f.subjob_id == c.subjob_id), None)
                self._record_completion(c, flight, current.spec.workload)
                # Folded in here at once (the job bids on it); written with the job's next write or
                # by the flusher, and acknowledged then. A finished job is written at once.
                self._own(new, rev)
                self._unsaved.setdefault(c.job_id, []).append((msg, c))
                self._unsaved_since.setdefault(c.job_id, time.monotonic())
                if J.is_terminal(new) or self.cfg.completion_flush_s <= 0:
                    state = await self._write_unsaved(c.job_id)
                    if state is not None and J.is_terminal(state):
                        log.info("job %s %s after %d subjobs", c.job_id, state.status, state.next_seq)
                        return
                if J.can_take_more(new):
                    self.ready(1)

    def _record_completion(self, c: Completion, flight: InFlight | None, workload: str) -> None:
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


@dataclass(slots=True)
class JobTrace:
    """What a job's ``sja.job`` span holds until the job ends."""

    started_ns: int
    recovered: bool
    """Taken back after a restart: links to rounds before it are lost (they lived in memory)."""
    links: list[trace.Link] = field(default_factory=list)
    grants: int = 0
    links_dropped: int = 0


def _reply_attributes(proposals: list[Proposal]) -> dict[str, AttributeValue]:
    """A reply span's attributes: the jobs that bid, and the best candidate's job and score."""
    attributes: dict[str, AttributeValue] = {
        "sja.proposals": len(proposals),
        "sja.job_ids": [p.job_id for p in proposals[:64]],
    }
    best = max(
        ((c.score, p.job_id) for p in proposals for c in p.candidates), default=None, key=lambda b: b[0]
    )
    if best is not None:
        attributes["sja.score"] = best[0]
        attributes["sja.job_id"] = best[1]
    return attributes
