"""``sja simulate``: replay a trace under SJA and the rigid baselines, or run the openb packing experiment."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from sja.sim.model import Progress as ProgressFn
from sja.sim.model import SimConfig, load_speed_table

FORMATS = ("alibaba-openb", "ms-itp", "csv")
PACKING_POLICY = {"bestfit": "bestfit", "random": "random"}
"""Our policy names that the packing experiment knows (every ``sja[:X]`` maps to its ``sja``)."""


class SimulateError(Exception):
    """A bad input to ``sja simulate``; the message is one line for the user."""


def _err(console: Console, message: str) -> int:
    console.print(f"[bold red]error:[/] {message}", soft_wrap=True)
    return 2


def simulate_command(
    *,
    trace: Path,
    fmt: str,
    cluster: str,
    policies: str,
    json_out: Path | None = None,
    report_dir: Path | None = None,
    limit: int | None = None,
    time_scale: float = 1.0,
    start_s: float | None = None,
    seed: int = 0,
    overhead_s: float | None = None,
    eps_mem: float | None = None,
    horizon_s: float | None = None,
    unit_s: float | None = None,
    speed_table: Path | None = None,
    packing_demand: float | None = None,
    nodes: Path | None = None,
    packing_seeds: int = 10,
    console: Console | None = None,
    err_console: Console | None = None,
) -> int:
    """Run the simulation the ``sja simulate`` options describe; returns the process exit code."""
    out = console or Console()
    err = err_console or Console(stderr=True)
    try:
        if not trace.is_file():
            raise SimulateError(f"{trace}: no such trace file")
        if fmt not in FORMATS:
            raise SimulateError(f"unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")
        if packing_demand is not None:
            return _packing(trace, fmt, policies, packing_demand, nodes, packing_seeds, json_out, out)
        return _replay(
            trace=trace,
            fmt=fmt,
            cluster_spec=cluster,
            policies_text=policies,
            json_out=json_out,
            report_dir=report_dir,
            limit=limit,
            time_scale=time_scale,
            start_s=start_s,
            cfg=_config(seed, overhead_s, eps_mem, horizon_s, unit_s, speed_table),
            out=out,
        )
    except SimulateError as e:
        return _err(err, str(e))
    except ValueError as e:
        return _err(err, str(e).splitlines()[0] if str(e) else type(e).__name__)
    except OSError as e:
        return _err(err, f"{e.filename or ''}: {e.strerror or e}".strip(": "))


def _config(
    seed: int,
    overhead_s: float | None,
    eps_mem: float | None,
    horizon_s: float | None,
    unit_s: float | None,
    speed_table: Path | None,
) -> SimConfig:
    """The run's settings: ``SimConfig``'s defaults (``sja.core.defaults`` for what the live stack
    also has), but for what the command line gives."""
    base = SimConfig()
    eps_mem = base.eps_mem if eps_mem is None else eps_mem
    horizon_s = base.horizon_s if horizon_s is None else horizon_s
    unit_s = base.unit_s if unit_s is None else unit_s
    if not 0.0 < eps_mem < 0.5:
        raise SimulateError(f"--eps-mem must be in (0, 0.5), got {eps_mem}")
    if not (horizon_s > 0 and math.isfinite(horizon_s)):
        raise SimulateError(f"--horizon-s must be positive, got {horizon_s}")
    if not unit_s > 0:
        raise SimulateError(f"--unit-s must be positive, got {unit_s}")
    cfg = SimConfig(
        seed=seed,
        eps_mem=eps_mem,
        horizon_s=horizon_s,
        unit_s=unit_s,
    )
    if overhead_s is not None:
        if overhead_s < 0:
            raise SimulateError(f"--overhead-s must be >= 0, got {overhead_s}")
        # Split like the default (10 s start + 5 s checkpoint): two thirds start, one third checkpoint.
        cfg = dataclasses.replace(cfg, start_s=overhead_s * 2 / 3, checkpoint_s=overhead_s / 3)
    if cfg.start_s + cfg.checkpoint_s >= horizon_s:
        raise SimulateError(
            f"per-subjob overhead {cfg.start_s + cfg.checkpoint_s:g} s leaves nothing of "
            f"the {horizon_s:g} s window"
        )
    if speed_table is not None:
        if not speed_table.is_file():
            raise SimulateError(f"{speed_table}: no such speed table")
        cfg = dataclasses.replace(cfg, speed_table=load_speed_table(speed_table))
    return cfg


def _replay(
    *,
    trace: Path,
    fmt: str,
    cluster_spec: str,
    policies_text: str,
    json_out: Path | None,
    report_dir: Path | None,
    limit: int | None,
    time_scale: float,
    start_s: float | None,
    cfg: SimConfig,
    out: Console,
) -> int:
    from sja.sim.cluster import parse_cluster
    from sja.sim.runner import comparability, compare, metrics_of, parse_policies, run_policy
    from sja.sim.trace import load_trace

    names = parse_policies(policies_text)
    try:
        cluster = parse_cluster(cluster_spec)
    except (ValueError, KeyError) as e:
        raise SimulateError(f"bad cluster spec {cluster_spec!r}: {e}") from None
    jobs = load_trace(trace, fmt, seed=cfg.seed, limit=limit, time_scale=time_scale, start_s=start_s)
    if not jobs:
        raise SimulateError(f"{trace}: no jobs to simulate")
    span = max(j.submit_s + j.duration_s for j in jobs) - min(j.submit_s for j in jobs)
    cfg = dataclasses.replace(cfg, bin_s=max(60.0, span / 200))
    results = {}
    metrics: dict[str, dict[str, Any]] = {}
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total} jobs"),
        TextColumn("{task.fields[events]} events"),
        TimeElapsedColumn(),
        console=out,
        transient=False,
    ) as bar:
        for name in names:
            task = bar.add_task(name, total=len(jobs), events=0)

            def tick(events: int, done: int, task: Any = task) -> None:
                bar.update(task, completed=done, events=events)

            fn: ProgressFn = tick
            results[name] = run_policy(name, cluster, jobs, cfg, fn)
            metrics[name] = metrics_of(results[name], jobs)
    compare(results, metrics)
    from sja.sim.report import COMPLETION_METRICS, TABLE_METRICS, metrics_table, rho_lines, write_report

    warning = comparability(metrics)
    if warning:
        out.print(f"[bold red]{warning}[/]", soft_wrap=True)
    out.print(metrics_table(metrics, COMPLETION_METRICS), soft_wrap=True)
    for name, m in metrics.items():
        for kind, why in (m.get("reasons") or {}).items():
            for text, n in why.items():
                out.print(f"  {name}, {kind} ({n:,}): {text}", soft_wrap=True, markup=False)
    out.print(
        metrics_table(metrics, [k for k in TABLE_METRICS if k not in COMPLETION_METRICS]), soft_wrap=True
    )
    for line in rho_lines(metrics):
        out.print(f"  {line}", soft_wrap=True, markup=False)
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(metrics, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        out.print(f"metrics written to {json_out}")
    if report_dir is not None:
        meta = {
            "trace": (
                f"{trace} ({fmt}, {len(jobs)} jobs, limit={limit}, time_scale={time_scale:g}, "
                f"start_s={start_s})"
            ),
            "cluster": f"{cluster_spec} ({len(cluster.gpus)} GPUs, {len(cluster.slices)} slices)",
            "seed": cfg.seed,
            "config": (
                f"horizon {cfg.horizon_s:g} s, unit {cfg.unit_s:g} s, "
                f"overhead {cfg.start_s:g}+{cfg.checkpoint_s:g} s, "
                f"eps_mem {cfg.eps_mem:g}, eps_time {cfg.eps_time:g}, "
                f"reconfiguration {cfg.reconfig_s:g} s "
                f"(repartitionable GPUs: {sum(1 for g in cluster.gpus if g.repartitionable)})"
            ),
        }
        path = write_report(report_dir, results, metrics, meta)
        out.print(f"report written to {path}")
    return 0


def _packing(
    pods: Path,
    fmt: str,
    policies_text: str,
    demand: float,
    nodes: Path | None,
    seeds: int,
    json_out: Path | None,
    out: Console,
) -> int:
    from sja.sim.packing import packing_summary

    if fmt != "alibaba-openb":
        raise SimulateError(f"--packing-demand needs an alibaba-openb pod list, not {fmt!r}")
    if not demand > 0:
        raise SimulateError(f"--packing-demand must be positive, got {demand}")
    node_path = nodes or pods.parent / "openb_node_list_gpu_node.csv"
    if not node_path.is_file():
        raise SimulateError(f"{node_path}: no such node list (give --nodes)")
    mapping: dict[str, str] = {}
    for raw in policies_text.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name == "sja" or name.startswith("sja:"):
            mapping[name] = "sja"
        elif name in PACKING_POLICY:
            mapping[name] = PACKING_POLICY[name]
        else:
            raise SimulateError(f"policy {name!r} has no packing variant (known: bestfit, random, sja)")
    if not mapping:
        raise SimulateError("no policy given")
    summary = packing_summary(pods, node_path, sorted(set(mapping.values())), demand, seeds)
    result = {name: dict(summary[inner]) for name, inner in mapping.items()}
    for name, s in result.items():
        out.print(f"{name}: allocated_gpu_ratio {s['allocated_gpu_ratio']:.2f} % (std {s['std']:.2f})")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        json_out.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        out.print(f"allocation written to {json_out}")
    return 0
