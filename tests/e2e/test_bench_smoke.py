"""The control-plane benchmarks run on a tiny setting and print what the docs read from them: the
protocol floor's rate, messages and CPU per grant (its JSON line), and the control-plane benchmark's
per-service CPU per grant."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]


def last_json(args: list[str], timeout_s: float) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    got: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return got


def test_protocol_floor_runs_every_role_and_reports_per_grant_costs() -> None:
    d = last_json(
        [
            "bench/protocol_floor.py",
            "--jobs",
            "20",
            "--slices",
            "16",
            "--warmup-s",
            "1",
            "--duration-s",
            "2",
            "--json",
        ],
        120,
    )
    assert float(d["grants_per_s"]) > 0
    # A lease, a job write, a subjob and a completion (each a JetStream write and its
    # acknowledgement, and a delivery), a free, the watch: never fewer than a dozen messages.
    assert 12 <= float(d["messages_per_grant"]) <= 40
    assert set(d["cpu_by_role_s"]) == {"agent", "clearer", "executor", "advertiser"}
    assert all(float(v) > 0 for v in d["cpu_by_role_s"].values())
    assert float(d["cpu_s_per_grant"]) > 0 and float(d["cpu_server_s_per_grant"]) > 0


def test_control_plane_reports_each_services_cpu_per_grant() -> None:
    d = last_json(
        [
            "bench/control_plane.py",
            "--jobs",
            "10",
            "--slices",
            "8",
            "--grants",
            "150",
            "--duration-s",
            "10",
            "--warmup-s",
            "5",
            "--trace-sample",
            "0.01",
            "--json",
        ],
        240,
    )
    assert d["jobs_wrong_result"] == 0 and d["subjobs_lost"] == 0
    by_service = d["cpu_s_per_grant_by_service"]
    assert isinstance(by_service, dict)
    assert {k.rsplit("-", 1)[0] for k in by_service} == {
        "inventory",
        "gateway",
        "clearer",
        "agent",
        "advertiser",
    }
    assert float(by_service["agent-0"]) > 0
    assert abs(sum(by_service.values()) - float(d["cpu_s_per_grant"])) < 1e-4
