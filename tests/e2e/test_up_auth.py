"""``sja up`` as a user runs it, attacked as a local process without credentials would: the bus
refuses an anonymous connection, no service holds a password in its environment, the operator's
credentials file is its owner's only and the CLI finds it where ``sja up`` wrote it, and a
tenant's file acts for that tenant only."""

from __future__ import annotations

import asyncio
import stat
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from sja.bus.auth import NatsAuthError, read_credentials
from sja.bus.connection import connect
from tests.e2e.test_up_store import env, sja_up

pytestmark = pytest.mark.slow


def sja(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sja.cli.main", *args], capture_output=True, text=True, env=env(), timeout=120
    )


def test_up_runs_an_authenticated_bus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "config"
    monkeypatch.setenv("XDG_CONFIG_HOME", str(config))
    out = tmp_path / "stack"
    spec = tmp_path / "small.yaml"
    spec.write_text("name: small\ntenant: alpha\nworkload: montecarlo\nparams: {units: 2}\n")
    with sja_up(out, "--cohost", "inventory,gateway,clearer,advertiser", "--tenants", "alpha,beta") as url:
        with pytest.raises(NatsAuthError):
            asyncio.run(connect(url, "anonymous", first_connect_retries=1))

        operator = config / "sja" / "credentials.json"
        assert stat.S_IMODE(operator.stat().st_mode) == 0o600
        assert stat.S_IMODE(operator.parent.stat().st_mode) == 0o700
        creds = read_credentials(operator)
        assert creds.user == "sja-admin" and creds.url == url

        # No process of the stack holds a password in its environment.
        passwords = {read_credentials(f).password for f in (out / "credentials").rglob("*.json")}
        assert len(passwords) == 7 + 1 + 2
        stack = [p for p in psutil.process_iter() if "sja.cli.main" in " ".join(cmdline(p))]
        assert len(stack) >= 5, stack
        for p in stack:
            try:
                environ = " ".join(f"{k}={v}" for k, v in p.environ().items())
            except (psutil.ZombieProcess, psutil.NoSuchProcess):
                continue  # ended meanwhile (a subjob's helper): it holds no environment any more
            assert not any(pw in environ for pw in passwords), p.cmdline()

        # The CLI finds the operator's file where `sja up` wrote it (and the URL in it).
        submitted = sja("submit", str(spec))
        assert submitted.returncode == 0, submitted.stderr
        job_id = submitted.stdout.strip()
        # A tenant's file acts for its tenant: alpha sees its job, beta does not.
        alpha = sja("--credentials", str(out / "credentials" / "tenant-alpha.json"), "jobs")
        beta = sja("--credentials", str(out / "credentials" / "tenant-beta.json"), "status", job_id)
        assert alpha.returncode == 0 and job_id in alpha.stdout, alpha.stderr
        assert beta.returncode != 0 and "no job" in beta.stderr


def cmdline(p: psutil.Process) -> list[str]:
    """A process's command line; empty for one that ended (or is a zombie) while it was looked at."""
    try:
        return p.cmdline()
    except (psutil.ZombieProcess, psutil.NoSuchProcess, psutil.AccessDenied):
        return []
