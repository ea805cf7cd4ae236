"""Bad job specs given to ``sja submit``: refused before anything is sent, naming the field."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.gateway.service import GatewayService, GatewaySettings
from sja.bus.natsd import EmbeddedNats

pytestmark = pytest.mark.timeout(120)

# --- the CLI -----------------------------------------------------------------------------------------


BAD_SPECS: dict[str, tuple[str, str]] = {
    "eps-out-of-range": ("name: x\ntenant: t\nworkload: montecarlo\neps_mem: 0.9\n", "eps_mem"),
    "eps-nan": ("name: x\ntenant: t\nworkload: montecarlo\neps_time: .nan\n", "eps_time"),
    "missing-tenant": ("name: x\nworkload: montecarlo\n", "tenant"),
    "unknown-field": ("name: x\ntenant: t\nworkload: montecarlo\ncolour: red\n", "colour"),
    "unknown-workload": ("name: x\ntenant: t\nworkload: nope\n", "workload"),
    "negative-param": ("name: x\ntenant: t\nworkload: matmul\nparams: {rows: -3}\n", "params.rows"),
    "unknown-param": ("name: x\ntenant: t\nworkload: matmul\nparams: {bogus: 1}\n", "params.bogus"),
    "param-wrong-type": ("name: x\ntenant: t\nworkload: montecarlo\nparams: {units: many}\n", "params.units"),
    "max-parallel-zero": ("name: x\ntenant: t\nworkload: montecarlo\nmax_parallel: 0\n", "max_parallel"),
    "name-with-spaces": ("name: 'a b\\u0007'\ntenant: t\nworkload: montecarlo\n", "name"),
    "tenant-too-long": (f"name: x\ntenant: {'t' * 65}\nworkload: montecarlo\n", "tenant"),
    "mode": ("name: x\ntenant: t\nworkload: montecarlo\nmode: greedy\n", "mode"),
    "negative-deadline": ("name: x\ntenant: t\nworkload: montecarlo\ndeadline_s: -5\n", "deadline_s"),
    "memory-negative": (
        "name: x\ntenant: t\nworkload: montecarlo\nmemory: {base_mib: -1, per_unit_mib: 1}\n",
        "memory.base_mib",
    ),
    "min-units-too-big": (
        "name: x\ntenant: t\nworkload: montecarlo\nmin_units: 100\nparams: {units: 10}\n",
        "min_units",
    ),
    "not-a-mapping": ("- name\n- tenant\n", "mapping"),
    "not-yaml": ("name: [unclosed\n", "YAML"),
}


def _run_cli(files: dict[str, Path], url: str) -> dict[str, subprocess.CompletedProcess[str]]:
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-m", "sja.cli.main", "submit", str(path), "--nats", url],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "COLUMNS": "400"},
        )
        for key, path in files.items()
    }
    out = {}
    for key, p in procs.items():
        stdout, stderr = p.communicate(timeout=60)
        out[key] = subprocess.CompletedProcess(p.args, p.returncode, stdout, stderr)
    return out


def test_cli_refuses_bad_specs_naming_the_field(tmp_path: Path, server: EmbeddedNats) -> None:
    """``sja submit bad.yaml``: exit code 2 and a message that names the offending field (checked before
    anything is sent; the server is up so that a spec that slipped through would be submitted)."""
    files = {}
    for key, (text, _) in BAD_SPECS.items():
        files[key] = tmp_path / f"{key}.yaml"
        files[key].write_text(text, encoding="utf-8")
    results = _run_cli(files, server.url)
    for key, (_, field_name) in BAD_SPECS.items():
        r = results[key]
        assert r.returncode == 2, (key, r.returncode, r.stdout, r.stderr)
        assert field_name in r.stderr, (key, r.stderr)
        assert "Traceback" not in r.stderr, (key, r.stderr)


def test_cli_refuses_an_infinite_profile_declaration(tmp_path: Path, server: EmbeddedNats) -> None:
    async def gateway_up() -> None:
        settings_ = {"nats_url": server.url, "out_dir": str(tmp_path / "out"), "instance": "gateway-t"}
        async with GatewayService(GatewaySettings(**settings_)):
            path = tmp_path / "inf.yaml"
            path.write_text(
                "name: x\ntenant: t\nworkload: montecarlo\nmemory: {base_mib: .inf, per_unit_mib: 1}\n"
            )
            r = (await asyncio.to_thread(_run_cli, {"inf": path}, server.url))["inf"]
            assert r.returncode == 2 and "memory.base_mib" in r.stderr, r.stderr

    asyncio.run(gateway_up())
