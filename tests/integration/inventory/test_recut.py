"""MIG layouts chosen for the work waiting and applied through NVML (``services.inventory.recut``),
against a real nats-server and the fake NVML: a job no instance holds gets its GPU re-cut whole; the
dry run plans the same re-cut and changes nothing; a held slice is drained (its holder asked to
yield) before its GPU is re-cut; with re-cutting off, nothing happens."""

from __future__ import annotations

import time

from nats.aio.client import Client

from services.inventory.service import InventoryService, InventorySettings
from sja.bus.codec import decode
from sja.bus.store import stores
from sja.bus.streams import ensure_jetstream
from sja.core import jobs as J
from sja.core import leases
from sja.inventory.layout import current_layout
from sja.protocol import subjects
from sja.protocol.messages import JobSpec, MemoryDecl, SliceState, YieldRequest
from tests.integration.waits import wait_until

NODE = "n1"


def inventory(nats_url: str, mode: str) -> InventoryService:
    return InventoryService(
        InventorySettings(
            nats_url=nats_url,
            inventory_source="fake-nvml:h100-mig",
            node=NODE,
            repartition=mode,
            repartition_interval_s=3600.0,  # passes are driven by the test
            poll_interval_s=3600.0,
        )
    )


async def add_big_job(nc: Client) -> None:
    """A job whose every subjob needs 60 GB: no instance of 2g.20gb+1g.10gb+1g.10gb+3g.40gb holds it."""
    js = nc.jetstream()
    await ensure_jetstream(js)
    _, jobs = await stores(js)
    spec = JobSpec(
        name="big",
        tenant="t",
        workload="montecarlo",
        params={"units": 8},
        memory=MemoryDecl(base_mib=60_000, per_unit_mib=0, rel_sd=0.0),
    )
    await jobs.create("big", J.new_job("big", spec, time.time()))


async def slices_of(svc: InventoryService) -> list[SliceState]:
    assert svc.slices is not None
    return [s for s, _ in await svc.slices.all() if s.node == NODE]


async def test_a_job_no_instance_holds_gets_its_gpu_re_cut_whole(nats_url: str, nc: Client) -> None:
    await add_big_job(nc)
    async with inventory(nats_url, "on") as svc:
        assert current_layout(svc.nvml, 0) == ("2g.20gb", "1g.10gb", "1g.10gb", "3g.40gb")
        await svc.recutter.tick()  # plans the re-cut; the GPU is idle: re-cut at once
        assert current_layout(svc.nvml, 0) == ("7g.80gb",)
        assert svc.recutter.recuts == 1
        free = [s for s in await slices_of(svc) if s.status == "free"]
        assert [s.profile for s in free] == ["7g.80gb"]
        assert free[0].mem_mib > 60_000
        # the old instances' slices are gone from the node: offline, never offered again
        assert {s.status for s in await slices_of(svc) if s.profile != "7g.80gb"} == {"offline"}
        await svc.recutter.tick()  # served: nothing more to do
        assert svc.recutter.recuts == 1


async def test_the_dry_run_plans_the_re_cut_and_changes_nothing(nats_url: str, nc: Client) -> None:
    await add_big_job(nc)
    async with inventory(nats_url, "dry-run") as svc:
        before = await slices_of(svc)
        await svc.recutter.tick()
        assert current_layout(svc.nvml, 0) == ("2g.20gb", "1g.10gb", "1g.10gb", "3g.40gb")
        assert await slices_of(svc) == before
        [(r, planned)] = svc.recutter.planned
        assert r.new == ("7g.80gb",)
        assert not isinstance(planned, str), planned
        assert planned.new == ("7g.80gb",) and len(planned.destroy) == 4


async def test_a_held_slice_is_drained_before_its_gpu_is_re_cut(nats_url: str, nc: Client) -> None:
    await add_big_job(nc)
    asked: list[YieldRequest] = []

    async def on_yield(msg: object) -> None:
        asked.append(decode(msg.data, YieldRequest))  # type: ignore[attr-defined]

    await nc.subscribe(subjects.slice_yield(NODE), cb=on_yield)
    async with inventory(nats_url, "on") as svc:
        assert svc.slices is not None
        # A holder on the 3g.40gb continuing past its window (an open subjob, core.continuation).
        held = next(s for s in await slices_of(svc) if s.profile == "3g.40gb")
        now = time.time()
        leased = leases.grant(
            held, offered_fence=held.fence, job_id="other", grant_id="g1", now=now, lease_s=60
        )
        busy = leases.start(
            leased,
            grant_id="g1",
            fence=leased.fence,
            now=now,
            time_cap_s=600,
            expected_s=60,
            grace_s=30,
            contestable_at=now - 1,
        )
        got = await svc.slices.get(held.slice_id)
        assert got is not None
        assert await svc.slices.cas(held.slice_id, busy, got[1]) is not None

        await svc.recutter.tick()  # drain: free slices offline, the holder asked to yield
        await wait_until(lambda: bool(asked), timeout_s=10, what="a yield request to the holder")
        assert asked[0].holder_grant_id == "g1" and asked[0].slice_id == held.slice_id
        assert current_layout(svc.nvml, 0) == ("2g.20gb", "1g.10gb", "1g.10gb", "3g.40gb"), (
            "not before it yields"
        )
        states = {s.profile: s.status for s in await slices_of(svc)}
        assert states["2g.20gb"] == "offline" and states["3g.40gb"] == "leased"
        # the inventory's own poll leaves a draining GPU's slices out of service
        await svc.poll()
        assert {s.status for s in await slices_of(svc) if s.profile == "1g.10gb"} == {"offline"}

        await svc.recutter.tick()  # the yielded slice offline; nothing runs: re-cut
        await svc.recutter.tick()
        assert current_layout(svc.nvml, 0) == ("7g.80gb",)
        assert [s.profile for s in await slices_of(svc) if s.status == "free"] == ["7g.80gb"]


async def test_with_re_cutting_off_the_layout_stays(nats_url: str, nc: Client) -> None:
    await add_big_job(nc)
    async with inventory(nats_url, "off") as svc:
        await svc.recutter.tick()
        assert current_layout(svc.nvml, 0) == ("2g.20gb", "1g.10gb", "1g.10gb", "3g.40gb")
        assert svc.recutter.planned == [] and svc.recutter.recuts == 0


def test_an_unknown_mode_is_refused() -> None:
    import pytest

    with pytest.raises(ValueError, match="repartition must be one of"):
        inventory("nats://127.0.0.1:1", "maybe")
