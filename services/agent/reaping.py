"""What an agent gives up on its own, every ``reap_every_s``: subjobs that will never complete
(``ownership.overdue``: no completion two leases past their time cap, their slice moved on), whose
units go back to their jobs as if reported lost; and jobs that can never run again (``J.hopeless``,
judged against the largest window offered since start), which fail instead of waiting forever."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import msgspec

from sja.core import jobs as J
from sja.core import ownership
from sja.protocol.messages import Completion, InFlight, JobState, Offer, Window

if TYPE_CHECKING:
    from services.agent.parts import Agent

log = logging.getLogger(__name__)


class Reaper:
    """An agent's reaping of overdue subjobs and hopeless jobs."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.best_window: Window | None = None
        """The largest window offered since start (see ``J.hopeless``)."""

    def saw(self, offers: list[Offer]) -> None:
        """Keep the largest window offered (the most memory, then compute share), open-ended."""
        best = self.best_window
        for o in offers:
            w = o.window
            if best is None or (w.mem_mib, w.compute_share) > (best.mem_mib, best.compute_share):
                best = msgspec.structs.replace(w, end_s=None)
        self.best_window = best

    async def reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.agent.cfg.reap_every_s)
            try:
                await self.reap(time.time())
            except Exception:
                log.exception("reaping overdue subjobs failed")

    async def reap(self, now: float) -> int:
        """Give up in-flight subjobs that will never complete (see ``ownership.overdue``): their
        units go back to their jobs, like a subjob reported lost. Returns how many."""
        agent = self.agent
        assert agent.slices is not None
        lease_s = agent.cfg.lease_s
        suspects = [
            (job_id, f)
            for job_id, (state, _) in list(agent.owned.items())
            for f in ownership.past_due(state, now, lease_s)
        ]
        reaped = 0
        holders: dict[str, str | None] = {}
        for _, f in suspects:
            if f.slice_id not in holders:
                got = await agent.slices.get(f.slice_id)
                holders[f.slice_id] = got[0].grant_id or None if got is not None else None
        for job_id in sorted({j for j, _ in suspects}):
            async with agent.lock(job_id):
                made: list[tuple[Completion, InFlight]] = []

                def transition(
                    state: JobState, made: list[tuple[Completion, InFlight]] = made
                ) -> JobState | None:
                    made.clear()
                    new = state
                    for f in ownership.overdue(state, holders, now, lease_s):
                        c = ownership.lost_completion(state, f, now, "no completion, and its slice moved on")
                        new, ok = J.apply_completion(new, c, now, profiles=agent.profiles)
                        if ok:
                            made.append((c, f))
                    return new if made else None

                if job_id not in agent.owned:
                    continue
                workload = agent.owned[job_id][0].spec.workload
                if await agent.save(job_id, transition) is None:
                    made.clear()  # the job is gone, or another agent's now: nothing was written
                for c, f in made:
                    log.warning("subjob %s of %s given up: %s", c.subjob_id, job_id, c.error)
                    agent.record_completion(c, f, workload)
                    reaped += 1
                agent.ready(len(made))
        await self.give_up_hopeless(now)
        return reaped

    async def give_up_hopeless(self, now: float) -> None:
        """Fail the jobs that can never run again (``J.hopeless``) instead of leaving them pending."""
        agent = self.agent
        best = self.best_window
        if best is None:
            return
        for job_id, (state, _) in list(agent.owned.items()):
            if J.hopeless(state, best, now, agent.limits, profiles=agent.profiles) is None:
                continue
            async with agent.lock(job_id):
                why: list[str] = []

                def transition(state: JobState, why: list[str] = why) -> JobState | None:
                    reason = J.hopeless(state, best, now, agent.limits, profiles=agent.profiles)
                    if reason is None:
                        return None
                    why[:] = [reason]
                    return J.give_up(state, reason, now)

                if await agent.save(job_id, transition, force=True) is not None and why:
                    log.warning("job %s failed: %s", job_id, why[0])
