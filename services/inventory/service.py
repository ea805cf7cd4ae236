"""Inventory: publishes the node's slices to the ``sja-slices`` KV bucket and frees a slice whose
holder gives its grant back (``sja.v1.lease.release``: the only way an agent changes a slice, so no
agent needs to write the bucket). Leases that run out are freed by the advertiser, which watches
every slice already.

Slices come from a declared file (emulated GPUs) or from NVML (``SJA_INVENTORY_SOURCE=nvml``), which
is read again every ``poll_interval_s``: slices of a GPU that stopped answering are marked offline,
and come back free when it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import get_args

from nats.aio.msg import Msg

from services.inventory.recut import Recutter
from sja.bus.codec import DecodeError, decode, encode
from sja.bus.service import Service
from sja.bus.settings import BaseSettings, Nodes
from sja.core import leases
from sja.inventory.declared import InventoryError
from sja.inventory.nvml import NvmlUnavailable, SoftSlices
from sja.inventory.sources import check_source, is_nvml, read_source
from sja.protocol import subjects
from sja.protocol.messages import ErrorReply, LeaseRelease, LeaseReleased, SliceState, SliceStatus

log = logging.getLogger(__name__)


RELEASE_ATTEMPTS = 5
"""Compare-and-set attempts to free a slice given back (each after reading it again)."""


class InventorySettings(BaseSettings, frozen=True, kw_only=True):
    inventory_source: str = ""
    """``declared`` (default; the file ``inventory``), ``declared:FILE``, ``nvml`` (this machine's GPUs
    through NVML) or ``fake-nvml:SCENARIO`` (see ``sja.inventory.fake_nvml``)."""
    inventory: str = ""
    """Declared inventory file; empty: the built-in default (one A100-40GB and one H100-80GB)."""
    nodes: Nodes = ()
    """Nodes of the file this replica owns (``SJA_NODES``, comma-separated); empty: every node."""
    node: str = "local"
    """The node NVML-discovered slices belong to (the executor of this machine uses the same name)."""
    pool: str = ""
    """Pool of NVML-discovered slices; empty: the node's name."""
    soft_slices: str = ""
    """How NVML GPUs without MIG are cut: empty or ``1``: one whole-GPU slice; ``N``: N equal
    memory-capped soft slices; ``MIB,MIB,...``: soft slices of these sizes."""
    poll_interval_s: float = 5.0
    """How often NVML is read again (GPUs lost or back)."""
    repartition: str = "off"
    """Whether this node's MIG GPUs are re-cut for the work waiting (``services.inventory.recut``):
    ``off`` (the operator's layouts stay), ``dry-run`` (each re-cut the core would make is planned
    on the GPU and logged, nothing changes) or ``on`` (drained, re-cut through NVML). NVML sources
    only; SJA never changes a GPU's MIG mode."""
    repartition_interval_s: float = 30.0
    """How often the layouts are looked at again."""
    slice_export_s: float = 5.0
    """How often the slice gauges are refreshed from the bucket: a read of every slice (the inventory
    does not watch the bucket, which would deliver it every change, several per grant). A second
    cost 512 deliveries a second at 512 slices, about a third of a message per grant at full load;
    Prometheus scrapes every 15-60 s."""


class InventoryService(Service):
    name = "inventory"

    def __init__(self, settings: InventorySettings) -> None:
        super().__init__(settings)
        self.cfg = settings
        self.declared: list[SliceState] = []
        """The slices the source sees now (this replica's)."""
        self.known: dict[str, SliceState] = {}
        """Every slice of this replica seen since it started, offline ones included."""
        self.source = check_source(settings.inventory_source)
        self.soft = SoftSlices.parse(settings.soft_slices)
        self.nvml: object | None = None
        """The NVML module read on every poll (kept: a fake's state lives in it)."""
        self.lost: list[str] = []
        self.recutter = Recutter(self, settings.repartition)
        self.m_slices = self.metrics.gauge(
            "sja_slices", "Slices of this inventory's nodes, by status.", unit="{slice}"
        )
        self.m_slice_state = self.metrics.gauge(
            "sja_slice_state",
            "1 for each slice of this inventory's nodes in its current status (one series per slice).",
        )

    async def on_start(self) -> None:
        if is_nvml(self.source):
            from sja.inventory.nvml import nvml_for

            self.nvml = nvml_for(self.source)
        self.declared = self.discover()
        await self.publish_inventory()
        await self.subscribe(subjects.LEASE_RELEASE, self.on_release, queue="inventory")
        self.loop(self._export_forever())
        if self.nvml is not None:
            self.loop(self._poll_forever())
            if self.recutter.mode != "off":
                self.loop(self._recut_forever())

    def discover(self) -> list[SliceState]:
        """The slices of this replica the source sees now; raises ``InventoryError``."""
        found = read_source(
            self.source,
            node=self.cfg.node,
            pool=self.cfg.pool,
            soft_slices=self.soft,
            nvml=self.nvml,
            declared_file=self.cfg.inventory,
        )
        for w in found.warnings:
            log.warning("inventory: %s", w)
        if found.lost != self.lost:
            for gpu in found.lost:
                log.error("GPU %s: its slices go offline", gpu)
            self.lost = list(found.lost)
        wanted = set(self.cfg.nodes)
        mine = [self.recutter.marked(s) for s in found.slices if not wanted or s.node in wanted]
        for s in mine:
            self.known[s.slice_id] = s
        return mine

    def owned_nodes(self) -> set[str]:
        """Nodes whose slices this replica answers for (a slice of theirs not discovered is offline)."""
        if self.nvml is not None:
            return {self.cfg.node}
        return {s.node for s in self.declared}

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.poll_interval_s)
            await self.poll()

    async def _recut_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.repartition_interval_s)
            try:
                await self.recutter.tick()
            except Exception:
                log.exception("choosing the MIG layouts failed")

    async def poll(self) -> None:
        """Read NVML again and publish what changed (lost GPUs' slices offline, returned ones free)."""
        try:
            self.declared = await asyncio.to_thread(self.discover)
        except NvmlUnavailable as e:
            # The driver went away under us: no GPU of this node can run anything.
            log.error("NVML unavailable (%s): every slice of %s goes offline", e, self.cfg.node)
            self.declared = []
        except InventoryError as e:
            log.error("inventory poll failed: %s", e)
            return
        try:
            await self.publish_inventory()
        except Exception:
            log.exception("publishing the inventory failed")

    async def publish_inventory(self) -> None:
        """Write what changed: each discovered slice merged into its state in the bucket
        (``leases.merge_declared``: new slices created, returned ones freed, nothing written for
        one unchanged), and the slices of this replica's nodes no longer discovered marked offline.

        Every state and revision comes from one read of the bucket, not a read per slice (this
        runs on every poll, and for 512 slices a read each took about 90 ms of CPU against 16). A
        write whose compare-and-set fails (a lease taken meanwhile) reads that slice again and
        merges anew."""
        assert self.slices is not None
        now = time.time()
        nodes = self.owned_nodes()
        declared_ids = {s.slice_id for s in self.declared}
        stored = await self.slices.all()
        by_id = {state.slice_id: (state, rev) for state, rev in stored}
        draining = self.recutter.holding()
        for s in self.declared:
            if s.gpu_index in draining:
                continue  # its slices stay out of service until the re-cut
            got = by_id.get(s.slice_id)
            while True:
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
                got = await self.slices.get(s.slice_id)
        for current, rev in stored:
            if current.node in nodes and current.slice_id not in declared_ids and current.status != "offline":
                log.warning("slice %s is gone from node %s: offline", current.slice_id, current.node)
                await self.slices.cas(current.slice_id, leases.offline(current, now), rev)
        log.info("inventory: %d slices on %s", len(self.declared), ",".join(sorted(nodes)))

    async def _export_forever(self) -> None:
        while True:
            try:
                await self.export_slices()
            except Exception:
                log.exception("reading the slices for their gauges failed")
            await asyncio.sleep(self.cfg.slice_export_s)

    async def export_slices(self) -> None:
        """Set the slice gauges from the bucket (only this replica's slices, so the sums over
        replicas sharding by ``SJA_NODES`` are right)."""
        assert self.slices is not None
        ids = set(self.known) | {s.slice_id for s in self.declared}
        mine = [s for s, _ in await self.slices.all() if s.slice_id in ids]
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

    async def on_release(self, msg: Msg) -> None:
        """A grant's holder gives its slice back: answer with ``LeaseReleased`` (or a typed error)."""
        try:
            req = decode(msg.data, LeaseRelease)
        except DecodeError as e:
            self.metrics.rejected(subjects.LEASE_RELEASE, e)
            if msg.reply:
                await msg.respond(encode(ErrorReply(code="bad_request", message=str(e)[:500])))
            return
        result = await self.release(req)
        if msg.reply:
            await msg.respond(encode(result))

    async def release(self, req: LeaseRelease) -> LeaseReleased:
        """Free the slice if it still holds ``req``'s grant at its fence (``leases.release``), by
        compare-and-set on the slice's revision."""
        assert self.slices is not None
        for _ in range(RELEASE_ATTEMPTS):
            got = await self.slices.get(req.slice_id)
            if got is None:
                return LeaseReleased(slice_id=req.slice_id, released=False, reason="unknown_slice")
            current, rev = got
            try:
                freed = leases.release(current, grant_id=req.grant_id, fence=req.fence, now=time.time())
            except leases.LeaseConflict:
                return LeaseReleased(slice_id=req.slice_id, released=False, reason="not_held")
            if await self.slices.cas(req.slice_id, freed, rev) is not None:
                log.info(
                    "released %s (grant %s, job %s): %s", req.slice_id, req.grant_id, req.job_id, req.reason
                )
                return LeaseReleased(slice_id=req.slice_id, released=True)
        return LeaseReleased(slice_id=req.slice_id, released=False, reason="conflict")
