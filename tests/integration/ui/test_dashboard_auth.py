"""The dashboard as an outsider and as a tenant would try it, against real services on a real
nats-server: without a valid token every page and every JSON answer is 401 (no token, a made-up
one, one minted from another secret, one tenant's proof under another tenant's name, the secret
itself); a tenant's token shows that tenant's jobs only (another tenant's job page is 404, its job
ids appear nowhere, its bids in rounds are anonymized); the operator's shows every job; and no
answer holds a value of a job's ``params.env``. The token of the address is kept in a cookie and
taken out of the address."""

from __future__ import annotations

import asyncio
import http.client
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from services.ui.service import COOKIE, UiService, UiSettings
from sja import dashauth
from sja.client import SjaClient
from sja.protocol.messages import JobSpec, MemoryDecl, TimeDecl
from sja.redaction import OTHER
from tests.integration.telemetry.test_metrics import common, running
from tests.integration.ui.test_ui import fetch, get_json
from tests.integration.waits import wait_until

pytestmark = pytest.mark.timeout(120)

API_KEY = "sk-live-0c1d2e3f4a5b6c7d8e9f00112233"


def raw_get(port: int, path: str, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    """A GET that does not follow redirects: status, headers (lower-case names), body."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("GET", path, headers=headers or {})
        r = conn.getresponse()
        return r.status, {k.lower(): v for k, v in r.getheaders()}, r.read()
    finally:
        conn.close()


async def test_tokens_decide_who_sees_which_jobs(nats_url: str, tmp_path: Path, nc: Any) -> None:
    c = lambda name: common(nats_url, tmp_path, name, 0)  # noqa: E731
    secret_file = tmp_path / "dashboard.secret"
    secret = dashauth.write_secret(secret_file)
    ui = UiService(UiSettings(**c("ui-a"), ui_port=0, ui_refresh_s=0.1, ui_token_file=str(secret_file)))
    services = [
        InventoryService(InventorySettings(**c("inventory-a"))),
        GatewayService(GatewaySettings(**c("gateway-a"))),
        ClearerService(ClearerSettings(**c("clearer-a"), lease_s=60.0)),
        AgentService(AgentSettings(**c("agent-a"))),
        AdvertiserService(AdvertiserSettings(**c("advertiser-a"))),
        ui,
    ]
    alpha_spec = JobSpec(
        name="mine", tenant="alpha", workload="montecarlo", max_parallel=2, params={"units": 400}
    )
    beta_spec = JobSpec(
        name="theirs",
        tenant="beta",
        workload="command",
        max_parallel=2,
        params={
            "argv": ["true"],
            "units": 400,
            "sequential": False,
            "merge_argv": ["true"],
            "env": {"API_KEY": API_KEY},
        },
        memory=MemoryDecl(base_mib=64.0, per_unit_mib=0.0),
        time=TimeDecl(warmup_s=0.1, per_unit_s=0.05),
    )
    async with running(*services):
        port = ui.http_port
        assert ui.ui.ui_host == "127.0.0.1"
        op = dashauth.operator_token(secret)
        alpha = dashauth.tenant_token(secret, "alpha")
        client = SjaClient(nc)
        alpha_job = (await client.submit(alpha_spec)).job_id
        beta_job = (await client.submit(beta_spec)).job_id

        # Both jobs hold slices and have bid in the same rounds (no executor: they stay in flight).
        async def both_running() -> dict[str, Any] | None:
            o: dict[str, Any] = await get_json(port, "/api/overview", op)
            ran = {g["job_id"] for g in o["timeline"]["segments"]}
            tenants_in_rounds = [{v["tenant"] for v in r["verdicts"]} for r in o["rounds"]]
            shared = any({"alpha", "beta"} <= t for t in tenants_in_rounds)
            return o if {alpha_job, beta_job} <= ran and shared else None

        everything = await wait_until(both_running, "both tenants' jobs running, bidding together", 60.0)
        assert {j["job_id"] for j in everything["jobs"]} == {alpha_job, beta_job}
        assert everything["viewer"] == {"operator": True, "tenant": ""}

        # No token, or none that the secret made: 401 everywhere but /healthz, and nothing shown.
        other_secret = dashauth.new_secret()
        forged = [
            "",
            "o." + "0" * 64,
            dashauth.operator_token(other_secret),
            dashauth.tenant_token(other_secret, "alpha"),
            "t.beta." + alpha.rpartition(".")[2],  # alpha's proof under beta's name
            "t.alpha",
            secret,  # the secret is no token
            op + "0",
        ]
        for token in forged:
            for path in ("/", f"/job/{alpha_job}", "/api/overview", f"/api/job/{alpha_job}"):
                status, _, body = await asyncio.to_thread(fetch, port, path, token)
                assert status == 401, (token, path, status)
                assert alpha_job.encode() not in body and beta_job.encode() not in body
            status, headers, _ = await asyncio.to_thread(raw_get, port, f"/?token={token}")
            assert status == 401 and "set-cookie" not in headers, token
            status, _, _ = await asyncio.to_thread(
                raw_get, port, "/api/overview", {"Cookie": f"{COOKIE}={token}"}
            )
            assert status == 401, token
        status, _, body = await asyncio.to_thread(raw_get, port, "/healthz")
        assert status == 200 and body == b"ok\n"

        # The address's token goes into a cookie and out of the address.
        status, headers, _ = await asyncio.to_thread(raw_get, port, f"/job/{alpha_job}?token={alpha}&x=1")
        assert status == 303 and headers["location"] == f"/job/{alpha_job}?x=1"
        cookie = headers["set-cookie"]
        assert (
            cookie.startswith(f"{COOKIE}={alpha};") and "HttpOnly" in cookie and "SameSite=Strict" in cookie
        )
        with_cookie = {"Cookie": f"{COOKIE}={alpha}"}
        status, _, body = await asyncio.to_thread(raw_get, port, f"/job/{alpha_job}", with_cookie)
        assert status == 200 and b"<html" in body.lower()

        # Alpha's view: its own job, nothing of beta's but anonymized bids.
        status, _, body = await asyncio.to_thread(raw_get, port, "/api/overview", with_cookie)
        assert status == 200
        assert beta_job.encode() not in body and b'"beta"' not in body and API_KEY.encode() not in body
        mine = await get_json(port, "/api/overview", alpha)
        assert mine["viewer"] == {"operator": False, "tenant": "alpha"}
        assert [j["job_id"] for j in mine["jobs"]] == [alpha_job]
        assert {g["job_id"] for g in mine["timeline"]["segments"]} == {alpha_job}
        assert [t["tenant"] for t in mine["tenants"]] == ["alpha"]
        holders = {s["holder_job"] for s in mine["slices"]}
        assert OTHER in holders and alpha_job in holders
        assert mine["rounds"] and all(
            v["tenant"] in ("alpha", OTHER, "") for r in mine["rounds"] for v in r["verdicts"]
        )
        assert any(v["tenant"] == OTHER for r in mine["rounds"] for v in r["verdicts"])
        status, _, body = await asyncio.to_thread(fetch, port, f"/api/job/{beta_job}", alpha)
        assert status == 404 and beta_job.encode() not in body
        page = await get_json(port, f"/api/job/{alpha_job}", alpha)
        assert page["job"]["job_id"] == alpha_job and page["explanation"]["by"] == "gateway"
        assert beta_job not in str(page)

        # Beta's view mirrors it; the operator sees beta's job, but not its key.
        theirs = await get_json(port, "/api/overview", dashauth.tenant_token(secret, "beta"))
        assert [j["job_id"] for j in theirs["jobs"]] == [beta_job]
        for token in (op, dashauth.tenant_token(secret, "beta")):
            status, _, body = await asyncio.to_thread(fetch, port, f"/api/job/{beta_job}", token)
            assert status == 200 and beta_job.encode() in body and API_KEY.encode() not in body
            status, _, body = await asyncio.to_thread(fetch, port, "/api/overview", token)
            assert status == 200 and API_KEY.encode() not in body


async def test_the_secret_is_made_once_readable_by_its_owner_only(nats_url: str, tmp_path: Path) -> None:
    """Without ``SJA_UI_TOKEN_FILE`` the service makes its secret under its out directory, mode 0600,
    and a restart keeps it (the tokens handed out keep working); a secret too short is refused."""
    settings = UiSettings(**common(nats_url, tmp_path, "ui-s", 0), ui_port=0)
    ui = UiService(settings)
    async with running(ui):
        assert ui.token_file == tmp_path / "out" / "ui" / "dashboard.secret"
        mode = stat.S_IMODE(ui.token_file.stat().st_mode)
        assert mode == 0o600, oct(mode)
        first = dashauth.read_secret(ui.token_file)
        status, _, _ = await asyncio.to_thread(
            fetch, ui.http_port, "/api/overview", dashauth.operator_token(first)
        )
        assert status == 200
    again = UiService(settings)
    async with running(again):
        assert dashauth.read_secret(again.token_file) == first

    short = tmp_path / "short.secret"
    short.write_text("guessable\n")
    weak = UiService(UiSettings(**common(nats_url, tmp_path, "ui-w", 0), ui_port=0, ui_token_file=str(short)))
    with pytest.raises(ValueError, match="shorter than"):
        async with running(weak):
            pass


def test_dashboard_token_mints_what_the_service_accepts(tmp_path: Path) -> None:
    """``sja dashboard-token``: the operator's token, a tenant's, the address with it; a missing
    secret or a bad tenant name is one line and exit 2."""
    secret_file = tmp_path / "dashboard.secret"
    secret = dashauth.write_secret(secret_file)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SJA_")}

    def sja(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "sja.cli.main", "dashboard-token", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )

    r = sja("--secret-file", str(secret_file))
    assert r.returncode == 0 and r.stdout.strip() == dashauth.operator_token(secret)
    r = sja("--secret-file", str(secret_file), "--tenant", "alpha")
    assert r.returncode == 0
    assert dashauth.viewer_of(r.stdout.strip(), secret) == dashauth.Viewer("alpha")
    r = sja("--secret-file", str(secret_file), "--tenant", "beta", "--url", "http://127.0.0.1:8080/")
    assert r.stdout.strip() == f"http://127.0.0.1:8080/?token={dashauth.tenant_token(secret, 'beta')}"
    env["SJA_OUT_DIR"] = str(tmp_path / "svc")
    dashauth.write_secret(tmp_path / "svc" / "ui" / "dashboard.secret", secret)
    r = sja()
    assert r.returncode == 0 and r.stdout.strip() == dashauth.operator_token(secret)
    r = sja("--secret-file", str(tmp_path / "missing"))
    assert r.returncode == 2 and "missing" in r.stderr and r.stdout == ""
    r = sja("--secret-file", str(secret_file), "--tenant", "a.b")
    assert r.returncode == 2 and "not a tenant name" in r.stderr
