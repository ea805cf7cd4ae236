"""Why a job waits, in words a user understands: from its state, the round records its clearer
kept (``SJA_ROUNDS``) and the other jobs waiting. Pure: the gateway reads the records and the
job store, and calls ``explain``.

For the last offer of each window shape (pool, MIG profile, memory) seen lately it says what became
of the job there: it won; it lost, to whom and why, under which policy; it was left out at capacity;
or it sent no bid, and why not (its smallest subjob needs more memory at ``eps_mem`` than the slice
holds, or more time than the window gives; it is at its ``max_parallel``, or its subjobs hold the
GPUs' worth it may have, ``JobSpec.gpus``; it is being cancelled).
The reasons come from the planner's own functions, so they follow whatever rule it plans by.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

from sja.core.jobs import (
    can_take_more,
    capacity,
    declarations,
    gpu_budget,
    held_gpus,
    is_terminal,
    next_range,
    plan_request,
)
from sja.core.planner import PlanLimits, largest_safe_size, usable_memory, usable_time
from sja.core.policies import REGISTRY, ClearingPolicy, Ledger, Policy, VerdictKind, verdict_kind
from sja.core.profiles import EVIDENCE_MIN_DOF, JobProfile
from sja.core.shadow import DUE_SLACK, SPAN_SLACK
from sja.protocol.messages import Explanation, JobSpec, JobState, RoundRecord, Window, WindowReason

_UNKNOWN = Policy("")
"""What explain asks of a policy it does not know (no round cleared lately, or one registered only
where the rounds are cleared): its defaults, a queue by submission."""


def _policy(name: str) -> ClearingPolicy:
    return REGISTRY.get(name, _UNKNOWN)


def deadline_readers() -> list[str]:
    """The registered clearing policies that read a job's ``deadline_s`` (``reads_deadline``); the
    others clear as if it had none."""
    return [name for name, pol in REGISTRY.items() if pol.reads_deadline]


def _listed(names: Sequence[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join(names) if len(names) <= 2 else f"{', '.join(names[:-1])} and {names[-1]}"


def deadline_note(policy: str, spec: JobSpec) -> str | None:
    """What a submitter of ``spec`` should know when ``policy`` clears its rounds and ignores its
    deadline; ``None`` when there is nothing to say."""
    if spec.deadline_s is None or _policy(policy).reads_deadline:
        return None
    readers = deadline_readers()
    if not readers:
        who = "deadline_s is read by no clearing policy"
    else:
        kind = "policy" if len(readers) == 1 else "policies"
        who = f"deadline_s is read only by the {_listed(readers)} {kind}"
    status = "`sja status` shows whether the deadline is met"
    if not policy:
        return f"{who} (no round cleared lately tells which one runs): {status}"
    return f"{who}; rounds are cleared under {policy}, which does not: {status}"


@dataclass(frozen=True)
class DeadlineStatus:
    verdict: str
    """``met``, ``missed`` or ``open`` (not over, not passed)."""
    deadline_at: float
    text: str


def deadline_status(state: JobState, now: float) -> DeadlineStatus | None:
    """Whether the job met its deadline (``submitted_at + deadline_s``), under every policy; ``None``
    without one."""
    if state.spec.deadline_s is None:
        return None
    due = state.submitted_at + state.spec.deadline_s
    within = f"deadline {state.spec.deadline_s:g} s after submission"
    if state.finished_at is not None:
        took = state.finished_at - state.submitted_at
        if state.status == "done" and state.finished_at <= due:
            return DeadlineStatus("met", due, f"{within}: met (done after {took:.1f} s)")
        if state.status == "done":
            late = state.finished_at - due
            text = f"{within}: missed by {late:.1f} s (done after {took:.1f} s)"
            return DeadlineStatus("missed", due, text)
        return DeadlineStatus("missed", due, f"{within}: missed (the job ended {state.status})")
    if now <= due:
        return DeadlineStatus("open", due, f"{within}: {due - now:.1f} s left")
    return DeadlineStatus("missed", due, f"{within}: missed by {now - due:.1f} s (still {state.status})")


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


class NoBidKind(StrEnum):
    """Why a job sent no bid for a window (``why_no_bid``), for code that branches on it."""

    ENDED = "ended"
    CANCELLING = "cancelling"
    UNCLAIMED = "unclaimed"
    HANDED_OUT = "handed out"
    """Every unit is handed out: it waits for its running subjobs."""
    AT_MAX_PARALLEL = "at max_parallel"
    AT_GPUS = "at its GPUs"
    NO_PROFILE = "no profile"
    TOO_LITTLE_MEMORY = "too little memory"
    """Its smallest subjob needs more memory than the window's slice holds."""
    TOO_SHORT = "too short"
    RULED_OUT = "ruled out"
    """An earlier subjob ran out of memory or time at this size here."""
    UNSAFE = "unsafe"
    SAT_OUT = "sat out"
    """It could have bid, and sat the round out (a grant in hand, or likely to win elsewhere)."""


class NoBid(NamedTuple):
    kind: NoBidKind
    text: str
    """The reason in words (``WindowReason.reason``)."""


def why_no_bid(state: JobState, window: Window, now: float, limits: PlanLimits) -> NoBid:
    """Why the job sent no bid for ``window`` at ``now``, from its state and its profile."""
    if is_terminal(state):
        return NoBid(NoBidKind.ENDED, f"the job had ended ({state.status})")
    if state.cancel_requested:
        return NoBid(NoBidKind.CANCELLING, "its cancellation was requested: it starts nothing new")
    if not state.owner_agent:
        return NoBid(NoBidKind.UNCLAIMED, "no agent had taken the job on yet")
    rng = next_range(state)
    if rng is None:
        return NoBid(NoBidKind.HANDED_OUT, "every unit is handed out: it waits for its running subjobs")
    running = len(state.in_flight)
    if running >= state.spec.max_parallel:
        return NoBid(
            NoBidKind.AT_MAX_PARALLEL,
            f"it is at its max_parallel ({state.spec.max_parallel}): {_plural(running, 'subjob')} running",
        )
    if capacity(state, window.compute_share) <= 0:
        return NoBid(
            NoBidKind.AT_GPUS,
            f"its subjobs hold {held_gpus(state):.2f} of its {gpu_budget(state.spec):g} GPUs: "
            f"a slice of {window.compute_share:.2f} of a GPU is more than it has left",
        )
    if state.profile is None:
        return NoBid(NoBidKind.NO_PROFILE, "it has no profile to plan with")
    profile = JobProfile.from_state(state.profile)
    req = plan_request(state, window, now, rng[1])
    k = req.min_units
    mem_cap = usable_memory(window, limits)
    need = profile.mem_quantile(k, 1.0 - req.eps_mem)
    if need > mem_cap:
        return NoBid(
            NoBidKind.TOO_LITTLE_MEMORY,
            (
                f"its smallest subjob ({_plural(k, 'unit')}) needs {need:,.0f} MiB at eps_mem "
                f"{req.eps_mem:g}{memory_basis(profile, k, 1.0 - req.eps_mem)}, and this "
                f"{window.profile} slice holds {window.mem_mib:,} MiB "
                f"({mem_cap:,.0f} usable after the {limits.mem_reserve_mib:,.0f} MiB reserve)"
            ),
        )
    length = usable_time(window, now, limits)
    took = profile.duration_quantile(k, 1.0 - req.eps_time, window.profile, window.compute_share)
    if took > length:
        return NoBid(
            NoBidKind.TOO_SHORT,
            (
                f"its smallest subjob ({_plural(k, 'unit')}) may take {took:.1f} s at eps_time "
                f"{req.eps_time:g} on {window.profile}, and the window gives {max(length, 0.0):.1f} s"
            ),
        )
    bound = profile.max_size_under_bounds(mem_cap, length, window.compute_share)
    if bound is not None and bound < k:
        return NoBid(
            NoBidKind.RULED_OUT,
            (
                "an earlier subjob ran out of memory or time at this size: "
                f"above {_plural(bound, 'unit')} is "
                f"ruled out here, and its smallest subjob is {_plural(k, 'unit')}"
            ),
        )
    size = largest_safe_size(profile, req, limits)
    if size is None:
        return NoBid(
            NoBidKind.UNSAFE, f"no size is safe here at eps_mem {req.eps_mem:g} and eps_time {req.eps_time:g}"
        )
    return NoBid(
        NoBidKind.SAT_OUT,
        (
            f"it could have bid ({_plural(size, 'unit')}) but sat the round out: a grant in hand, or "
            "likely to win another window of the same batch"
        ),
    )


def memory_basis(profile: JobProfile, k: int, q: float) -> str:
    """Why the memory a subjob of size ``k`` is planned for is what it is, when that is the
    declaration or the peaks seen rather than the learned profile (a clause, or "")."""
    need = profile.mem_quantile(k, q)
    dof = profile.evidence()[0]
    seen = sum(1 for _, _, bound in profile.mem.obs if bound <= 0.0)
    if profile.mem_bound is not None and need >= profile.mem_ceiling(k) and dof < EVIDENCE_MIN_DOF and seen:
        return (
            f" (its declaration: {_plural(seen, 'measured peak')} {'says' if seen == 1 else 'say'} too "
            "little of how its peaks vary between subjobs to plan it lower)"
        )
    if (
        dof >= EVIDENCE_MIN_DOF
        and need > profile.mem.upper(k, q) * (1 + 1e-9)
        and need < profile.mem_ceiling(k)
    ):
        return " (from how far apart its measured peaks and out-of-memory subjobs were)"
    return ""


@dataclass(frozen=True)
class MemoryOverrun:
    """Subjobs whose measured peak exceeded what the job declared for their size."""

    peak_mib: float
    """The largest of those peaks."""
    declared_mib: float
    """The declaration at that subjob's size."""
    subjobs: tuple[int, ...]
    """Their numbers in the job (``<job>.s<n>``), in order."""
    suggest_base_mib: float
    suggest_per_unit_mib: float
    """The smallest declaration of the same shape that holds every measured peak."""
    text: str


SUBJOBS_NAMED = 8
"""Subjob numbers a memory overrun names before it counts the rest."""


def memory_overrun(state: JobState) -> MemoryOverrun | None:
    """Whether any subjob measured a peak above the job's declaration at its size, in words: e.g.
    "measured 986 MiB, above the declared 400 MiB (subjobs 3, 4, 7): declare at least 986 MiB".
    ``None`` without a declaration or without such a subjob."""
    mem, _ = declarations(state.spec)
    base, per_unit = float(mem.base_mib), float(mem.per_unit_mib)
    if base <= 0.0 and per_unit <= 0.0:
        return None
    over: list[tuple[int, float, float]] = []
    for h in state.history:
        declared = base + per_unit * h.units
        if h.peak_mem_mib > declared:
            over.append((_subjob_number(h.subjob_id), h.peak_mem_mib, declared))
    if not over:
        return None
    over.sort()
    _, peak, at = max(over, key=lambda o: (o[1] / o[2] if o[2] > 0 else math.inf, o[1]))
    factor = max(o[1] / o[2] for o in over if o[2] > 0) if any(o[2] > 0 for o in over) else 1.0
    nums = [o[0] for o in over]
    named = ", ".join(str(n) for n in nums[:SUBJOBS_NAMED])
    if len(nums) > SUBJOBS_NAMED:
        named += f" and {len(nums) - SUBJOBS_NAMED} more"
    which = f"subjob {named}" if len(nums) == 1 else f"subjobs {named}"
    if per_unit <= 0.0:
        s_base, s_unit = float(math.ceil(max(o[1] for o in over))), 0.0
        declared_text, suggest = f"{base:,.0f} MiB", f"{s_base:,.0f} MiB"
    else:
        s_base = float(math.ceil(base * factor))
        s_unit = math.ceil(per_unit * factor * 100.0) / 100.0
        declared_text = f"{at:,.0f} MiB ({base:,.0f} + {per_unit:g} per unit)"
        suggest = f"{s_base:,.0f} MiB + {s_unit:g} MiB per unit"
    text = f"measured {peak:,.0f} MiB, above the declared {declared_text} ({which}): declare at least "
    text += suggest
    return MemoryOverrun(
        peak_mib=peak,
        declared_mib=at,
        subjobs=tuple(nums),
        suggest_base_mib=s_base,
        suggest_per_unit_mib=s_unit,
        text=text,
    )


def _subjob_number(subjob_id: str) -> int:
    _, _, tail = subjob_id.rpartition(".s")
    return int(tail) if tail.isdigit() else -1


def shape(window: Window) -> tuple[str, str, int]:
    return (window.pool, window.profile, window.mem_mib)


def window_reasons(state: JobState, records: Iterable[RoundRecord], limits: PlanLimits) -> list[WindowReason]:
    """What became of the job at the latest offer of each window shape in ``records``, largest
    memory first."""
    return [w for w, _ in _window_outcomes(state, records, limits)]


def _window_outcomes(
    state: JobState, records: Iterable[RoundRecord], limits: PlanLimits
) -> list[tuple[WindowReason, NoBid | None]]:
    """``window_reasons``, each with why the job sent no bid there (``None`` where it bid)."""
    latest: dict[tuple[str, str, int], RoundRecord] = {}
    for r in records:
        if r.opened_at < state.submitted_at:
            continue
        k = shape(r.window)
        got = latest.get(k)
        if got is None or (r.opened_at, r.round) > (got.opened_at, got.round):
            latest[k] = r
    out: list[tuple[WindowReason, NoBid | None]] = []
    for k in sorted(latest, key=lambda s: (-s[2], s[0], s[1])):
        r = latest[k]
        mine = next((v for v in r.verdicts if v.job_id == state.job_id), None)
        no_bid: NoBid | None = None
        if mine is not None:
            kind = verdict_kind(mine)
            outcome = str(kind)
            reason = mine.reason.removeprefix(f"{VerdictKind.WON}: ")
        else:
            outcome = "no_bid"
            no_bid = why_no_bid(state, r.window, r.opened_at, limits)
            reason = no_bid.text
        out.append(
            (
                WindowReason(
                    pool=r.window.pool,
                    profile=r.window.profile,
                    mem_mib=r.window.mem_mib,
                    slice_id=r.window.slice_id,
                    offer_id=r.offer_id,
                    opened_at=r.opened_at,
                    policy=r.policy,
                    outcome=outcome,  # type: ignore[arg-type]
                    reason=reason,
                ),
                no_bid,
            )
        )
    return out


def is_waiting(state: JobState) -> bool:
    """Whether the job is waiting for a window: not over, not being cancelled, and able to start
    another subjob."""
    return can_take_more(state)


def queue_order(policy: str, jobs: Sequence[JobState]) -> tuple[list[JobState], str]:
    """The waiting ``jobs`` in the order ``policy`` would likely serve them (its ``queue_key``
    against the service the jobs themselves hold, shares taken as equal; then the job id), and that
    order in words. A policy not known here orders them by submission."""
    pol = _policy(policy)
    ledger = Ledger()
    for s in jobs:
        tenant = s.spec.tenant
        ledger.tenant_attained[tenant] = ledger.tenant_attained.get(tenant, 0.0) + s.attained_gpu_s
        ledger.job_attained[s.job_id] = s.attained_gpu_s
    waiting = [s for s in jobs if is_waiting(s)]
    waiting.sort(key=lambda s: (*pol.queue_key(s, ledger), s.job_id))
    what = f"{policy}: " if policy else ""
    return waiting, what + pol.queue_order()


def summary(state: JobState, now: float) -> str:
    """The job's state in a sentence."""
    units = f"{state.units_done}/{state.total_units} units"
    if is_terminal(state):
        why = f": {state.error}" if state.error else ""
        return f"{state.status} ({units}){why}"
    running = len(state.in_flight)
    if state.cancel_requested:
        return f"being cancelled ({units}): waits for {_plural(running, 'running subjob')}"
    if not state.owner_agent:
        return (
            f"pending ({units}): no agent has taken it on yet (no agent running, or every one at "
            "SJA_MAX_JOBS)"
        )
    if running:
        left = "; it waits for a window for more" if is_waiting(state) else ""
        return f"{state.status} ({units}): {_plural(running, 'subjob')} running{left}"
    waited = now - state.submitted_at
    return f"{state.status} ({units}): waiting for a window ({waited:.0f} s since submission)"


def explain(
    state: JobState,
    records: Iterable[RoundRecord],
    jobs: Sequence[JobState],
    now: float,
    limits: PlanLimits,
) -> Explanation:
    """The job's state and, while it waits, why: per window shape of ``records`` (the rounds the
    job's pools cleared lately), and its place among the waiting ``jobs`` under the policy of the
    latest round."""
    records = list(records)
    latest = max(records, key=lambda r: (r.opened_at, r.round), default=None)
    policy = latest.policy if latest is not None else ""
    outcomes = _window_outcomes(state, records, limits) if not is_terminal(state) else []
    windows = [w for w, _ in outcomes]
    notes: list[str] = []
    position = waiting = 0
    order = ""
    if is_waiting(state):
        known = any(s.job_id == state.job_id for s in jobs)
        ranked, order = queue_order(policy, jobs if known else [*jobs, state])
        waiting = len(ranked)
        position = next(i for i, s in enumerate(ranked, 1) if s.job_id == state.job_id)
        if not records:
            notes.append("no round was cleared lately: no slice is free, or no advertiser is running")
        elif outcomes and all(
            nb is not None and nb.kind is NoBidKind.TOO_LITTLE_MEMORY for _, nb in outcomes
        ):
            largest = max(windows, key=lambda w: w.mem_mib)
            notes.append(
                f"the job fits none of the slices offered lately (the largest, {largest.profile}, "
                f"holds {largest.mem_mib:,} MiB): it cannot run until a larger one is offered"
            )
    note = deadline_note(policy, state.spec)
    if note is not None:
        notes.append(note)
    if state.due_at > 0 and not is_terminal(state):
        left = state.due_at - now
        by = f"to finish within {left:.0f} s" if left >= 0 else f"{-left:.0f} s past when it was to finish"
        notes.append(
            f"due against the rigid reference, {by}: it would finish more than "
            f"{DUE_SLACK:g} times later than under best-fit (or end its burst of work more than "
            f"{SPAN_SLACK:g} times later), so it comes before every job that is not due, earliest "
            "finish first, and no such job takes a slice it holds"
        )
    over = memory_overrun(state)
    if over is not None:
        notes.append(over.text)
    d = deadline_status(state, now)
    return Explanation(
        job_id=state.job_id,
        status=state.status,
        summary=summary(state, now),
        windows=windows,
        policy=policy,
        position=position,
        waiting=waiting,
        order=order,
        deadline=d.text if d is not None else "",
        notes=notes,
    )
