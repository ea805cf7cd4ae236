"""A user's program on the live stack: every service a process, a local Ray, the defaults of ``sja up``.

``bench/user_program.py --live`` runs it. The program is ``examples/steps/steps.py`` (the command
contract, no SDK: a start-up, then units of busy arithmetic, its state a JSON file, SIGTERM honoured
at a unit boundary), and ``examples/torch-train/train.py`` (a PyTorch MLP, one optimizer step a unit,
its state ``state.pt``) when the interpreter has torch. Each is run in one piece first, then on the
stack:

- ``idle``: alone on a stack with every default (``sja.core.defaults``): the time from submission to
  the job done, against the one-piece run (``ratio``), the subjobs it took, and whether its result
  equals the one-piece run's. With a start-up of 0, 5 and 10 s; for PyTorch (``torch``), its own
  start-up (importing torch, building the model), and a result equal when the last step's loss is
  the one-piece run's, bit for bit.
- ``idle_past_window``: the same with windows shorter than the job (``--short-window-s``), so that
  the job runs past its first window: it continues in the same process while nobody waits.
- ``contended``: a stack of one slice with ``--short-window-s`` windows; job A runs past its
  window, then job B comes. ``decision_to_yield_s``: from the clearer's grant of A's slice to B
  (the round's ``cleared_at``) to A's subjob ending; ``decision_to_start_s``: to B's subjob
  starting; ``within``: whether that is at most one of A's units plus 2 s. Both results are checked
  against their one-piece runs, and A's units are counted (none lost, none twice).

Timings are wall-clock on whatever machine runs it; run the whole bench in one go to compare.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from sja.client import SjaClient
from sja.core import defaults
from sja.protocol.messages import JobSpec, JobState, MemoryDecl, TimeDecl
from sja.stack import LocalStack

ROOT = Path(__file__).resolve().parents[1]
STEPS = ROOT / "examples" / "steps" / "steps.py"
TRAIN = ROOT / "examples" / "torch-train" / "train.py"
TORCH_WINDOW_S = 5.0
"""The torch case's short windows: about half its one-piece time on a CPU, so it runs past its first."""
ONE_SLICE = "nodes:\n  - name: local\n    gpus:\n      - model: A100-40GB\n        layout: [7g.40gb]\n"


def plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SJA_")}


def one_piece(python: str, units: int, startup_s: float, unit_s: float) -> dict[str, Any]:
    env = {**plain_env(), "STARTUP_S": str(startup_s), "UNIT_S": str(unit_s)}
    t0 = time.perf_counter()
    out = subprocess.run(
        [python, str(STEPS), "--units", str(units)], capture_output=True, text=True, check=True, env=env
    )
    return {"wall_s": round(time.perf_counter() - t0, 3), "result": json.loads(out.stdout)}


def steps_spec(name: str, python: str, units: int, startup_s: float, unit_s: float) -> JobSpec:
    return JobSpec(
        name=name,
        tenant="bench",
        workload="command",
        params={
            "argv": [python, str(STEPS)],
            "units": units,
            "env": {"STARTUP_S": str(startup_s), "UNIT_S": str(unit_s)},
            "stop_grace_s": 2.0,
        },
        memory=MemoryDecl(base_mib=64.0, per_unit_mib=0.0, rel_sd=0.3),
        time=TimeDecl(warmup_s=startup_s + 0.5, per_unit_s=unit_s, rel_sd=0.3),
    )


async def wait_state(
    client: SjaClient, job_id: str, check: Callable[[JobState], bool], timeout_s: float
) -> JobState:
    deadline = time.monotonic() + timeout_s
    while True:
        s = await client.status(job_id)
        if check(s):
            return s
        if time.monotonic() > deadline:
            raise TimeoutError(f"{job_id}: {s.status} {s.units_done}/{s.total_units}")
        await asyncio.sleep(0.05)


async def wait_done(client: SjaClient, job_id: str, timeout_s: float) -> JobState:
    return await wait_state(client, job_id, lambda s: s.status in ("done", "failed", "cancelled"), timeout_s)


def stack(out: Path, env: dict[str, str]) -> LocalStack:
    s = LocalStack(out_dir=out, env={"SJA_RAY_NUM_CPUS": "2", **env})
    s.start()
    asyncio.run(s.wait_ready())
    return s


def summary(state: JobState, ref: dict[str, Any], wall_s: float) -> dict[str, Any]:
    metrics = (state.result or {}).get("metrics", {})
    return {
        "status": state.status,
        "wall_s": round(wall_s, 3),
        "one_piece_s": ref["wall_s"],
        "ratio": round(wall_s / ref["wall_s"], 3),
        "subjobs": len(state.history),
        "starts": metrics.get("starts"),
        "equal_to_one_piece": metrics.get("hash") == ref["result"]["hash"]
        and metrics.get("units") == ref["result"]["units"],
    }


async def run_alone(url: str, spec: JobSpec, timeout_s: float) -> tuple[JobState, float]:
    client = await SjaClient.connect(url)
    try:
        t0 = time.perf_counter()
        ack = await client.submit(spec)
        state = await wait_done(client, ack.job_id, timeout_s)
        return state, time.perf_counter() - t0
    finally:
        await client.close()


def idle(python: str, tmp: Path, units: int, unit_s: float, startups: list[float]) -> list[dict[str, Any]]:
    rows = []
    s = stack(tmp / "idle", {})
    try:
        for startup in startups:
            ref = one_piece(python, units, startup, unit_s)
            spec = steps_spec(f"idle-{startup:g}", python, units, startup, unit_s)
            state, wall = asyncio.run(run_alone(s.nats_url, spec, 600))
            rows.append({"startup_s": startup, "units": units, "unit_s": unit_s, **summary(state, ref, wall)})
    finally:
        s.stop()
    return rows


def idle_past_window(
    python: str, tmp: Path, units: int, unit_s: float, startup: float, window_s: float
) -> dict[str, Any]:
    s = stack(tmp / "past", {"SJA_HORIZON_S": str(window_s)})
    try:
        ref = one_piece(python, units, startup, unit_s)
        spec = steps_spec("past-window", python, units, startup, unit_s)
        state, wall = asyncio.run(run_alone(s.nats_url, spec, 900))
        return {
            "window_s": window_s,
            "startup_s": startup,
            "units": units,
            "unit_s": unit_s,
            **summary(state, ref, wall),
        }
    finally:
        s.stop()


async def _contend(url: str, a: JobSpec, b: JobSpec, window_s: float) -> tuple[JobState, JobState, float]:
    client = await SjaClient.connect(url)
    try:
        a_id = (await client.submit(a)).job_id
        await wait_state(client, a_id, lambda s: bool(s.in_flight), 120)
        await asyncio.sleep(window_s + 2.0)  # A is past its window
        b_id = (await client.submit(b)).job_id
        b_state = await wait_done(client, b_id, 600)
        a_state = await wait_done(client, a_id, 900)
        won = [r for r in await client.rounds(b_id) if r.winner_job == b_id and r.grant_id]
        decided = min(r.cleared_at for r in won) if won else float("nan")
        return a_state, b_state, decided
    finally:
        await client.close()


def contended(python: str, tmp: Path, window_s: float) -> dict[str, Any]:
    inventory = tmp / "one-slice.yaml"
    inventory.write_text(ONE_SLICE)
    a_units, a_unit_s, b_units, b_unit_s = 400, 0.1, 100, 0.05
    a_ref = one_piece(python, a_units, 2.0, a_unit_s)
    b_ref = one_piece(python, b_units, 0.0, b_unit_s)
    s = stack(tmp / "contended", {"SJA_HORIZON_S": str(window_s), "SJA_INVENTORY": str(inventory)})
    try:
        a_state, b_state, decided = asyncio.run(
            _contend(
                s.nats_url,
                steps_spec("holder", python, a_units, 2.0, a_unit_s),
                steps_spec("newcomer", python, b_units, 0.0, b_unit_s),
                window_s,
            )
        )
    finally:
        s.stop()
    first_a = a_state.history[0]
    first_b = b_state.history[0]
    yield_s = first_a.finished_at - decided
    start_s = first_b.started_at - decided
    a_metrics = (a_state.result or {}).get("metrics", {})
    return {
        "window_s": window_s,
        "holder": {
            "status": a_state.status,
            "subjobs": [(h.status, h.unit_start, h.units) for h in a_state.history],
            "first_subjob_s": round(first_a.duration_s, 3),
            "units_done_once": sum(h.units for h in a_state.history if h.status == "ok") == a_units,
            "equal_to_one_piece": a_metrics.get("hash") == a_ref["result"]["hash"],
        },
        "newcomer": {
            "status": b_state.status,
            "equal_to_one_piece": (b_state.result or {}).get("metrics", {}).get("hash")
            == b_ref["result"]["hash"],
        },
        "holder_unit_s": a_unit_s,
        "decision_to_yield_s": round(yield_s, 3),
        "decision_to_start_s": round(start_s, 3),
        "within": start_s <= a_unit_s + 2.0,
    }


def has_torch(python: str) -> bool:
    return subprocess.run([python, "-c", "import torch"], capture_output=True).returncode == 0


def torch_spec(python: str, steps: int) -> JobSpec:
    return JobSpec(
        name="torch-train",
        tenant="bench",
        workload="command",
        params={"argv": [python, str(TRAIN)], "units": steps, "sequential": True, "stop_grace_s": 2.0},
        memory=MemoryDecl(base_mib=400.0, per_unit_mib=0.0, rel_sd=0.5),
        time=TimeDecl(warmup_s=3.0, per_unit_s=0.002, rel_sd=0.5),
    )


def torch_runs(python: str, tmp: Path, steps: int, window_s: float) -> list[dict[str, Any]]:
    """``examples/torch-train`` alone on a stack with every default, and with ``window_s`` windows
    (shorter than the job: it runs past its first one), each against its one-piece run."""
    t0 = time.perf_counter()
    out = subprocess.run(
        [python, str(TRAIN), "--steps", str(steps), "--out", str(tmp / "torch-one-piece")],
        capture_output=True,
        text=True,
        check=True,
        env=plain_env(),
    )
    one_piece_s = time.perf_counter() - t0
    ref = json.loads(out.stdout)["metrics"]
    rows = []
    for name, env in (("defaults", {}), ("past_window", {"SJA_HORIZON_S": str(window_s)})):
        s = stack(tmp / f"torch-{name}", env)
        try:
            state, wall = asyncio.run(run_alone(s.nats_url, torch_spec(python, steps), 900))
        finally:
            s.stop()
        metrics = (state.result or {}).get("metrics", {})
        first = state.history[0] if state.history else None
        rows.append(
            {
                "case": name,
                "window_s": float(env.get("SJA_HORIZON_S", defaults.HORIZON_S)),
                "steps": steps,
                "status": state.status,
                "wall_s": round(wall, 3),
                "one_piece_s": round(one_piece_s, 3),
                "ratio": round(wall / one_piece_s, 3),
                "subjobs": len(state.history),
                # Where the time went: submission to the first subjob's start, and the steps'
                # own pace against the one-piece run's (the start-up is the rest).
                "to_first_start_s": round(first.started_at - state.submitted_at, 3) if first else None,
                "steps_per_s": round(float(metrics.get("steps_per_s", 0.0)), 1),
                "one_piece_steps_per_s": round(float(ref["steps_per_s"]), 1),
                "equal_to_one_piece": metrics.get("loss") == ref["loss"],
            }
        )
    return rows


def run(python: str, short_window_s: float = 20.0) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="sja-live-") as d:
        tmp = Path(d)
        # Subjobs run as the slices' own uids: the program must be readable by others.
        tmp.chmod(0o755)
        return {
            "defaults": {
                "horizon_s": defaults.HORIZON_S,
                "start_overhead_s": defaults.START_OVERHEAD_S,
                "policy": defaults.POLICY,
            },
            "idle": idle(python, tmp, units=150, unit_s=0.1, startups=[0.0, 5.0, 10.0]),
            "idle_past_window": idle_past_window(
                python, tmp, units=400, unit_s=0.1, startup=5.0, window_s=short_window_s
            ),
            "contended": contended(python, tmp, short_window_s),
            "torch": (
                torch_runs(python, tmp, steps=6000, window_s=TORCH_WINDOW_S) if has_torch(python) else None
            ),
        }


if __name__ == "__main__":
    print(json.dumps(msgspec.to_builtins(run(sys.executable))))
