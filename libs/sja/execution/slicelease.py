"""An executor's side of a slice's lease: admit a delivered subjob (marking its slice busy when the
grant's lease does not already cover the run), then free the slice when the subjob is over, each
with at most one compare-and-set when nothing else touched the slice in between.

A subjob carries the slice as its grant leased it (``Subjob.slice_state`` at ``slice_revision``).
When that lease lasts through the run's time cap and grace (``leases.covers``: a short subjob
delivered promptly), the run starts with no write at all: nobody can be granted the slice before
the lease ends, and freeing it is a compare-and-set against the grant's own revision, which fails
if anything touched the slice meanwhile. Otherwise the slice is marked busy (its lease extended
for the run) by a compare-and-set against that revision, which succeeds only if the slice is still
exactly that lease, so the admission is decided without reading the slice first. When the slice
changed since (the lease lapsed, an older agent sent no snapshot) the slice is read and
``leases.admit`` decides as before. A subjob delivered again is never run twice (``admit``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sja.bus.store import KvStore
from sja.core import continuation, leases
from sja.protocol.messages import SliceState, Subjob


@dataclass(frozen=True)
class Held:
    """The slice as this executor last wrote it, and the revision that write made."""

    state: SliceState
    revision: int


@dataclass(frozen=True)
class Admitted:
    verdict: leases.Admission
    """``run``, ``stale``, ``interrupted``, ``unknown`` (``leases.admit``), or ``moved``: the slice
    changed under the compare-and-set (look again later)."""
    held: Held | None = None


async def start(
    slices: KvStore[SliceState],
    sj: Subjob,
    *,
    known: bool,
    grace_s: float,
    now: float | None = None,
    redelivered: bool = False,
    started: dict[str, int] | None = None,
    tries: int = 3,
) -> Admitted:
    """Admit ``sj`` on its slice and, if it may run, mark the slice busy with it unless the grant's
    lease covers the run already (``leases.covers``). ``redelivered``: the subjob was delivered
    before (``leases.admit``). ``started``: the highest fence this executor admitted a run at, per
    slice (updated here). Only a subjob above it may start without a write: a subjob published
    again (not a redelivery, so not caught by ``redelivered``) carries its grant's lease too, and is
    then admitted by compare-and-set, which only one delivery can win. Without ``started`` every run
    marks its slice busy. A slice that keeps changing under the compare-and-set is looked at again
    up to ``tries`` times before the verdict is ``moved``."""
    # A run admitted here before at this very fence (the subjob published again): as redelivered.
    again = redelivered or (started is not None and started.get(sj.slice_id, 0) >= sj.fence)
    admitted = await _start(slices, sj, known, grace_s, now, again, started, tries)
    if admitted.verdict == leases.Admission.RUN and started is not None:
        started[sj.slice_id] = max(started.get(sj.slice_id, 0), sj.fence)
    return admitted


async def _start(
    slices: KvStore[SliceState],
    sj: Subjob,
    known: bool,
    grace_s: float,
    now: float | None,
    redelivered: bool,
    started: dict[str, int] | None,
    tries: int,
) -> Admitted:

    def busy_at(s: SliceState, at: float) -> SliceState:
        return leases.start(
            s,
            grant_id=sj.grant_id,
            fence=sj.fence,
            now=at,
            time_cap_s=sj.time_cap_s,
            expected_s=sj.planned_duration_q_s,
            grace_s=grace_s,
            contestable_at=continuation.contestable_at(at, sj.time_cap_s, sj.max_units, sj.units),
            holder_attained_gpu_s=sj.attained_gpu_s,
            holder_tenant=sj.tenant,
            holder_submitted_at=sj.submitted_at,
            holder_due_at=sj.due_at,
        )

    at = time.time() if now is None else now
    snap = sj.slice_state
    if (
        known
        and not redelivered
        and snap is not None
        and sj.slice_revision > 0
        and snap.slice_id == sj.slice_id
        and leases.admit(snap, grant_id=sj.grant_id, fence=sj.fence, known=True) == leases.Admission.RUN
    ):
        if (
            started is not None
            and sj.max_units <= sj.units  # an open subjob's slice says when it is offered again
            and sj.fence > started.get(sj.slice_id, 0)
            and leases.covers(snap, now=at, time_cap_s=sj.time_cap_s, grace_s=grace_s)
        ):
            # Nothing to write: the lease outlasts the run. Should the slice have changed since
            # the grant (taken offline, say), freeing it fails its compare-and-set and leaves it be.
            return Admitted(leases.Admission.RUN, Held(snap, sj.slice_revision))
        busy = busy_at(snap, at)
        rev = await slices.cas(sj.slice_id, busy, sj.slice_revision)
        if rev is not None:
            return Admitted(leases.Admission.RUN, Held(busy, rev))
    for _ in range(max(tries, 1)):
        got = await slices.get(sj.slice_id)
        current, rev0 = got if got is not None else (None, 0)
        verdict = leases.admit(
            current, grant_id=sj.grant_id, fence=sj.fence, known=known, redelivered=redelivered
        )
        if verdict != leases.Admission.RUN or current is None:
            return Admitted(verdict)
        busy = busy_at(current, at)
        rev = await slices.cas(sj.slice_id, busy, rev0)
        if rev is not None:
            return Admitted(leases.Admission.RUN, Held(busy, rev))
    return Admitted(leases.Admission.MOVED)


async def keep(
    slices: KvStore[SliceState],
    sj: Subjob,
    held: Held | None,
    *,
    lease_s: float,
    now: float | None = None,
    tries: int = 3,
) -> Held | None:
    """Extend the lease of ``sj``, an open subjob that goes on past its window, to ``now + lease_s``
    while it still holds its slice. ``None`` when the lease moved on (another job won the slice:
    the subjob must yield); ``held`` itself when the slice kept changing (try again later)."""
    at = time.time() if now is None else now
    if held is not None:
        try:
            new = leases.extend(held.state, grant_id=sj.grant_id, fence=sj.fence, now=at, lease_s=lease_s)
        except leases.LeaseConflict:
            new = None
        if new is not None:
            rev = await slices.cas(sj.slice_id, new, held.revision)
            if rev is not None:
                return Held(new, rev)
    for _ in range(max(tries, 1)):
        got = await slices.get(sj.slice_id)
        if got is None:
            return None
        current, rev0 = got
        try:
            new = leases.extend(current, grant_id=sj.grant_id, fence=sj.fence, now=at, lease_s=lease_s)
        except leases.LeaseConflict:
            return None
        rev = await slices.cas(sj.slice_id, new, rev0)
        if rev is not None:
            return Held(new, rev)
    return held


async def free(slices: KvStore[SliceState], sj: Subjob, held: Held | None = None, tries: int = 10) -> bool:
    """Give the slice back after ``sj`` (only while it still holds ``sj``'s lease). True if freed
    here, False if the lease had moved on."""
    if held is not None:
        freed = leases.release(held.state, grant_id=sj.grant_id, fence=sj.fence, now=time.time())
        if await slices.cas(sj.slice_id, freed, held.revision) is not None:
            return True
    for _ in range(tries):
        got = await slices.get(sj.slice_id)
        if got is None:
            return False
        current, rev = got
        try:
            freed = leases.release(current, grant_id=sj.grant_id, fence=sj.fence, now=time.time())
        except leases.LeaseConflict:
            return False
        if await slices.cas(sj.slice_id, freed, rev) is not None:
            return True
    return False
