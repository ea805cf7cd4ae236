"""Liveness between agents: each heartbeats (``AgentHeartbeat``); the jobs of an agent not heard
from for ``takeover_after_s`` are taken over by the live ones (``ownership.takeover`` decides which
agent is heir to which job; each job moves by compare-and-set on its revision, so one agent gets
it), and the completions that reached the new owner before the job was its own are read back."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

from nats.aio.msg import Msg

from sja.bus.codec import DecodeError, decode, encode
from sja.bus.completions import iter_completions
from sja.core import jobs as J
from sja.core import ownership, proofs
from sja.protocol import subjects
from sja.protocol.messages import AgentHeartbeat, Completion, JobHead, JobState

if TYPE_CHECKING:
    from services.agent.parts import Agent

log = logging.getLogger(__name__)

MAX_AGENTS_SEEN = 10_000
"""Agents whose last heartbeat an agent remembers (bounded against heartbeats naming made-up agents)."""


class Takeover:
    """An agent's heartbeats, what it heard of the others', and its takeovers of silent ones' jobs."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.last_seen: dict[str, float] = {}
        """agent id -> when its last heartbeat arrived here (this host's clock)."""
        self.heard_since = time.time()
        """When this agent started listening to heartbeats (its first scan for jobs of silent
        agents is a bound later)."""

    async def heartbeat_forever(self) -> None:
        agent = self.agent
        while True:
            hb = AgentHeartbeat(
                agent_id=agent.agent_id,
                jobs=len(agent.owned),
                sent_at=time.time(),
                interval_s=agent.cfg.heartbeat_s,
            )
            with contextlib.suppress(Exception):
                await agent.bus.publish(subjects.AGENT_HEARTBEAT, encode(hb))
            await asyncio.sleep(agent.cfg.heartbeat_s)

    async def on_heartbeat(self, msg: Msg) -> None:
        hb = decode(msg.data, AgentHeartbeat)
        if hb.agent_id == self.agent.agent_id:
            return
        if hb.agent_id not in self.last_seen and len(self.last_seen) >= MAX_AGENTS_SEEN:
            return
        self.last_seen[hb.agent_id] = time.time()

    async def takeover_forever(self) -> None:
        cfg = self.agent.cfg
        liveness_s = cfg.takeover_after_s
        every = max(liveness_s / 4, 0.1)
        next_scan = self.heard_since + liveness_s + every
        while True:
            await asyncio.sleep(every)
            now = time.time()
            silent = any(now - t > liveness_s for t in self.last_seen.values())
            if not silent and now < next_scan:
                continue
            try:
                taken = await self.take_over(now)
                if taken:
                    log.info("took over %d jobs of silent agents", taken)
            except Exception:
                log.exception("taking over the jobs of silent agents failed")
            if now >= next_scan:
                next_scan = now + cfg.takeover_scan_s

    async def take_over(self, now: float) -> int:
        """Take over the jobs of agents silent for longer than ``takeover_after_s``
        (``ownership.takeover``: this agent takes the ones it is heir to at once, any after twice
        the bound), each by compare-and-set on its revision; returns how many. An agent silent that
        long with no job left is forgotten."""
        agent = self.agent
        jobs = agent.jobs
        assert jobs is not None
        liveness_s = agent.cfg.takeover_after_s
        live = [a for a, t in self.last_seen.items() if now - t <= liveness_s]
        live.append(agent.agent_id)
        still_owning: set[str] = set()
        mine: list[tuple[str, bytes, int]] = []
        taken = 0
        # Only the jobs of silent owners are decoded whole: a scan of a store of thousands of jobs
        # owned by live agents reads three fields of each.
        for head, raw, rev in await jobs.heads(JobHead):
            owner = head.owner_agent
            if not owner or head.status in J.TERMINAL:
                continue
            if owner == agent.agent_id:
                held = agent.owned.get(head.job_id)
                if held is None or held[1] < rev:
                    mine.append((head.job_id, raw, rev))
                continue
            if len(agent.owned) >= agent.cfg.max_jobs:
                still_owning.add(owner)
                continue
            seen = self.last_seen.get(owner)
            if seen is None:
                # Never heard from: gone before this agent started, or just started with its first
                # heartbeat on its way. Counted as heard now, so taken over a full bound from now.
                if len(self.last_seen) < MAX_AGENTS_SEEN:
                    self.last_seen[owner] = now
                still_owning.add(owner)
                continue
            if now - seen <= liveness_s:
                still_owning.add(owner)
                continue
            try:
                state = jobs.load(raw)
            except DecodeError as e:
                log.warning("job %s unreadable, not taken over: %s", head.job_id, e)
                continue
            new = ownership.takeover(state, agent.agent_id, seen, now, liveness_s, live_agents=live)
            if new is None:
                still_owning.add(owner)
                continue
            new_rev = await jobs.cas(state.job_id, new, rev)
            if new_rev is None:
                continue  # another agent took it first (or its owner wrote it: alive after all)
            log.warning(
                "took over job %s of %s (silent %.1fs, %d subjobs in flight)",
                state.job_id,
                owner,
                now - seen,
                len(new.in_flight),
            )
            agent.remember(new, new_rev)
            agent.spans.taken(new.job_id, recovered=True)  # its rounds before were another agent's
            await self.replay_completions(new.job_id)
            now_state = agent.owned.get(new.job_id)
            if now_state is not None and J.can_take_more(now_state[0]):
                agent.ready(J.slots_left(now_state[0]))
            taken += 1
        for other, t in list(self.last_seen.items()):
            if now - t > liveness_s and other not in still_owning:
                del self.last_seen[other]
        for job_id, raw, rev in mine:
            await self.reconcile(job_id, raw, rev)
        return taken

    async def reconcile(self, job_id: str, raw: bytes, rev: int) -> bool:
        """A job the store says is this agent's, which this agent does not hold, or holds at an
        older revision than the store's: held again as stored (with the completions folded in here
        and not yet written folded in again), as after a conflicting write. A write whose answer was
        lost (a server killed between applying and answering it) or a read that found nothing during
        a leader election leave the two apart; a job whose proposals come from a stale copy, or that
        nobody holds, would otherwise wait forever. Returns whether the job was taken back."""
        agent = self.agent
        async with agent.lock(job_id):
            held = agent.owned.get(job_id)
            if held is not None and held[1] >= rev:
                return False  # written here since the scan read it
            try:
                state = agent.jobs.load(raw) if agent.jobs is not None else None
            except DecodeError as e:
                log.warning("job %s unreadable, not taken back: %s", job_id, e)
                return False
            if state is None or not ownership.is_owned_by(state, agent.agent_id) or J.is_terminal(state):
                return False
            state = agent.writer.refolded(job_id, state)
            log.warning(
                "job %s: the store holds revision %d, this agent %s: taken back as stored",
                job_id,
                rev,
                "nothing" if held is None else f"revision {held[1]}",
            )
            agent.remember(state, rev)
        if held is None:
            agent.spans.taken(job_id, recovered=True)
        if J.can_take_more(state):
            agent.ready(J.slots_left(state))
        return True

    async def replay_completions(self, job_id: str) -> int:
        """Fold in the completions of a job just taken over that reached this agent before the job
        was its own (acknowledged and dropped then; its old owner never acknowledges them now): read
        back from ``SJA_COMPLETIONS``, for the subjobs still in flight. Returns how many were
        applied. Without this they would be given up as overdue and run again."""
        agent = self.agent
        got = agent.owned.get(job_id)
        if got is None or not got[0].in_flight:
            return 0
        try:
            found = [c async for c in iter_completions(agent.jetstream, job_id)]
        except Exception as e:
            log.warning(
                "could not read back the completions of %s (%r): overdue subjobs are given up", job_id, e
            )
            return 0
        async with agent.lock(job_id):
            before = agent.owned.get(job_id)
            if before is None:
                return 0
            made: list[Completion] = []

            def transition(state: JobState, made: list[Completion] = made) -> JobState | None:
                made.clear()
                new = state
                for c in found:
                    unproven = proofs.verify_completion(new, c)
                    if unproven is not None:
                        if unproven is not proofs.Unproven.NOT_IN_FLIGHT:
                            agent.drop_unproven(c, unproven)
                        continue
                    new, ok = J.apply_completion(new, c, time.time(), profiles=agent.profiles)
                    if ok:
                        made.append(c)
                return new if made else None

            if await agent.save(job_id, transition) is None:
                made.clear()  # nothing to apply, or the job is gone or another agent's now
            flights = {f.subjob_id: f for f in before[0].in_flight}
            for c in made:
                agent.record_completion(c, flights.get(c.subjob_id), before[0].spec.workload)
            if made:
                log.info("job %s taken over: %d completions read back", job_id, len(made))
        return len(made)
