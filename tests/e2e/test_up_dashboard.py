"""``sja up`` prints the dashboard's address with the operator's token: that address opens it, the
same without the token is refused, and a tenant's token minted from the secret file ``sja up`` wrote
(readable by its user only) shows that tenant's jobs and not another's, and its job's page the
output of its subjobs (the dashboard's NATS user may ask the gateway for a tenant's logs). The
dashboard listens on ``SJA_UI_PORT`` from the environment; on a narrow terminal every command
``sja up`` prints stays on one line, with ``sja`` written as the user can run it."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from sja.bus.natsd import free_port
from tests.e2e.test_up_store import env, sja
from tests.integration.waits import wait_until

pytestmark = pytest.mark.slow


def get(url: str, token: str = "") -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_up_prints_a_dashboard_address_whose_token_opens_it(tmp_path: Path) -> None:
    out = tmp_path / "stack"
    port = free_port()
    ui_port = free_port()
    up_env = {**env(), "SJA_UI_PORT": str(ui_port), "COLUMNS": "60"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "sja.cli.main", "up", "--out", str(out), "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=up_env,
    )
    assert proc.stdout is not None
    seen: list[str] = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "Ctrl-C stops the stack" in line:
                break
        else:
            raise AssertionError("sja up exited before it was up:\n" + "".join(seen))
        printed = "".join(seen)
        found = re.search(r"dashboard: (http://127\.0\.0\.1:(\d+)/)\?token=(o\.[0-9a-f]{64})", printed)
        assert found, printed
        base, token = found.group(1), found.group(3)
        assert found.group(2) == str(ui_port), "the dashboard's port from SJA_UI_PORT"
        # Each example command whole on its line, starting with an `sja` the user's shell finds.
        submit = next(line for line in seen if "submit examples/jobs/matmul.yaml" in line)
        assert submit.strip().startswith(f"export SJA_NATS_URL=nats://127.0.0.1:{port}; "), submit
        command = shlex.split(submit.split(";", 1)[1])[0]
        runs = shutil.which(command, path=up_env["PATH"]) if "/" not in command else command
        assert runs is not None and os.access(runs, os.X_OK), (command, submit)
        assert any("dashboard-token --tenant NAME --secret-file" in line for line in seen), printed
        secret_file = out / "dashboard.secret"
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        assert secret_file.read_text().strip() not in printed, "the secret itself is never printed"

        nats = f"nats://127.0.0.1:{port}"
        for tenant in ("alpha", "beta"):
            spec = tmp_path / f"{tenant}.yaml"
            spec.write_text(
                f"name: {tenant}-job\ntenant: {tenant}\nworkload: montecarlo\nparams: {{units: 2}}\n"
            )
            sja("submit", str(spec), "--nats", nats)

        assert get(f"{base}api/overview")[0] == 401
        status, body = get(f"{base}api/overview", token)
        assert status == 200 and b"alpha-job" in body and b"beta-job" in body
        minted = sja("dashboard-token", "--tenant", "alpha", "--secret-file", str(secret_file)).strip()
        status, body = get(f"{base}api/overview", minted)
        assert status == 200 and b"alpha-job" in body and b"beta-job" not in body

        # The tenant's job page shows what its subjobs' programs wrote: the dashboard's user asks
        # the gateway on the tenant's own logs subject (refused before: no output, a note instead).
        alpha_job = next(j["job_id"] for j in json.loads(body)["jobs"] if j["name"] == "alpha-job")

        def page_with_output() -> dict[str, object] | None:
            code, got = get(f"{base}api/job/{alpha_job}", minted)
            page = json.loads(got) if code == 200 else None
            return page if page is not None and page["output"] else None

        page = asyncio.run(
            wait_until(page_with_output, "alpha's subjobs in its job page's output", 120.0, every_s=0.5)
        )
        assert page["output_note"] == "", page["output_note"]
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        seen.append(rest or "")
    assert proc.returncode == 0, "".join(seen)
