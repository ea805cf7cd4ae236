"""Continuation and yield: a subjob goes on past its window while no other job wins its slice.

Cutting a job into subjobs costs each subjob its start-up (interpreter, framework, model, state
read) and its state written at the end. A scheduler that stops a job only at a unit boundary need not
pay that while nobody else wants the slice. The rule, which the services and the simulator both
apply:

1. **Open subjobs.** A subjob whose program stops at a unit boundary when asked (the ``command``
   contract's ``SIGTERM``, the SDK's ``should_stop``) is *open*: it is planned, sized and charged
   for its window like any subjob (``Subjob.units``), and may go on past it through its *open
   range* (``Subjob.max_units``): the rest of its contiguous range for a job that runs one subjob at
   a time; for a job that may run ``p`` at once, its even share of the work not yet handed out (the
   work left over the subjobs it may still start), so that its subjobs continue side by side. The
   range is held from the moment the subjob is cut (the job's other subjobs are cut from what lies
   beyond), and what the subjob does not report done is planned again. It ends as far as the job's
   memory quantile still fits the slice (a job whose memory grows with the units it does is held to
   what the slice can take).
2. **Continuation.** Once the subjob's window has passed (``SliceState.contestable_at``), its slice
   is offered again, naming its holder (``Window.held_by``). The holder's job does not bid for it:
   while no other job wins the slice, the holder continues in the same process, with no new
   start-up and no state round trip.
3. **Yield.** When another job wins the slice, the holder is asked to yield at once (``SIGTERM``,
   ``should_stop``): it finishes its current unit, writes its state, reports how far it got and
   exits; the winner's subjob starts on the slice as soon as it has. A holder that does not stop is
   killed ``yield_grace_s`` after the request; what it had not reported is planned again.

A subjob is never asked to yield before its own window is over: the window it won is its to use.
And a waiting job takes a held slice only from a job after it in the order of service
(``takes_held``, ``service_key``: attained service, less ``AGEING`` for the time in the system): a
newcomer takes a slice from a job that has had its window, while a job that has had more than the
holder's job waits for a free slice or a holder later in that order, as the ``fair`` policy ranks
them. Jobs that do not contend keep their slices: a window's end is a decision only
where a waiting job may take the slice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

AGEING = 0.3
"""GPU-seconds of service a job is forgiven for every second it has been in the system, in the order
of service (``service_key``): among jobs of one tenant, and where a waiting job may take a held
slice. Without it, least attained service alone serves last the longest jobs and the multi-GPU ones
(which attain service fastest), so the end of a loaded trace is such a job alone; with it, a job
that has had an hour more service than a newcomer but was submitted more than 3.3 hours earlier is
served first. On the evaluation grid (seed 0, 54 cells) 0.3 took makespan misses from 24 cells to
20 and mean JCT misses from 27 to 23; 1.0 made newcomers wait behind long jobs (openb's short
pods: p99 rho up to 190)."""


def continuable(yields: bool, params: dict[str, Any] | None = None) -> bool:
    """Whether a job's subjobs are open (may continue past their window): its workload ``yields``
    (its runs stop at a unit boundary when asked: the ``command`` contract's ``SIGTERM`` handler and
    the SDK's ``should_stop``, a ``Workload.yields``; a Python workload's ``run`` is given its range
    and runs it to the end). A job may opt out with ``params.continue: false`` (its program then
    gets exactly its planned range)."""
    if not yields:
        return False
    return not (params is not None and params.get("continue") is False)


def open_units(
    planned: int, contiguous: int, mem_quantile: Callable[[int], float], mem_cap_mib: float
) -> int:
    """How many units an open subjob may do: at least its ``planned`` size, at most the
    ``contiguous`` units from its start, and no more than the largest count whose memory quantile
    (``mem_quantile(k)``, non-decreasing in ``k``) fits the slice's ``mem_cap_mib``."""
    hi = max(planned, contiguous)
    if hi <= planned or mem_quantile(hi) <= mem_cap_mib:
        return hi
    lo = planned  # fits (the planner sized it); find the largest k in [lo, hi) that fits
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if mem_quantile(mid) <= mem_cap_mib:
            lo = mid
        else:
            hi = mid
    return lo


def contestable_at(started_at: float, time_cap_s: float, max_units: int, units: int) -> float:
    """When the slice of a subjob started at ``started_at`` is offered again while it runs: at the end
    of its window for an open subjob, never for a bounded one (0)."""
    return started_at + time_cap_s if max_units > units else 0.0


def held_attained(
    holder_attained_gpu_s: float, contestable_at: float, compute_share: float, now: float
) -> float:
    """The holder's attained service at ``now``: as when its subjob started (its window charged),
    with the time it has held the slice past the window."""
    return holder_attained_gpu_s + max(0.0, now - contestable_at) * compute_share


DUE_KEY = -1e13
"""The service key of a due job less its due time: below every key of a job that is not due (a
job's attained GPU-seconds and ``AGEING`` times its submission's Unix time are far smaller), and
exact to a millisecond between due jobs."""


def service_key(attained_gpu_s: float, submitted_at: float, due_at: float = 0.0) -> float:
    """A job's place in the order of service, least first: its attained service, less ``AGEING``
    GPU-seconds for every second it has been in the system (all jobs age alike, so the order is
    the same at every instant and the key counts from its submission instead). A job that is due
    (``due_at`` > 0, the instant it is due to finish by: it would finish too late against the rigid
    reference, ``core.shadow``) comes before every job that is not, earliest first."""
    if due_at > 0.0:
        return DUE_KEY + due_at
    return attained_gpu_s + AGEING * submitted_at


def takes_held(waiting_key: float, held_key: float) -> bool:
    """Whether a job of ``service_key`` ``waiting_key`` bids for a slice held past its window by a
    job of ``service_key`` ``held_key`` (``Window.held_attained_gpu_s``, ``held_submitted_at``)."""
    return waiting_key < held_key


def is_contestable(contestable: float, now: float) -> bool:
    """Whether a held slice with ``contestable`` (``SliceState.contestable_at``) is offered at ``now``."""
    return 0.0 < contestable <= now


def yield_grace_for(params: dict[str, Any], first_unit_s: float, default_stop_grace_s: float) -> float:
    """``yield_grace_s`` for a subjob with ``params`` (its ``stop_grace_s``, when a number)."""
    wanted = params.get("stop_grace_s", default_stop_grace_s)
    if isinstance(wanted, bool) or not isinstance(wanted, int | float):
        wanted = default_stop_grace_s
    return yield_grace_s(float(wanted), first_unit_s)


def yield_grace_s(stop_grace_s: float, first_unit_s: float) -> float:
    """How long a holder asked to yield has before it is killed: the job's stop grace (to write its
    state) plus its planned start-up and first unit (``Subjob.first_unit_s``: at most one unit to
    finish, or a start-up still under way)."""
    return max(0.0, stop_grace_s) + max(0.0, first_unit_s)


__all__ = [
    "contestable_at",
    "continuable",
    "held_attained",
    "is_contestable",
    "open_units",
    "service_key",
    "takes_held",
    "yield_grace_for",
    "yield_grace_s",
]
