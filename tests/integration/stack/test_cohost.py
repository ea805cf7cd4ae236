"""Services co-hosted in one process (``sja service clearer,advertiser``), against a real
nats-server: each answers discovery under the id it would have alone, and SIGTERM stops them all
gracefully."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from nats.aio.client import Client

from sja.stack import discover
from tests.integration.waits import wait_until


def service_env(nats_url: str, out: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SJA_", "OTEL_"))}
    env.update({"SJA_NATS_URL": nats_url, "SJA_OUT_DIR": str(out), "PYTHONUNBUFFERED": "1", **extra})
    return env


async def discovered(nc: Client, wanted: set[str], timeout_s: float) -> dict[str, str]:
    """instance -> micro service name, once every one of ``wanted`` answers ``$SRV.PING``."""
    seen: dict[str, str] = {}

    async def all_answer() -> dict[str, str] | None:
        nonlocal seen
        seen = await discover(nc)  # itself waits a while for the answers
        return seen if wanted <= set(seen) else None

    found: dict[str, str] = await wait_until(
        all_answer, lambda: f"every one of {sorted(wanted)} answering: {seen}", timeout_s, every_s=0.0
    )
    return found


async def test_cohosted_services_run_and_stop_as_they_would_alone(
    nats_url: str, nc: Client, tmp_path: Path
) -> None:
    with (tmp_path / "svc.log").open("wb") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sja.cli.main",
            "service",
            "advertiser,clearer",
            env=service_env(nats_url, tmp_path, SJA_INSTANCE="7"),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        seen = await discovered(nc, {"clearer-7", "advertiser-7"}, 60)
        assert seen["clearer-7"] == "sja-clearer" and seen["advertiser-7"] == "sja-advertiser"
        proc.send_signal(signal.SIGTERM)
        rc = await asyncio.wait_for(proc.wait(), 60)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    text = (tmp_path / "svc.log").read_text()
    assert rc == 0, text[-3000:]
    assert "clearer-7 stopped" in text and "advertiser-7 stopped" in text
