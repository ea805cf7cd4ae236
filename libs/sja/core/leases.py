"""Slice lease transitions: grant, start, extend, release, expire. Pure; callers CAS the result.

A slice's ``fence`` is bumped by every grant and never goes down; each transition after the grant
checks the holder's ``grant_id`` and ``fence``, so a stale holder cannot touch a slice it lost.
"""

from __future__ import annotations

from enum import StrEnum

import msgspec

from sja.core.continuation import is_contestable
from sja.protocol.messages import SliceState


class LeaseConflict(Exception):
    """The slice is not in the state the transition expects (someone else got there first)."""


def grant(
    s: SliceState, *, offered_fence: int, job_id: str, grant_id: str, now: float, lease_s: float
) -> SliceState:
    """Lease a free slice to ``grant_id``; or a busy one whose holder continues past its window
    (``preempts``): the holder is then asked to yield (``core.continuation``)."""
    if s.status != "free" and not preempts(s, now):
        raise LeaseConflict(f"slice {s.slice_id} is {s.status}")
    if s.fence != offered_fence:
        raise LeaseConflict(f"slice {s.slice_id} fence moved {offered_fence} -> {s.fence}")
    return msgspec.structs.replace(
        s,
        status="leased",
        fence=s.fence + 1,
        holder_job=job_id,
        grant_id=grant_id,
        lease_until=now + lease_s,
        expected_end=0.0,
        contestable_at=0.0,
        holder_attained_gpu_s=0.0,
        holder_tenant="",
        holder_submitted_at=0.0,
        holder_due_at=0.0,
        updated_at=now,
    )


def preempts(s: SliceState, now: float) -> bool:
    """Whether a grant of ``s`` at ``now`` takes it from a holder that continues past its window."""
    return s.status == "busy" and is_contestable(s.contestable_at, now)


def holds(s: SliceState, grant_id: str, fence: int) -> bool:
    return s.grant_id == grant_id and s.fence == fence and s.status in ("leased", "busy")


def carried_lease(
    grant_id: str, fence: int, slice_id: str, job_id: str, leased: SliceState | None
) -> bool | None:
    """Whether the lease a grant carries (``Grant.slice_state``, as the clearer wrote it) is the lease
    the grant names; ``None`` if it carries none (a reader must then look at the slice itself).

    A grant whose own fields disagree with its lease is not the clearer's (edited or corrupted) and
    is refused without a read. One that agrees may still be old (a replay of a grant whose lease
    has since moved on): executors admit a subjob only against the slice's current lease (``admit``,
    by compare-and-set), so such a grant's subjob is reported ``lost`` and never runs."""
    if leased is None:
        return None
    return (
        leased.slice_id == slice_id
        and leased.status == "leased"
        and leased.holder_job == job_id
        and holds(leased, grant_id, fence)
    )


def start(
    s: SliceState,
    *,
    grant_id: str,
    fence: int,
    now: float,
    time_cap_s: float,
    expected_s: float,
    grace_s: float,
    contestable_at: float = 0.0,
    holder_attained_gpu_s: float = 0.0,
    holder_tenant: str = "",
    holder_submitted_at: float = 0.0,
    holder_due_at: float = 0.0,
) -> SliceState:
    """The slice busy with the grant's subjob until its time cap and grace. ``contestable_at``: an
    open subjob's slice is offered again from then on (``core.continuation``), its holder's job
    having attained ``holder_attained_gpu_s``."""
    if not holds(s, grant_id, fence) or s.status != "leased":
        raise LeaseConflict(f"slice {s.slice_id} not leased to grant {grant_id} (fence {fence})")
    return msgspec.structs.replace(
        s,
        status="busy",
        lease_until=now + time_cap_s + grace_s,
        expected_end=now + expected_s,
        contestable_at=contestable_at,
        holder_attained_gpu_s=max(0.0, holder_attained_gpu_s) if contestable_at > 0 else 0.0,
        holder_tenant=holder_tenant if contestable_at > 0 else "",
        holder_submitted_at=max(0.0, holder_submitted_at) if contestable_at > 0 else 0.0,
        holder_due_at=max(0.0, holder_due_at) if contestable_at > 0 else 0.0,
        updated_at=now,
    )


def covers(s: SliceState, *, now: float, time_cap_s: float, grace_s: float) -> bool:
    """Whether the slice's granted lease already lasts for a run started at ``now``: through its time
    cap and the grace past it, as far as ``start`` would extend it. Such a run starts without
    marking the slice busy (there is nothing to extend), and no one else can be granted the slice
    before the run is over."""
    return s.status == "leased" and now + time_cap_s + grace_s <= s.lease_until


def extend(s: SliceState, *, grant_id: str, fence: int, now: float, lease_s: float) -> SliceState:
    """The holder keeps its lease until at least ``now + lease_s`` (a lease is never shortened)."""
    if not holds(s, grant_id, fence):
        raise LeaseConflict(f"slice {s.slice_id} not held by grant {grant_id} (fence {fence})")
    return msgspec.structs.replace(s, lease_until=max(s.lease_until, now + lease_s), updated_at=now)


def release(s: SliceState, *, grant_id: str, fence: int, now: float) -> SliceState:
    """The holder gives the slice back (subjob finished, or grant declined)."""
    if not holds(s, grant_id, fence):
        raise LeaseConflict(f"slice {s.slice_id} not held by grant {grant_id} (fence {fence})")
    return _freed(s, now)


LEASED = frozenset({"leased", "busy"})
"""The statuses of a slice under a lease (``lease_until`` says until when)."""


def expire(s: SliceState, now: float) -> SliceState | None:
    """The freed slice when its lease ran out, else ``None``."""
    if s.status in LEASED and s.lease_until < now:
        return _freed(s, now)
    return None


def _freed(s: SliceState, now: float) -> SliceState:
    return msgspec.structs.replace(
        s,
        status="free",
        holder_job="",
        grant_id="",
        lease_until=0.0,
        expected_end=0.0,
        contestable_at=0.0,
        holder_attained_gpu_s=0.0,
        holder_tenant="",
        holder_submitted_at=0.0,
        holder_due_at=0.0,
        updated_at=now,
    )


def merge_declared(current: SliceState | None, declared: SliceState, now: float) -> SliceState | None:
    """Reconcile a discovered slice with what the store holds; ``None`` when nothing changes.

    Lease fields (status, fence, holder) survive a restart of the inventory; static fields follow the
    discovery. An offline slice that reappears comes back free.
    """
    if current is None:
        return msgspec.structs.replace(declared, updated_at=now)
    static = msgspec.structs.replace(
        current,
        node=declared.node,
        pool=declared.pool,
        gpu_index=declared.gpu_index,
        gpu_model=declared.gpu_model,
        gpu_uuid=declared.gpu_uuid,
        profile=declared.profile,
        mem_mib=declared.mem_mib,
        compute_slots=declared.compute_slots,
        compute_share=declared.compute_share,
        placement_start=declared.placement_start,
        source=declared.source,
        recut_mib=declared.recut_mib,
    )
    if static.status == "offline":
        static = _freed(static, now)
    if static == current:
        return None
    return msgspec.structs.replace(static, updated_at=now)


def offline(s: SliceState, now: float) -> SliceState:
    return msgspec.structs.replace(
        s, status="offline", holder_job="", grant_id="", lease_until=0.0, updated_at=now
    )


class Admission(StrEnum):
    """What an executor does with a delivered subjob (``admit``)."""

    RUN = "run"
    """Start it."""
    STALE = "stale"
    """The lease lapsed or moved on: never run it."""
    INTERRUPTED = "interrupted"
    """An earlier delivery may have started it and its executor died (the slice is busy with this
    very grant, or the subjob is delivered again while the grant still holds the slice)."""
    UNKNOWN = "unknown"
    """The slice is not this executor's."""
    MOVED = "moved"
    """Not ``admit``'s: the slice kept changing under the executor's compare-and-set
    (``execution.slicelease``); look again later."""


def admit(
    s: SliceState | None, *, grant_id: str, fence: int, known: bool, redelivered: bool = False
) -> Admission:
    """What an executor does with a delivered subjob, given the slice's current state.

    ``redelivered``: the subjob was delivered before. A run its lease ``covers`` starts without a
    write, so a lease still held under the grant cannot tell a run that never started from one whose
    executor died mid-run: a subjob delivered again is never run twice, it is ``interrupted``
    (reported lost, its units planned again)."""
    if s is None or not known:
        return Admission.UNKNOWN
    if not holds(s, grant_id, fence):
        return Admission.STALE
    if s.status == "busy" or redelivered:
        return Admission.INTERRUPTED
    return Admission.RUN
