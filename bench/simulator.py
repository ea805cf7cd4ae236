"""Benchmark of the simulator: the whole Microsoft ITP cluster04 trace under SJA.

Prints progress to stderr and, as its last stdout line, a JSON object with ``events_per_s``,
``wall_s``, ``events`` and ``jobs``. Run ``python bench/simulator.py --json``.

Defaults: 512 A100-80GB GPUs, each one whole slice (cluster04 kept about 491 GPUs busy on average),
and the simulator's defaults (``SimConfig``: the live stack's ``sja.core.defaults``, 10-minute windows
under the ``fair`` policy and ``eps_mem`` 0.05, and one-minute work units), the settings ``sja
simulate`` and ``bench/evaluation.py`` use.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from sja.accel import use_compiled_core

use_compiled_core()  # before the decision core is imported

from sja.sim.cluster import parse_cluster
from sja.sim.engine import run_sja
from sja.sim.metrics import summarize
from sja.sim.model import SimConfig
from sja.sim.trace import load_trace

REPO = Path(__file__).resolve().parent.parent
CANDIDATES = (
    Path("/work/shared/traces/ms-itp/cluster04.csv"),
    REPO.parent / "shared" / "traces" / "ms-itp" / "cluster04.csv",
    REPO / "shared" / "traces" / "ms-itp" / "cluster04.csv",
)


def find_trace(explicit: str | None) -> Path:
    if explicit:
        return Path(explicit)
    for p in CANDIDATES:
        if p.is_file():
            return p
    raise SystemExit(f"cluster04.csv not found (looked in {', '.join(map(str, CANDIDATES))}); pass --trace")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the result line as JSON (always last)")
    ap.add_argument("--trace", default=None, help="path to cluster04.csv")
    ap.add_argument("--cluster", default="512xA100-80GB")
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--horizon-s", type=float, default=SimConfig.horizon_s)
    ap.add_argument("--unit-s", type=float, default=SimConfig.unit_s)
    ap.add_argument("--eps-mem", type=float, default=SimConfig.eps_mem)
    ap.add_argument("--policy", default=SimConfig.policy)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    jobs = load_trace(find_trace(args.trace), "ms-itp", seed=args.seed, limit=args.limit)
    cluster = parse_cluster(args.cluster)
    cfg = SimConfig(
        seed=args.seed,
        policy=args.policy,
        horizon_s=args.horizon_s,
        unit_s=args.unit_s,
        eps_mem=args.eps_mem,
        bin_s=86400.0,
    )

    def progress(events: int, done: int) -> None:
        if events % 50_000 < 2000:
            print(
                f"  {events} events, {done}/{len(jobs)} jobs, {time.perf_counter() - t0:.0f} s",
                file=sys.stderr,
            )

    t0 = time.perf_counter()
    result = run_sja(cluster, jobs, cfg, progress)
    wall = time.perf_counter() - t0
    m = summarize(result.recorder)
    events = int(result.counters["events"])
    line = {
        "events_per_s": round(events / wall, 1),
        "wall_s": round(wall, 2),
        "events": events,
        "jobs": len(jobs),
        "jobs_finished": m["jobs_finished"],
        "subjobs": m["subjobs"],
        "rounds": int(result.counters["rounds"]),
        "open_subjobs": int(result.counters.get("open_subjobs", 0)),
        "yields": int(result.counters.get("yields", 0)),
        "contended_s": result.counters.get("contended_s", 0.0),
        "span_s": m["makespan_s"],
        "mean_jct_s": m["mean_jct_s"],
        "utilization": m["utilization"],
        "policy": args.policy,
        "cluster": args.cluster,
        "horizon_s": args.horizon_s,
        "eps_mem": args.eps_mem,
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()
