"""Takeover: an agent killed with SIGKILL and never restarted (a recreated or scaled-down agent comes
back, if at all, under a new id). Its jobs are taken over by the live agents once it has been silent
past the liveness bound; every job completes with the result of the job run in one piece, and no
slice is ever held by two grants at once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from sja.audit import Mix, audit, call, mixed_specs, read_rounds, statuses
from sja.protocol.messages import JobState
from sja.stack import LocalStack

# The stack's start (up to 40 s on a loaded machine), the jobs' wait (``WAIT_S``) and its stop fit
# inside the per-test limit, so a slow run fails on its own assertion, with the jobs' states, and
# the fixture's stop always runs to its end (no stack outlives its test).
WAIT_S = 420.0
pytestmark = [pytest.mark.slow, pytest.mark.timeout(WAIT_S + 180)]

TAKEOVER_AFTER_S = 3.0
ENV = {
    # Each Python subjob starts an interpreter in its sandbox (0.3 s on an idle machine, a second
    # or more with three agents, Ray and the services on two cores, over 2 s on a slower two-core
    # machine): 4 s windows leave every subjob time for work after it.
    "SJA_HORIZON_S": "4.0",
    "SJA_START_OVERHEAD_S": "1.0",
    "SJA_LEASE_S": "5.0",
    "SJA_RAY_NUM_CPUS": "2",
    "SJA_HEARTBEAT_S": "0.5",
    "SJA_TAKEOVER_AFTER_S": str(TAKEOVER_AFTER_S),
}
TERMINAL = ("done", "failed", "cancelled")


def start(out: object, agents: int) -> LocalStack:
    s = LocalStack(out_dir=out, env=ENV, replicas={"agent": agents})  # type: ignore[arg-type]
    s.start()
    asyncio.run(s.wait_ready())
    return s


@pytest.fixture
def two_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start(tmp_path_factory.mktemp("takeover2"), 2)
    try:
        yield s
    finally:
        s.stop()


@pytest.fixture
def three_agents(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    s = start(tmp_path_factory.mktemp("takeover3"), 3)
    try:
        yield s
    finally:
        s.stop()


def submit_until_claimed(stack: LocalStack, n: int, agents: set[str]) -> list[str]:
    """Submit ``n`` jobs and wait until each has an owner; every agent must own some."""
    # Large enough that no agent's jobs are all over before it is killed (seconds after the last
    # claim), on a fast machine too; small enough that twelve of them finish in minutes on two slow
    # cores, where most of each subjob is its sandboxed interpreter's start-up.
    specs = mixed_specs(n, Mix(mc_units=750, mc_samples_per_unit=50_000, mm_rows=8_000, mm_inner=512))
    ids = [asyncio.run(call(stack.nats_url, "submit", s)).job_id for s in specs]
    deadline = time.monotonic() + 60
    while True:
        states = asyncio.run(statuses(stack.nats_url, ids))
        if all(s.owner_agent for s in states) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    owners = {s.owner_agent for s in states}
    assert owners == agents, f"every agent claims some of the jobs: {owners}"
    return ids


def wait_done(stack: LocalStack, ids: list[str], timeout_s: float = WAIT_S) -> list[JobState]:
    deadline = time.monotonic() + timeout_s
    while True:
        states = asyncio.run(statuses(stack.nats_url, ids))
        if all(s.status in TERMINAL for s in states) or time.monotonic() > deadline:
            return states
        time.sleep(1.0)


def check_taken_over(
    stack: LocalStack, ids: list[str], victim: str, orphaned: list[str], survivors: set[str]
) -> None:
    states = wait_done(stack, ids)
    for s in states:
        assert s.status == "done", (s.job_id, s.status, s.error, s.owner_agent, s.units_done, s.total_units)
    by_id = {s.job_id: s for s in states}
    assert orphaned, "the victim owned unfinished jobs when it was killed"
    for job_id in orphaned:
        assert by_id[job_id].owner_agent in survivors, (job_id, by_id[job_id].owner_agent)
    assert all(s.owner_agent != victim for s in states if s.job_id in orphaned)
    report = audit(states, asyncio.run(read_rounds(stack.nats_url)), len(ids))
    assert report.clean, report


def kill_owner(stack: LocalStack, ids: list[str], victim: str) -> list[str]:
    """SIGKILL ``victim`` (never restarted); the jobs it owned that were not over."""
    stack.kill(victim)
    states = asyncio.run(statuses(stack.nats_url, ids))
    return [s.job_id for s in states if s.owner_agent == victim and s.status not in TERMINAL]


def test_a_killed_agents_jobs_complete_on_the_other_agent(two_agents: LocalStack) -> None:
    ids = submit_until_claimed(two_agents, 8, {"agent-0", "agent-1"})
    orphaned = kill_owner(two_agents, ids, "agent-1")
    check_taken_over(two_agents, ids, "agent-1", orphaned, {"agent-0"})


def test_three_agents_share_the_jobs_and_the_survivors_finish_a_killed_ones(
    three_agents: LocalStack,
) -> None:
    agents = {"agent-0", "agent-1", "agent-2"}
    ids = submit_until_claimed(three_agents, 12, agents)
    orphaned = kill_owner(three_agents, ids, "agent-2")
    check_taken_over(three_agents, ids, "agent-2", orphaned, agents - {"agent-2"})
    # The survivors' logs say they took the jobs over (not claimed them anew, nor recovered them).
    logs = "".join((three_agents.out_dir / "logs" / f"{a}.log").read_text() for a in ("agent-0", "agent-1"))
    assert logs.count("took over job ") >= len(orphaned), logs[-3000:]
