"""What the dashboard shows, as plain JSON-ready values, from what the UI service read on the bus.

Pure: no I/O. Nothing here decides anything about scheduling: the job's sentence and deadline come
from ``sja.core.explain``, the tenants' attained and target fractions from the clearer's own
``sja.core.policies.Ledger``; this module only puts them in the shape the page draws.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import msgspec

from sja.core import explain as E
from sja.core.jobs import is_terminal
from sja.core.policies import Ledger
from sja.protocol.messages import Explanation, JobState, RoundRecord, SliceState
from sja.redaction import OTHER, anonymize_round

TIMELINE_SPAN_S = 300.0
"""The timeline shows at most this many seconds back from now."""
ROUND_VERDICTS_SHOWN = 8
"""Verdicts listed per round (the winner's first); the rest are counted."""


def job_colour(job_id: str) -> str:
    """A stable colour per job (the same on every page and every replica)."""
    hue = zlib.crc32(job_id.encode()) % 360
    return f"hsl({hue}, 62%, 55%)"


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
    states: Iterable[JobState], slices: Sequence[SliceState], now: float, span_s: float = TIMELINE_SPAN_S
) -> dict[str, Any]:
    """Slices x time, as ``sja demo`` draws it: every subjob that ran (from its job's history) or
    runs now (in flight, drawn up to ``now``) on a known slice within ``span_s`` of ``now``."""
    known = {s.slice_id for s in slices}
    start = now - span_s
    earliest = now
    segments: list[dict[str, Any]] = []
    for st in states:
        base = {"job_id": st.job_id, "tenant": st.spec.tenant, "colour": job_colour(st.job_id)}
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
                    "running": True,
                }
            )
    for seg in segments:
        earliest = min(earliest, seg["start"])
    segments.sort(key=lambda s: (s["start"], s["slice_id"], s["subjob_id"]))
    return {"start": earliest, "end": now, "segments": segments}


def job_row(state: JobState, now: float) -> dict[str, Any]:
    """A job as the jobs table lists it: state, progress and why it waits, in a sentence."""
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
        "submitted_at": state.submitted_at,
        "finished_at": state.finished_at,
        "summary": E.summary(state, now),
        "deadline": d.text if d is not None else "",
        "deadline_verdict": d.verdict if d is not None else "",
        "memory": over.text if over is not None else "",
        "terminal": is_terminal(state),
        "colour": job_colour(state.job_id),
    }


def job_rows(states: Iterable[JobState], now: float) -> list[dict[str, Any]]:
    """Every job, those still running or waiting first, then the newest first."""
    rows = [job_row(s, now) for s in states]
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
    return {
        "now": now,
        "policy": policy,
        "job_counts": counts,
        "slices": slice_rows(slices),
        "timeline": timeline(states, slices, now),
        "jobs": job_rows(states, now),
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


def job_page(
    state: JobState,
    explanation: Explanation,
    rounds: Sequence[RoundRecord],
    now: float,
    jaeger_url: str,
    explained_by: str,
    rounds_shown: int = 200,
) -> dict[str, Any]:
    """A job's page: its state, the explanation, its subjobs and its rounds (the newest first),
    each round with a link to its trace when a Jaeger UI is configured."""
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
        "job": job_row(state, now),
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
