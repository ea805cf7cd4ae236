"""The dashboard service (``services/ui``) against real services on a real nats-server: its JSON
endpoints show the slices, a job's subjobs on the timeline, the job's state and explanation (from
the gateway's ``explain``), the tenants' shares against their targets and the rounds the clearer
stored, each round linked to its trace in Jaeger when ``SJA_JAEGER_URL`` is set. No executor runs:
the agent's subjobs stay in flight, which the timeline draws as running."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from services.ui.service import UiService, UiSettings
from sja import dashauth
from sja.bus.settings import SettingsError
from sja.client import SjaClient
from sja.protocol.messages import JobSpec, MemoryDecl
from tests.integration.accepted import accepted_earlier
from tests.integration.telemetry.test_metrics import common, running
from tests.integration.waits import wait_until


def operator(ui: UiService) -> str:
    """The operator's token, as ``sja dashboard-token`` derives it from the service's secret."""
    return dashauth.operator_token(dashauth.read_secret(ui.token_file))


def fetch(
    port: int, path: str, token: str = "", headers: dict[str, str] | None = None
) -> tuple[int, str, bytes]:
    sent = dict(headers or {})
    if token:
        sent["Authorization"] = f"Bearer {token}"
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", headers=sent)
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.headers["Content-Type"], r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers["Content-Type"], e.read()


async def get_json(port: int, path: str, token: str) -> Any:
    status, ctype, body = await asyncio.to_thread(fetch, port, path, token)
    assert status == 200 and ctype == "application/json", (path, status, body[:200])
    return json.loads(body)


async def test_the_dashboard_shows_subjobs_explanations_shares_and_rounds(
    nats_url: str, tmp_path: Path, nc
) -> None:
    c = lambda name: common(nats_url, tmp_path, name, 0)  # noqa: E731
    ui = UiService(
        UiSettings(
            **c("ui-t"),
            ui_port=0,
            ui_host="127.0.0.1",
            ui_refresh_s=0.1,
            jaeger_url="http://jaeger.example:16686/",
            tenant_shares={"alpha": 3.0, "beta": 1.0},
        )
    )
    services = [
        InventoryService(InventorySettings(**c("inventory-u"))),
        GatewayService(GatewaySettings(**c("gateway-u"))),
        # Long leases: with no executor a granted subjob stays in flight for the test to see.
        ClearerService(ClearerSettings(**c("clearer-u"), lease_s=60.0)),
        AgentService(AgentSettings(**c("agent-u"))),
        AdvertiserService(AdvertiserSettings(**c("advertiser-u"))),
        ui,
    ]
    spec = JobSpec(name="shown", tenant="alpha", workload="montecarlo", max_parallel=2, params={"units": 400})
    huge = JobSpec(
        name="huge",
        tenant="beta",
        workload="montecarlo",
        params={"units": 10},
        memory=MemoryDecl(base_mib=100_000, per_unit_mib=10),
    )
    async with running(*services):
        port = ui.http_port
        assert port > 0
        op = operator(ui)
        status, ctype, body = await asyncio.to_thread(fetch, port, "/", op)
        assert status == 200 and ctype.startswith("text/html") and b'id="timeline"' in body
        assert (await asyncio.to_thread(fetch, port, "/healthz"))[0] == 200
        assert (await asyncio.to_thread(fetch, port, "/nothing", op))[0] == 404
        assert (await asyncio.to_thread(fetch, port, "/api/job/no-such-job", op))[0] == 404
        assert (await asyncio.to_thread(fetch, port, "/api/job/..%2Fx", op))[0] == 404

        client = SjaClient(nc)
        job_id = (await client.submit(spec)).job_id
        huge_id = await accepted_earlier(nc, huge)  # the gateway refuses it now: no slice holds it

        # The timeline draws the job's subjobs on the slices the inventory declared.
        async def drawn() -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
            o = await get_json(port, "/api/overview", op)
            mine = [g for g in o["timeline"]["segments"] if g["job_id"] == job_id]
            return (o, mine) if mine and o["rounds"] else None

        o, mine = await wait_until(drawn, "the job's subjobs and rounds in the overview", 60.0, every_s=0.2)
        slice_ids = {s["slice_id"] for s in o["slices"]}
        assert len(slice_ids) == 6
        assert all(g["slice_id"] in slice_ids and g["running"] for g in mine)
        assert o["policy"] == "fair"
        row = next(j for j in o["jobs"] if j["job_id"] == job_id)
        assert row["tenant"] == "alpha" and row["total_units"] == 400 and "running" in row["summary"]
        tenants = {t["tenant"]: t for t in o["tenants"]}
        assert tenants["alpha"]["target"] == pytest.approx(0.75)
        assert tenants["beta"]["target"] == pytest.approx(0.25)
        assert tenants["alpha"]["attained_gpu_s"] > 0
        assert tenants["alpha"]["attained"] == pytest.approx(1.0)  # beta's job never wins a window
        won = [r for r in o["rounds"] if r["winner_job"] == job_id]
        assert won and won[0]["verdicts"][0]["won"] and won[0]["policy"] == "fair"

        # A job's page: the gateway's explanation and the job's rounds, linked to Jaeger.
        async def explained() -> dict[str, Any] | None:
            x: dict[str, Any] = (await get_json(port, f"/api/job/{huge_id}", op))["explanation"]
            return x if x["windows"] and all("needs" in w["reason"] for w in x["windows"]) else None

        x = await wait_until(explained, "every window of the huge job explained", 60.0, every_s=0.3)
        assert x["by"] == "gateway" and x["status"] == "pending"
        assert any("fits none of the slices" in n for n in x["notes"])
        page = await get_json(port, f"/api/job/{job_id}", op)
        assert page["job"]["job_id"] == job_id and page["subjobs"]
        assert page["rounds"] and page["jaeger_url"] == "http://jaeger.example:16686"
        traced = [r for r in page["rounds"] if r["trace_id"]]
        assert traced, "rounds carry their trace ids"
        for r in traced:
            assert r["trace_url"] == f"http://jaeger.example:16686/trace/{r['trace_id']}"
        assert any(r["verdict"] and r["verdict"]["won"] for r in page["rounds"])


async def test_without_a_gateway_a_job_page_still_shows_the_state(nats_url: str, tmp_path: Path, nc) -> None:
    c = lambda name: common(nats_url, tmp_path, name, 0)  # noqa: E731
    gateway = GatewayService(GatewaySettings(**c("gateway-v")))
    ui = UiService(UiSettings(**c("ui-v"), ui_port=0, ui_host="127.0.0.1", ui_refresh_s=0.0))
    async with running(ui):
        async with gateway:
            alone = JobSpec(name="alone", tenant="a", workload="montecarlo")
            job_id = (await SjaClient(nc).submit(alone)).job_id
        page = await get_json(ui.http_port, f"/api/job/{job_id}", operator(ui))
        assert page["explanation"]["by"] == "dashboard"
        assert page["explanation"]["summary"].startswith("pending")
        assert page["rounds"] == [] and page["jaeger_url"] == ""


def test_the_ui_settings_are_validated() -> None:
    assert UiSettings.from_env({}).ui_port == 8080
    assert UiSettings.from_env({}).ui_host == "127.0.0.1"
    assert UiSettings.from_env({"SJA_UI_PORT": "9090"}).ui_port == 9090
    with pytest.raises(SettingsError):
        UiSettings.from_env({"SJA_UI_PORT": "70000"})


async def test_a_job_page_shows_its_subjobs_output_as_text(nats_url: str, tmp_path: Path, nc) -> None:
    """What a subjob's program wrote (its completion, through the gateway's ``logs``) reaches the
    job's page as the text it is: a traceback with its lines, markup a program printed (``<script>``)
    as characters for the page to escape, never taken out of it. A tenant's view asks on the
    tenant's own subjects and sees its own job's output; another tenant's job stays 404."""
    from sja.bus.codec import encode
    from sja.protocol import subjects
    from sja.protocol.messages import Completion

    c = lambda name: common(nats_url, tmp_path, name, 0)  # noqa: E731
    gateway = GatewayService(GatewaySettings(**c("gateway-o")))
    ui = UiService(UiSettings(**c("ui-o"), ui_port=0, ui_host="127.0.0.1", ui_refresh_s=0.0))
    traceback = 'Traceback (most recent call last):\n  File "train.py", line 3, in <module>\nValueError: bad'
    printed = "<script>alert(document.cookie)</script>\nloss 0.5\n"
    async with running(gateway, ui):
        client = SjaClient(nc)
        job_id = (await client.submit(JobSpec(name="talks", tenant="alpha", workload="montecarlo"))).job_id
        other = (await client.submit(JobSpec(name="other", tenant="beta", workload="montecarlo"))).job_id
        empty = await get_json(ui.http_port, f"/api/job/{job_id}", operator(ui))
        assert empty["output"] == [] and empty["output_note"] == ""
        done = Completion(
            subjob_id=f"{job_id}.s0", job_id=job_id, grant_id="g", fence=1, slice_id="s", status="failed",
            unit_start=0, units=8, units_done=0, peak_mem_mib=1.0, duration_s=1.0, mem_cap_mib=4608,
            time_cap_s=5.0, started_at=1.0, finished_at=2.0, error="exited with 1", stdout=printed,
            stderr=traceback,
        )  # fmt: skip
        await nc.jetstream().publish(subjects.subjob_completed(job_id), encode(done))

        async def shown(token: str) -> dict[str, Any] | None:
            page: dict[str, Any] = await get_json(ui.http_port, f"/api/job/{job_id}", token)
            return page if page["output"] else None

        secret = dashauth.read_secret(ui.token_file)
        for token in (operator(ui), dashauth.tenant_token(secret, "alpha")):
            page = await wait_until(lambda t=token: shown(t), "the subjob's output on the job's page", 30.0)
            (out,) = page["output"]
            assert out["stdout"] == printed and out["stderr"] == traceback and out["error"] == "exited with 1"
            assert out["units_text"] == "0-7 (8)" and page["output_note"] == ""
        status, _, body = await asyncio.to_thread(
            fetch, ui.http_port, f"/api/job/{other}", dashauth.tenant_token(secret, "alpha")
        )
        assert status == 404 and other.encode() not in body
