"""Warm continuation through the whole stack (a real nats-server, the real executor and runner, a
real program): a warm command job on a stack of one slice continues in the same process from one
subjob to the next, and its result is the same as in one piece."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest

from sja.execution import warm
from sja.protocol import messages as m
from tests.integration.agent.test_sequential_checkpoints import Actors, running, until_state

pytestmark = pytest.mark.timeout(150)

LIBS = str(Path(__file__).resolve().parents[3] / "libs")

PROGRAM = textwrap.dedent(
    """
    import os, sys, time
    sys.path.insert(0, os.environ["LIBS"])
    import sja.job
    ctx = sja.job.context()
    total, pids, loads = None, set(), 0
    while ctx is not None:
        if total is None or not ctx.resumed:
            f = ctx.state_in / "total"
            total = int(f.read_text()) if f.exists() else 0
            loads += 1
        done = 0
        for u in ctx.units:
            if ctx.should_stop():
                break
            time.sleep(0.02)  # each unit takes a while, so that a stop can come between units
            total += u
            done += 1
        (ctx.state_out / "total").write_text(str(total))
        ctx.report(units_done=done, pid=os.getpid(), loads=loads, total=total)
        ctx = ctx.next_range()
    """
)


async def test_a_warm_job_continues_in_one_process_and_ends_as_in_one_piece(
    nats_url: str, tmp_path: Path
) -> None:
    inventory = tmp_path / "one-slice.yaml"
    inventory.write_text(
        "nodes:\n  - name: local\n    gpus:\n      - model: A100-40GB\n        layout: [7g.40gb]\n"
    )
    units = 120
    async with running(nats_url, tmp_path, Actors(), inventory=str(inventory)) as stack:
        spec = m.JobSpec(
            name="warm",
            tenant="t",
            workload="command",
            params={
                "argv": [sys.executable, "-c", PROGRAM],
                "units": units,
                "warm": True,
                "continue": False,  # subjobs bounded by their windows: the warm path between them
                "env": {"LIBS": LIBS},
                "stop_grace_s": 0.3,
            },
            memory=m.MemoryDecl(base_mib=64.0, per_unit_mib=0.0, rel_sd=0.2),
            time=m.TimeDecl(warmup_s=0.1, per_unit_s=0.02, rel_sd=0.3),
        )
        ack = await stack.client.submit(spec, "warm-1")
        state = await until_state(
            stack.client, ack.job_id, lambda s: s.status in ("done", "failed"), 120, "the job to end"
        )
        assert state.status == "done", state.error
        ok = [h for h in state.history if h.status == "ok"]
        assert len(ok) >= 3, [(h.subjob_id, h.units) for h in state.history]
        metrics = state.result["metrics"]
        assert metrics["total"] == sum(range(units))
        # Fewer state loads than subjobs: at least one subjob went on from the process's memory.
        assert metrics["loads"] < len(ok), (metrics, len(ok))
        print(f"{len(ok)} subjobs ok, the state loaded {metrics['loads']} times in the last process")
    warm.evict_except("", "")
