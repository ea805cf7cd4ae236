"""Slice leases (fenced transitions, and the executor's admission by them), the windows offered from
slice states, and the pace at which they are offered."""

from __future__ import annotations

import itertools

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sja.core import leases
from sja.core.leases import LeaseConflict
from sja.core.windows import OfferPacer, WindowRequest, find_windows
from sja.inventory.declared import load_declared
from sja.protocol.messages import SliceState

NOW = 5_000.0


def slice_state(slice_id: str = "local-g0-1g.5gb-2", **overrides: object) -> SliceState:
    fields: dict[str, object] = dict(
        slice_id=slice_id,
        node="local",
        pool="local",
        gpu_index=0,
        gpu_model="A100-40GB",
        profile="1g.5gb",
        mem_mib=4864,
        compute_slots=1,
        compute_share=1 / 7,
        placement_start=2,
    )
    fields.update(overrides)
    return SliceState(**fields)  # type: ignore[arg-type]


def granted(s: SliceState | None = None, grant_id: str = "g-1", now: float = NOW) -> SliceState:
    s = s or slice_state()
    return leases.grant(s, offered_fence=s.fence, job_id="j1", grant_id=grant_id, now=now, lease_s=5.0)


# --- lease transitions ------------------------------------------------------------------------------


def test_grant_leases_a_free_slice_and_bumps_the_fence() -> None:
    s = slice_state(fence=4)
    g = leases.grant(s, offered_fence=4, job_id="j1", grant_id="g-1", now=NOW, lease_s=5.0)
    assert g.status == "leased"
    assert g.fence == 5
    assert (g.holder_job, g.grant_id) == ("j1", "g-1")
    assert g.lease_until == NOW + 5.0
    assert g.updated_at == NOW
    assert leases.holds(g, "g-1", 5)
    assert not leases.holds(g, "g-1", 4)
    assert not leases.holds(g, "g-2", 5)


def test_grant_on_a_moved_fence_is_refused() -> None:
    s = slice_state(fence=4)
    with pytest.raises(LeaseConflict, match="fence moved 3 -> 4"):
        leases.grant(s, offered_fence=3, job_id="j1", grant_id="g-1", now=NOW, lease_s=5.0)


@pytest.mark.parametrize("status", ["leased", "busy", "offline"])
def test_grant_on_a_slice_that_is_not_free_is_refused(status: str) -> None:
    s = slice_state(status=status)
    with pytest.raises(LeaseConflict, match=status):
        leases.grant(s, offered_fence=0, job_id="j1", grant_id="g-1", now=NOW, lease_s=5.0)


@settings(max_examples=200, deadline=None)
@given(data=st.data(), clearers=st.integers(2, 4), steps=st.integers(1, 40))
def test_a_slice_is_never_granted_twice(data: st.DataObject, clearers: int, steps: int) -> None:
    """Clearers take offers of the slice (its fence when offered) and try to grant them later, while
    holders release and leases lapse: each offer is granted at most once, a grant from an offer the
    slice has moved past (a stale fence) is refused, and there is never more than one holder."""
    s = slice_state()
    now = NOW
    offered: dict[int, int] = {}  # clearer -> the fence of the offer it holds
    granted_from: list[int] = []
    for n in range(steps):
        now += 1.0
        op = data.draw(st.sampled_from(["offer", "grant", "release", "expire"]))
        if op == "offer":
            offered[data.draw(st.integers(0, clearers - 1))] = s.fence
        elif op == "grant" and offered:
            fence = offered.pop(data.draw(st.sampled_from(sorted(offered))))
            ok = s.status == "free" and fence == s.fence
            try:
                s = leases.grant(
                    s, offered_fence=fence, job_id=f"j{n}", grant_id=f"g{n}", now=now, lease_s=3.0
                )
            except LeaseConflict:
                assert not ok
            else:
                assert ok, f"granted from offer fence {fence} on a slice at fence {s.fence - 1} ({s.status})"
                granted_from.append(fence)
        elif op == "release" and s.status != "free":
            s = leases.release(s, grant_id=s.grant_id, fence=s.fence, now=now)
        elif op == "expire":
            s = leases.expire(s, now + data.draw(st.sampled_from([0.0, 5.0]))) or s
        assert len(granted_from) == len(set(granted_from)), f"an offer was granted twice: {granted_from}"
        assert s.fence == len(granted_from)


def test_start_makes_the_slice_busy_with_a_lease_covering_the_time_cap() -> None:
    g = granted()
    b = leases.start(g, grant_id="g-1", fence=1, now=NOW + 1.0, time_cap_s=30.0, expected_s=12.0, grace_s=2.0)
    assert b.status == "busy"
    assert b.lease_until == NOW + 1.0 + 30.0 + 2.0
    assert b.expected_end == NOW + 13.0
    assert b.fence == 1 and b.grant_id == "g-1"


@pytest.mark.parametrize(("grant_id", "fence"), [("g-1", 0), ("g-1", 2), ("g-old", 1)])
def test_start_with_a_stale_grant_or_fence_is_refused(grant_id: str, fence: int) -> None:
    with pytest.raises(LeaseConflict):
        leases.start(
            granted(), grant_id=grant_id, fence=fence, now=NOW, time_cap_s=30.0, expected_s=1.0, grace_s=1.0
        )


def test_start_twice_is_refused() -> None:
    b = leases.start(
        granted(), grant_id="g-1", fence=1, now=NOW, time_cap_s=30.0, expected_s=1.0, grace_s=1.0
    )
    with pytest.raises(LeaseConflict):
        leases.start(b, grant_id="g-1", fence=1, now=NOW, time_cap_s=30.0, expected_s=1.0, grace_s=1.0)


@pytest.mark.parametrize("busy", [False, True])
def test_release_frees_the_slice_but_keeps_the_fence(busy: bool) -> None:
    s = granted()
    if busy:
        s = leases.start(s, grant_id="g-1", fence=1, now=NOW, time_cap_s=30.0, expected_s=1.0, grace_s=1.0)
    r = leases.release(s, grant_id="g-1", fence=1, now=NOW + 3.0)
    assert r.status == "free"
    assert r.fence == 1
    assert (r.holder_job, r.grant_id, r.lease_until, r.expected_end) == ("", "", 0.0, 0.0)
    assert r.updated_at == NOW + 3.0
    # the next grant must quote the new fence
    again = leases.grant(r, offered_fence=1, job_id="j2", grant_id="g-2", now=NOW + 4.0, lease_s=5.0)
    assert again.fence == 2


@pytest.mark.parametrize(("grant_id", "fence"), [("g-2", 1), ("g-1", 0), ("g-1", 7)])
def test_release_by_a_stale_holder_is_refused(grant_id: str, fence: int) -> None:
    with pytest.raises(LeaseConflict):
        leases.release(granted(), grant_id=grant_id, fence=fence, now=NOW)


def test_a_holder_that_lost_the_slice_cannot_touch_it() -> None:
    s = granted(grant_id="g-1")
    expired = leases.expire(s, NOW + 10.0)
    assert expired is not None
    regranted = leases.grant(
        expired, offered_fence=1, job_id="j2", grant_id="g-2", now=NOW + 10.0, lease_s=5.0
    )
    with pytest.raises(LeaseConflict):
        leases.release(regranted, grant_id="g-1", fence=1, now=NOW + 11.0)
    with pytest.raises(LeaseConflict):
        leases.start(
            regranted, grant_id="g-1", fence=1, now=NOW + 11.0, time_cap_s=1.0, expected_s=1.0, grace_s=1.0
        )
    assert leases.release(regranted, grant_id="g-2", fence=2, now=NOW + 11.0).status == "free"


def test_release_of_a_free_slice_is_refused() -> None:
    with pytest.raises(LeaseConflict):
        leases.release(slice_state(), grant_id="", fence=0, now=NOW)


def test_expire_frees_only_after_the_lease() -> None:
    s = granted()  # lease_until = NOW + 5
    assert leases.expire(s, NOW + 4.9) is None
    assert leases.expire(s, NOW + 5.0) is None
    freed = leases.expire(s, NOW + 5.1)
    assert freed is not None and freed.status == "free" and freed.fence == 1
    busy = leases.start(
        s, grant_id="g-1", fence=1, now=NOW + 1.0, time_cap_s=30.0, expected_s=5.0, grace_s=2.0
    )
    assert leases.expire(busy, NOW + 30.0) is None
    assert leases.expire(busy, NOW + 33.5) is not None


@pytest.mark.parametrize("status", ["free", "offline"])
def test_expire_leaves_unleased_slices_alone(status: str) -> None:
    assert leases.expire(slice_state(status=status, lease_until=1.0), NOW) is None


def test_offline_clears_the_holder_and_keeps_the_fence() -> None:
    o = leases.offline(granted(), NOW + 1.0)
    assert o.status == "offline" and o.fence == 1 and o.holder_job == "" and o.grant_id == ""


OPS = ["grant", "extend", "release", "expire", "busy", "complete"]


@settings(max_examples=300, deadline=None)
@given(data=st.data(), ops=st.lists(st.sampled_from(OPS), max_size=40))
def test_fence_never_goes_down_and_at_most_one_holder(data: st.DataObject, ops: list[str]) -> None:
    """Interleavings of grant / extend / release / expire / busy (start) / complete (release of a
    busy slice), each quoting a fence drawn from the current value and stale (or forged) ones and a
    grant id from every grant issued so far: a transition succeeds exactly when it quotes the
    current fence (and, after the grant, the current grant id), the fence never goes down, and at
    any time at most one grant ever issued holds the slice."""
    s = slice_state()
    now = NOW
    issued: list[tuple[str, int]] = []  # (grant id, fence) of every grant made
    for n, op in enumerate(ops):
        now += 1.0
        before = s
        # Fences from the current value, from the past, and one never reached yet.
        fence = data.draw(
            st.sampled_from(sorted({s.fence, s.fence + 1, *range(max(0, s.fence - 3), s.fence)}))
        )
        if op != "grant" and issued and data.draw(st.booleans()):
            grant_id, fence = data.draw(st.sampled_from(issued))  # a real grant, maybe an old one
        else:
            grant_id = s.grant_id or "g-none"  # the current grant id with the drawn fence
        # Whether it quotes the current lease, from the slice's own fields (not from ``holds``).
        current = s.status in ("leased", "busy") and (grant_id, fence) == (s.grant_id, s.fence)
        try:
            if op == "grant":
                expected = s.status == "free" and fence == s.fence
                s = leases.grant(
                    s, offered_fence=fence, job_id=f"j{n}", grant_id=f"g{n}", now=now, lease_s=3.0
                )
                issued.append((s.grant_id, s.fence))
            elif op == "extend":
                expected = current
                s = leases.extend(s, grant_id=grant_id, fence=fence, now=now, lease_s=3.0)
            elif op == "busy":
                expected = current and s.status == "leased"
                s = leases.start(
                    s, grant_id=grant_id, fence=fence, now=now, time_cap_s=2.0, expected_s=1.0, grace_s=0.5
                )
            elif op in ("release", "complete"):
                expected = current and (op == "release" or s.status == "busy")
                if op == "complete" and s.status != "busy":
                    raise LeaseConflict("nothing running to complete")
                s = leases.release(s, grant_id=grant_id, fence=fence, now=now)
            else:  # the advertiser's sweep: frees a lapsed lease, leaves any other slice as it is
                lapsed = s.status in ("leased", "busy") and s.lease_until < now + 2.0
                freed = leases.expire(s, now + 2.0)
                assert (freed is not None) == lapsed
                s, expected = freed or s, True
        except LeaseConflict:
            assert not expected, f"{op} with the current fence {fence} and grant {grant_id} was refused"
            assert s == before
        else:
            assert expected, (
                f"{op} with a stale fence {fence} (slice at {before.fence}) or grant was accepted"
            )
        assert before.fence <= s.fence <= before.fence + 1
        if op != "grant" or s == before:
            assert s.fence == before.fence, "only a grant moves the fence"
        holders = [g for g, f in issued if leases.holds(s, g, f)]
        if s.status == "free":
            assert holders == [] and s.grant_id == "" and s.holder_job == ""
        else:
            assert holders == [issued[-1][0]], holders
            assert s.fence == issued[-1][1]
        if s.status == "leased" and before.status == "leased" and s.grant_id == before.grant_id:
            assert s.lease_until >= before.lease_until, "a lease is never shortened"


def test_extend_keeps_a_lease_only_for_its_holder() -> None:
    g = granted()  # fence 1, lease until NOW + 5
    longer = leases.extend(g, grant_id="g-1", fence=1, now=NOW + 4.0, lease_s=5.0)
    assert longer.lease_until == NOW + 9.0 and longer.fence == 1 and longer.grant_id == "g-1"
    assert leases.extend(longer, grant_id="g-1", fence=1, now=NOW, lease_s=1.0).lease_until == NOW + 9.0
    with pytest.raises(LeaseConflict):
        leases.extend(g, grant_id="g-1", fence=0, now=NOW, lease_s=5.0)
    with pytest.raises(LeaseConflict):
        leases.extend(
            leases.release(g, grant_id="g-1", fence=1, now=NOW), grant_id="g-1", fence=1, now=NOW, lease_s=5.0
        )


# --- restart reconciliation ----------------------------------------------------------------------


def test_merge_declared_creates_a_new_slice() -> None:
    declared = slice_state()
    merged = leases.merge_declared(None, declared, NOW)
    assert merged == msgspec.structs.replace(declared, updated_at=NOW)


def test_merge_declared_keeps_lease_fields_across_a_restart() -> None:
    busy = leases.start(
        granted(slice_state(fence=6)),
        grant_id="g-1",
        fence=7,
        now=NOW,
        time_cap_s=30.0,
        expected_s=5.0,
        grace_s=2.0,
    )
    fresh = slice_state()  # as the inventory declares it: free, fence 0
    assert leases.merge_declared(busy, fresh, NOW + 50.0) is None
    # static fields follow the discovery, lease fields stay
    rediscovered = slice_state(gpu_uuid="MIG-real-uuid", source="nvml")
    merged = leases.merge_declared(busy, rediscovered, NOW + 50.0)
    assert merged is not None
    assert (merged.status, merged.fence, merged.grant_id, merged.holder_job) == ("busy", 7, "g-1", "j1")
    assert merged.lease_until == busy.lease_until
    assert merged.gpu_uuid == "MIG-real-uuid" and merged.source == "nvml"
    assert merged.updated_at == NOW + 50.0


def test_merge_declared_brings_an_offline_slice_back_free_with_its_fence() -> None:
    off = leases.offline(granted(slice_state(fence=2)), NOW)
    merged = leases.merge_declared(off, slice_state(), NOW + 1.0)
    assert merged is not None
    assert merged.status == "free" and merged.fence == 3


# --- windows ---------------------------------------------------------------------------------------


def fleet() -> list[SliceState]:
    return [
        slice_state("s-free-b"),
        slice_state("s-free-a"),
        slice_state("s-leased", status="leased", grant_id="g", holder_job="j", fence=1),
        slice_state("s-busy", status="busy", grant_id="g", holder_job="j", fence=1, expected_end=NOW + 12.0),
        slice_state(
            "s-busy-late", status="busy", grant_id="g", holder_job="j", fence=1, expected_end=NOW - 3.0
        ),
        slice_state("s-busy-unknown", status="busy", grant_id="g", holder_job="j", fence=1),
        slice_state("s-offline", status="offline"),
    ]


def test_windows_only_for_free_slices_by_default() -> None:
    ws = find_windows(fleet(), WindowRequest(now=NOW, horizon_s=30.0))
    assert [w.slice_id for w in ws] == ["s-free-a", "s-free-b"]
    for w in ws:
        assert w.start_s == NOW and w.end_s == NOW + 30.0
        assert w.length_s == 30.0
        assert (w.mem_mib, w.profile, w.compute_share) == (4864, "1g.5gb", 1 / 7)


def test_future_windows_open_when_busy_slices_are_expected_to_end() -> None:
    ws = find_windows(fleet(), WindowRequest(now=NOW, horizon_s=30.0, include_future=True))
    assert [(w.slice_id, w.start_s) for w in ws] == [
        ("s-busy-late", NOW),  # overdue: offered from now, not from the past
        ("s-free-a", NOW),
        ("s-free-b", NOW),
        ("s-busy", NOW + 12.0),
    ]
    assert all(w.end_s == w.start_s + 30.0 for w in ws)


def test_reservations_cut_windows_short_or_remove_them() -> None:
    req = WindowRequest(
        now=NOW,
        horizon_s=30.0,
        include_future=True,
        reservations={"s-free-a": NOW + 10.0, "s-free-b": NOW, "s-busy": NOW + 20.0},
    )
    ws = {w.slice_id: w for w in find_windows(fleet(), req)}
    assert "s-free-b" not in ws
    assert ws["s-free-a"].end_s == NOW + 10.0
    assert ws["s-busy"].start_s == NOW + 12.0 and ws["s-busy"].end_s == NOW + 20.0
    far = WindowRequest(now=NOW, horizon_s=30.0, reservations={"s-free-a": NOW + 100.0})
    assert {w.slice_id: w.end_s for w in find_windows(fleet(), far)}["s-free-a"] == NOW + 30.0


@settings(max_examples=100, deadline=None)
@given(
    statuses=st.lists(st.sampled_from(["free", "leased", "busy", "offline"]), max_size=12),
    ends=st.lists(st.floats(-50.0, 50.0), min_size=12, max_size=12),
    reserve=st.lists(st.none() | st.floats(-10.0, 60.0), min_size=12, max_size=12),
    horizon=st.floats(1.0, 60.0),
    future=st.booleans(),
)
def test_windows_are_sorted_bounded_and_never_on_held_slices(
    statuses: list[str],
    ends: list[float],
    reserve: list[float | None],
    horizon: float,
    future: bool,
) -> None:
    slices = [
        slice_state(f"s{i:02d}", status=st_, expected_end=NOW + ends[i] if st_ == "busy" else 0.0)
        for i, st_ in enumerate(statuses)
    ]
    reservations = {f"s{i:02d}": NOW + r for i, r in enumerate(reserve) if r is not None}
    req = WindowRequest(now=NOW, horizon_s=horizon, include_future=future, reservations=reservations)
    ws = find_windows(slices, req)
    by_id = {s.slice_id: s for s in slices}
    assert [(w.start_s, w.slice_id) for w in ws] == sorted((w.start_s, w.slice_id) for w in ws)
    assert len({w.slice_id for w in ws}) == len(ws)
    for w in ws:
        s = by_id[w.slice_id]
        assert s.status == "free" or (future and s.status == "busy")
        assert w.start_s >= NOW
        assert w.end_s is not None and w.start_s < w.end_s <= w.start_s + horizon
        if w.slice_id in reservations:
            assert w.end_s <= reservations[w.slice_id]
    # every free slice without a reservation that has already begun gets its window
    for s in slices:
        r = reservations.get(s.slice_id)
        if s.status == "free" and (r is None or r > NOW):
            assert s.slice_id in {w.slice_id for w in ws}


def test_open_ended_windows_leave_free_slices_unbounded_unless_reserved() -> None:
    req = WindowRequest(now=NOW, horizon_s=30.0, include_future=True, open_ended=True)
    ws = {w.slice_id: w for w in find_windows(fleet(), req)}
    assert ws["s-free-a"].end_s is None and ws["s-free-a"].start_s == NOW
    assert ws["s-busy"].end_s == ws["s-busy"].start_s + 30.0, "a future window keeps its bound"
    reserved = WindowRequest(now=NOW, horizon_s=30.0, open_ended=True, reservations={"s-free-a": NOW + 10.0})
    assert {w.slice_id: w.end_s for w in find_windows(fleet(), reserved)}["s-free-a"] == NOW + 10.0


def test_pacer_offers_at_once_then_backs_off_and_resets_on_demand() -> None:
    s = load_declared(None)[0]
    windows = find_windows([s], WindowRequest(now=0.0, horizon_s=5.0))
    pacer = OfferPacer(min_s=0.2, max_s=1.0)
    fences = {s.slice_id: 0}
    times = [t / 100 for t in range(0, 400)]
    offered = [t for t in times if pacer.due(windows, fences, t)]
    gaps = [b - a for a, b in itertools.pairwise(offered)]
    assert offered[0] == 0.0
    assert gaps[:3] == pytest.approx([0.2, 0.4, 0.8], abs=0.011), gaps
    assert max(gaps) == pytest.approx(1.0, abs=0.011), gaps
    # the slice was granted and freed again: its fence moved, so it is offered at once
    fences[s.slice_id] = 1
    assert pacer.due(windows, fences, 4.0)
    assert not pacer.due(windows, fences, 4.05)
    # A long backoff later, new demand brings the next offer back to min_s after the last one...
    offered = [t for t in (4.21, 4.62, 5.0) if pacer.due(windows, fences, t)]
    assert offered == [4.21, 4.62], "backing off: 0.2 s, then 0.4 s, then 0.8 s"
    pacer.demand_changed()
    assert pacer.due(windows, fences, 5.21), "new demand skips the backoff"
    # ...but never sooner: the last offer's round may still be open.
    pacer.demand_changed()
    assert not pacer.due(windows, fences, 5.3)
    assert pacer.due(windows, fences, 5.42)


def test_executor_admission_from_the_slice_lease() -> None:
    s = load_declared(None)[0]
    leased = leases.grant(s, offered_fence=0, job_id="j", grant_id="g1", now=0.0, lease_s=5.0)
    assert leases.admit(leased, grant_id="g1", fence=1, known=True) == "run"
    assert leases.admit(leased, grant_id="g0", fence=1, known=True) == "stale"
    assert leases.admit(leased, grant_id="g1", fence=2, known=True) == "stale"
    assert leases.admit(leased, grant_id="g1", fence=1, known=False) == "unknown"
    assert leases.admit(None, grant_id="g1", fence=1, known=True) == "unknown"
    busy = msgspec.structs.replace(leased, status="busy")
    assert leases.admit(busy, grant_id="g1", fence=1, known=True) == "interrupted"
