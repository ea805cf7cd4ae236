"""Crash tests: every service kind is killed with SIGKILL during a run and restarted; every job still
completes with the correct result, and no slice is ever held by two grants at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from sja.audit import Mix, audit, call, mixed_specs, read_rounds
from sja.protocol.messages import JobState
from sja.stack import LocalStack

pytestmark = pytest.mark.slow

KILL_ORDER = ["agent-0", "clearer-0", "executor-0", "advertiser-0", "inventory-0", "gateway-0"]


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    out = tmp_path_factory.mktemp("crash")
    s = LocalStack(out_dir=out, env={"SJA_HORIZON_S": "4.0", "SJA_LEASE_S": "5.0", "SJA_RAY_NUM_CPUS": "2"})
    try:
        s.start()
        asyncio.run(s.wait_ready())
        yield s
    finally:
        s.stop()


def run_with_kills(stack: LocalStack, n_jobs: int, victims: list[str]) -> None:
    """Submit ``n_jobs`` jobs, SIGKILL and restart the process of each victim in turn, then check
    that every job is done with its one-piece result, each unit applied once, no (slice, fence)
    granted twice and the ok subjobs on one slice never overlapping in time."""
    url = stack.nats_url
    jobs = mixed_specs(n_jobs, Mix(mc_units=60, mc_samples_per_unit=50_000, mm_rows=1500, mm_inner=512))
    ids = [asyncio.run(call(url, "submit", s)).job_id for s in jobs]  # type: ignore[attr-defined]
    for victim in victims:
        time.sleep(1.5)
        killed = stack.kill(victim)
        time.sleep(1.0)
        stack.restart(killed.instance)
    asyncio.run(stack.wait_ready())

    deadline = time.monotonic() + 300
    while True:
        states: list[JobState] = [asyncio.run(call(url, "status", j)) for j in ids]  # type: ignore[misc]
        if all(s.status in ("done", "failed", "cancelled") for s in states) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    for s in states:
        assert s.status == "done", (s.job_id, s.status, s.error, s.units_done, s.total_units)
    report = audit(states, asyncio.run(read_rounds(url)), len(ids))
    assert report.clean, report


def test_every_service_killed_and_restarted_loses_nothing(stack: LocalStack) -> None:
    run_with_kills(stack, 16, KILL_ORDER)


def test_cohosted_services_killed_together_and_restarted_lose_nothing(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The inventory, gateway, clearer and advertiser in one process (``sja service a,b,...``):
    SIGKILL takes all four down at once, twice, between kills of the agent and the executor; each
    comes back as it would alone and nothing is lost or granted twice."""
    out = tmp_path_factory.mktemp("crash-cohost")
    stack = LocalStack(
        out_dir=out,
        env={"SJA_HORIZON_S": "4.0", "SJA_LEASE_S": "5.0", "SJA_RAY_NUM_CPUS": "2"},
        groups=[["inventory", "gateway", "clearer", "advertiser"]],
    )
    try:
        stack.start()
        asyncio.run(stack.wait_ready())
        assert len(stack.procs) == 3
        run_with_kills(stack, 12, ["clearer-0", "agent-0", "executor-0", "inventory-0"])
    finally:
        stack.stop()
