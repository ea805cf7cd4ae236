"""The control-plane benchmarks run on a tiny setting and print what the docs read from them: the
protocol floor's rate, messages and CPU per grant (its JSON line), and the control-plane benchmark's
per-service CPU per grant."""

from __future__ import annotations

import json
import math
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


def control_plane(*args: str) -> list[str]:
    """The control-plane benchmark at (10, 8), 1 % traced, printing only its JSON line."""
    small = ["--jobs", "10", "--slices", "8", "--trace-sample", "0.01", "--json"]
    return ["bench/control_plane.py", *small, *args]


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
    d = last_json(control_plane("--grants", "150", "--duration-s", "10", "--warmup-s", "5"), 240)
    assert d["jobs_wrong_result"] == 0 and d["subjobs_lost"] == 0
    # The p99 of each second of the window: a second for each, and (nearest rank) the worst of
    # them at least the window's p99, which cannot sit above every second's.
    seconds = d["offer_to_grant_p99_ms_by_second"]
    assert len(seconds) == math.ceil(float(d["window_s"]))
    by_second = [float(v) for v in seconds if v == v]  # nan: a second without a grant
    assert by_second and max(by_second) >= float(d["offer_to_grant_p99_ms"]) - 0.05
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


def test_control_plane_with_services_cohosted_completes_every_job_correctly() -> None:
    """``--cohost``: the inventory, gateway, clearer and advertiser in one process (``sja service
    a,b,...``), the agent in its own; rounds still clear and every result is right."""
    d = last_json(
        control_plane(
            "--grants",
            "150",
            "--duration-s",
            "8",
            "--warmup-s",
            "4",
            "--cohost",
            "advertiser,inventory,clearer,gateway",
        ),
        240,
    )
    assert d["jobs_wrong_result"] == 0 and d["subjobs_lost"] == 0
    assert float(d["grants_per_s"]) > 0
    assert d["cohost"] == "inventory,gateway,clearer,advertiser"
    assert set(d["cpu_s_per_grant_by_service"]) == {"inventory,gateway,clearer,advertiser-0", "agent-0"}


def test_control_plane_with_nodes_sharing_pools_completes_every_job_correctly() -> None:
    """``--pools``: three nodes dealt into two pools (one of two nodes), so a pool's offers come from
    several nodes in one batch; rounds still clear and every result is right."""
    d = last_json(
        control_plane(
            "--slices", "120", "--pools", "2", "--grants", "100", "--duration-s", "5", "--warmup-s", "3"
        ),
        240,
    )
    assert d["pools"] == 2 and d["slices"] == 120
    assert d["jobs_wrong_result"] == 0 and d["subjobs_lost"] == 0
    assert float(d["grants_per_s"]) > 0


def refusal(*args: str) -> str:
    """The benchmark's usage error for ``args`` (it must exit 2 before starting anything)."""
    out = subprocess.run(
        [sys.executable, "bench/control_plane.py", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 2, out.stderr
    return out.stderr


def test_control_plane_refuses_a_bad_cohost_list() -> None:
    for spec, message in [
        ("clearer", "two or more"),
        ("clearer,executor", "two or more"),
        ("clearer,nope", "unknown"),
    ]:
        assert message in refusal("--cohost", spec)


def test_control_plane_below_saturation_holds_each_slice() -> None:
    """``--hold-s``: each subjob keeps its slice that long, so the load is at most slices / hold
    grants a second (a slice never runs two subjobs at once) and every result is still right."""
    d = last_json(
        control_plane("--grants", "60", "--duration-s", "6", "--warmup-s", "3", "--hold-s", "0.2"), 240
    )
    assert d["jobs_wrong_result"] == 0 and d["subjobs_lost"] == 0
    assert d["hold_s"] == 0.2 and d["offered_grants_per_s_max"] == 40.0
    assert 0 < float(d["grants_per_s"]) <= 1.1 * 40.0


def test_control_plane_refuses_a_negative_pool_count() -> None:
    assert "--pools must be 0" in refusal("--pools", "-1")


def test_control_plane_refuses_a_hold_longer_than_its_windows_allow() -> None:
    assert "--hold-s must be between 0 and 1" in refusal("--hold-s", "5")


def test_two_versions_run_the_benchmark_in_turns(tmp_path: Path) -> None:
    """``bench/interleaved.py``: the previous commit and this one, one round each, compared."""
    out = subprocess.run(
        [
            sys.executable,
            "bench/interleaved.py",
            "HEAD~1",
            "HEAD",
            "--rounds",
            "1",
            "--work",
            str(tmp_path),
            "--",
            *control_plane("--grants", "100", "--duration-s", "8", "--warmup-s", "4")[1:],
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(ln) for ln in out.stdout.splitlines() if ln.startswith("{")]
    runs, summary = lines[:-1], lines[-1]
    assert [(r["rev"], r["round"]) for r in runs] == [(summary["a"], 1), (summary["b"], 1)]
    assert all("error" not in r and r["jobs_wrong_result"] == 0 for r in runs), runs
    assert summary["errors"] == 0 and summary["rounds"] == 1
    assert summary["grants_per_s"]["b_over_a"] > 0
    assert not list(tmp_path.iterdir())  # the checkouts it made are removed
