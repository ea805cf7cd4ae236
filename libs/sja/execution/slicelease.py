"""An executor's side of a slice's lease: admit a delivered subjob and mark its slice busy, then
free the slice when the subjob is over, each with one compare-and-set when nothing else touched the
slice in between.

A subjob carries the slice as its grant leased it (``Subjob.slice_state`` at ``slice_revision``):
a compare-and-set against that revision succeeds only if the slice is still exactly that lease, so
the admission is decided without reading the slice first. When the slice changed since (the lease
lapsed, the subjob is delivered again, an older agent sent no snapshot) the slice is read and
``leases.admit`` decides as before. Freeing likewise writes over the busy state this executor wrote.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sja.bus.connection import Store
from sja.core import leases
from sja.protocol.messages import SliceState, Subjob


@dataclass(frozen=True)
class Held:
    """The slice as this executor last wrote it, and the revision that write made."""

    state: SliceState
    revision: int


@dataclass(frozen=True)
class Admitted:
    verdict: str
    """``leases.Admission`` (``run``, ``stale``, ``interrupted``, ``unknown``), or ``moved``: the slice
    changed under the compare-and-set (look again later)."""
    held: Held | None = None


async def start(
    slices: Store[SliceState], sj: Subjob, *, known: bool, grace_s: float, now: float | None = None
) -> Admitted:
    """Admit ``sj`` on its slice and, if it may run, mark the slice busy with it."""

    def started(s: SliceState, at: float) -> SliceState:
        return leases.start(
            s,
            grant_id=sj.grant_id,
            fence=sj.fence,
            now=at,
            time_cap_s=sj.time_cap_s,
            expected_s=sj.planned_duration_q_s,
            grace_s=grace_s,
        )

    at = time.time() if now is None else now
    snap = sj.slice_state
    if (
        known
        and snap is not None
        and sj.slice_revision > 0
        and snap.slice_id == sj.slice_id
        and leases.admit(snap, grant_id=sj.grant_id, fence=sj.fence, known=True) == "run"
    ):
        busy = started(snap, at)
        rev = await slices.cas(sj.slice_id, busy, sj.slice_revision)
        if rev is not None:
            return Admitted("run", Held(busy, rev))
    got = await slices.get(sj.slice_id)
    current, rev0 = got if got is not None else (None, 0)
    verdict = leases.admit(current, grant_id=sj.grant_id, fence=sj.fence, known=known)
    if verdict != "run" or current is None:
        return Admitted(verdict)
    busy = started(current, at)
    rev = await slices.cas(sj.slice_id, busy, rev0)
    if rev is None:
        return Admitted("moved")
    return Admitted("run", Held(busy, rev))


async def free(slices: Store[SliceState], sj: Subjob, held: Held | None = None, tries: int = 10) -> bool:
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
