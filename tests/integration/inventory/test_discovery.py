"""NATS micro discovery beyond the ping: every service (the executor with its local Ray included)
answers ``$SRV.INFO`` and ``$SRV.STATS`` with its name, version, replica id and endpoints, and the
request/reply endpoints' statistics count the requests they served."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.executor.service import ExecutorService, ExecutorSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from services.registry import SERVICES
from services.ui.service import UiService, UiSettings
from sja import __version__
from sja.client import SjaClient
from sja.protocol import subjects

pytestmark = pytest.mark.timeout(180)


@contextlib.asynccontextmanager
async def running(*services: object) -> AsyncIterator[None]:
    async with contextlib.AsyncExitStack() as stack:
        for s in services:
            await stack.enter_async_context(s)  # type: ignore[arg-type]
        yield


async def ask(nc: Any, subject: str) -> dict[str, Any]:
    msg = await nc.request(subject, b"", timeout=5)
    return json.loads(msg.data)  # type: ignore[no-any-return]


async def everyone(nc: Any, subject: str, expected: int, timeout_s: float = 5.0) -> list[dict[str, Any]]:
    """Every answer to a discovery request sent to all services (``$SRV.INFO``, no name)."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish(subject, b"", reply=inbox)
    out: list[dict[str, Any]] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    try:
        while len(out) < expected and loop.time() < deadline:
            with contextlib.suppress(TimeoutError):
                msg = await sub.next_msg(timeout=max(0.01, deadline - loop.time()))
                out.append(json.loads(msg.data))
    finally:
        await sub.unsubscribe()
    return out


def endpoint(doc: dict[str, Any], name: str) -> dict[str, Any]:
    found = [e for e in doc.get("endpoints") or [] if e["name"] == name]
    assert len(found) == 1, (name, doc.get("endpoints"))
    return found[0]


async def test_every_service_answers_info_and_stats(nats_url: str, tmp_path: Path, nc) -> None:
    def c(name: str) -> dict[str, object]:
        return {"nats_url": nats_url, "out_dir": str(tmp_path / "out"), "instance": name}

    services = [
        InventoryService(InventorySettings(**c("inventory-d"))),
        GatewayService(GatewaySettings(**c("gateway-d"))),
        ClearerService(ClearerSettings(**c("clearer-d"))),
        AgentService(AgentSettings(**c("agent-d"))),
        ExecutorService(ExecutorSettings(**c("executor-d"), ray_num_cpus=1)),
        AdvertiserService(AdvertiserSettings(**c("advertiser-d"))),
        UiService(UiSettings(**c("ui-d"), ui_port=0, ui_host="127.0.0.1")),
    ]
    assert {s.name for s in services} == set(SERVICES)
    async with running(*services):
        infos = {}
        for s in services:
            info = await ask(nc, f"$SRV.INFO.sja-{s.name}")
            assert info["type"] == "io.nats.micro.v1.info_response"
            assert info["name"] == f"sja-{s.name}"
            assert info["version"] == __version__
            assert info["metadata"]["instance"] == f"{s.name}-d"
            assert info["description"] == f"SJA {s.name}"
            # Addressed by id too (what the health check and `nats micro info` use).
            assert (await ask(nc, f"$SRV.INFO.sja-{s.name}.{info['id']}"))["id"] == info["id"]
            infos[s.name] = info

            stats = await ask(nc, f"$SRV.STATS.sja-{s.name}")
            assert stats["type"] == "io.nats.micro.v1.stats_response"
            assert stats["name"] == f"sja-{s.name}" and stats["id"] == info["id"]
            assert stats["version"] == __version__
            started = datetime.fromisoformat(stats["started"].replace("Z", "+00:00"))
            assert started.year >= 2024
            assert {e["name"] for e in stats.get("endpoints") or []} == {
                e["name"] for e in info.get("endpoints") or []
            }

        # The request/reply APIs are listed as endpoints with their subjects.
        gw = {e["name"]: e["subject"] for e in infos["gateway"]["endpoints"]}
        assert gw["submit"] == subjects.JOB_SUBMIT and gw["status"] == subjects.JOB_STATUS
        assert gw["tenant-submit"] == subjects.tenant_request(subjects.JOB_SUBMIT, "*")
        assert endpoint(infos["clearer"], "policy")["subject"] == f"{subjects.PREFIX}.clearer.policy"

        # One request to `$SRV.INFO` reaches every service.
        everyone_info = await everyone(nc, "$SRV.INFO", expected=len(services))
        assert sorted(i["name"] for i in everyone_info) == sorted(f"sja-{n}" for n in SERVICES)

        # STATS count what an endpoint served.
        before = endpoint(await ask(nc, "$SRV.STATS.sja-gateway"), "list")["num_requests"]
        await SjaClient(nc).jobs()
        await SjaClient(nc).jobs()
        after = endpoint(await ask(nc, "$SRV.STATS.sja-gateway"), "list")
        assert after["num_requests"] == before + 2
        assert after["num_errors"] == 0
        assert after["processing_time"] > 0
        policy_before = endpoint(await ask(nc, "$SRV.STATS.sja-clearer"), "policy")["num_requests"]
        reply = await nc.request(f"{subjects.PREFIX}.clearer.policy", b"efficiency", timeout=5)
        assert reply.data == b"efficiency"
        policy = endpoint(await ask(nc, "$SRV.STATS.sja-clearer"), "policy")
        assert policy["num_requests"] == policy_before + 1
