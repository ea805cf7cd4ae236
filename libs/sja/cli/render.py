"""Terminal rendering of negotiation rounds."""

from __future__ import annotations

import time

from rich.tree import Tree

from sja.protocol.messages import JobState, RoundRecord


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
