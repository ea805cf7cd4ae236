"""Demand signals: the windows an agent's jobs became able to take (claimed, a subjob done, taken
over) are announced to the advertisers (``DemandChanged.ready``) after ``demand_coalesce_s``, so a
burst is one message."""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

from sja.bus.codec import encode
from sja.protocol import subjects
from sja.protocol.messages import DemandChanged

if TYPE_CHECKING:
    from services.agent.parts import Agent


class Demand:
    """An agent's coalesced ``DemandChanged`` messages."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.ready_new = 0
        """Windows this agent's jobs became able to take since the last ``DemandChanged``."""
        self._event = asyncio.Event()

    def ready(self, windows: int) -> None:
        """Jobs here can take ``windows`` more windows: tell the advertisers (coalesced)."""
        if windows > 0:
            self.ready_new += windows
            self._event.set()

    async def forever(self) -> None:
        agent = self.agent
        while True:
            await self._event.wait()
            await asyncio.sleep(agent.cfg.demand_coalesce_s)
            self._event.clear()
            n, self.ready_new = self.ready_new, 0
            if n <= 0:
                continue
            demand = DemandChanged(agent_id=agent.agent_id, jobs=len(agent.owned), ready=min(n, 1_000_000))
            with contextlib.suppress(Exception):
                await agent.bus.publish(subjects.DEMAND_CHANGED, encode(demand))
