"""Glue: run named policies on one trace and one cluster, and collect their metrics.

Policy names: ``fifo``, ``easy``, ``bestfit`` (rigid baselines) and ``sja`` or ``sja:<clearing
policy>`` (SJA through the decision core; plain ``sja`` clears by the policy the live stack runs by
default, ``sja.core.defaults.POLICY``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from sja.core import defaults
from sja.core.policies import POLICIES
from sja.sim.baselines import BASELINES, run_baseline
from sja.sim.engine import run_sja
from sja.sim.metrics import (
    RHO_FIELDS,
    RHO_REFERENCE,
    common_jct,
    finish_time_fairness,
    finished_ids,
    reasons,
    summarize,
)
from sja.sim.model import Progress, SimCluster, SimConfig, SimResult, TraceJob

DEFAULT_SJA_POLICY = defaults.POLICY


def parse_policies(text: str) -> list[str]:
    """Comma-separated policy names, normalized (``sja`` -> ``sja:<defaults.POLICY>``), in the given order.

    Raises:
        ValueError: an unknown name.
    """
    out: list[str] = []
    for raw in text.split(","):
        name = raw.strip().lower()
        if not name:
            continue
        if name in BASELINES:
            norm = name
        elif name == "sja" or name.startswith("sja:"):
            clearing = name.partition(":")[2] or DEFAULT_SJA_POLICY
            if clearing not in POLICIES:
                known = ", ".join(f"sja:{p}" for p in sorted(POLICIES))
                raise ValueError(f"unknown SJA clearing policy {clearing!r} (known: {known})")
            norm = f"sja:{clearing}"
        else:
            known = ", ".join([*BASELINES, "sja", "sja:<policy>"])
            raise ValueError(f"unknown policy {name!r} (known: {known})")
        if norm not in out:
            out.append(norm)
    if not out:
        raise ValueError("no policy given")
    return out


def run_policy(
    name: str,
    cluster: SimCluster,
    jobs: Sequence[TraceJob],
    cfg: SimConfig,
    progress: Progress | None = None,
) -> SimResult:
    """Simulate one normalized policy name (see ``parse_policies``)."""
    if name.startswith("sja:"):
        result = run_sja(cluster, jobs, dataclasses.replace(cfg, policy=name[4:]), progress)
    else:
        result = run_baseline(name, cluster, jobs, cfg, progress)
    result.policy = name
    return result


def synthetic_fields(jobs: Sequence[TraceJob]) -> list[str]:
    """The trace fields a seeded model filled in for at least one job (results using them are synthetic)."""
    return sorted({f for j in jobs for f in j.synthetic})


def metrics_of(result: SimResult, jobs: Sequence[TraceJob]) -> dict[str, Any]:
    """The metrics dict of one result, with its counters and the synthetic labels."""
    extra: dict[str, Any] = {f"counter_{k}": v for k, v in sorted(result.counters.items())}
    synthetic = synthetic_fields(jobs)
    extra["synthetic"] = bool(synthetic)
    extra["synthetic_fields"] = synthetic
    return _finite(summarize(result.recorder, extra))


def _finite(d: dict[str, Any]) -> dict[str, Any]:
    """NaN and infinities as ``None`` so the JSON stays standard."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, float) and not math.isfinite(v):
            out[k] = None
        elif isinstance(v, dict):
            out[k] = _finite(v)
        else:
            out[k] = v
    return out


ProgressFactory = Callable[[str], Progress | None]


def run_comparison(
    cluster: SimCluster,
    jobs: Sequence[TraceJob],
    policies: Sequence[str],
    cfg: SimConfig,
    progress_for: ProgressFactory | None = None,
) -> tuple[dict[str, SimResult], dict[str, dict[str, Any]]]:
    """Run every policy on the same trace and cluster; returns the raw results and their metrics."""
    results: dict[str, SimResult] = {}
    metrics: dict[str, dict[str, Any]] = {}
    for name in policies:
        progress = progress_for(name) if progress_for is not None else None
        results[name] = run_policy(name, cluster, jobs, cfg, progress)
        metrics[name] = metrics_of(results[name], jobs)
    compare(results, metrics)
    return results, metrics


def compare(results: Mapping[str, SimResult], metrics: dict[str, dict[str, Any]]) -> None:
    """Add to each policy's metrics what makes runs comparable: ``comparable`` (every policy finished
    the same jobs), the JCT and wait over the jobs every policy finished (``*_common``), the reasons
    jobs were left out (``reasons``), and finish-time fairness against best-fit (``rho_*``, see
    ``sja.sim.metrics.finish_time_fairness``; ``None`` when best-fit is not among the policies)."""
    finished = {name: finished_ids(r.recorder) for name, r in results.items()}
    common = set.intersection(*finished.values()) if finished else set()
    same = len({frozenset(f) for f in finished.values()}) <= 1
    reference = results.get(RHO_REFERENCE)
    for name, r in results.items():
        metrics[name]["comparable"] = same
        metrics[name].update(_finite(common_jct(r.recorder, common)))
        metrics[name]["reasons"] = reasons(r.recorder)
        if reference is None:
            metrics[name].update(dict.fromkeys(RHO_FIELDS))
        else:
            metrics[name].update(_finite(finish_time_fairness(r.recorder, reference.recorder)))


def comparability(metrics: Mapping[str, Mapping[str, Any]]) -> str:
    """One line saying why the runs' JCTs do not compare ("" when they do)."""
    if all(m.get("comparable", True) for m in metrics.values()):
        return ""
    parts = [
        f"{name} finished {m['jobs_finished']:,} (unfinished {m['jobs_unfinished']:,}, failed "
        f"{m.get('jobs_failed', 0):,}, unschedulable {m['jobs_unschedulable']:,})"
        for name, m in metrics.items()
    ]
    common = next(iter(metrics.values())).get("jobs_common", 0)
    return (
        "NOT COMPARABLE: the policies finished different sets of jobs; mean_jct_s and mean_wait_s are "
        f"over different jobs. Compare *_common (the {common:,} jobs every policy finished). "
        + "; ".join(parts)
    )


def rho_note(metrics: Mapping[str, Mapping[str, Any]]) -> str:
    """One line saying that finish-time fairness was not computed and why ("" when it was)."""
    if any(m.get("rho_jobs") is not None for m in metrics.values()):
        return ""
    return (
        f"finish-time fairness (rho_*) needs {RHO_REFERENCE!r} among the policies: each job's JCT is "
        "measured against its own JCT under best-fit"
    )
