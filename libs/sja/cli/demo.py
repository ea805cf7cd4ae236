"""``sja demo``: the whole stack on one machine, mixed jobs from two tenants, a summary and a timeline.

Exit status 0 only when every job completed and its result equals the job computed in one piece.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

import sja.execution.commands  # noqa: F401 - runs a command job in one piece (Command.run)
from sja.bus.auth import NatsSettings
from sja.bus.connection import connect
from sja.bus.rounds import iter_rounds
from sja.client import SjaClient
from sja.protocol.messages import JobSpec, JobState, MemoryDecl, RoundRecord, SliceState
from sja.stack import LocalStack
from sja.workloads import run_in_one_piece

console = Console()
if not console.is_terminal:  # logs and CI: wide enough for the tables
    console = Console(width=160)


def demo_jobs(quick: bool = False) -> list[JobSpec]:
    """Ten jobs of three kinds and several sizes from two tenants; one (``jacobi``) is sequential,
    its state passed from subjob to subjob through the checkpoint store, and one (``big-model``)
    declares a peak of nearly the largest slice (39,000 MiB of the 40,192 a 40 GB instance gives):
    its declaration is a bound it vouches for, so it is planned there from its first subjob."""
    s = 0.25 if quick else 1.0

    def n(x: int) -> int:
        return max(1, int(x * s))

    return [
        JobSpec(
            name="train-embed",
            tenant="research",
            workload="matmul",
            max_parallel=2,
            params={"rows": n(16000), "inner": 2048, "cols": 2048, "seed": 1},
        ),
        JobSpec(
            name="pi-sweep",
            tenant="research",
            workload="montecarlo",
            max_parallel=2,
            params={"units": n(500), "samples_per_unit": 200_000, "seed": 2},
        ),
        JobSpec(
            name="wide-proj",
            tenant="research",
            workload="matmul",
            params={"rows": n(2500), "inner": 4096, "cols": 4096, "seed": 3},
        ),
        JobSpec(
            name="mc-risk",
            tenant="research",
            workload="montecarlo",
            mode="sja",
            params={"units": n(300), "samples_per_unit": 100_000, "seed": 4},
        ),
        JobSpec(
            name="score-batch",
            tenant="prod",
            workload="matmul",
            params={"rows": n(8000), "inner": 1024, "cols": 1024, "seed": 5},
        ),
        JobSpec(
            name="pi-check",
            tenant="prod",
            workload="montecarlo",
            deadline_s=120.0,
            params={"units": n(150), "samples_per_unit": 200_000, "seed": 6},
        ),
        JobSpec(
            name="rank-update",
            tenant="prod",
            workload="matmul",
            mode="sja",
            params={"rows": n(10000), "inner": 2048, "cols": 1024, "seed": 7},
        ),
        JobSpec(
            name="mc-var",
            tenant="prod",
            workload="montecarlo",
            max_parallel=2,
            params={"units": n(400), "samples_per_unit": 100_000, "seed": 8},
        ),
        JobSpec(
            name="big-model",
            tenant="research",
            workload="montecarlo",
            max_parallel=2,
            params={"units": n(200), "samples_per_unit": 100_000, "seed": 10},
            memory=MemoryDecl(base_mib=39_000.0, per_unit_mib=0.0),
        ),
        JobSpec(
            name="heat-solve",
            tenant="prod",
            workload="jacobi",
            params={"grid": 512, "sweeps": n(8000), "seed": 9},
        ),
    ]


def progress_table(states: list[JobState], started: float) -> Table:
    t = Table(title=f"SJA demo — {time.time() - started:5.1f}s", expand=False)
    for col in ("job", "tenant", "kind", "status", "progress", "subjobs", "running on"):
        t.add_column(col)
    for s in states:
        pct = 100.0 * s.units_done / s.total_units
        bar = "█" * int(pct / 5) + "·" * (20 - int(pct / 5))
        style = {"done": "green", "failed": "red", "cancelled": "yellow"}.get(s.status, "")
        t.add_row(
            s.job_id.rsplit("-", 1)[0],
            s.spec.tenant,
            s.spec.workload,
            f"[{style}]{s.status}[/]" if style else s.status,
            f"{bar} {pct:5.1f}%",
            str(len(s.history)),
            ", ".join(f.slice_id for f in s.in_flight),
        )
    return t


async def read_rounds(url: str, auth: NatsSettings | None = None) -> list[RoundRecord]:
    nc = await connect(url, "sja-demo-reader", auth=auth)
    try:
        return [rec async for rec in iter_rounds(nc.jetstream(), timeout_s=5.0, strict=True)]
    finally:
        await nc.close()


async def read_slices(url: str, auth: NatsSettings | None = None) -> list[SliceState]:
    from sja.bus.store import stores

    nc = await connect(url, "sja-demo-reader", auth=auth)
    try:
        slices, _ = await stores(nc.jetstream())
        return sorted((s for s, _ in await slices.all()), key=lambda s: s.slice_id)
    finally:
        await nc.close()


async def drive(
    url: str, specs: list[JobSpec], timeout_s: float, auth: NatsSettings | None = None
) -> tuple[list[JobState], float, float]:
    client = await SjaClient.connect(url, auth=auth)
    try:
        ids = [(await client.submit(spec)).job_id for spec in specs]
        started = time.time()
        with Live(console=console, refresh_per_second=4, transient=False) as live:
            while True:
                states = [await client.status(j) for j in ids]
                live.update(progress_table(states, started))
                if all(s.status in ("done", "failed", "cancelled") for s in states):
                    break
                if time.time() - started > timeout_s:
                    console.print(f"[red]timed out after {timeout_s:.0f}s[/]")
                    break
                await asyncio.sleep(0.5)
        return states, started, time.time()
    finally:
        await client.close()


def summarize(
    states: list[JobState],
    rounds: list[RoundRecord],
    slices: list[SliceState],
    started: float,
    ended: float,
) -> dict[str, Any]:
    jobs = []
    for s in states:
        expected = run_in_one_piece(s.spec.workload, s.spec.params)
        ok_runs = [h for h in s.history if h.status == "ok"]
        correct = s.status == "done" and s.result == expected
        jobs.append(
            {
                "job_id": s.job_id,
                "tenant": s.spec.tenant,
                "workload": s.spec.workload,
                "mode": s.spec.mode,
                "state": s.status,
                "correct": correct,
                "result": s.result,
                "expected": expected,
                "units": s.total_units,
                "subjobs": len(ok_runs),
                "attempts": len(s.history),
                "failed_attempts": {
                    st: sum(1 for h in s.history if h.status == st)
                    for st in ("oom", "timeout", "failed", "lost")
                    if any(h.status == st for h in s.history)
                },
                "wait_s": round((s.first_started_at or ended) - s.submitted_at, 3),
                "jct_s": round((s.finished_at or ended) - s.submitted_at, 3),
                "peak_mem_mib": round(max((h.peak_mem_mib for h in s.history), default=0.0), 1),
                "max_planned_mem_q_mib": round(max((h.planned_mem_q_mib for h in s.history), default=0.0), 1),
                "mem_within_plan": sum(1 for h in ok_runs if h.peak_mem_mib <= h.planned_mem_q_mib),
                "time_within_plan": sum(1 for h in ok_runs if h.duration_s <= h.planned_duration_q_s),
                "slices_used": sorted({h.slice_id for h in s.history}),
                "min_slice_mem_cap_mib": min((h.mem_cap_mib for h in s.history), default=0),
            }
        )
    span = max(ended - started, 1e-9)
    busy: dict[str, float] = {}
    for s in states:
        for h in s.history:
            lo, hi = max(h.started_at, started), min(h.finished_at, ended)
            busy[h.slice_id] = busy.get(h.slice_id, 0.0) + max(0.0, hi - lo)
    slice_rows = [
        {
            "slice": sl.slice_id,
            "profile": sl.profile,
            "mem_mib": sl.mem_mib,
            "utilization": round(busy.get(sl.slice_id, 0.0) / span, 4),
            "busy_s": round(busy.get(sl.slice_id, 0.0), 3),
        }
        for sl in slices
    ]
    in_run = [r for r in rounds if r.opened_at >= started - 1.0]
    return {
        "jobs": jobs,
        "slices": slice_rows,
        "rounds": len(in_run),
        # an agent that replied without a bid has a verdict with no job: not a bid
        "rounds_with_bids": sum(1 for r in in_run if any(v.job_id for v in r.verdicts)),
        "grants": sum(1 for r in in_run if r.grant_id),
        "makespan_s": round(span, 3),
        "all_correct": all(j["correct"] for j in jobs),
    }


def draw_timeline(states: list[JobState], slices: list[SliceState], started: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    names = [s.slice_id for s in slices]
    cmap = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(names) + 1.8))
    handles = []
    for i, s in enumerate(states):
        color = cmap(i % 10)
        handles.append(Patch(color=color, label=f"{s.job_id.rsplit('-', 1)[0]} ({s.spec.tenant})"))
        for h in s.history:
            if h.slice_id not in names:
                continue
            y = names.index(h.slice_id)
            hatch = "" if h.status == "ok" else "xx"
            ax.broken_barh(
                [(h.started_at - started, max(h.finished_at - h.started_at, 0.01))],
                (y - 0.4, 0.8),
                facecolors=color,
                edgecolor="black",
                linewidth=0.3,
                hatch=hatch,
            )
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels([f"{sl.slice_id} ({sl.mem_mib} MiB)" for sl in slices], fontsize=8)
    ax.set_xlabel("seconds since the first submission")
    ax.set_title("SJA demo: subjobs on slices (hatched: oom/timeout/lost)")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=4, fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_summary(summary: dict[str, Any]) -> None:
    t = Table(title="jobs")
    for col in (
        "job",
        "tenant",
        "state",
        "correct",
        "subjobs",
        "attempts",
        "wait s",
        "jct s",
        "peak MiB",
        "planned q MiB",
        "slice cap MiB",
    ):
        t.add_column(col)
    for j in summary["jobs"]:
        t.add_row(
            j["job_id"],
            j["tenant"],
            j["state"],
            "yes" if j["correct"] else "[red]NO[/]",
            str(j["subjobs"]),
            str(j["attempts"]),
            f"{j['wait_s']:.1f}",
            f"{j['jct_s']:.1f}",
            f"{j['peak_mem_mib']:.0f}",
            f"{j['max_planned_mem_q_mib']:.0f}",
            str(j["min_slice_mem_cap_mib"]),
        )
    console.print(t)
    ts = Table(title="slices")
    for col in ("slice", "profile", "MiB", "busy s", "utilization"):
        ts.add_column(col)
    for s in summary["slices"]:
        ts.add_row(
            s["slice"],
            s["profile"],
            str(s["mem_mib"]),
            f"{s['busy_s']:.1f}",
            f"{100 * s['utilization']:.1f}%",
        )
    console.print(ts)
    console.print(
        f"rounds: {summary['rounds']} ({summary['rounds_with_bids']} with bids), "
        f"grants: {summary['grants']}, makespan {summary['makespan_s']:.1f}s"
    )


def run_demo(out: Path, policy: str = "fair", quick: bool = False, timeout_s: float = 900.0) -> int:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    stack = LocalStack(
        out_dir=out,
        env={"SJA_POLICY": policy, "SJA_TENANT_SHARES": "research=1,prod=1"},
        auth=True,  # as `sja up`: a user per service, the demo's reader as the operator
        tenants=("research", "prod"),
    )
    console.print(f"starting the stack (logs in {out}/logs)…")
    try:
        stack.start()
        asyncio.run(stack.wait_ready())
        console.print(f"[green]stack up[/]: NATS {stack.nats_url}, policy {policy}")
        specs = demo_jobs(quick)
        auth = stack.client_auth()
        states, started, ended = asyncio.run(drive(stack.nats_url, specs, timeout_s, auth))
        rounds = asyncio.run(read_rounds(stack.nats_url, auth))
        slices = asyncio.run(read_slices(stack.nats_url, auth))
    finally:
        stack.stop()
    summary = summarize(states, rounds, slices, started, ended)
    (out / "summary.json").write_text(json.dumps(summary, indent=2, default=str), encoding="utf-8")
    draw_timeline(states, slices, started, out / "timeline.png")
    print_summary(summary)
    console.print(
        f"summary: {out / 'summary.json'}, timeline: {out / 'timeline.png'}, traces: {out / 'traces'}"
    )
    if not summary["all_correct"]:
        bad = [j["job_id"] for j in summary["jobs"] if not j["correct"]]
        console.print(f"[bold red]FAILED[/]: {', '.join(bad)} did not complete correctly")
        return 1
    console.print("[bold green]all jobs completed with results equal to the one-piece computation[/]")
    return 0


__all__ = ["demo_jobs", "run_demo"]
