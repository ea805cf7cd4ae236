"""A job that can never run again fails with the reason instead of waiting for ever: its smallest
subjob (here the whole job: ``min_units`` is all of it) ran out of memory on the largest slice
there is, so nothing it could wait for would take it."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.executor.service import ExecutorService, ExecutorSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from sja.client import ApiError, SjaClient
from sja.core import jobs as J
from sja.protocol.messages import JobSpec, MemoryDecl, TimeDecl
from tests.integration.telemetry.test_metrics import common, running
from tests.integration.waits import until_state, wait_until


async def test_a_job_whose_smallest_subjob_fits_no_slice_fails_with_the_reason(
    nats_url: str, tmp_path: Path, nc
) -> None:
    port = 0
    c = lambda name: common(nats_url, tmp_path, name, port)  # noqa: E731
    inventory = InventoryService(
        InventorySettings(
            **c("inventory-h"), inventory_source="fake-nvml:h100-nomig", node="local", soft_slices="96,96"
        )
    )
    services = [
        inventory,
        GatewayService(GatewaySettings(**c("gateway-h"), mem_reserve_mib=0.0)),
        ClearerService(ClearerSettings(**c("clearer-h"))),
        AgentService(AgentSettings(**c("agent-h"), horizon_s=4.0, mem_reserve_mib=0.0, reap_every_s=0.5)),
        ExecutorService(ExecutorSettings(**c("executor-h"), node="local", ray_num_cpus=2)),
        AdvertiserService(AdvertiserSettings(**c("advertiser-h"), horizon_s=4.0)),
    ]
    rows = 40_000  # ~160 MiB for the left operand alone: more than either 96 MiB slice
    spec = JobSpec(
        name="one-piece-too-big",
        tenant="th",
        workload="matmul",
        params={"rows": rows, "inner": 512, "cols": 64, "seed": 3},
        min_units=rows,
        # Declared as if it took almost nothing, so the first try is planned and runs out of memory.
        memory=MemoryDecl(base_mib=1.0, per_unit_mib=0.0001, rel_sd=0.0),
        time=TimeDecl(warmup_s=0.0, per_unit_s=1e-9, rel_sd=0.0),
    )
    async with running(*services):
        client = SjaClient(nc)
        job = await client.submit(spec)
        state = await until_state(client, job.job_id, J.is_terminal, 120, "the job to end", every_s=0.3)
    assert state.status == "failed", (state.status, state.error)
    assert [h.status for h in state.history] == ["oom"], "it is given up after one try, not retried"
    assert "ran out of memory" in state.error and "smallest subjob" in state.error, state.error
    assert state.units_done == 0 and not state.in_flight


async def test_a_job_no_slice_can_hold_is_refused_at_submission_naming_the_largest_slice(
    nats_url: str, tmp_path: Path, nc
) -> None:
    c = lambda name: common(nats_url, tmp_path, name, 0)  # noqa: E731
    inventory = InventoryService(
        InventorySettings(
            **c("inventory-r"), inventory_source="fake-nvml:h100-nomig", node="local", soft_slices="96,160"
        )
    )
    gateway = GatewayService(GatewaySettings(**c("gateway-r"), mem_reserve_mib=32.0))
    async with running(inventory, gateway):
        assert gateway.slice_view is not None
        view = gateway.slice_view
        await wait_until(lambda: len(view.entries) >= 2, "the inventory's slices in the gateway's view", 30.0)
        client = SjaClient(nc)
        too_big = JobSpec(
            name="too-big",
            tenant="tr",
            workload="matmul",
            params={"rows": 64, "inner": 64, "cols": 64},
            memory=MemoryDecl(base_mib=149.0, per_unit_mib=1.0),  # 150 MiB for its smallest subjob
            time=TimeDecl(warmup_s=0.0, per_unit_s=0.001),
        )
        with pytest.raises(ApiError) as refused:
            await client.submit(too_big)
        err = refused.value.error
        assert err.code == "bad_request" and err.field == "spec.memory"
        assert "150 MiB" in err.message and "128 MiB usable" in err.message and "160 MiB" in err.message
        assert not [s for s in await client.jobs() if s.spec.name == "too-big"], "nothing was queued"
        # Nearly the whole largest slice, declared: accepted (and plannable there, see test_never_worse).
        fits = msgspec.structs.replace(
            too_big, name="fits", memory=MemoryDecl(base_mib=127.0, per_unit_mib=0.0)
        )
        assert (await client.submit(fits)).job_id
