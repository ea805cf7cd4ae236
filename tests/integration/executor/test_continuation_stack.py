"""Continuation and yield through the whole stack (a real nats-server, the real services, executor and
runner, a real program under the command contract, no SDK): on a stack of one slice,

- a job alone runs as one subjob past its window, its program started once;
- a job that comes while another holds the slice past its window wins it: the holder stops at a unit
  boundary (SIGTERM), keeps every unit it did, and goes on after the newcomer; both results equal
  their one-piece runs.
"""

from __future__ import annotations

import asyncio
import sys
import textwrap
from pathlib import Path

import pytest

from sja.protocol import messages as m
from tests.integration.agent.test_sequential_checkpoints import HORIZON_S, Actors, running, until_state

pytestmark = pytest.mark.timeout(150)

# A program of the command contract, no SDK: it starts, does its units in order, and on SIGTERM
# stops after the unit it is in, leaves its state and says how far it got.
PROGRAM = textwrap.dedent(
    """
    import json, os, signal, time
    stop = False
    def on_term(signum, frame):
        global stop
        stop = True
    signal.signal(signal.SIGTERM, on_term)
    time.sleep(float(os.environ["STARTUP_S"]))
    start, count = int(os.environ["SJA_UNIT_START"]), int(os.environ["SJA_UNITS"])
    state_in, state_out = os.environ["SJA_STATE_IN"], os.environ["SJA_STATE_OUT"]
    path = os.path.join(state_in, "acc")
    acc = json.load(open(path)) if os.path.exists(path) else {"sum": 0, "starts": 0}
    acc["starts"] += 1
    done = 0
    for u in range(start, start + count):
        if stop:
            break
        time.sleep(float(os.environ["UNIT_S"]))
        acc["sum"] = (acc["sum"] * 31 + u) % 1000000007
        done += 1
    json.dump(acc, open(os.path.join(state_out, "acc"), "w"))
    json.dump({"units_done": done, "metrics": acc}, open(os.environ["SJA_REPORT"], "w"))
    """
)


def one_piece(units: int) -> int:
    acc = 0
    for u in range(units):
        acc = (acc * 31 + u) % 1000000007
    return acc


def spec(name: str, units: int, unit_s: float, startup_s: float = 0.0) -> m.JobSpec:
    return m.JobSpec(
        name=name,
        tenant="t",
        workload="command",
        params={
            "argv": [sys.executable, "-c", PROGRAM],
            "units": units,
            "env": {"UNIT_S": str(unit_s), "STARTUP_S": str(startup_s)},
            "stop_grace_s": 1.0,
        },
        memory=m.MemoryDecl(base_mib=64.0, per_unit_mib=0.0, rel_sd=0.2),
        time=m.TimeDecl(warmup_s=startup_s + 0.2, per_unit_s=unit_s, rel_sd=0.3),
    )


def one_slice(tmp: Path) -> str:
    inventory = tmp / "one-slice.yaml"
    inventory.write_text(
        "nodes:\n  - name: local\n    gpus:\n      - model: A100-40GB\n        layout: [7g.40gb]\n"
    )
    return str(inventory)


async def test_a_job_alone_runs_as_one_subjob_past_its_window(nats_url: str, tmp_path: Path) -> None:
    units, unit_s = 60, 0.05  # 3 s of work, past the 2-s window
    async with running(nats_url, tmp_path, Actors(), inventory=one_slice(tmp_path)) as stack:
        ack = await stack.client.submit(spec("alone", units, unit_s, startup_s=0.3), "alone-1")
        state = await until_state(
            stack.client, ack.job_id, lambda s: s.status in ("done", "failed"), 120, "the job to end"
        )
    assert state.status == "done", state.error
    assert [(h.status, h.unit_start, h.units) for h in state.history] == [("ok", 0, units)]
    (only,) = state.history
    assert only.duration_s > HORIZON_S, "it went on past its window"
    assert state.result["metrics"] == {"sum": one_piece(units), "starts": 1}


async def test_a_holder_past_its_window_yields_to_a_newcomer_at_a_unit_boundary(
    nats_url: str, tmp_path: Path
) -> None:
    long_units, unit_s = 200, 0.05  # 10 s of work
    async with running(nats_url, tmp_path, Actors(), inventory=one_slice(tmp_path)) as stack:
        holder = (await stack.client.submit(spec("holder", long_units, unit_s), "holder-1")).job_id
        # The holder runs, then goes on past its window: time going by is the scenario (the window's
        # length and a second more), and only then does a newcomer come.
        await until_state(stack.client, holder, lambda s: bool(s.in_flight), 60, "the holder to run")
        await asyncio.sleep(HORIZON_S + 1.0)
        newcomer = (await stack.client.submit(spec("newcomer", 10, 0.02), "newcomer-1")).job_id
        new_state = await until_state(
            stack.client, newcomer, lambda s: s.status in ("done", "failed"), 60, "the newcomer to end"
        )
        held = await until_state(
            stack.client, holder, lambda s: s.status in ("done", "failed"), 120, "the holder to end"
        )
    assert new_state.status == "done", new_state.error
    assert held.status == "done", held.error
    first = held.history[0]
    assert first.status == "ok" and 0 < first.units < long_units, "the holder yielded part-way"
    assert first.duration_s > HORIZON_S, "it went on past its window before it yielded"
    newcomer_first = new_state.history[0]
    assert newcomer_first.started_at >= first.finished_at - 0.05, "the newcomer started once the holder left"
    # Every unit once, in order: the result is the one-piece run's, with one start per subjob.
    assert sum(h.units for h in held.history if h.status == "ok") == long_units
    assert held.result["metrics"]["sum"] == one_piece(long_units)
    assert held.result["metrics"]["starts"] == len([h for h in held.history if h.status == "ok"])
    assert new_state.result["metrics"]["sum"] == one_piece(10)
