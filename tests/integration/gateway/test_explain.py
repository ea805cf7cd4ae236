"""``sja explain``: why a job waits, answered by the gateway from the rounds the clearer stored, with
real services on a real nats-server. A job whose declared memory fits no slice is never offered a
window it can bid on; explain names, for each window shape, what its smallest subjob needs at its
``eps_mem`` (the planner's own quantile) and what the slice holds."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from sja.client import ApiError, SjaClient
from sja.core.profiles import JobProfile
from sja.protocol.messages import Explanation, JobSpec, MemoryDecl
from tests.integration.cli.test_cli_errors import sja_async
from tests.integration.telemetry.test_metrics import common, running
from tests.integration.waits import wait_until


async def test_explain_says_why_a_job_that_fits_no_slice_waits(nats_url: str, tmp_path: Path, nc) -> None:
    c = lambda name: common(nats_url, tmp_path, name, 0)  # noqa: E731
    inventory = InventoryService(InventorySettings(**c("inventory-x")))
    gateway = GatewayService(GatewaySettings(**c("gateway-x")))
    services = [
        gateway,
        ClearerService(ClearerSettings(**c("clearer-x"))),
        AgentService(AgentSettings(**c("agent-x"))),
        AdvertiserService(AdvertiserSettings(**c("advertiser-x"))),
    ]
    huge = JobSpec(
        name="huge",
        tenant="alpha",
        workload="montecarlo",
        params={"units": 10},
        memory=MemoryDecl(base_mib=100_000, per_unit_mib=10),
    )
    timed = msgspec.structs.replace(huge, name="timed", tenant="beta", deadline_s=30.0)
    async with running(*services):
        client = SjaClient(nc)
        # Submitted before any slice is published (the gateway refuses nothing against an empty
        # inventory; the inventory then shrank, say); once the slices are known the same job is
        # refused at submission, naming the largest slice.
        ack = await client.submit(huge)
        ack2 = await client.submit(timed)
        # A deadline under a policy that ignores it: the submission says so.
        assert any("sla and jasda" in n for n in ack2.notes), ack2.notes
        async with running(inventory):
            assert gateway.slice_view is not None
            view = gateway.slice_view
            await wait_until(lambda: view.entries, "the inventory's slices in the gateway's view", 30.0)
            with pytest.raises(ApiError, match="largest slice") as refused:
                await client.submit(msgspec.structs.replace(huge, name="later"))
            assert refused.value.error.field == "spec.memory"

            # Rounds go on (no job can take the free slices): wait until every shape's last offer
            # was seen after the job was taken on by the agent.
            async def every_shape_seen() -> Explanation | None:
                e = await client.explain(ack.job_id)
                return e if len(e.windows) == 5 and all("needs" in w.reason for w in e.windows) else None

            e = await wait_until(every_shape_seen, "a reason for each of the five shapes", 90.0, every_s=0.3)
            state = await client.status(ack.job_id)
            assert state.profile is not None
            need = JobProfile.from_state(state.profile).mem_quantile(1, 1.0 - huge.eps_mem)
            assert e.status == "pending" and e.policy == "fair"
            assert [w.mem_mib for w in e.windows] == sorted((w.mem_mib for w in e.windows), reverse=True)
            for w in e.windows:
                assert w.outcome == "no_bid"
                assert f"needs {need:,.0f} MiB at eps_mem 0.05" in w.reason, w.reason
                assert f"holds {w.mem_mib:,} MiB" in w.reason, w.reason
            assert (e.position, e.waiting) == (1, 2)
            assert any("fits none of the slices" in n and "40,448 MiB" in n for n in e.notes), e.notes
            e2 = await client.explain(ack2.job_id)
            assert e2.deadline.startswith("deadline 30 s after submission: ") and "left" in e2.deadline
            assert e2.waiting == 2
            await _tenant_and_cli(nc, nats_url, ack.job_id)


async def _tenant_and_cli(nc, nats_url: str, job_id: str) -> None:  # type: ignore[no-untyped-def]
    # Tenant-scoped: alpha sees its job, beta does not.
    assert (await SjaClient(nc, tenant="alpha").explain(job_id)).job_id == job_id
    with pytest.raises(ApiError, match="not_found"):
        await SjaClient(nc, tenant="beta").explain(job_id)

    code, out, err_text = await sja_async("explain", job_id, "--json", "--nats", nats_url)
    assert code == 0, err_text
    got = json.loads(out)
    assert got["job_id"] == job_id and got["windows"][0]["outcome"] == "no_bid"
    code, out, err_text = await sja_async("explain", job_id, "--nats", nats_url)
    assert code == 0 and "no bid: its smallest subjob (1 unit) needs" in " ".join(out.split()), out
    code, out, err_text = await sja_async("explain", "no-such-job", "--nats", nats_url)
    assert code == 2 and "no job no-such-job" in err_text
