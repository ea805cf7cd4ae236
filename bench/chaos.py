"""Chaos run: the whole stack as processes, N jobs, every service kind killed with SIGKILL in turn and
restarted, then every invariant checked from the durable records.

    python bench/chaos.py --jobs 200 --json

Checks: every job completes with the result of the job computed in one piece (lost_jobs, wrong
results), no (slice, fence) granted twice and no two subjobs overlapping on one slice
(double_grants), every unit applied exactly once (results_applied_twice), no submission lost.
Reported beside them: grants whose round record never reached ``SJA_ROUNDS`` (unrecorded_grants:
the records of a clearer killed between its grants and their publication), which the checks on
grants cannot see. The last line is a JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from services.registry import parse_cohost
from sja.audit import audit, call, mixed_specs, read_rounds, statuses
from sja.stack import LocalStack

KILL_ORDER = ["agent-0", "clearer-0", "executor-0", "advertiser-0", "inventory-0", "gateway-0"]


def run(
    n_jobs: int, rounds_of_kills: int, timeout_s: float, cohost: list[str] | None = None
) -> dict[str, object]:
    out = Path(tempfile.mkdtemp(prefix="sja-chaos-"))
    stack = LocalStack(
        out_dir=out,
        env={"SJA_HORIZON_S": "2.0", "SJA_LEASE_S": "3.0", "SJA_LOG_LEVEL": "WARNING"},
        groups=[cohost] if cohost else [],
    )
    t0 = time.perf_counter()
    kills = 0
    try:
        stack.start()
        asyncio.run(stack.wait_ready())
        url = stack.nats_url
        specs = mixed_specs(n_jobs)
        ids: list[str] = []
        # Each process once per round: co-hosted services die (and come back) together.
        processes = list(dict.fromkeys(stack.process_of(v).instance for v in KILL_ORDER))
        victims = processes * rounds_of_kills
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
    result: dict[str, object] = dict(audit(mine, rounds, len(ids)).summary())
    result.update({"kills": kills, "wall_s": round(time.perf_counter() - t0, 1), "out_dir": str(out)})
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=200)
    ap.add_argument("--kill-rounds", type=int, default=1, help="times each service kind is killed")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument(
        "--cohost",
        default="",
        help="services run together in one process, comma-separated (killed and restarted together)",
    )
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    try:
        cohost = parse_cohost(args.cohost) if args.cohost else []
    except ValueError as e:
        ap.error(f"--cohost: {e}")
    result = run(args.jobs, args.kill_rounds, args.timeout_s, cohost)
    if not args.json:
        for k, v in result.items():
            print(f"{k:28s} {v}")
    print(json.dumps(result))
    ok = result["lost_jobs"] == 0 and result["double_grants"] == 0 and result["results_applied_twice"] == 0
    return 0 if ok and result["wrong_results"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
