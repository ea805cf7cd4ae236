"""What the dashboard shows, as plain JSON-ready values, from what the UI service read on the bus.

Pure: no I/O. Nothing here decides anything about scheduling: the job's sentence and deadline come
from ``sja.core.explain``, the tenants' attained and target fractions from the clearer's own
``sja.core.policies.Ledger``; this module only puts them in the shape the page draws.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from sja.core import explain as E
from sja.core.jobs import is_terminal
from sja.core.policies import Ledger
from sja.protocol.messages import Explanation, JobState, LogsView, RoundRecord, SliceState
from sja.protocol.wording import unit_range
from sja.redaction import OTHER, anonymize_round

TIMELINE_SPAN_S = 300.0
"""The timeline shows at most this many seconds back from now."""
ROUND_VERDICTS_SHOWN = 8
"""Verdicts listed per round (the winner's first); the rest are counted."""


GOLDEN_ANGLE = 137.50776405003785
"""Degrees between the hues of consecutive jobs: any number of them stay spread round the wheel."""
_LIGHTNESS = (55, 40, 70)


def colour_at(i: int) -> str:
    """The colour of the ``i``-th job on screen: hues a golden angle apart (never the same for two
    indexes under a few thousand, and far apart for the few jobs a screen shows), the lightness
    changing every eight jobs as well."""
    hue = (i * GOLDEN_ANGLE) % 360
    return f"hsl({hue:.1f}, 62%, {_LIGHTNESS[(i // 8) % len(_LIGHTNESS)]}%)"


def job_colours(states: Iterable[JobState]) -> dict[str, str]:
    """A colour per job on screen, distinct from every other job's there, deterministic: the jobs
    in the order of their submission (then id), each given ``colour_at`` its place. The same jobs
    get the same colours on every page and every replica; a job submitted later takes the next
    colour and changes no earlier one's."""
    ordered = sorted(states, key=lambda s: (s.submitted_at, s.job_id))
    return {s.job_id: colour_at(i) for i, s in enumerate(ordered)}


def subjob_tally(state: JobState) -> dict[str, int]:
    """How the job's subjobs ended, counted by status (``ok``, ``failed``, ``oom``, ...)."""
    counts: dict[str, int] = {}
    for h in state.history:
        counts[h.status] = counts.get(h.status, 0) + 1
    return counts


def subjobs_text(state: JobState) -> str:
    """The subjobs that ended, in words, by status: ``9 subjobs ended: 1 ok, 8 failed``."""
    counts = subjob_tally(state)
    total = sum(counts.values())
    if not total:
        return "no subjob ended yet"
    order = ("ok", "failed", "oom", "timeout", "lost", "cancelled")
    keys = sorted(counts, key=lambda k: (order.index(k) if k in order else len(order), k))
    parts = ", ".join(f"{counts[k]} {k}" for k in keys)
    return f"{total} subjob{'s' if total != 1 else ''} ended: {parts}"


def slice_rows(slices: Iterable[SliceState]) -> list[dict[str, Any]]:
    """The timeline's rows: every slice, by node, GPU and placement."""
    ordered = sorted(slices, key=lambda s: (s.node, s.gpu_index, s.placement_start, s.slice_id))
    return [
        {
            "slice_id": s.slice_id,
            "node": s.node,
            "pool": s.pool,
            "gpu_model": s.gpu_model,
            "profile": s.profile,
            "mem_mib": s.mem_mib,
            "status": s.status,
            "holder_job": s.holder_job,
        }
        for s in ordered
    ]


def timeline(
    states: Sequence[JobState],
    slices: Sequence[SliceState],
    now: float,
    span_s: float = TIMELINE_SPAN_S,
    colours: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """Slices x time, as ``sja demo`` draws it: every subjob that ran (from its job's history) or
    runs now (in flight, drawn up to ``now``) on a known slice within ``span_s`` of ``now``, in its
    job's colour (``colours``, default ``job_colours(states)``)."""
    known = {s.slice_id for s in slices}
    colour = job_colours(states) if colours is None else colours
    start = now - span_s
    earliest = now
    segments: list[dict[str, Any]] = []
    for st in states:
        base = {"job_id": st.job_id, "tenant": st.spec.tenant, "colour": colour.get(st.job_id, "")}
        for h in st.history:
            if h.slice_id not in known or h.finished_at < start:
                continue
            segments.append(
                {
                    **base,
                    "subjob_id": h.subjob_id,
                    "slice_id": h.slice_id,
                    "start": max(h.started_at, start),
                    "end": max(h.finished_at, h.started_at),
                    "status": h.status,
                    "units": h.units,
                    "units_text": unit_range(h.unit_start, h.units),
                    "running": False,
                }
            )
        for f in st.in_flight:
            if f.slice_id not in known:
                continue
            segments.append(
                {
                    **base,
                    "subjob_id": f.subjob_id,
                    "slice_id": f.slice_id,
                    "start": max(f.dispatched_at, start),
                    "end": max(now, f.dispatched_at),
                    "status": "running",
                    "units": f.units,
                    "units_text": unit_range(f.unit_start, f.units),
                    "running": True,
                }
            )
    for seg in segments:
        earliest = min(earliest, seg["start"])
    segments.sort(key=lambda s: (s["start"], s["slice_id"], s["subjob_id"]))
    return {"start": earliest, "end": now, "segments": segments}


def job_row(state: JobState, now: float, colour: str = "") -> dict[str, Any]:
    """A job as the jobs table lists it: state, progress and why it waits, in a sentence; its
    subjobs counted by how they ended (``subjob_counts``, and in words ``subjobs_text``)."""
    d = E.deadline_status(state, now)
    over = E.memory_overrun(state)
    return {
        "job_id": state.job_id,
        "name": state.spec.name,
        "tenant": state.spec.tenant,
        "workload": state.spec.workload,
        "status": state.status,
        "units_done": state.units_done,
        "total_units": state.total_units,
        "progress": state.units_done / state.total_units if state.total_units else 0.0,
        "running": len(state.in_flight),
        "subjobs": len(state.history),
        "subjob_counts": subjob_tally(state),
        "subjobs_text": subjobs_text(state),
        "submitted_at": state.submitted_at,
        "finished_at": state.finished_at,
        "summary": E.summary(state, now),
        "deadline": d.text if d is not None else "",
        "deadline_verdict": d.verdict if d is not None else "",
        "memory": over.text if over is not None else "",
        "terminal": is_terminal(state),
        "colour": colour,
    }


def job_rows(
    states: Sequence[JobState], now: float, colours: Mapping[str, str] | None = None
) -> list[dict[str, Any]]:
    """Every job, those still running or waiting first, then the newest first."""
    colour = job_colours(states) if colours is None else colours
    rows = [job_row(s, now, colour.get(s.job_id, "")) for s in states]
    rows.sort(key=lambda r: (r["terminal"], -r["submitted_at"], r["job_id"]))
    return rows


def tenant_shares(states: Iterable[JobState], targets: Mapping[str, float]) -> list[dict[str, Any]]:
    """Each tenant's attained fraction of the GPU-seconds granted (what the clearer's ledger
    charges, as the agents count it per job) against its target fraction (``SJA_TENANT_SHARES``;
    a tenant not listed weighs 1), over the tenants that have jobs or a target."""
    ledger = Ledger(tenant_shares=dict(targets))
    tenants: set[str] = set(targets)
    jobs: dict[str, int] = {}
    for s in states:
        tenants.add(s.spec.tenant)
        jobs[s.spec.tenant] = jobs.get(s.spec.tenant, 0) + 1
        ledger.charge(s.spec.tenant, s.job_id, s.attained_gpu_s)
    names = sorted(tenants)
    return [
        {
            "tenant": t,
            "jobs": jobs.get(t, 0),
            "attained_gpu_s": ledger.tenant_attained.get(t, 0.0),
            "attained": ledger.attained_fraction(t, names),
            "target": ledger.target_fraction(t, names),
            "weight": ledger.share(t),
        }
        for t in names
    ]


def round_row(record: RoundRecord, shown: int = ROUND_VERDICTS_SHOWN) -> dict[str, Any]:
    """A cleared round: its window, policy, winner and the verdict of each bid."""
    verdicts = sorted(record.verdicts, key=lambda v: (not v.won, v.job_id == "", v.job_id))
    winner_tenant = next((v.tenant for v in record.verdicts if v.won), "")
    return {
        "offer_id": record.offer_id,
        "round": record.round,
        "pool": record.window.pool,
        "slice_id": record.window.slice_id,
        "profile": record.window.profile,
        "mem_mib": record.window.mem_mib,
        "policy": record.policy,
        "winner_job": record.winner_job,
        "winner_tenant": winner_tenant,
        "bids": record.bids or sum(1 for v in record.verdicts if v.job_id),
        "closed_because": record.closed_because,
        "note": record.note,
        "trace_id": record.trace_id,
        "opened_at": record.opened_at,
        "cleared_at": record.cleared_at,
        "verdicts": [
            {"job_id": v.job_id, "tenant": v.tenant, "won": v.won, "reason": v.reason, "size": v.size}
            for v in verdicts[:shown]
        ],
        "more_verdicts": max(0, len(verdicts) - shown),
    }


def overview(
    states: Sequence[JobState],
    slices: Sequence[SliceState],
    records: Sequence[RoundRecord],
    targets: Mapping[str, float],
    now: float,
    rounds_shown: int = 25,
) -> dict[str, Any]:
    """The dashboard's main page: the timeline, the jobs, the tenants and the latest rounds."""
    latest = records[-rounds_shown:] if rounds_shown else []
    policy = records[-1].policy if records else ""
    counts: dict[str, int] = {}
    for s in states:
        counts[s.status] = counts.get(s.status, 0) + 1
    colours = job_colours(states)
    return {
        "now": now,
        "policy": policy,
        "job_counts": counts,
        "slices": slice_rows(slices),
        "timeline": timeline(states, slices, now, colours=colours),
        "jobs": job_rows(states, now, colours),
        "tenants": tenant_shares(states, targets),
        "rounds": [round_row(r) for r in reversed(latest)],
    }


def subjob_rows(state: JobState, now: float) -> list[dict[str, Any]]:
    """A job's subjobs in the order they were cut (by first unit), the running ones included."""
    rows: list[dict[str, Any]] = [
        {
            "subjob_id": h.subjob_id,
            "slice_id": h.slice_id,
            "profile": h.profile,
            "status": h.status,
            "unit_start": h.unit_start,
            "units": h.units,
            "units_text": unit_range(h.unit_start, h.units),
            "planned_mem_q_mib": h.planned_mem_q_mib,
            "peak_mem_mib": h.peak_mem_mib,
            "mem_cap_mib": h.mem_cap_mib,
            "duration_s": h.duration_s,
            "time_cap_s": h.time_cap_s,
            "started_at": h.started_at,
        }
        for h in state.history
    ]
    for f in state.in_flight:
        rows.append(
            {
                "subjob_id": f.subjob_id,
                "slice_id": f.slice_id,
                "profile": f.profile,
                "status": "running",
                "unit_start": f.unit_start,
                "units": f.units,
                "units_text": unit_range(f.unit_start, f.units),
                "planned_mem_q_mib": f.planned_mem_q_mib,
                "peak_mem_mib": None,
                "mem_cap_mib": None,
                "duration_s": max(0.0, now - f.dispatched_at),
                "time_cap_s": f.time_cap_s,
                "started_at": f.dispatched_at,
            }
        )
    rows.sort(key=lambda r: (r["started_at"], r["unit_start"]))
    return rows


def output_rows(logs: LogsView | None) -> list[dict[str, Any]]:
    """What each subjob's program wrote last (the gateway's ``logs``: the tails its completion
    carries), the newest subjob first; the text as the program wrote it (the page escapes it)."""
    if logs is None:
        return []
    return [
        {
            "subjob_id": s.subjob_id,
            "slice_id": s.slice_id,
            "status": s.status,
            "units_text": unit_range(s.unit_start, s.units),
            "units_done": s.units_done,
            "finished_at": s.finished_at,
            "error": s.error,
            "stdout": s.stdout,
            "stderr": s.stderr,
        }
        for s in reversed(logs.subjobs)
    ]


def job_page(
    state: JobState,
    explanation: Explanation,
    rounds: Sequence[RoundRecord],
    now: float,
    jaeger_url: str,
    explained_by: str,
    rounds_shown: int = 200,
    *,
    colour: str = "",
    logs: LogsView | None = None,
    logs_note: str = "",
) -> dict[str, Any]:
    """A job's page: its state, the explanation, its subjobs, what their programs wrote last
    (``logs``; ``logs_note`` says why there is none when the gateway did not answer) and its rounds
    (the newest first), each round with a link to its trace when a Jaeger UI is configured."""
    base = jaeger_url.rstrip("/")
    out_rounds = []
    for r in reversed(rounds[-rounds_shown:]):
        row = round_row(r, shown=len(r.verdicts))
        mine = next((v for v in r.verdicts if v.job_id == state.job_id), None)
        row["verdict"] = (
            {"won": mine.won, "reason": mine.reason, "size": mine.size} if mine is not None else None
        )
        row["trace_url"] = f"{base}/trace/{r.trace_id}" if base and r.trace_id else ""
        out_rounds.append(row)
    return {
        "now": now,
        "job": job_row(state, now, colour),
        "result": state.result,
        "error": state.error,
        "explanation": {
            "summary": explanation.summary,
            "status": explanation.status,
            "policy": explanation.policy,
            "position": explanation.position,
            "waiting": explanation.waiting,
            "order": explanation.order,
            "deadline": explanation.deadline,
            "notes": list(explanation.notes),
            "windows": [
                {
                    "pool": w.pool,
                    "profile": w.profile,
                    "mem_mib": w.mem_mib,
                    "slice_id": w.slice_id,
                    "outcome": w.outcome,
                    "reason": w.reason,
                    "policy": w.policy,
                    "opened_at": w.opened_at,
                }
                for w in explanation.windows
            ],
            "by": explained_by,
        },
        "subjobs": subjob_rows(state, now),
        "output": output_rows(logs),
        "output_note": logs_note,
        "rounds": out_rounds,
        "rounds_total": len(rounds),
        "jaeger_url": base,
    }


def tenant_overview(
    tenant: str,
    states: Sequence[JobState],
    slices: Sequence[SliceState],
    records: Sequence[RoundRecord],
    targets: Mapping[str, float],
    now: float,
    rounds_shown: int = 25,
) -> dict[str, Any]:
    """The main page as ``tenant`` may see it: its own jobs only (timeline, table, counts); every
    slice, but which job holds it only when the job is the tenant's; its own share, counted against
    every tenant's (what the clearer is fair about); the rounds it bid in, with the other tenants'
    bids anonymized (``sja.redaction.anonymize_round``, as the gateway's tenant subjects answer)."""
    mine = [s for s in states if s.spec.tenant == tenant]
    own_ids = {s.job_id for s in mine}
    shown_slices = [
        s if not s.holder_job or s.holder_job in own_ids else msgspec.structs.replace(s, holder_job=OTHER)
        for s in slices
    ]
    bid_in = [anonymize_round(r, tenant) for r in records if any(v.tenant == tenant for v in r.verdicts)]
    out = overview(mine, shown_slices, bid_in, {}, now, rounds_shown)
    out["tenants"] = [row for row in tenant_shares(states, targets) if row["tenant"] == tenant]
    return out
