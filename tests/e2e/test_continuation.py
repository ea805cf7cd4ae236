"""End to end: a user's program of the command contract (``examples/steps``, no SDK) on the live stack
(every service a process, a local Ray, the slice actors and their sandboxes):

- alone on a stack with every default, it runs as one subjob, started once, its result the one-piece
  run's;
- on a stack of one slice with short windows, it goes on past its window while nobody waits; a job
  that comes then wins the slice, the holder stops at a unit boundary on SIGTERM (asked through its
  slice's Ray actor while the actor runs it), the newcomer starts once it has exited, and both
  results equal their one-piece runs, no unit lost or done twice.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from sja.client import SjaClient
from sja.protocol.messages import JobSpec, JobState, MemoryDecl, TimeDecl
from sja.stack import LocalStack

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = ROOT / "examples" / "steps" / "steps.py"


def one_piece(units: int, unit_s: float) -> dict[str, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SJA_")}
    env.update(STARTUP_S="0", UNIT_S=str(unit_s))
    out = subprocess.run(
        [sys.executable, str(STEPS), "--units", str(units)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
    )
    return json.loads(out.stdout)


def spec(name: str, units: int, unit_s: float, startup_s: float) -> JobSpec:
    return JobSpec(
        name=name,
        tenant="t",
        workload="command",
        params={
            "argv": [sys.executable, str(STEPS)],
            "units": units,
            "env": {"STARTUP_S": str(startup_s), "UNIT_S": str(unit_s)},
            "stop_grace_s": 2.0,
        },
        memory=MemoryDecl(base_mib=64.0, per_unit_mib=0.0, rel_sd=0.3),
        time=TimeDecl(warmup_s=startup_s + 0.5, per_unit_s=unit_s, rel_sd=0.3),
    )


async def until(
    client: SjaClient, job_id: str, check: Callable[[JobState], bool], timeout_s: float
) -> JobState:
    deadline = time.monotonic() + timeout_s
    while True:
        state = await client.status(job_id)
        if check(state):
            return state
        assert time.monotonic() < deadline, (state.status, state.units_done, state.history)
        await asyncio.sleep(0.1)


def ended(state: JobState) -> bool:
    return state.status in ("done", "failed", "cancelled")


def start(out: Path, env: dict[str, str]) -> LocalStack:
    s = LocalStack(out_dir=out, env={"SJA_RAY_NUM_CPUS": "2", "SJA_LOG_LEVEL": "INFO", **env})
    s.start()
    asyncio.run(s.wait_ready())
    return s


def test_a_program_alone_on_the_default_stack_runs_once_and_equals_its_one_piece_run(tmp_path: Path) -> None:
    units, unit_s = 40, 0.05

    async def go(url: str) -> JobState:
        client = await SjaClient.connect(url)
        try:
            ack = await client.submit(spec("alone", units, unit_s, startup_s=1.0))
            return await until(client, ack.job_id, ended, 240)
        finally:
            await client.close()

    s = start(tmp_path / "stack", {})
    try:
        state = asyncio.run(go(s.nats_url))
    finally:
        s.stop()
    assert state.status == "done", state.error
    assert [(h.status, h.units) for h in state.history] == [("ok", units)]
    metrics = state.result["metrics"]
    assert metrics["starts"] == 1
    assert metrics["hash"] == one_piece(units, unit_s)["hash"]


def test_a_holder_past_its_window_yields_its_slice_through_its_actor(tmp_path: Path) -> None:
    inventory = tmp_path / "one-slice.yaml"
    inventory.write_text(
        "nodes:\n  - name: local\n    gpus:\n      - model: A100-40GB\n        layout: [7g.40gb]\n"
    )
    window_s = 6.0
    a_units, a_unit_s, b_units, b_unit_s = 200, 0.1, 20, 0.05

    async def go(url: str) -> tuple[JobState, JobState]:
        client = await SjaClient.connect(url)
        try:
            a = (await client.submit(spec("holder", a_units, a_unit_s, startup_s=0.5))).job_id
            await until(client, a, lambda s: bool(s.in_flight), 120)
            await asyncio.sleep(window_s + 2.0)
            b = (await client.submit(spec("newcomer", b_units, b_unit_s, startup_s=0.0))).job_id
            b_state = await until(client, b, ended, 240)
            a_state = await until(client, a, ended, 240)
            return a_state, b_state
        finally:
            await client.close()

    s = start(tmp_path / "stack", {"SJA_HORIZON_S": str(window_s), "SJA_INVENTORY": str(inventory)})
    try:
        a_state, b_state = asyncio.run(go(s.nats_url))
    finally:
        s.stop()
    assert a_state.status == "done", a_state.error
    assert b_state.status == "done", b_state.error
    first = a_state.history[0]
    assert first.status == "ok" and 0 < first.units < a_units, a_state.history
    assert first.duration_s > window_s, "it went on past its window"
    assert b_state.history[0].started_at >= first.finished_at - 0.05
    ok = [h for h in a_state.history if h.status == "ok"]
    assert sum(h.units for h in ok) == a_units
    assert a_state.result["metrics"]["hash"] == one_piece(a_units, a_unit_s)["hash"]
    assert a_state.result["metrics"]["starts"] == len(ok)
    assert b_state.result["metrics"]["hash"] == one_piece(b_units, b_unit_s)["hash"]
