"""An executor's side of a slice's lease against a real KV bucket: a run its grant's lease covers
starts with no write; anything else is marked busy by compare-and-set; a subjob delivered or
published again never runs twice."""

from __future__ import annotations

import time

import pytest

from sja.bus.store import Store, stores
from sja.core import leases
from sja.execution import slicelease
from sja.inventory.declared import load_declared
from sja.protocol.messages import SliceState, Subjob

LEASE_S = 5.0
GRACE_S = 1.0


async def _granted(nc: object, lease_s: float = LEASE_S) -> tuple[Store[SliceState], Subjob]:
    """A slice granted by compare-and-set as the clearer does, and the subjob its grant makes."""
    slices, _ = await stores(nc.jetstream())  # type: ignore[attr-defined]
    s = load_declared(None)[0]
    rev0 = await slices.put(s.slice_id, s)
    now = time.time()
    leased = leases.grant(s, offered_fence=s.fence, job_id="j1", grant_id="g1", now=now, lease_s=lease_s)
    rev = await slices.cas(s.slice_id, leased, rev0)
    assert rev is not None
    sj = Subjob(
        subjob_id="j1.s0",
        seq=0,
        job_id="j1",
        tenant="t",
        agent_id="a",
        workload="montecarlo",
        params={},
        unit_start=0,
        units=1,
        grant_id="g1",
        fence=leased.fence,
        slice_id=s.slice_id,
        node=s.node,
        mem_cap_mib=1000,
        time_cap_s=1.0,
        planned_mem_q_mib=10.0,
        planned_duration_q_s=0.1,
        created_at=now,
        slice_revision=rev,
        slice_state=leased,
    )
    return slices, sj


async def test_a_run_the_lease_covers_starts_without_a_write_and_frees_the_slice(nc: object) -> None:
    slices, sj = await _granted(nc)
    started: dict[str, int] = {}
    admitted = await slicelease.start(slices, sj, known=True, grace_s=GRACE_S, started=started)
    assert admitted.verdict == "run"
    got = await slices.get(sj.slice_id)
    assert got is not None and got[1] == sj.slice_revision, "no write: the slice is as the grant left it"
    assert got[0].status == "leased" and started == {sj.slice_id: sj.fence}
    assert await slicelease.free(slices, sj, admitted.held)
    freed = await slices.get(sj.slice_id)
    assert freed is not None and freed[0].status == "free" and freed[0].fence == sj.fence


@pytest.mark.parametrize("case", ["short lease", "no tracking", "late"])
async def test_a_run_the_lease_does_not_cover_marks_the_slice_busy(nc: object, case: str) -> None:
    slices, sj = await _granted(nc, lease_s=1.5 if case == "short lease" else LEASE_S)
    now = time.time() + (4.0 if case == "late" else 0.0)  # 4 s after the grant: 1 s of a 5 s lease left
    started = None if case == "no tracking" else {}
    admitted = await slicelease.start(slices, sj, known=True, grace_s=GRACE_S, now=now, started=started)
    assert admitted.verdict == "run"
    got = await slices.get(sj.slice_id)
    assert got is not None and got[0].status == "busy" and got[1] > sj.slice_revision
    assert got[0].lease_until == pytest.approx(now + sj.time_cap_s + GRACE_S)
    assert await slicelease.free(slices, sj, admitted.held)
    freed = await slices.get(sj.slice_id)
    assert freed is not None and freed[0].status == "free"


async def test_a_subjob_delivered_again_under_its_lease_is_interrupted_not_run(nc: object) -> None:
    """The first delivery started with no write and its executor died: the slice still shows the
    grant's lease, so a delivery again cannot tell whether it ran; it never runs it twice."""
    slices, sj = await _granted(nc)
    assert (await slicelease.start(slices, sj, known=True, grace_s=GRACE_S, started={})).verdict == "run"
    again = await slicelease.start(slices, sj, known=True, grace_s=GRACE_S, redelivered=True, started={})
    assert again.verdict == "interrupted"
    # The executor then reports it lost and gives the slice back.
    assert await slicelease.free(slices, sj)
    freed = await slices.get(sj.slice_id)
    assert freed is not None and freed[0].status == "free"


async def test_a_subjob_published_again_is_never_run_twice(nc: object) -> None:
    """Not a redelivery (a new message with the same subjob): the executor that admitted it at this
    fence knows; once it ran and freed the slice, the copy finds the lease gone."""
    slices, sj = await _granted(nc)
    started: dict[str, int] = {}
    first = await slicelease.start(slices, sj, known=True, grace_s=GRACE_S, started=started)
    assert first.verdict == "run"
    copy = await slicelease.start(slices, sj, known=True, grace_s=GRACE_S, started=started)
    assert copy.verdict == "interrupted", "admitted here at this fence before: not started again"
    assert await slicelease.free(slices, sj, first.held)
    late = await slicelease.start(slices, sj, known=True, grace_s=GRACE_S, started=started)
    assert late.verdict == "stale"
    rev = await slices.get(sj.slice_id)
    assert rev is not None and rev[0].status == "free"


async def test_a_lease_that_moved_on_is_never_freed_by_the_old_holder(nc: object) -> None:
    slices, sj = await _granted(nc)
    admitted = await slicelease.start(slices, sj, known=True, grace_s=GRACE_S, started={})
    assert admitted.verdict == "run"
    # The lease lapsed (the advertiser's sweep) and the slice went to another job.
    cur = await slices.get(sj.slice_id)
    assert cur is not None
    lapsed = leases.expire(cur[0], cur[0].lease_until + 1)
    assert lapsed is not None
    rev = await slices.cas(sj.slice_id, lapsed, cur[1])
    assert rev is not None
    regranted = leases.grant(
        lapsed, offered_fence=lapsed.fence, job_id="j2", grant_id="g2", now=0.0, lease_s=9.0
    )
    assert await slices.cas(sj.slice_id, regranted, rev) is not None
    assert not await slicelease.free(slices, sj, admitted.held)
    now = await slices.get(sj.slice_id)
    assert now is not None and now[0] == regranted


def test_covers_is_the_lease_start_would_write() -> None:
    s = load_declared(None)[0]
    leased = leases.grant(s, offered_fence=s.fence, job_id="j", grant_id="g", now=100.0, lease_s=5.0)
    assert leases.covers(leased, now=101.0, time_cap_s=3.0, grace_s=1.0)  # runs to 105 at the latest
    assert not leases.covers(leased, now=101.01, time_cap_s=3.0, grace_s=1.0)
    busy = leases.start(
        leased, grant_id="g", fence=leased.fence, now=101.0, time_cap_s=3.0, expected_s=1.0, grace_s=1.0
    )
    assert busy.lease_until == leased.lease_until, "what busy would write is no longer than the lease"
    assert not leases.covers(busy, now=101.0, time_cap_s=0.1, grace_s=0.0), "only a lease not yet started"
    assert (
        leases.admit(leased, grant_id="g", fence=leased.fence, known=True, redelivered=True) == "interrupted"
    )
    assert leases.admit(leased, grant_id="x", fence=leased.fence, known=True, redelivered=True) == "stale"
