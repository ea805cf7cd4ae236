"""A job's life as pure transitions: admit its spec, materialize a subjob for a grant, apply a
completion (calibrating the profiles), finish, fail or cancel; and the unit ranges its subjobs take.
The agent service only moves these states between NATS and the KV store.

What a job bids for an offer is ``sja.core.bidding``; which agent owns it, and which of its subjobs
are given up for lost, ``sja.core.ownership``; the profiles a process holds for its jobs
``sja.core.profile_cache``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import msgspec

from sja.core import continuation
from sja.core.planner import (
    PlanLimits,
    PlanRequest,
    first_unit_s,
    largest_safe_size,
    materialize_size,
    plan_length,
)
from sja.core.policies import window_cost
from sja.core.profile_cache import ProfileCache, profile_of
from sja.core.profiles import JobProfile
from sja.core.windows import reachable_mib
from sja.protocol.messages import (
    Completion,
    Grant,
    InFlight,
    JobSpec,
    JobState,
    MemoryDecl,
    SliceState,
    Subjob,
    SubjobSummary,
    TimeDecl,
    UnitRange,
    Window,
    WorkloadFacts,
)
from sja.workloads import WORKLOADS, SpecError, trusted, workload
from sja.workloads.base import is_sequential
from sja.workloads.parts import add_part, count_parts

MAX_CONSECUTIVE_FAILURES = 8
"""A job whose subjobs fail this many times in a row (other than OOM/timeout) is failed."""
MAX_CONSECUTIVE_TIMEOUTS = 8
"""A job whose subjobs run out of time this many times with no subjob done between is failed, with
the reason ("timed out N times in a row: ..."): each timeout already made its next subjob smaller
(``JobProfile.observe_timeout``), so one that still times out will not finish by retrying."""
TIMEOUT_BACKOFF_S = 1.0
"""After its second timeout in a row a job waits this long before it bids again; twice as long
after each further one (``timeout_backoff_s``)."""
MAX_TIMEOUT_BACKOFF_S = 60.0

SUMMARY_ERROR_CHARS = 300
"""Characters of a subjob's error its summary keeps (the job's history holds many)."""
HISTORY_LIMIT = 500
DECLINED_KEPT = 16
"""Grants a job remembers declining (``JobState.declined_grants``)."""


def validate_spec(spec: JobSpec) -> tuple[JobSpec, int]:
    """Normalize a spec's parameters and return it with the job's total work units.

    A workload built into SJA is asked (``validate``, ``total_units``); whatever it raises, or returns
    that a job cannot hold (parameters that cannot be encoded, units that are not a positive integer),
    is a ``SpecError``. Any other workload is the tenant's code, which the control plane never runs:
    its facts come with the spec (``JobSpec.facts``)."""
    if not trusted(spec.workload):
        return _validate_declared(spec)
    w = workload(spec.workload)
    try:
        params = w.validate(dict(spec.params))
        sequential = is_sequential(w, params)
        total = w.total_units(params)
    except SpecError:
        raise
    except Exception as e:
        raise SpecError(
            "params", f"workload {spec.workload!r} refused them: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(params, dict):
        raise SpecError(
            "params", f"workload {spec.workload!r}: validate returned {type(params).__name__}, not a map"
        )
    try:
        msgspec.msgpack.encode(params)
    except (TypeError, OverflowError, ValueError) as e:
        raise SpecError("params", f"cannot be encoded ({type(e).__name__}: {e})") from None
    if isinstance(total, bool) or not isinstance(total, int) or not 1 <= total < 2**63:
        raise SpecError(
            "params", f"workload {spec.workload!r}: total_units gave {total!r}, not a positive integer"
        )
    _check_shape(spec, sequential, total)
    return msgspec.structs.replace(spec, params=params, facts=None), total


def _check_shape(spec: JobSpec, sequential: bool, total: int) -> None:
    if sequential and spec.max_parallel != 1:
        raise SpecError("max_parallel", f"workload {spec.workload} is sequential: max_parallel must be 1")
    if spec.gpus is not None and spec.gpus > spec.max_parallel:
        raise SpecError(
            "gpus",
            f"{spec.gpus:g} GPUs is more than its max_parallel ({spec.max_parallel}) subjobs can hold "
            "(each holds at most one GPU): raise max_parallel",
        )
    if spec.min_units > total:
        raise SpecError("min_units", f"{spec.min_units} is more than the job's {total} units")


def _validate_declared(spec: JobSpec) -> tuple[JobSpec, int]:
    """A tenant's workload: checked by what the spec states, without importing it."""
    facts = spec.facts
    if facts is None:
        raise SpecError(
            "facts",
            f"workload {spec.workload!r} is not built into SJA ({', '.join(sorted(WORKLOADS))}), and the "
            "control plane never runs a tenant's code: the submission states its facts (total_units, "
            "sequential; `sja submit` adds them from the workload installed where it runs)",
        )
    try:
        msgspec.msgpack.encode(spec.params)
    except (TypeError, OverflowError, ValueError) as e:
        raise SpecError("params", f"cannot be encoded ({type(e).__name__}: {e})") from None
    _check_shape(spec, facts.sequential, facts.total_units)
    return spec, facts.total_units


UNDECLARED_MEMORY = MemoryDecl(base_mib=512.0, per_unit_mib=0.0, rel_sd=0.5)
"""The prior of a tenant's workload whose facts bring none (as wide as ``command``'s)."""
UNDECLARED_TIME = TimeDecl(warmup_s=2.0, per_unit_s=1.0, rel_sd=1.0)


def declarations(spec: JobSpec) -> tuple[MemoryDecl, TimeDecl]:
    """The memory and time priors a job is planned by: the spec's own, else the workload's."""
    if trusted(spec.workload):
        w = workload(spec.workload)
        return spec.memory or w.declared_memory(spec.params), spec.time or w.declared_time(spec.params)
    facts = spec.facts or WorkloadFacts(total_units=1)
    return (
        spec.memory or facts.memory or UNDECLARED_MEMORY,
        spec.time or facts.time or UNDECLARED_TIME,
    )


def spec_sequential(spec: JobSpec) -> bool:
    """Whether the job passes its state from one subjob to the next."""
    if trusted(spec.workload):
        return is_sequential(workload(spec.workload), spec.params)
    return spec.facts is not None and spec.facts.sequential


def new_job(job_id: str, spec: JobSpec, now: float, *, window_s: float | None = None) -> JobState:
    """A submitted job's initial state, its profiles built from the declaration.

    The prior's reference scale is a typical subjob: an eighth of the job, or what fits one planning
    window (``window_s``) when that is less. Scaled by the whole job instead, a long job's prior
    would predict even a one-unit subjob to take a share of the whole runtime, and a job longer than
    a few dozen windows could never start.
    """
    spec, total = validate_spec(spec)
    mem, time = declarations(spec)
    typical = max(1, total // 8)
    if window_s is not None and window_s > 0:
        typical = max(1, min(typical, int(window_s / time.per_unit_s)))
    profile = JobProfile.from_declaration(mem, time, typical_units=typical)
    return JobState(
        job_id=job_id,
        spec=spec,
        total_units=total,
        submitted_at=now,
        profile=profile.to_state(),
    )


def largest_live(slices: Iterable[SliceState]) -> SliceState | None:
    """The slice ``never_fits`` measures a job against: the largest not offline (by the memory its
    GPU can give one instance, then compute share, then id), or ``None``. ``never_fits`` of it alone
    answers as of them all."""
    return max(
        (s for s in slices if s.status != "offline"),
        key=lambda s: (reachable_mib(s), s.compute_share, s.slice_id),
        default=None,
    )


def fit_key(s: SliceState) -> tuple[bool, int, int, float, str, str, str]:
    """What ``largest_live`` and ``never_fits`` read of a slice: a change that leaves it alone (a
    lease, its holder, its times) changes neither's answer."""
    return (
        s.status == "offline",
        s.mem_mib,
        s.recut_mib,
        s.compute_share,
        s.slice_id,
        s.profile,
        s.gpu_model,
    )


def never_fits(
    state: JobState, slices: Iterable[SliceState], limits: PlanLimits, *, profiles: ProfileCache | None = None
) -> str | None:
    """Why no slice of the inventory can ever hold the job's smallest subjob, or ``None``.

    Only a ceiling the job vouches for (its declared peak at ``min_units``) can say so: a job with
    no declaration measures first, and an empty inventory (none published yet) refuses nothing."""
    largest = largest_live(slices)
    if largest is None:
        return None
    profile = profile_of(state, profiles)
    need = profile.mem_ceiling(state.spec.min_units)
    reach = reachable_mib(largest)
    usable = reach - limits.mem_reserve_mib
    if need <= usable:
        return None
    return (
        f"the job's smallest subjob ({state.spec.min_units} unit(s)) declares a peak of {need:,.0f} MiB, "
        f"and the largest slice ({largest.profile} on {largest.gpu_model}, {largest.slice_id}) holds "
        f"{usable:,.0f} MiB usable ({reach:,} MiB less the {limits.mem_reserve_mib:,.0f} MiB "
        f"reserve): declare less memory per subjob (memory, min_units) or run it where a larger slice is"
    )


TERMINAL = frozenset(("done", "failed", "cancelled"))
"""The statuses a job never leaves."""


def is_terminal(state: JobState) -> bool:
    return state.status in TERMINAL


def units_remaining(state: JobState) -> int:
    """Units not yet completed (in flight included)."""
    return state.total_units - state.units_done


def next_range(state: JobState) -> tuple[int, int] | None:
    """The contiguous range the next subjob may take: a range to retry first, else fresh work."""
    if state.retry:
        r = state.retry[0]
        return r.start, r.count
    if state.next_unit < state.total_units:
        return state.next_unit, state.total_units - state.next_unit
    return None


SHARE_EPS = 1e-6
"""Rounding allowed when compute shares are added (a 4g and a 3g slice are 4/7 and 3/7)."""


def gpu_budget(spec: JobSpec) -> float:
    """The GPUs' worth of compute a job's subjobs may hold at once (``JobSpec.gpus``; one whole GPU
    per subjob, ``max_parallel``, when it does not say)."""
    return float(spec.max_parallel) if spec.gpus is None else min(spec.gpus, float(spec.max_parallel))


def held_gpus(state: JobState) -> float:
    """The compute its subjobs in flight hold: their slices' compute shares added."""
    return sum(f.compute_share for f in state.in_flight)


def reference_width(spec: JobSpec) -> int:
    """The whole GPUs a job runs on at once where it holds whole GPUs (the rigid reference's
    ``RigidJob.gpus``): its budget rounded up, at most ``max_parallel``."""
    return max(1, min(spec.max_parallel, math.ceil(gpu_budget(spec) - SHARE_EPS)))


def capacity(state: JobState, share: float = 1.0) -> int:
    """How many more subjobs on slices of ``share`` the job may start: the subjobs it may still run
    (``max_parallel`` less those in flight), and as many as the compute left of its budget takes.
    A job with nothing in flight may always start one (a budget under the slice's share is what
    one piece of it uses, not a reason to wait for a smaller slice)."""
    slots = state.spec.max_parallel - len(state.in_flight)
    if slots <= 0 or state.spec.gpus is None:
        return max(slots, 0)
    room = gpu_budget(state.spec) - held_gpus(state) + SHARE_EPS
    fits = max(0, min(slots, math.floor(room / max(share, SHARE_EPS))))
    return fits if state.in_flight else max(fits, 1)


def slots_left(state: JobState) -> int:
    """How many more slices the job may want at once: its subjobs left, and its budget left in whole
    GPUs (rounded up)."""
    slots = state.spec.max_parallel - len(state.in_flight)
    if slots <= 0 or state.spec.gpus is None:
        return max(slots, 0)
    room = gpu_budget(state.spec) - held_gpus(state)
    return max(0, min(slots, math.ceil(room - SHARE_EPS)))


def balanced_units(state: JobState, available: int, share: float = 1.0) -> int:
    """At most how many units the next subjob, on a slice of ``share``, takes of the ``available``
    ones: the work not yet handed out shared over the subjobs the job may still start, so that a job
    that may run ``p`` subjobs at once finishes them together instead of leaving one long piece to
    run alone at its end. Shared evenly over the subjobs left (``max_parallel`` less those in
    flight); for a job with a compute budget (``JobSpec.gpus``) at least in proportion to the slice's
    share of the budget left (a 4g slice of a one-GPU job takes 4/7 of the work, a 3g one the rest)."""
    unassigned = sum(r.count for r in state.retry) + max(state.total_units - state.next_unit, 0)
    slots = max(state.spec.max_parallel - len(state.in_flight), 1)
    even = -(-unassigned // slots)
    if state.spec.gpus is not None:
        room = gpu_budget(state.spec) - held_gpus(state)
        part = min(1.0, share / room) if room > SHARE_EPS else 1.0
        even = max(even, math.ceil(unassigned * part - SHARE_EPS))
    return max(1, min(available, even))


def timeout_backoff_s(timeouts_in_row: int) -> float:
    """How long a job waits before its next bid after ``timeouts_in_row`` timeouts with no subjob
    done between: nothing after the first (its profile plans smaller at once), then
    ``TIMEOUT_BACKOFF_S``, doubled after each further one, at most ``MAX_TIMEOUT_BACKOFF_S``."""
    if timeouts_in_row <= 1:
        return 0.0
    return min(TIMEOUT_BACKOFF_S * 2.0 ** (timeouts_in_row - 2), MAX_TIMEOUT_BACKOFF_S)


def can_take_more(state: JobState, share: float | None = None) -> bool:
    """Whether the job may start another subjob: on a slice of ``share`` (``capacity``), or on some
    slice (``None``: it has a subjob and compute left)."""
    if is_terminal(state) or state.cancel_requested or next_range(state) is None:
        return False
    if share is not None:
        return capacity(state, share) > 0
    return slots_left(state) > 0


def plan_request(state: JobState, offer_window: Any, now: float, max_units: int) -> PlanRequest:
    return PlanRequest(
        window=offer_window,
        now=now,
        eps_mem=state.spec.eps_mem,
        eps_time=state.spec.eps_time,
        max_units=max_units,
        min_units=min(state.spec.min_units, max_units),
        remaining_units=units_remaining(state),
    )


class Declined(StrEnum):
    """Why a grant became no subjob (``Materialized.reason``). The text is what logs, spans and the
    release request (``LeaseRelease.reason``) say."""

    ALREADY_MATERIALIZED = "grant already materialized"
    """The same grant delivered again (a replay): its subjob exists already."""
    ALREADY_DECLINED = "grant already declined"
    """Declined before, its slice given back then (and maybe granted again since)."""
    CANNOT_TAKE_MORE = "job cannot take more work now"
    NO_SAFE_SIZE = "no safe size left in the granted window"
    JOB_GONE = "job gone"
    """The agent no longer holds the job (finished, or another agent's now)."""
    NOT_OWNED = "job not owned here"
    """The grant names a job this agent does not hold."""


HANDLED_BEFORE = frozenset({Declined.ALREADY_MATERIALIZED, Declined.ALREADY_DECLINED})
"""Declines of a grant seen before: its slice was dealt with at its first delivery (it runs the
subjob, or was given back), so it is not given back again."""


def gives_slice_back(reason: Declined) -> bool:
    """Whether a grant declined for ``reason`` has its slice given back at once (``LeaseRelease``)
    rather than left to its subjob or to an earlier release."""
    return reason not in HANDLED_BEFORE


@dataclass(frozen=True)
class Materialized:
    state: JobState
    subjob: Subjob | None
    reason: Declined | None = None
    """Why there is no subjob (``None`` when there is one)."""


def materialize(
    state: JobState,
    grant: Grant,
    now: float,
    limits: PlanLimits,
    agent_id: str,
    *,
    profiles: ProfileCache | None = None,
    proof_key: bytes = b"",
) -> Materialized:
    """Cut the subjob for a granted window, sized with the latest profile, never larger than the
    proposal; or decline (the caller releases the lease). ``proof_key``: the subjob's secret
    (``sja.core.proofs``), kept in its ``InFlight`` and sent in the ``Subjob``."""
    if any(f.grant_id == grant.grant_id for f in state.in_flight):
        # The same grant delivered again (a replay): its subjob exists already.
        return Materialized(state, None, Declined.ALREADY_MATERIALIZED)
    if grant.grant_id in state.declined_grants:
        # Declined before, its slice given back (and maybe granted again since): never a subjob.
        return Materialized(state, None, Declined.ALREADY_DECLINED)
    seen = msgspec.structs.replace(
        state,
        grants_seen=state.grants_seen + 1,
        declined_grants=[*state.declined_grants, grant.grant_id][-DECLINED_KEPT:],
    )
    if not can_take_more(state, grant.window.compute_share):
        return Materialized(seen, None, Declined.CANNOT_TAKE_MORE)
    rng = next_range(state)
    assert rng is not None
    start, available = rng
    profile = profile_of(state, profiles)
    req = plan_request(state, grant.window, now, balanced_units(state, available, grant.window.compute_share))
    size = materialize_size(profile, req, limits, grant.candidate.size)
    if size is None:
        return Materialized(seen, None, Declined.NO_SAFE_SIZE)
    window = grant.window
    time_cap = plan_length(profile, req, limits) + limits.start_overhead_s
    first_unit = min(first_unit_s(profile, req), time_cap)
    mem_cap = window.mem_mib - limits.mem_reserve_mib
    max_units = 0
    if not state.bounded and continuation.continuable(yields(state.spec.workload), state.spec.params):
        # An open subjob: past its window it goes on while no other job wins the slice, through
        # its share of the work not handed out (the whole of it for a job of one subjob at a time).
        q = 1.0 - state.spec.eps_mem
        share = balanced_units(state, contiguous_from(state, start), window.compute_share)
        reach = continuation.open_units(size, share, lambda k: profile.mem_quantile(k, q), mem_cap)
        max_units = reach if reach > size else 0
    retry = list(state.retry)
    next_unit = state.next_unit
    if max_units:
        # Its open range is its own: the job's other subjobs are cut from what lies beyond.
        retry, next_unit = claim_units(retry, next_unit, start, start + max_units)
    elif retry:
        head = retry.pop(0)
        if head.count > size:
            retry.insert(0, UnitRange(start=head.start + size, count=head.count - size))
    else:
        next_unit = start + size
    seq = state.next_seq
    subjob = Subjob(
        subjob_id=f"{state.job_id}.s{seq}",
        seq=seq,
        job_id=state.job_id,
        tenant=state.spec.tenant,
        agent_id=agent_id,
        workload=state.spec.workload,
        params=state.spec.params,
        unit_start=start,
        units=size,
        grant_id=grant.grant_id,
        fence=grant.fence,
        slice_id=window.slice_id,
        node=window.node,
        mem_cap_mib=int(window.mem_mib - limits.mem_reserve_mib),
        time_cap_s=round(max(time_cap, 0.001), 6),
        planned_mem_q_mib=round(profile.mem_quantile(size, 1 - state.spec.eps_mem), 3),
        planned_duration_q_s=round(
            profile.duration_quantile(size, 1 - state.spec.eps_time, window.profile, window.compute_share),
            6,
        ),
        input_checkpoint=state.accumulator if _sequential(state) else b"",
        created_at=now,
        slice_revision=grant.slice_revision,
        slice_state=grant.slice_state,
        attempt=attempt_of(state, start),
        proof_key=proof_key,
        first_unit_s=round(max(first_unit, 0.0), 6),
        max_units=max_units,
        attained_gpu_s=round(state.attained_gpu_s + window_cost(window, grant.candidate), 6),
        submitted_at=state.submitted_at,
        due_at=state.due_at,
    )
    flight = InFlight(
        subjob_id=subjob.subjob_id,
        grant_id=grant.grant_id,
        slice_id=window.slice_id,
        unit_start=start,
        units=size,
        dispatched_at=now,
        time_cap_s=subjob.time_cap_s,
        profile=window.profile,
        compute_share=window.compute_share,
        planned_mem_q_mib=subjob.planned_mem_q_mib,
        planned_duration_q_s=subjob.planned_duration_q_s,
        proof_key=proof_key,
        max_units=max_units,
    )
    new_state = msgspec.structs.replace(
        state,
        status="running",
        first_started_at=state.first_started_at if state.first_started_at is not None else now,
        retry=retry,
        next_unit=next_unit,
        in_flight=[*state.in_flight, flight],
        next_seq=seq + 1,
        rounds_won=state.rounds_won + 1,
        grants_seen=state.grants_seen + 1,
        attained_gpu_s=state.attained_gpu_s + window_cost(window, grant.candidate),
    )
    return Materialized(new_state, subjob)


def apply_completion(
    state: JobState, c: Completion, now: float, *, profiles: ProfileCache | None = None
) -> tuple[JobState, bool]:
    """Fold a completion into the job. Returns ``(state, applied)``; a completion for a subjob not in
    flight (a duplicate or a stale one) changes nothing."""
    flight = next((f for f in state.in_flight if f.subjob_id == c.subjob_id), None)
    if flight is None or flight.grant_id != c.grant_id:
        return state, False
    in_flight = [f for f in state.in_flight if f.subjob_id != c.subjob_id]
    profile_name, compute_share = flight.profile, flight.compute_share
    profile = profile_of(state, profiles).copy()  # updated below: a copy of its own
    retry = list(state.retry)
    acc = state.accumulator
    units_done = state.units_done
    failures = state.attempt_failures
    timeouts, bids_again_at = state.timeouts_in_row, state.bids_again_at
    error = state.error
    merge_error = ""
    gave_up = ""
    done = c.units
    next_unit = state.next_unit
    bounded = state.bounded
    attained = state.attained_gpu_s
    if flight.max_units > flight.units:
        # An open subjob held its slice past its window: that time is service it attained too.
        attained += max(0.0, c.duration_s - flight.time_cap_s) * flight.compute_share
    held = held_units(flight)
    if c.status == "ok":
        done = c.units_done if 0 < c.units_done < c.units else c.units
        if flight.max_units > flight.units and c.units_done > flight.units:
            # An open subjob that went on past its window: it did units beyond its planned range.
            done = min(c.units_done, flight.max_units)
        if done < held:
            # Stopped early (it said how far it got), or an open subjob asked to yield: the rest
            # of its range is planned again.
            retry.append(UnitRange(start=flight.unit_start + done, count=held - done))
            retry.sort(key=lambda r: r.start)
        if spec_sequential(state.spec):
            acc = c.output_checkpoint
        else:
            try:
                acc = (
                    workload(state.spec.workload).merge(acc, c.output_checkpoint)
                    if trusted(state.spec.workload)
                    # A tenant's merge is its code: the parts are kept, in unit order, and merged
                    # where the result is fetched (``sja result``), not in the agent.
                    else add_part(acc, c.unit_start, c.output_checkpoint)
                )
                if not isinstance(acc, bytes):
                    raise TypeError(f"merge returned {type(acc).__name__}, not bytes")
            except Exception as e:
                acc = state.accumulator
                merge_error = f"the workload's merge failed: {type(e).__name__}: {str(e)[:1000]}"
        units_done += done
        profile.observe(done, c.peak_mem_mib, c.duration_s, profile_name, compute_share, c.mem_cap_mib)
        if not (state.cancel_requested and failures >= MAX_CONSECUTIVE_FAILURES):
            failures = 0  # else the job has failed (``_fail_now``): it ends so once in flight is done
            timeouts, bids_again_at = 0, 0.0
    else:
        retry.append(UnitRange(start=flight.unit_start, count=held))
        retry.sort(key=lambda r: r.start)
        if c.status == "oom":
            profile.observe_oom(c.units, c.mem_cap_mib, c.peak_mem_mib)
        elif c.status == "timeout" and c.yielded:
            # An open subjob that ran past its window and did not stop at a unit boundary when
            # asked to yield: its program does not honour SIGTERM; from now on it gets exactly its
            # planned ranges (its window was not too short: no time profile lesson).
            bounded = True
            error = c.error or c.status
        elif c.status == "timeout":
            profile.observe_timeout(c.units, c.time_cap_s, profile_name, compute_share)
            # Timeouts count toward giving up, and each one more makes the job wait longer to bid.
            timeouts += 1
            error = c.error or c.status
            bids_again_at = max(bids_again_at, now + timeout_backoff_s(timeouts))
            if timeouts >= MAX_CONSECUTIVE_TIMEOUTS:
                gave_up = f"timed out {timeouts} times in a row: {error[:SUMMARY_ERROR_CHARS]}"
        elif c.status == "failed":
            # Only the workload's own failures count toward giving up; a subjob lost to the
            # infrastructure (lease lapsed, executor died) is simply planned again.
            failures += 1
            error = c.error or c.status
            if c.final:
                # What the job names is missing where it runs: trying again would fail the same way.
                gave_up = error
        # ``lost`` (the infrastructure lost the subjob: a lease lapsed, an executor died) and
        # ``cancelled`` are not the job's error: the range is planned again and the subjob's own
        # entry in the history keeps why it ended.
    summary = SubjobSummary(
        subjob_id=c.subjob_id,
        slice_id=c.slice_id,
        profile=profile_name,
        status=c.status,
        unit_start=c.unit_start,
        units=done,  # a subjob that stopped early: the units it kept (the rest is planned again)
        planned_mem_q_mib=flight.planned_mem_q_mib,
        peak_mem_mib=c.peak_mem_mib,
        mem_cap_mib=c.mem_cap_mib,
        planned_duration_q_s=flight.planned_duration_q_s,
        duration_s=c.duration_s,
        time_cap_s=c.time_cap_s,
        started_at=c.started_at,
        finished_at=c.finished_at,
        error="" if c.status == "ok" else c.error[:SUMMARY_ERROR_CHARS],
    )
    history = [*state.history, summary][-HISTORY_LIMIT:]
    calibrated = profile.to_state()
    if profiles is not None:
        profiles.keep(
            state.job_id, calibrated, profile
        )  # fitted already: the next proposal need not refit it
    new = msgspec.structs.replace(
        state,
        in_flight=in_flight,
        retry=retry,
        next_unit=next_unit,
        bounded=bounded,
        attained_gpu_s=attained,
        accumulator=acc,
        units_done=units_done,
        profile=calibrated,
        history=history,
        attempt_failures=failures,
        timeouts_in_row=timeouts,
        bids_again_at=bids_again_at,
        error=error,
    )
    if gave_up and not state.cancel_requested:
        return _fail_now(new, gave_up, now), True
    if merge_error:
        # The contract makes merge deterministic: trying the range again would fail the same way.
        return _fail_now(new, merge_error, now), True
    return settle(new, now), True


def _fail_now(state: JobState, reason: str, now: float) -> JobState:
    """The job failed with ``reason``: finished at once if nothing is in flight, else cancelled so
    that what is in flight ends it (``settle``)."""
    state = msgspec.structs.replace(state, error=reason, attempt_failures=MAX_CONSECUTIVE_FAILURES)
    if state.in_flight:
        return msgspec.structs.replace(state, cancel_requested=True)
    return msgspec.structs.replace(state, status="failed", finished_at=now)


def yields(name: str) -> bool:
    """Whether the workload's runs stop at a unit boundary when asked (``Workload.yields``); a
    tenant's own workload is never imported here (it runs its range to the end)."""
    return trusted(name) and bool(getattr(workload(name), "yields", False))


def contiguous_from(state: JobState, start: int) -> int:
    """How many units from ``start`` (the range the next subjob takes, ``next_range``) are waiting
    without a gap: a range to retry, continued by the fresh work after it when it ends there."""
    retry = sorted(state.retry, key=lambda r: r.start)
    end = start
    for r in retry:
        if r.start <= end < r.start + r.count:
            end = r.start + r.count
    if state.next_unit <= end:
        end = max(end, state.total_units)
    return max(end - start, 0)


def held_units(flight: InFlight) -> int:
    """How many units from its start a subjob in flight holds: its open range (``max_units``), else
    its planned range. What it does not report done goes back to be planned again."""
    return flight.max_units if flight.max_units > flight.units else flight.units


def claim_units(retry: list[UnitRange], next_unit: int, lo: int, hi: int) -> tuple[list[UnitRange], int]:
    """``retry`` and ``next_unit`` with the units ``[lo, hi)`` taken out: an open subjob holds them
    (``materialize``)."""
    out: list[UnitRange] = []
    for r in retry:
        a, b = r.start, r.start + r.count
        if b <= lo or a >= hi:
            out.append(r)
            continue
        if a < lo:
            out.append(UnitRange(start=a, count=lo - a))
        if b > hi:
            out.append(UnitRange(start=hi, count=b - hi))
    return sorted(out, key=lambda r: r.start), max(next_unit, hi)


def _sequential(state: JobState) -> bool:
    return spec_sequential(state.spec)


def attempt_of(state: JobState, unit_start: int) -> int:
    """Earlier tries of a range starting at ``unit_start`` that did not complete."""
    return sum(1 for h in state.history if h.unit_start == unit_start and h.status != "ok")


def settle(state: JobState, now: float) -> JobState:
    """Move a job to a terminal status when nothing more can happen to it."""
    if is_terminal(state) or state.in_flight:
        return state
    if state.attempt_failures >= MAX_CONSECUTIVE_FAILURES:
        return msgspec.structs.replace(
            state, status="failed", finished_at=now, error=f"{state.error} (gave up)"
        )
    if state.cancel_requested:
        return msgspec.structs.replace(state, status="cancelled", finished_at=now)
    if state.units_done >= state.total_units:
        result, why = safe_finalize(state)
        if why:
            return msgspec.structs.replace(state, status="failed", finished_at=now, error=why)
        # A job that finished did not fail: what went wrong on the way (a timeout, a failed try)
        # stays in its subjobs' history, not as the job's error.
        return msgspec.structs.replace(state, status="done", finished_at=now, result=result, error="")
    return state


def safe_finalize(state: JobState) -> tuple[dict[str, Any], str]:
    """The job's result, or why there is none: the workload's ``finalize`` raised, or returned what a
    job state cannot hold (not a map, or values MessagePack cannot encode: an int past 64 bits)."""
    try:
        result = finalize(state)
    except Exception as e:
        return {}, f"the workload's finalize failed: {type(e).__name__}: {str(e)[:1000]}"
    if not isinstance(result, dict):
        return {}, f"the workload's finalize returned {type(result).__name__}, not a map"
    try:
        msgspec.msgpack.encode(result)
    except (TypeError, OverflowError, ValueError, RecursionError) as e:
        return {}, f"the workload's result cannot be encoded ({type(e).__name__}: {str(e)[:300]})"
    return result, ""


def hopeless(
    state: JobState, best: Window, now: float, limits: PlanLimits, *, profiles: ProfileCache | None = None
) -> str | None:
    """Why the job can never run again, or ``None``.

    A job whose last subjob, already at the smallest size it may be cut to, ran out of memory or
    time, and which no longer has a safe size even in ``best`` (the largest window offered: its
    slice open-ended, so as long as a plan may be) would wait for ever: nothing it learns from
    waiting changes that. Without such a failure a job that fits nowhere yet stays pending, as a
    pod too large for every node does.
    """
    if is_terminal(state) or state.in_flight or state.cancel_requested or not state.history:
        return None
    last = state.history[-1]
    if last.status not in ("oom", "timeout"):
        return None  # the common case, checked first: the agent asks for every idle job each second
    rng = next_range(state)
    if rng is None:
        return None
    req = plan_request(state, best, now, rng[1])
    if last.units > req.min_units:
        return None
    if largest_safe_size(profile_of(state, profiles), req, limits) is not None:
        return None
    what = (
        f"ran out of memory ({last.mem_cap_mib} MiB)"
        if last.status == "oom"
        else f"ran out of time ({last.time_cap_s:.1f} s)"
    )
    return (
        f"{last.units} unit(s), the smallest subjob the job allows, {what}, and no size is safe "
        f"even in the largest window offered ({best.profile}, {best.mem_mib} MiB, "
        f"{limits.horizon_s:.0f} s planning horizon): cut the work finer (min_units, units) or "
        f"raise the horizon"
    )


def give_up(state: JobState, reason: str, now: float) -> JobState:
    return msgspec.structs.replace(state, status="failed", finished_at=now, error=reason)


def finalize(state: JobState) -> dict[str, Any]:
    if trusted(state.spec.workload):
        return workload(state.spec.workload).finalize(state.spec.params, state.accumulator)
    # A tenant's finalize is its code: ``sja result`` runs it where the result is fetched.
    if spec_sequential(state.spec):
        return {"units_done": state.units_done, "state_bytes": len(state.accumulator), "result": "sja result"}
    return {"units_done": state.units_done, "parts": count_parts(state.accumulator), "result": "sja result"}


def request_cancel(state: JobState, now: float) -> JobState:
    if is_terminal(state):
        return state
    return settle(msgspec.structs.replace(state, cancel_requested=True), now)
