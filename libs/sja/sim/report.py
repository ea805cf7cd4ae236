"""A comparison report: ``report.md`` with PNG plots (JCT CDF, utilization over time, a bar per metric)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from sja.sim.metrics import RHO_REFERENCE, jct_values
from sja.sim.model import SimResult
from sja.sim.runner import comparability, rho_note

BAR_METRICS: tuple[tuple[str, str], ...] = (
    ("utilization", "utilization (useful work / capacity x makespan)"),
    ("alloc_utilization", "allocated compute / capacity x makespan"),
    ("mean_jct_s", "mean JCT (s)"),
    ("p95_jct_s", "p95 JCT (s)"),
    ("mean_wait_s", "mean wait (s)"),
    ("makespan_s", "makespan (s)"),
    ("fragmentation", "fragmentation"),
    ("overhead_s", "atomization overhead (slice-s)"),
)

COMPLETION_METRICS: tuple[str, ...] = (
    "jobs_finished",
    "jobs_failed",
    "jobs_unfinished",
    "jobs_unschedulable",
)

TABLE_METRICS: tuple[str, ...] = (
    "jobs_finished",
    "jobs_failed",
    "jobs_unfinished",
    "jobs_unschedulable",
    "mean_jct_common_s",
    "p95_jct_common_s",
    "rho_p50",
    "rho_p99",
    "rho_max",
    "rho_over_1_5",
    "rho_jobs",
    "utilization",
    "alloc_utilization",
    "mem_utilization",
    "mean_jct_s",
    "p95_jct_s",
    "mean_wait_s",
    "p95_wait_s",
    "makespan_s",
    "makespan_lower_bound_s",
    "fragmentation",
    "oom_count",
    "timeout_count",
    "subjobs",
    "overhead_s",
    "repartitions",
    "reconfig_s",
    "jain_fairness",
)


def fmt(value: Any) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:,.0f}"
    return str(value)


def metrics_table(metrics: Mapping[str, Mapping[str, Any]], keys: Sequence[str] = TABLE_METRICS) -> str:
    """A markdown table: one row per metric, one column per policy."""
    names = list(metrics)
    lines = ["| metric | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for k in keys:
        lines.append(f"| {k} | " + " | ".join(fmt(metrics[n].get(k)) for n in names) + " |")
    return "\n".join(lines)


def rho_lines(metrics: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """Per policy but best-fit, its p99 and max finish-time fairness rho and the jobs of largest rho with
    both JCTs; or the one line saying rho needs best-fit."""
    note = rho_note(metrics)
    if note:
        return [note]
    lines = []
    for name, m in metrics.items():
        if name == RHO_REFERENCE or not m.get("rho_jobs"):
            continue
        worst = ", ".join(
            f"{w['job_id']} {fmt(w['rho'])} ({fmt(w['jct_s'])} s vs {fmt(w['reference_jct_s'])} s)"
            for w in m.get("rho_worst") or []
        )
        lines.append(
            f"{name}: p99 rho {fmt(m.get('rho_p99'))}, max rho {fmt(m.get('rho_max'))} over "
            f"{m['rho_jobs']:,} jobs; largest rho (JCT vs best-fit's): {worst}"
        )
    return lines


def write_report(
    out_dir: str | Path,
    results: Mapping[str, SimResult],
    metrics: Mapping[str, Mapping[str, Any]],
    meta: Mapping[str, Any],
) -> Path:
    """Write ``report.md`` and its plots into ``out_dir``; returns the markdown's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, r in results.items():
        # Over every job the scheduler could run: a curve that ends below 1 left jobs unfinished.
        jct = jct_values(r.recorder)
        total = sum(1 for j in r.recorder.jobs.values() if not j.unschedulable)
        if jct and total:
            ys = [(i + 1) / total for i in range(len(jct))]
            ax.step(jct, ys, where="post", label=name)
    ax.set_xscale("log")
    ax.set_xlabel("job completion time (s)")
    ax.set_ylabel("fraction of schedulable jobs finished")
    ax.set_title("JCT CDF")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "jct_cdf.png", dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, r in results.items():
        times, comp, _mem = r.recorder.utilization_series()
        if times:
            ax.plot([t / 3600 for t in times], comp, label=name, linewidth=1)
    ax.set_xlabel("time (h)")
    ax.set_ylabel("useful compute / capacity")
    ax.set_title(f"utilization over time (bins of {next(iter(results.values())).recorder.bin_s:g} s)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "utilization.png", dpi=120)
    plt.close(fig)

    bar_files = []
    for key, label in BAR_METRICS:
        names = list(metrics)
        values = [metrics[n].get(key) for n in names]
        heights = [v if isinstance(v, int | float) and math.isfinite(v) else 0.0 for v in values]
        fig, ax = plt.subplots(figsize=(5.5, 3.5))
        ax.bar(names, heights, color="tab:blue")
        ax.set_title(label)
        ax.tick_params(axis="x", rotation=20)
        fig.tight_layout()
        fname = f"bar_{key}.png"
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        bar_files.append((label, fname))

    synthetic = sorted({f for m in metrics.values() for f in m.get("synthetic_fields", [])})
    lines = ["# Simulation report", ""]
    warning = comparability(metrics)
    if warning:
        lines += [f'<p style="color:red"><b>{warning}</b></p>', ""]
    lines += ["## Completion", "", metrics_table(metrics, COMPLETION_METRICS), ""]
    for name, m in metrics.items():
        for kind, why in (m.get("reasons") or {}).items():
            for text, n in why.items():
                lines.append(f"- {name}, {kind} ({n:,}): {text}")
    lines.append("")
    for k, v in meta.items():
        lines.append(f"- **{k}**: {v}")
    if synthetic:
        lines += [
            "",
            f"**Synthetic**: these results use modeled trace fields ({', '.join(synthetic)}); "
            "see `docs/evaluation.md` for the models.",
        ]
    lines += ["", "## Metrics", "", metrics_table(metrics), ""]
    lines += [
        "## Finish-time fairness",
        "",
        "rho of a job: its JCT under the policy over its JCT under best-fit, over the jobs both finished "
        "(see `docs/evaluation.md`).",
        "",
        *(f"- {line}" for line in rho_lines(metrics)),
        "",
    ]
    lines += ["## Job completion time", "", "![JCT CDF](jct_cdf.png)", ""]
    lines += ["## Utilization over time", "", "![utilization](utilization.png)", ""]
    lines += ["## Per metric", ""]
    lines += [f"![{label}]({fname})" for label, fname in bar_files]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path
