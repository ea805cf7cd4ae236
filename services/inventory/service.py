"""Inventory: publishes the node's slices to the ``sja-slices`` KV bucket and expires leases."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import get_args

from sja.bus.service import Service
from sja.bus.settings import BaseSettings
from sja.bus.watch import KvView
from sja.core import leases
from sja.inventory.declared import load_declared
from sja.protocol import subjects
from sja.protocol.messages import SliceState, SliceStatus

log = logging.getLogger(__name__)


SLICE_EXPORT_S = 1.0
"""How often the slice gauges are refreshed from the watched cache."""


class InventorySettings(BaseSettings, frozen=True, kw_only=True):
    inventory: str = ""
    """Declared inventory file; empty: the built-in default (one A100-40GB and one H100-80GB)."""
    nodes: str = ""
    """Comma-separated nodes this replica owns; empty: every node of the file."""
    sweep_interval_s: float = 0.25


class InventoryService(Service):
    name = "inventory"

    def __init__(self, settings: InventorySettings) -> None:
        super().__init__(settings)
        self.cfg = settings
        self.declared: list[SliceState] = []
        self.view: KvView[SliceState] | None = None
        self.m_slices = self.metrics.gauge(
            "sja_slices", "Slices of this inventory's nodes, by status.", unit="{slice}"
        )
        self.m_slice_state = self.metrics.gauge(
            "sja_slice_state",
            "1 for each slice of this inventory's nodes in its current status (one series per slice).",
        )
        self._exported_at = 0.0

    async def on_start(self) -> None:
        wanted = {n for n in self.cfg.nodes.split(",") if n}
        self.declared = [s for s in load_declared(self.cfg.inventory) if not wanted or s.node in wanted]
        await self.publish_inventory()
        assert self.js is not None
        # The sweep reads a watched cache: listing the bucket would create a consumer per sweep.
        self.view = KvView(await self.js.key_value(subjects.BUCKET_SLICES), SliceState)
        await self.view.start()
        self.loop(self._sweep_forever())

    async def on_stop(self) -> None:
        if self.view is not None:
            await self.view.stop()

    async def publish_inventory(self) -> None:
        assert self.slices is not None
        now = time.time()
        nodes = {s.node for s in self.declared}
        declared_ids = {s.slice_id for s in self.declared}
        for s in self.declared:
            while True:
                got = await self.slices.get(s.slice_id)
                current, rev = got if got is not None else (None, 0)
                merged = leases.merge_declared(current, s, now)
                if merged is None:
                    break
                ok = (
                    await self.slices.create(s.slice_id, merged)
                    if current is None
                    else await self.slices.cas(s.slice_id, merged, rev)
                )
                if ok is not None:
                    break
        for current, rev in await self.slices.all():
            if current.node in nodes and current.slice_id not in declared_ids and current.status != "offline":
                log.warning("slice %s is gone from node %s: offline", current.slice_id, current.node)
                await self.slices.cas(current.slice_id, leases.offline(current, now), rev)
        log.info("inventory: %d slices on %s", len(self.declared), ",".join(sorted(nodes)))

    async def _sweep_forever(self) -> None:
        while True:
            try:
                await self.sweep()
            except Exception:
                log.exception("lease sweep failed")
            now = time.monotonic()
            if now - self._exported_at >= SLICE_EXPORT_S:
                self._exported_at = now
                self.export_slices()
            await asyncio.sleep(self.cfg.sweep_interval_s)

    def export_slices(self) -> None:
        """Set the slice gauges from the watched cache (only this replica's slices, so the sums over
        replicas sharding by ``SJA_NODES`` are right)."""
        if self.view is None:
            return
        ids = {s.slice_id for s in self.declared}
        mine = [s for s, _ in list(self.view.entries.values()) if s.slice_id in ids]
        counts = dict.fromkeys(get_args(SliceStatus), 0)
        for s in mine:
            counts[s.status] = counts.get(s.status, 0) + 1
        self.m_slices.replace((n, {"status": status}) for status, n in counts.items())
        self.m_slice_state.replace(
            (
                1,
                {
                    "slice": s.slice_id,
                    "node": s.node,
                    "pool": s.pool,
                    "profile": s.profile,
                    "status": s.status,
                },
            )
            for s in mine
        )

    async def sweep(self) -> int:
        """Free every slice of ours whose lease ran out; returns how many."""
        assert self.slices is not None and self.view is not None
        ids = {s.slice_id for s in self.declared}
        freed = 0
        now = time.time()
        for current, rev in list(self.view.entries.values()):
            if current.slice_id not in ids:
                continue
            new = leases.expire(current, now)
            if new is not None and await self.slices.cas(current.slice_id, new, rev) is not None:
                log.warning(
                    "lease of %s (grant %s, %s) expired: slice freed",
                    current.slice_id,
                    current.grant_id,
                    current.status,
                )
                freed += 1
        return freed
