"""The evaluation grid: SJA against the rigid schedulers on every trace, GPU model, layout and load.

Cells: each trace (Microsoft ITP cluster04 and cluster07; Alibaba openb replayed on a scaled-down
cluster) x GPU model (A100-40GB, A100-80GB, H100-80GB) x layout (the model's MIG layout, or whole
GPUs) x cluster size (80 % and 130 % of the sample's average GPU demand). In each cell every policy
(fifo, easy, bestfit, sja:efficiency, sja:fair) replays the same jobs under ``--seeds`` seeds, with
the simulator's defaults (``SimConfig``: what ``sja simulate`` uses; the window, start overhead,
policy and ``eps`` are the live stack's, ``sja.core.defaults``).

The jobs of a cell are the ``--jobs`` jobs submitted from the middle of the trace on (submission
times kept); the sample's average GPU demand is its GPU-seconds of work over its submission span.

Per cell and seed it checks the goal: SJA finishes every job best-fit finishes (the very jobs, not
their number), its mean JCT over the jobs every policy finished is at most the best baseline's, and
its utilization is at least the best baseline's; and, reported beside the goal, that no job fares
much worse than under best-fit: SJA's p99 finish-time fairness rho (a job's JCT over its JCT under
best-fit, ``sja.sim.metrics.finish_time_fairness``) is at most 1.5. Writes ``grid.csv`` (one row
per cell, policy and seed), ``grid.json`` (every run's metrics, ``rho_*`` included) and ``grid.md``
(one row per cell, seeds averaged, with the checks) into ``--out``, and prints a JSON summary as
its last stdout line.

    python bench/evaluation.py --json --seeds 1      # the whole grid, one seed (half an hour on a core)
    python bench/evaluation.py --json                # three seeds: three times as long
    python bench/evaluation.py --json --quick        # one seed, two traces, one model: minutes
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import sys
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from sja.accel import use_compiled_core

use_compiled_core()  # before the decision core is imported

from sja.sim.cluster import parse_cluster
from sja.sim.metrics import RHO_LIMIT, finished_ids
from sja.sim.model import SimConfig, TraceJob
from sja.sim.runner import compare, metrics_of, run_policy
from sja.sim.trace import load_trace

REPO = Path(__file__).resolve().parent.parent
TRACES_DIRS = (REPO.parent / "shared" / "traces", Path("/work/shared/traces"), REPO / "shared" / "traces")

TRACES: dict[str, tuple[str, str]] = {
    "cluster04": ("ms-itp/cluster04.csv", "ms-itp"),
    "cluster07": ("ms-itp/cluster07.csv", "ms-itp"),
    "openb": ("alibaba-openb/openb_pod_list_default.csv", "alibaba-openb"),
}
MODELS: dict[str, str] = {
    # the MIG layout each model is cut into in the "mig" cells: a large and a medium instance
    "A100-40GB": "4g.20gb+3g.20gb",
    "A100-80GB": "4g.40gb+3g.40gb",
    "H100-80GB": "4g.40gb+3g.40gb",
}
LAYOUTS = ("mig", "repart", "whole")
"""``mig``: every GPU cut into the model's layout for good; ``repart``: the same layout at first, re-cut
by the scheduler for the work waiting (``~repart``: SJA re-cuts idle GPUs and drains busy ones,
best-fit re-cuts idle ones); ``whole``: MIG off. FIFO and EASY hand out whole GPUs in every cell."""
LOADS = (0.8, 1.3)
POLICIES = ("fifo", "easy", "bestfit", "sja:efficiency", "sja:fair")
BASELINES = ("fifo", "easy", "bestfit")
SJA = ("sja:efficiency", "sja:fair")
REL_TOL = 1e-9
UTIL_TOL = 0.98
"""The goal: SJA's utilization at least this times the best baseline's."""
MAKESPAN_TOL = 1.05
"""The goal: SJA's makespan at most this times the best baseline's."""
GOAL = ("completes_bestfit", "jct", "utilization", "makespan", "rho")
"""The checks that together are the goal."""
LOADED_JCT = 0.7
"""The goal at loads of 100 % and more: SJA's mean JCT at most this times the best baseline's."""


def trace_path(rel: str) -> Path:
    for d in TRACES_DIRS:
        if (d / rel).is_file():
            return d / rel
    raise SystemExit(f"{rel} not found under {', '.join(map(str, TRACES_DIRS))}")


def sample(trace: str, seed: int, n: int) -> list[TraceJob]:
    """The ``n`` jobs submitted from the middle of the trace on."""
    rel, fmt = TRACES[trace]
    every = load_trace(trace_path(rel), fmt, seed=seed)
    mid = every[len(every) // 2].submit_s
    return load_trace(trace_path(rel), fmt, seed=seed, start_s=mid, limit=n)


def demand(jobs: Sequence[TraceJob]) -> float:
    """Average GPUs the jobs keep busy while they are submitted: each job's GPUs over the part of its
    run (from its submission, at full speed) inside the submission span, over the span. A job that
    runs on for days after the span counts only inside it: counted whole, a few long jobs make a
    cluster sized to "80 %" of the demand one where nothing waits."""
    first = min(j.submit_s for j in jobs)
    last = max(j.submit_s for j in jobs)
    if last <= first:
        return float(len(jobs))
    busy = sum(
        max(j.num_gpus, 1) * min(j.gpu_fraction, 1.0) * (min(j.submit_s + j.duration_s, last) - j.submit_s)
        for j in jobs
    )
    return busy / (last - first)


@dataclasses.dataclass(frozen=True)
class Cell:
    trace: str
    model: str
    layout: str
    load: float
    gpus: int

    @property
    def cluster(self) -> str:
        spec = f"{self.gpus}x{self.model}"
        if self.layout == "whole":
            return spec
        return f"{spec}:{MODELS[self.model]}" + ("~repart" if self.layout == "repart" else "")

    @property
    def name(self) -> str:
        return f"{self.trace}/{self.model}/{self.layout}/{int(self.load * 100)}%"


def run_cell(cell: Cell, seed: int, n: int) -> dict[str, Any]:
    """Every policy on one cell under one seed, and the goal's checks."""
    jobs = sample(cell.trace, seed, n)
    cluster = parse_cluster(cell.cluster)
    cfg = SimConfig(seed=seed)
    t0 = time.perf_counter()
    results = {p: run_policy(p, cluster, jobs, cfg) for p in POLICIES}
    metrics = {p: metrics_of(r, jobs) for p, r in results.items()}
    compare(results, metrics)
    finished = {p: finished_ids(r.recorder) for p, r in results.items()}
    checks = goal_checks(
        metrics, {s: finished["bestfit"] <= finished[s] for s in SJA}, dataclasses.asdict(cell)
    )
    return {
        "cell": dataclasses.asdict(cell),
        "name": cell.name,
        "cluster": cell.cluster,
        "seed": seed,
        "jobs": len(jobs),
        "wall_s": round(time.perf_counter() - t0, 2),
        "metrics": metrics,
        "checks": checks,
    }


def goal_checks(
    metrics: dict[str, dict[str, Any]], completes_bestfit: dict[str, bool], cell: Mapping[str, Any]
) -> dict[str, dict[str, bool]]:
    """Per SJA policy, the goal against the best rigid baseline of the cell (``cell``: its ``layout``
    and ``load``): on a fixed MIG layout best-fit alone, the only one that runs it; otherwise FIFO,
    EASY (whole GPUs, MIG off) and best-fit. It finished every job best-fit finished; its mean JCT
    (over the jobs every policy finished) is at most the best baseline's, and at most ``LOADED_JCT``
    times it where the load is 100 % or more (a cluster sized at most to the jobs' average demand,
    ``load`` <= 1); its utilization is at least ``UTIL_TOL`` times
    the best baseline's; its makespan at most ``MAKESPAN_TOL`` times the best baseline's; its p99
    finish-time fairness rho against best-fit is at most ``RHO_LIMIT`` (1.5; false when rho is
    missing). Beside it: its mean JCT and utilization against best-fit's alone."""
    rigid = ("bestfit",) if cell["layout"] == "mig" else BASELINES
    best_jct = min(_num(metrics[b]["mean_jct_common_s"]) for b in rigid)
    best_util = max(_num(metrics[b]["utilization"], -1.0) for b in rigid)
    best_span = min(_num(metrics[b].get("makespan_s")) for b in rigid)
    jct_bar = best_jct * (LOADED_JCT if cell["load"] <= 1.0 else 1.0)
    bf = metrics["bestfit"]
    out = {}
    for s in SJA:
        jct, util = _num(metrics[s]["mean_jct_common_s"]), _num(metrics[s]["utilization"], -1.0)
        out[s] = {
            "completes_bestfit": completes_bestfit[s],
            "jct": jct <= jct_bar * (1 + REL_TOL),
            "utilization": util >= best_util * UTIL_TOL * (1 - REL_TOL),
            "makespan": _num(metrics[s].get("makespan_s")) <= best_span * MAKESPAN_TOL * (1 + REL_TOL),
            "rho": _num(metrics[s].get("rho_p99")) <= RHO_LIMIT * (1 + REL_TOL),
            "jct_vs_bestfit": jct <= _num(bf["mean_jct_common_s"]) * (1 + REL_TOL),
            "utilization_vs_bestfit": util >= _num(bf["utilization"], -1.0) * (1 - REL_TOL),
        }
    return out


def _num(v: Any, default: float = math.inf) -> float:
    return float(v) if isinstance(v, int | float) and math.isfinite(v) else default


def cells(traces: Sequence[str], models: Sequence[str], n: int) -> list[Cell]:
    out = []
    for trace in traces:
        d = demand(sample(trace, 0, n))
        for model in models:
            for layout in LAYOUTS:
                for load in LOADS:
                    out.append(Cell(trace, model, layout, load, max(1, round(d * load))))
    return out


ROW_KEYS = (
    "jobs_finished",
    "jobs_failed",
    "jobs_unfinished",
    "jobs_unschedulable",
    "jobs_common",
    "mean_jct_common_s",
    "p95_jct_common_s",
    "mean_jct_s",
    "p95_jct_s",
    "rho_p50",
    "rho_p99",
    "rho_max",
    "utilization",
    "makespan_s",
    "subjobs",
)


def write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(["cell", "cluster", "seed", "policy", *ROW_KEYS, "goal_met", "rho_met"])
        for r in rows:
            for p in POLICIES:
                m = r["metrics"][p]
                c = r["checks"].get(p)
                goal = all(c[k] for k in GOAL) if c else ""
                rho = c.get("rho", "") if c else ""
                row = [r["name"], r["cluster"], r["seed"], p, *(m.get(k) for k in ROW_KEYS), goal, rho]
                w.writerow(row)


def _fmt(v: float | None, digits: int = 0) -> str:
    if v is None or not math.isfinite(v):
        return "—"
    return f"{v:,.{digits}f}"


def write_markdown(path: Path, rows: list[dict[str, Any]], meta: dict[str, Any]) -> dict[str, Any]:
    """One row per cell: per policy the finished share and the figures averaged over seeds; the
    goal's checks for each SJA policy as met in k of n seeds."""
    by_cell: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        by_cell.setdefault(r["name"], []).append(r)
    head = ["cell", "GPUs"]
    for p in POLICIES:
        head += [
            f"{p} done",
            f"{p} mean JCT (h)",
            f"{p} p95 JCT (h)",
            f"{p} util",
            f"{p} makespan (h)",
            f"{p} p99 / max rho",
        ]
    head += [f"{s}: ⊇bestfit / JCT / util / makespan / p99 rho (vs best-fit: JCT / util)" for s in SJA]
    lines = [
        "# Evaluation grid",
        "",
        *(f"- **{k}**: {v}" for k, v in meta.items()),
        "",
        "JCTs are over the jobs every policy finished in that run (`*_common`); `done` is finished over "
        "jobs submitted; the makespan is empty where some job never finished. Layouts: `mig` cuts every "
        "GPU into the model's layout for good, `repart` starts there and lets the scheduler re-cut, "
        "`whole` is MIG off; FIFO and EASY hand out whole GPUs in every cell. The goal's checks, against "
        "the best rigid baseline of the cell (best-fit alone on a fixed MIG layout, the only one that "
        "runs it): SJA finished every job best-fit finished; its mean JCT is at most the best "
        f"baseline's ({LOADED_JCT:g}x it where the cluster is at most the jobs' average demand, load "
        "of 100 % and more: the 80 % cells); its utilization "
        f"at least {UTIL_TOL:g}x the best baseline's; its makespan at most {MAKESPAN_TOL:g}x the best "
        f"baseline's; its p99 finish-time fairness rho (a job's JCT over its own JCT under best-fit, over "
        f"the jobs both finished) at most {RHO_LIMIT:g}. In parentheses: its mean JCT and utilization "
        "against best-fit's, the rigid scheduler of the same layout. Each check is met in k of n seeds; "
        "rho columns: p99 and max rho, averaged over seeds.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    summary: dict[str, Any] = {
        "cells": 0,
        "goal_met_cells": {s: 0 for s in SJA},
        "goal_met_vs_bestfit_cells": {s: 0 for s in SJA},
        "rho_met_cells": {s: 0 for s in SJA},
        "misses": [],
    }
    for name, rs in by_cell.items():
        summary["cells"] += 1
        cells_ = [name, str(rs[0]["cluster"].split("x")[0])]
        for p in POLICIES:
            ms = [r["metrics"][p] for r in rs]
            done = sum(m["jobs_finished"] for m in ms) / max(sum(m["jobs"] for m in ms), 1)
            jct = [_num(m["mean_jct_common_s"]) for m in ms]
            p95 = [_num(m["p95_jct_common_s"]) for m in ms]
            util = [_num(m["utilization"], math.nan) for m in ms]
            span = [_num(m.get("makespan_s"), math.nan) for m in ms]
            rho99 = [_num(m.get("rho_p99"), math.nan) for m in ms]
            rho_max = [_num(m.get("rho_max"), math.nan) for m in ms]
            cells_ += [
                f"{done:.1%}",
                _fmt(sum(jct) / len(jct) / 3600, 1),
                _fmt(sum(p95) / len(p95) / 3600, 1),
                _fmt(sum(util) / len(util), 3),
                _fmt(sum(span) / len(span) / 3600, 1),
                f"{_fmt(sum(rho99) / len(rho99), 2)} / {_fmt(sum(rho_max) / len(rho_max), 2)}",
            ]
        for s in SJA:
            n = len(rs)
            for r in rs:  # the checks as they are now, whatever wrote the rows
                r["checks"][s] = goal_checks(
                    r["metrics"], {x: r["checks"][x]["completes_bestfit"] for x in SJA}, r["cell"]
                )[s]
            names = (
                "completes_bestfit",
                "jct",
                "utilization",
                "makespan",
                "rho",
                "jct_vs_bestfit",
                "utilization_vs_bestfit",
            )
            k = [sum(1 for r in rs if r["checks"][s][c]) for c in names]
            # rows written before rho existed carry no rho_* figures: their rho check is unknown, not failed
            has_rho = all(r["metrics"][s].get("rho_jobs") is not None for r in rs)
            goal = [f"{x}/{n}" for x in k[:5]]
            if not has_rho:
                goal[4] = "—"
            cells_.append(" / ".join(goal) + f" ({k[5]}/{n} / {k[6]}/{n})")
            if has_rho and k[4] == n:
                summary["rho_met_cells"][s] += 1
            if k[0] == k[5] == k[6] == n:
                summary["goal_met_vs_bestfit_cells"][s] += 1
            if all(x == n for x in k[:5]):
                summary["goal_met_cells"][s] += 1
            else:
                summary["misses"].append(
                    {
                        "cell": name,
                        "policy": s,
                        "completes_bestfit": k[0],
                        "jct": k[1],
                        "utilization": k[2],
                        "makespan": k[3],
                        "rho": k[4],
                        "of": n,
                    }
                )
        lines.append("| " + " | ".join(cells_) + " |")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the summary as JSON (always the last line)")
    ap.add_argument("--jobs", type=int, default=300, help="jobs per cell (from the trace's middle on)")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--traces", default=",".join(TRACES))
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--quick", action="store_true", help="one seed, cluster07 and openb, A100-80GB")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--out", type=Path, default=REPO / "out" / "evaluation")
    ap.add_argument("--from-json", type=Path, help="write the tables again from a grid.json, running nothing")
    args = ap.parse_args()
    if args.from_json is not None:
        rows = json.loads(args.from_json.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        write_csv(args.out / "grid.csv", rows)
        summary = write_markdown(args.out / "grid.md", rows, {"from": str(args.from_json)})
        print(json.dumps(summary))
        return
    traces = [t for t in args.traces.split(",") if t]
    models = [m for m in args.models.split(",") if m]
    seeds = args.seeds
    if args.quick:
        traces, models, seeds = ["cluster07", "openb"], ["A100-80GB"], 1
    for t in traces:
        if t not in TRACES:
            raise SystemExit(f"unknown trace {t!r} (known: {', '.join(TRACES)})")
    for m in models:
        if m not in MODELS:
            raise SystemExit(f"unknown model {m!r} (known: {', '.join(MODELS)})")
    t0 = time.perf_counter()
    grid = cells(traces, models, args.jobs)
    tasks = [(c, s) for c in grid for s in range(seeds)]
    print(f"{len(grid)} cells x {seeds} seeds x {len(POLICIES)} policies", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        futures = [pool.submit(run_cell, c, s, args.jobs) for c, s in tasks]
        for i, f in enumerate(futures):
            r = f.result()
            rows.append(r)
            print(f"  [{i + 1}/{len(tasks)}] {r['name']} seed {r['seed']}: {r['wall_s']} s", file=sys.stderr)
    args.out.mkdir(parents=True, exist_ok=True)
    write_csv(args.out / "grid.csv", rows)
    meta = {
        "jobs per cell": f"{args.jobs}, submitted from the middle of each trace on (submission times kept)",
        "seeds": seeds,
        "settings": "the simulator's defaults (SimConfig): "
        + ", ".join(
            f"{k}={getattr(SimConfig(), k)}"
            for k in ("horizon_s", "start_overhead_s", "unit_s", "start_s", "checkpoint_s", "eps_mem")
        ),
        "synthetic": "ms-itp GPU fractions, declared and true memory, tenants; openb true memory (seeded)",
    }
    summary = write_markdown(args.out / "grid.md", rows, meta)
    (args.out / "grid.json").write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    summary.update(
        {
            "runs": len(tasks) * len(POLICIES),
            "wall_s": round(time.perf_counter() - t0, 1),
            "csv": str(args.out / "grid.csv"),
            "markdown": str(args.out / "grid.md"),
        }
    )
    print(json.dumps(summary) if args.json else json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
