"""The rigid reference an agent keeps (``core.shadow.Reference``), and the jobs it owns made due by it.

Every agent replays every admitted job (an ordered consumer on ``SJA_JOBS`` from its first message:
the submissions the gateway published, each a ``JobState`` with its spec and submission time) on the
slices of the inventory (``sja-slices``, read every ``SLICES_EVERY_S``), so each reaches the same due
times without asking another. Once a job it owns is due, the agent sets ``JobState.due_at`` to the
instant it is due to finish by (written with the job's next write): its proposals, subjobs and held
slices carry it, and the order of service puts it first, earliest first
(``continuation.service_key``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from typing import TYPE_CHECKING, Any

import msgspec
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from sja.bus.codec import DecodeError, decode
from sja.bus.watch import read_bucket
from sja.core.shadow import Reference, rigid_job, rigid_slices
from sja.protocol import subjects
from sja.protocol.messages import JobState, SliceState

if TYPE_CHECKING:
    from services.agent.service import AgentService

log = logging.getLogger(__name__)

TICK_S = 1.0
"""How often the agent looks for jobs of its own that became due."""

SLICES_EVERY_S = 5.0
"""How often the agent reads the inventory's slices again for the reference (every second while it
has none). The reference needs their shapes, which change when a GPU is re-cut, lost or added, not
their leases: a watch would hand every agent every lease of the cluster, a few per grant."""


class DueKeeper:
    def __init__(self, agent: AgentService) -> None:
        self.agent = agent
        self.ref = Reference(reserve_mib=agent.cfg.mem_reserve_mib)
        self._sub: Any = None
        self._slices_read = -math.inf
        self.marked = 0
        """Jobs this agent made due."""
        self.unmarked = 0
        """Due jobs whose own measurements put their due time back (or voided it)."""

    async def start(self) -> None:
        await self.read_slices(time.monotonic())
        self._sub = await self.agent.jetstream.subscribe(
            f"{subjects.PREFIX}.job.submitted.>",
            stream=subjects.STREAM_JOBS.name,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
            cb=self._on_admitted,
            pending_msgs_limit=1_000_000,
        )

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()

    async def read_slices(self, now: float) -> None:
        """The reference's slices as the inventory's bucket holds them now (``set_slices`` replays
        only when their shapes changed)."""
        self._slices_read = now
        slices = await read_bucket(self.agent.jetstream, subjects.BUCKET_SLICES, SliceState)
        self.ref.set_slices(*rigid_slices(slices))

    async def _on_admitted(self, msg: Msg) -> None:
        try:
            state = decode(msg.data, JobState)
        except DecodeError:
            return  # the claiming consumer reports a malformed submission
        try:
            self.ref.admit(rigid_job(state))
        except Exception as e:  # a spec whose declarations cannot be had: never due
            log.warning("job %s has no rigid reference: %s", state.job_id, e)

    def tick(self, now: float) -> int:
        """Bring the reference to ``now`` and mark the owned jobs due whose time has come by the
        reference and their own measurements (``core.shadow.due_by_evidence``), unmarking those whose
        measurements put it back; returns how many it made due."""
        self.ref.advance(now)
        made = 0
        profiles = self.agent.profiles
        for job_id, (state, rev) in list(self.agent.owned.items()):
            if job_id not in self.ref.bases:
                continue
            profile = profiles.of(state) if state.profile is not None else None
            at = self.ref.due_by(job_id, now, state, profile)
            if at == state.due_at:
                continue
            self.agent.remember(msgspec.structs.replace(state, due_at=at), rev)
            if at > 0 and state.due_at == 0:
                made += 1
            elif at == 0:
                self.unmarked += 1
        self.marked += made
        if made:
            self.agent.ready(made)
        return made

    async def forever(self) -> None:
        while True:
            await asyncio.sleep(TICK_S)
            try:
                mono = time.monotonic()
                if mono - self._slices_read >= (SLICES_EVERY_S if self.ref.slices else TICK_S):
                    await self.read_slices(mono)
                self.tick(time.time())
            except Exception:
                log.exception("the rigid reference failed")
