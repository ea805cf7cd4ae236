"""Terminal rendering of jobs, their status, their rounds and why they wait."""

from __future__ import annotations

import time
from typing import Any

from rich.console import RenderableType
from rich.tree import Tree

from sja.protocol.messages import Explanation, JobState, RoundRecord
from sja.protocol.wording import unit_range


def render_no_rounds(state: JobState) -> str:
    """What `sja trace` says of a known job that has taken part in no round yet."""
    return (
        f"job {state.job_id} ({state.status}, {state.units_done}/{state.total_units} units) "
        "has taken part in no round yet"
    )


def render_rounds(job_id: str, rounds: list[RoundRecord]) -> Tree:
    won = sum(1 for r in rounds if r.winner_job == job_id)
    root = Tree(f"[bold]{job_id}[/]: {len(rounds)} rounds, won {won}")
    for r in rounds:
        when = time.strftime("%H:%M:%S", time.localtime(r.opened_at))
        w = r.window
        length = f"{w.end_s - w.start_s:.1f}s" if w.end_s is not None else "open"
        mark = "[green]won[/]" if r.winner_job == job_id else "[yellow]lost[/]"
        node = root.add(
            f"{mark} round {r.round} {when} offer {r.offer_id} · slice {w.slice_id} "
            f"({w.profile}, {w.mem_mib} MiB, {length}) · policy {r.policy} · "
            f"closed on {r.closed_because} · trace {r.trace_id[:16] or '-'}"
        )
        node.add(f"replies from: {', '.join(r.replies_from) or 'nobody'}")
        for v in r.verdicts:
            if not v.job_id:  # an agent that replied without a bid for this window
                node.add(f"[dim]agent {v.agent_id}[/]: {v.reason}")
                continue
            style = "green" if v.won else ("bold" if v.job_id == job_id else "dim")
            node.add(f"[{style}]{v.job_id}[/] ({v.tenant}, size {v.size}): {v.reason}")
        if r.note:
            node.add(f"[red]{r.note}[/]")
    return root


# --- jobs, status and explain ----------------------------------------------------------------------

STATUS_COLUMNS = (
    "units: the first and last unit the subjob ran, both included, and how many (0-7 (8): units 0 to "
    "7, eight); plan mem q: the planner's (1 - eps_mem) quantile "
    "of its peak memory; peak: measured; mem cap: the slice's memory less the driver reserve; "
    "plan time q: the (1 - eps_time) quantile of its duration; took: measured"
)


def _clock(t: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(t)) if t else "-"


def status_json(state: JobState, now: float) -> dict[str, object]:
    """A job's state as JSON: every field but its checkpoint and profile, with its deadline judged
    (``deadline``: met, missed or open, and in words) and each running subjob's time left."""
    import msgspec

    from sja.core.explain import deadline_status, memory_overrun

    d: dict[str, Any] = msgspec.to_builtins(state)
    d.pop("accumulator", None)
    d.pop("profile", None)
    d["history"] = sorted(d["history"], key=lambda h: (h["unit_start"], h["started_at"]))
    for f in d["in_flight"]:
        f["time_left_s"] = round(max(f["dispatched_at"] + f["time_cap_s"] - now, 0.0), 3)
    dl = deadline_status(state, now)
    if dl is not None:
        d["deadline"] = {"verdict": dl.verdict, "deadline_at": dl.deadline_at, "text": dl.text}
    over = memory_overrun(state)
    if over is not None:
        d["memory"] = {
            "peak_mib": over.peak_mib,
            "declared_mib": over.declared_mib,
            "subjobs": list(over.subjobs),
            "suggest_base_mib": over.suggest_base_mib,
            "suggest_per_unit_mib": over.suggest_per_unit_mib,
            "text": over.text,
        }
    return d


def render_status(state: JobState, now: float, limit: int = 20) -> list[RenderableType]:
    """``sja status``: the job, what runs now (slice, units, time left of its cap), the subjobs
    that ran in the order of their units, with a unit on every column."""
    import json

    from rich.table import Table
    from rich.text import Text

    from sja.core.explain import deadline_status, memory_overrun

    out: list[RenderableType] = []
    s = state
    out.append(
        Text.from_markup(
            f"[bold]{s.job_id}[/] {s.spec.workload} tenant={s.spec.tenant} "
            f"status=[bold]{s.status}[/] {s.units_done}/{s.total_units} units, "
            f"{len(s.history)} subjobs, {len(s.in_flight)} running",
        )
    )
    dl = deadline_status(s, now)
    if dl is not None:
        colour = {"met": "green", "missed": "red"}.get(dl.verdict, "yellow")
        out.append(Text.from_markup(f"[{colour}]{dl.text}[/]"))
    if s.result:
        out.append(Text("result: " + json.dumps(s.result, sort_keys=True)))
    if s.error:
        out.append(Text.from_markup(f"[red]error:[/] {s.error}"))
    over = memory_overrun(s)
    if over is not None:
        out.append(Text.assemble(("memory: ", "bold yellow"), over.text))
    if s.in_flight:
        run = Table(title="running", title_justify="left")
        for col in (
            "subjob",
            "slice",
            "profile",
            "units",
            "started",
            "running (s)",
            "time cap (s)",
            "left (s)",
        ):
            run.add_column(col, no_wrap=col in ("subjob", "slice", "units"))
        for f in sorted(s.in_flight, key=lambda f: f.unit_start):
            left = max(f.dispatched_at + f.time_cap_s - now, 0.0)
            run.add_row(
                f.subjob_id,
                f.slice_id,
                f.profile,
                unit_range(f.unit_start, f.units),
                _clock(f.dispatched_at),
                f"{max(now - f.dispatched_at, 0.0):.1f}",
                f"{f.time_cap_s:.1f}",
                f"{left:.1f}",
            )
        out.append(run)
    if s.history:
        done = sorted(s.history, key=lambda h: (h.unit_start, h.started_at))
        t = Table(title=f"subjobs by unit (last {limit} of {len(done)})" if len(done) > limit else "subjobs")
        t.title_justify = "left"
        cols = ("subjob", "slice", "status", "units", "plan mem q (MiB)", "peak (MiB)", "mem cap (MiB)",
                "plan time q (s)", "took (s)")  # fmt: skip
        for col in cols:
            t.add_column(col, no_wrap=col in ("subjob", "slice", "units"))
        for h in done[-limit:]:
            t.add_row(
                h.subjob_id,
                h.slice_id,
                h.status,
                unit_range(h.unit_start, h.units),
                f"{h.planned_mem_q_mib:,.0f}",
                f"{h.peak_mem_mib:,.0f}",
                f"{h.mem_cap_mib:,}",
                f"{h.planned_duration_q_s:.2f}",
                f"{h.duration_s:.2f}",
            )
        out.append(t)
        out.append(Text(STATUS_COLUMNS, style="dim"))
    return out


def render_jobs(
    states: list[JobState], now: float, wide: bool = False, width: int | None = None
) -> RenderableType:
    """``sja jobs``: a job's id and status are never cut short, whatever the terminal's ``width``. A
    table when it fits; else each job in a few lines: its id, status and units on the first
    (never wrapped), the rest below, indented, wrapped as the terminal needs."""
    from rich import box
    from rich.console import Group
    from rich.padding import Padding
    from rich.table import Table
    from rich.text import Text

    from sja.core.explain import deadline_status

    columns = ["job", "status", "units done", "running", "subjobs", "tenant", "workload"]
    if wide:
        columns += ["submitted", "agent", "deadline"]
    rows: list[list[str]] = []
    for s in states:
        row = [
            s.job_id,
            s.status,
            f"{s.units_done}/{s.total_units}",
            str(len(s.in_flight)),
            str(s.next_seq),
            s.spec.tenant,
            s.spec.workload,
        ]
        if wide:
            dl = deadline_status(s, now)
            row += [_clock(s.submitted_at), s.owner_agent or "-", dl.verdict if dl else "-"]
        rows.append(row)
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]
    if width is None or sum(widths) + 2 * (len(columns) - 1) <= width:
        t = Table(box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1), collapse_padding=True)
        for col in columns:
            t.add_column(col, no_wrap=True, overflow="ignore")
        for r in rows:
            t.add_row(*r)
        return t
    parts: list[RenderableType] = []
    for r in rows:
        first = f"{r[0]}  {r[1]}  {r[2]} units"
        if len(first) <= width:
            parts.append(Text(first, no_wrap=True))
        else:  # the id on a line of its own (folded, never cut), then its status
            parts.append(Text(r[0], overflow="fold"))
            parts.append(Padding(Text(f"{r[1]}  {r[2]} units", overflow="fold"), (0, 0, 0, 2)))
        rest = f"tenant {r[5]}, workload {r[6]}, {r[4]} subjobs ({r[3]} running)"
        if wide:
            rest += f", submitted {r[7]}, agent {r[8]}, deadline {r[9]}"
        parts.append(Padding(Text(rest, style="dim"), (0, 0, 0, 2)))
    return Group(*parts)


def render_explanation(e: Explanation) -> list[RenderableType]:
    """``sja explain``: the state, then per window shape what became of the job, its place in the
    queue, the deadline and notes."""
    from rich.markup import escape
    from rich.text import Text

    out: list[RenderableType] = [Text.from_markup(f"[bold]{e.job_id}[/]: {escape(e.summary)}")]
    if e.windows:
        tree = Tree(f"last offer of each window shape (policy {e.policy or '-'}):")
        mark = {"won": "[green]won[/]", "lost": "[yellow]lost[/]", "excluded": "[yellow]left out[/]",
                "invalid": "[red]invalid[/]", "no_bid": "[dim]no bid[/]"}  # fmt: skip
        for w in e.windows:
            tree.add(
                f"{w.pool} {w.profile} ({w.mem_mib:,} MiB) at {_clock(w.opened_at)}, offer {w.offer_id}: "
                f"{mark[w.outcome]}: {escape(w.reason)}"
            )
        out.append(tree)
    if e.position:
        out.append(Text(f"position {e.position} of {e.waiting} waiting jobs; order: {e.order}"))
    if e.deadline:
        out.append(Text(e.deadline))
    for n in e.notes:
        out.append(Text.from_markup(f"[yellow]note:[/] {escape(n)}"))
    return out
