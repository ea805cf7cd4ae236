"""What the agent's parts (``takeover``, ``reaping``, ``demand``) use of the agent: its state and
the few operations they share with its handlers. The parts depend on this protocol, not on the
service class: the service imports its parts, and nothing imports the service but its runner."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from nats.aio.client import Client

from services.agent.settings import AgentSettings
from services.agent.spans import JobSpans
from sja.bus.jetstream import JetStream
from sja.bus.persist import DeferredWriter
from sja.bus.store import KvStore
from sja.core import proofs
from sja.core.planner import PlanLimits
from sja.core.profile_cache import ProfileCache
from sja.protocol.messages import Completion, InFlight, JobState, SliceState


class Agent(Protocol):
    """An agent service as its parts see it (``AgentService`` is one)."""

    agent_id: str
    cfg: AgentSettings
    limits: PlanLimits
    owned: dict[str, tuple[JobState, int]]
    """job id -> (state, revision) of the jobs it owns."""
    profiles: ProfileCache
    spans: JobSpans
    slices: KvStore[SliceState] | None
    jobs: KvStore[JobState] | None
    writer: DeferredWriter[JobState, Completion]

    @property
    def bus(self) -> Client: ...

    @property
    def jetstream(self) -> JetStream: ...

    def lock(self, job_id: str) -> asyncio.Lock: ...

    async def save(
        self, job_id: str, transition: Callable[[JobState], JobState | None], force: bool = False
    ) -> JobState | None: ...

    def remember(self, state: JobState, rev: int) -> None: ...

    def ready(self, windows: int) -> None: ...

    def record_completion(self, c: Completion, flight: InFlight | None, workload: str) -> None: ...

    def drop_unproven(self, c: Completion, why: proofs.Unproven) -> None: ...
