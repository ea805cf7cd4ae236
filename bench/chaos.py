"""Chaos run: the whole stack as processes, N jobs, every service kind killed with SIGKILL in turn and
restarted, then every invariant checked from the durable records.

    python bench/chaos.py --jobs 200 --json

Checks: every job completes with the result of the job computed in one piece (lost_jobs, wrong
results), no (slice, fence) granted twice and no two subjobs overlapping on one slice
(double_grants), every unit applied exactly once (results_applied_twice), no submission lost.
The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import sys
import tempfile
import time
from pathlib import Path

from nats.js.api import DeliverPolicy

from sja.bus.codec import decode
from sja.bus.connection import connect
from sja.client import SjaClient
from sja.protocol import subjects
from sja.protocol.messages import JobSpec, JobState, RoundRecord
from sja.stack import LocalStack
from sja.workloads import run_in_one_piece

KILL_ORDER = ["agent-0", "clearer-0", "executor-0", "advertiser-0", "inventory-0", "gateway-0"]


def job_specs(n: int) -> list[JobSpec]:
    out = []
    for i in range(n):
        if i % 2:
            out.append(
                JobSpec(
                    name=f"mc{i}",
                    tenant=f"t{i % 3}",
                    workload="montecarlo",
                    max_parallel=2,
                    params={"units": 40, "samples_per_unit": 20_000, "seed": i},
                )
            )
        else:
            out.append(
                JobSpec(
                    name=f"mm{i}",
                    tenant=f"t{i % 3}",
                    workload="matmul",
                    params={"rows": 800, "inner": 256, "cols": 256, "seed": i},
                )
            )
    return out


async def call(url: str, fn: str, *args: object) -> object:
    """A gateway call that rides out a gateway restart."""
    last: Exception | None = None
    for _ in range(240):
        try:
            c = await SjaClient.connect(url, timeout_s=2.0)
            try:
                return await getattr(c, fn)(*args)
            finally:
                await c.close()
        except Exception as e:  # retried: the gateway may be restarting
            last = e
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{fn} kept failing: {last}")


async def statuses(url: str, ids: list[str]) -> list[JobState]:
    return [await call(url, "status", j) for j in ids]  # type: ignore[misc]


async def read_rounds(url: str) -> list[RoundRecord]:
    nc = await connect(url, "chaos-check")
    js = nc.jetstream()
    out: list[RoundRecord] = []
    try:
        info = await js.stream_info(subjects.STREAM_ROUNDS.name)
        if not info.state.messages:
            return out
        sub = await js.subscribe(
            f"{subjects.PREFIX}.round.cleared.>", ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
        )
        while True:
            msg = await sub.next_msg(timeout=5.0)
            out.append(decode(msg.data, RoundRecord))
            if msg.metadata.num_pending == 0:
                break
        return out
    finally:
        await nc.close()


def check(states: list[JobState], rounds: list[RoundRecord], submitted: int) -> dict[str, object]:
    lost = [s.job_id for s in states if s.status != "done"]
    wrong = [
        s.job_id
        for s in states
        if s.status == "done" and s.result != run_in_one_piece(s.spec.workload, s.spec.params)
    ]
    applied_twice = 0
    for s in states:
        ranges = sorted((h.unit_start, h.unit_start + h.units) for h in s.history if h.status == "ok")
        applied_twice += sum(1 for a, b in itertools.pairwise(ranges) if b[0] < a[1])
    grants = [(r.window.slice_id, r.fence) for r in rounds if r.grant_id]
    double = len(grants) - len(set(grants))
    by_slice: dict[str, list[tuple[float, float]]] = {}
    for s in states:
        for h in s.history:
            if h.status == "ok":
                by_slice.setdefault(h.slice_id, []).append((h.started_at, h.finished_at))
    for spans in by_slice.values():
        spans.sort()
        double += sum(1 for a, b in itertools.pairwise(spans) if b[0] < a[1] - 1e-3)
    return {
        "jobs": submitted,
        "completed": sum(1 for s in states if s.status == "done"),
        "lost_jobs": len(lost) + (submitted - len(states)),
        "wrong_results": len(wrong),
        "double_grants": double,
        "results_applied_twice": applied_twice,
        "grants": len(grants),
        "subjobs_lost_and_replanned": sum(
            1 for s in states for h in s.history if h.status in ("lost", "timeout", "oom")
        ),
    }


def run(n_jobs: int, rounds_of_kills: int, timeout_s: float) -> dict[str, object]:
    out = Path(tempfile.mkdtemp(prefix="sja-chaos-"))
    stack = LocalStack(
        out_dir=out, env={"SJA_HORIZON_S": "2.0", "SJA_LEASE_S": "3.0", "SJA_LOG_LEVEL": "WARNING"}
    )
    t0 = time.perf_counter()
    kills = 0
    try:
        stack.start()
        asyncio.run(stack.wait_ready())
        url = stack.nats_url
        specs = job_specs(n_jobs)
        ids: list[str] = []
        victims = KILL_ORDER * rounds_of_kills
        every = max(1, len(specs) // (len(victims) + 1))
        for i, spec in enumerate(specs):
            ids.append(asyncio.run(call(url, "submit", spec)).job_id)  # type: ignore[attr-defined]
            if victims and i % every == every - 1:
                victim = victims.pop(0)
                stack.kill(victim)
                kills += 1
                time.sleep(0.5)
                stack.restart(victim)
        for victim in victims:  # the rest while the jobs run
            time.sleep(1.0)
            stack.kill(victim)
            kills += 1
            time.sleep(0.5)
            stack.restart(victim)
        asyncio.run(stack.wait_ready())
        deadline = time.monotonic() + timeout_s
        while True:
            mine = asyncio.run(statuses(url, ids))
            if all(s.status in ("done", "failed", "cancelled") for s in mine) or time.monotonic() > deadline:
                break
            time.sleep(2.0)
        rounds = asyncio.run(read_rounds(url))
    finally:
        stack.stop()
    result = check(mine, rounds, len(ids))
    result.update({"kills": kills, "wall_s": round(time.perf_counter() - t0, 1), "out_dir": str(out)})
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--kill-rounds", type=int, default=1, help="times each service kind is killed")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    result = run(args.jobs, args.kill_rounds, args.timeout_s)
    if not args.json:
        for k, v in result.items():
            print(f"{k:28s} {v}")
    print(json.dumps(result))
    ok = result["lost_jobs"] == 0 and result["double_grants"] == 0 and result["results_applied_twice"] == 0
    return 0 if ok and result["wrong_results"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
