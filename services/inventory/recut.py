"""The node's MIG layouts, chosen for the work waiting and applied through NVML.

Every ``repartition_interval_s`` the inventory of an NVML node reads the slices of its GPUs and the
jobs waiting, and asks the core what the simulator asks it (``sja.core.repartition``): which idle
GPU to re-cut (``plan_repartitions``), which busy one to drain (``plan_drains``), to which layout.
The demand is the jobs in the default policy's queue order (``core.explain.queue_order``), one
slice per subjob each could still start, of the profiles its planner would propose for
(``core.bidding.propose`` against a window of each profile).

``repartition`` says what happens then:

- ``off`` (the default): nothing; the layouts are the operator's;
- ``dry-run``: each re-cut is planned on the GPU (``sja.inventory.layout.plan_layout``, which
  changes nothing) and logged with its steps, or with the reason NVML would refuse it;
- ``on``: the GPU is drained, then re-cut. Its free slices go offline (no window is offered on them);
  a holder continuing past its window is asked to yield, as to a job that won its slice (its slice is
  leased to a drain grant, ``YieldRequest``); a holder whose subjob ends anyway is left to end. Once
  every slice is offline and no process runs on the GPU, ``apply_layout`` re-cuts it and the
  inventory publishes the new slices (free). A refusal (``busy``: something still runs) is tried
  again at the next pass; any other gives the GPU back its slices as they were.

Drains live in this process only: an inventory that restarts publishes its GPUs' slices afresh
(offline ones come back free), so a drain it had begun is abandoned, never half-applied. A re-cut
that failed midway is reported by ``apply_layout``, which puts the old layout back where it can.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgspec

from sja.bus.codec import encode
from sja.core import defaults, leases
from sja.core.bidding import propose
from sja.core.explain import queue_order
from sja.core.mig import CATALOGUE
from sja.core.node_layouts import plan_node
from sja.core.planner import PlanLimits
from sja.core.profile_cache import ProfileCache
from sja.core.repartition import Repartition
from sja.inventory.layout import LayoutPlan, LayoutRefused, apply_layout, plan_layout
from sja.protocol import subjects
from sja.protocol.messages import JobState, Offer, SliceState, YieldRequest

if TYPE_CHECKING:
    from services.inventory.service import InventoryService

log = logging.getLogger(__name__)

MODES = ("off", "dry-run", "on")
DRAIN_LEASE_S = 60.0
"""How long a drain grant holds a slice taken from its holder (it goes offline at the next pass)."""
DRAIN_GRANT = "drain-"
"""Prefix of the grant a drain leases a held slice under (its holder yields to it)."""


@dataclass
class Drain:
    """A GPU being drained for ``layout``."""

    gpu_index: int
    layout: tuple[str, ...]
    started: float


class Recutter:
    """The inventory's layout loop (see the module docstring)."""

    def __init__(self, service: InventoryService, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"repartition must be one of {', '.join(MODES)}, got {mode!r}")
        self.svc = service
        self.mode = mode
        self.draining: dict[int, Drain] = {}
        self.recut_at: dict[int, float] = {}
        self.profiles = ProfileCache()
        self.limits = PlanLimits()
        self.planned: list[tuple[Repartition, LayoutPlan | str]] = []
        """The last pass's re-cuts, each with NVML's plan or the reason it would be refused (dry run)."""
        self.recuts = 0

    def marked(self, s: SliceState) -> SliceState:
        """``s`` with the memory a re-cut of its GPU can reach (``SliceState.recut_mib``) when this
        inventory re-cuts: what the gateway admits a job against and the offers' largest slice."""
        model = CATALOGUE.get(s.gpu_model)
        if self.mode != "on" or s.source != "nvml" or model is None:
            return s
        return msgspec.structs.replace(s, recut_mib=max(p.mem_mib for p in model.profiles))

    def holding(self) -> set[int]:
        """GPU indices whose slices the inventory's polls must leave as they are (being drained)."""
        return set(self.draining)

    async def tick(self) -> None:
        """One pass: plan, then drive the drains."""
        if self.mode == "off" or self.svc.nvml is None:
            return
        svc = self.svc
        assert svc.slices is not None and svc.jobs is not None
        now = time.time()
        gpus = await self._gpus()
        jobs = [s for s, _ in await svc.jobs.all()]
        waiting, _ = queue_order(defaults.POLICY, jobs)

        def propose_for(state: JobState, offer: Offer) -> bool:
            return propose(state, offer, now, self.limits, profiles=self.profiles) is not None

        plan = plan_node(
            gpus,
            waiting,
            propose_for,
            node=svc.cfg.node,
            now=now,
            draining={i: d.layout for i, d in self.draining.items()},
            recut_at=self.recut_at,
        )
        if self.mode == "dry-run":
            self.planned = [(r, await self._dry_run(r, gpus)) for r in plan]
            return
        for r in plan:
            idx = int(r.gpu_id)
            log.info("GPU %d: draining for %s (from %s)", idx, "+".join(r.new), "+".join(r.old))
            self.draining[idx] = Drain(idx, r.new, now)
        for idx in sorted(self.draining):
            await self._drive(self.draining[idx], gpus.get(idx, []))

    async def _gpus(self) -> dict[int, list[SliceState]]:
        assert self.svc.slices is not None
        node = self.svc.cfg.node
        known = {s.slice_id for s in self.svc.declared}
        out: dict[int, list[SliceState]] = {}
        for s, _ in await self.svc.slices.all():
            if s.node == node and s.slice_id in known:
                out.setdefault(s.gpu_index, []).append(s)
        return out

    async def _dry_run(self, r: Repartition, gpus: Mapping[int, Sequence[SliceState]]) -> LayoutPlan | str:
        idx = int(r.gpu_id)
        busy = {s.gpu_uuid for s in gpus.get(idx, []) if s.status != "free"}
        try:
            planned = await asyncio.to_thread(plan_layout, self.svc.nvml, idx, r.new, busy=busy)
        except LayoutRefused as e:
            log.info(
                "GPU %d: would re-cut %s -> %s, refused now: %s", idx, "+".join(r.old), "+".join(r.new), e
            )
            return f"{e.reason}: {e.message}"
        log.info(
            "GPU %d: would re-cut %s -> %s for %d waiting slices: %s",
            idx,
            "+".join(r.old),
            "+".join(r.new),
            len(r.serves),
            "; ".join(planned.describe()),
        )
        return planned

    async def _drive(self, drain: Drain, slices: Sequence[SliceState]) -> None:
        """Take the drained GPU's slices out of service; re-cut it once nothing runs on it."""
        svc = self.svc
        assert svc.slices is not None
        now = time.time()
        done = True
        for s in slices:
            if s.status == "offline":
                continue
            # A slice its holder yielded to the drain goes offline too: the re-cut itself waits until
            # NVML sees no process on the GPU (``apply_layout`` refuses ``busy`` until then).
            if s.status == "free" or (s.status == "leased" and s.grant_id.startswith(DRAIN_GRANT)):
                done = await self._cas(s, leases.offline(s, now)) and done
                continue
            done = False
            if s.status == "busy" and s.contestable_at > 0 and leases.preempts(s, now):
                await self._take(s, now)
        if not done:
            return
        try:
            await asyncio.to_thread(apply_layout, svc.nvml, drain.gpu_index, drain.layout)
        except LayoutRefused as e:
            if e.reason == "busy":
                log.info("GPU %d: still busy, re-cut at the next pass: %s", drain.gpu_index, e)
                return
            log.error("GPU %d: re-cut to %s refused: %s", drain.gpu_index, "+".join(drain.layout), e)
        else:
            self.recuts += 1
            self.recut_at[drain.gpu_index] = time.time()
            log.info("GPU %d: re-cut to %s", drain.gpu_index, "+".join(drain.layout))
        del self.draining[drain.gpu_index]
        await svc.poll()

    async def _cas(self, current: SliceState, new: SliceState) -> bool:
        assert self.svc.slices is not None
        got = await self.svc.slices.get(current.slice_id)
        if got is None or got[0] != current:
            return False
        return await self.svc.slices.cas(current.slice_id, new, got[1]) is not None

    async def _take(self, s: SliceState, now: float) -> None:
        """Lease a held slice past its holder's window to a drain grant and ask its holder to yield."""
        grant_id = f"{DRAIN_GRANT}{uuid.uuid4().hex[:12]}"
        leased = leases.grant(
            s, offered_fence=s.fence, job_id="drain", grant_id=grant_id, now=now, lease_s=DRAIN_LEASE_S
        )
        if not await self._cas(s, leased):
            return
        req = YieldRequest(
            slice_id=s.slice_id,
            node=s.node,
            holder_grant_id=s.grant_id,
            grant_id=grant_id,
            fence=leased.fence,
            issued_at=now,
        )
        await self.svc.bus.publish(subjects.slice_yield(s.node), encode(req))


def describe(planned: Sequence[tuple[Repartition, Any]]) -> list[str]:
    """One line per planned re-cut (what ``dry-run`` logs)."""
    out = []
    for r, p in planned:
        what = p if isinstance(p, str) else "; ".join(p.describe())
        out.append(f"GPU {r.gpu_id}: {'+'.join(r.old)} -> {'+'.join(r.new)}: {what}")
    return out
