"""A tenant's Python workload through the control plane (a real nats-server; the gateway, the agent,
the clearer, the advertiser and the inventory in this process): it is accepted, planned and
materialized by the facts its spec carries, and nothing of the control plane imports it. The
workload's module is importable here and writes a marker when imported, so an import anywhere in
this process (every service under test runs in it) would show."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from sja.client import ApiError
from sja.protocol import messages as m

pytestmark = pytest.mark.timeout(120)

HORIZON_S = 2.0


@contextlib.asynccontextmanager
async def control_plane(nats_url: str, tmp: Path) -> AsyncIterator[Any]:
    """Every service but the executor, and a client."""
    from services.advertiser.service import AdvertiserService, AdvertiserSettings
    from services.agent.service import AgentService, AgentSettings
    from services.clearer.service import ClearerService, ClearerSettings
    from services.gateway.service import GatewayService, GatewaySettings
    from services.inventory.service import InventoryService, InventorySettings
    from sja.bus.connection import connect
    from sja.bus.service import Service
    from sja.client import SjaClient

    def c(name: str) -> dict[str, Any]:
        return {"nats_url": nats_url, "out_dir": str(tmp / "out"), "instance": name}

    services: list[Service] = [
        InventoryService(InventorySettings(**c("inventory-t"))),
        GatewayService(GatewaySettings(**c("gateway-t"))),
        ClearerService(ClearerSettings(**c("clearer-t"), lease_s=3.0)),
        AgentService(AgentSettings(**c("agent-t"), horizon_s=HORIZON_S, heartbeat_s=0.5, lease_s=3.0)),
        AdvertiserService(AdvertiserSettings(**c("advertiser-t"), horizon_s=HORIZON_S, sweep_interval_s=0.1)),
    ]
    nc = await connect(nats_url, "test-client")
    started: list[Service] = []
    try:
        for svc in services:
            await svc.start()
            started.append(svc)
        yield SjaClient(nc)
    finally:
        for svc in reversed(started):
            with contextlib.suppress(Exception):
                await svc.stop()
        await nc.close()


async def test_a_tenant_workload_is_planned_by_its_facts_and_never_imported(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.integration.agent.test_sequential_checkpoints import until_state

    marker = tmp_path / "imported-by"
    (tmp_path / "sja_test_tenant_spy_gw.py").write_text(
        "import os, sys\n"
        f"open({str(marker)!r}, 'a').write(' '.join(sys.argv) + '\\n')\n"
        "from sja.workloads.montecarlo import MonteCarloPi as W\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    name = "sja_test_tenant_spy_gw:W"
    async with control_plane(nats_url, tmp_path) as client:
        # Without facts the gateway cannot plan it and will not run it to find out: refused, saying so.
        with pytest.raises(ApiError) as e:
            await client.submit(m.JobSpec(name="spy", tenant="t", workload=name, params={"units": 50}))
        assert e.value.error.field == "facts" and "never runs a tenant's code" in e.value.error.message

        spec = m.JobSpec(
            name="spy",
            tenant="t",
            workload=name,
            params={"units": 50},
            facts=m.WorkloadFacts(
                total_units=50,
                memory=m.MemoryDecl(base_mib=64.0, per_unit_mib=0.0, rel_sd=0.2),
                time=m.TimeDecl(warmup_s=0.05, per_unit_s=0.01, rel_sd=0.5),
            ),
            max_parallel=2,
        )
        ack = await client.submit(spec, "spy-1")
        # Claimed, bid for, granted and materialized: a subjob is dispatched (no executor runs it).
        state = await until_state(
            client, ack.job_id, lambda s: bool(s.in_flight), 60, "a subjob materialized by its facts"
        )
        assert state.total_units == 50 and state.status in ("pending", "running")
    assert not marker.exists(), f"a service imported the tenant's workload: {marker.read_text()}"
    assert "sja_test_tenant_spy_gw" not in sys.modules
