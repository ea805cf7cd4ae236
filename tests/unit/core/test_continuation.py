"""Continuation and yield (``core.continuation``): which subjobs are open, how far they may go, when
their slice is offered again and taken, and how a completion past the planned range is folded in."""

from __future__ import annotations

import msgspec
import pytest

from sja.core import continuation, leases
from sja.core.bidding import propose
from sja.core.jobs import apply_completion, claim_units, contiguous_from, materialize, new_job
from sja.core.planner import PlanLimits
from sja.core.windows import WindowRequest, find_windows
from sja.protocol.messages import Completion, JobSpec, MemoryDecl, SliceState, Subjob, TimeDecl, UnitRange
from tests.unit.core.test_jobs import grant_for, offer_for, window

NOW = 1_000.0
LIMITS = PlanLimits(start_overhead_s=0.3)


def command_spec(units: int = 100, max_parallel: int = 1, **params: object) -> JobSpec:
    return JobSpec(
        name="prog",
        tenant="t",
        workload="command",
        params={"argv": ["true"], "units": units, **params},
        max_parallel=max_parallel,
        memory=MemoryDecl(base_mib=64.0, per_unit_mib=0.0, rel_sd=0.1),
        time=TimeDecl(warmup_s=0.5, per_unit_s=1.0, rel_sd=0.2),
    )


def first_subjob(spec: JobSpec, length_s: float = 10.0) -> tuple[object, Subjob]:
    state = new_job("j1", spec, NOW)
    offer = offer_for(window(NOW, mem_mib=40960, profile="7g.40gb", share=1.0, length_s=length_s), NOW)
    proposal = propose(state, offer, NOW, LIMITS)
    assert proposal is not None
    mat = materialize(state, grant_for(state, offer, proposal, NOW), NOW, LIMITS, "agent-1")
    assert mat.subjob is not None, mat.reason
    return mat.state, mat.subjob


def completion(
    sj: Subjob, status: str, units_done: int, duration_s: float, yielded: bool = False
) -> Completion:
    return Completion(
        subjob_id=sj.subjob_id,
        job_id=sj.job_id,
        grant_id=sj.grant_id,
        fence=sj.fence,
        slice_id=sj.slice_id,
        status=status,  # type: ignore[arg-type]
        unit_start=sj.unit_start,
        units=sj.units,
        units_done=units_done,
        peak_mem_mib=70.0,
        duration_s=duration_s,
        mem_cap_mib=sj.mem_cap_mib,
        time_cap_s=sj.time_cap_s,
        started_at=NOW,
        finished_at=NOW + duration_s,
        output_checkpoint=b"" if status != "ok" else b"state",
        yielded=yielded,
    )


def test_open_units_stop_where_the_memory_quantile_stops_fitting() -> None:
    assert continuation.open_units(5, 100, lambda k: 10.0 * k, 1000.0) == 100
    assert continuation.open_units(5, 100, lambda k: 10.0 * k, 425.0) == 42
    assert continuation.open_units(5, 3, lambda k: 10.0 * k, 1000.0) == 5  # never below the planned size


def test_only_jobs_that_yield_are_open() -> None:
    assert continuation.continuable(True)
    assert not continuation.continuable(False)

    assert not continuation.continuable(True, {"continue": False})


def test_a_command_subjob_may_go_on_through_the_rest_of_the_job() -> None:
    _, sj = first_subjob(command_spec(100))
    assert 0 < sj.units < 100 and sj.max_units == 100
    _, bounded = first_subjob(command_spec(100, **{"continue": False}))
    assert bounded.max_units == 0


def test_a_completion_past_the_planned_range_takes_those_units_as_done() -> None:
    state, sj = first_subjob(command_spec(100))
    after, applied = apply_completion(state, completion(sj, "ok", 60, 80.0), NOW + 80)  # type: ignore[arg-type]
    assert applied
    # The subjob held the whole job from its start: what it did not do is planned again.
    assert after.units_done == 60 and after.next_unit == 100
    assert after.retry == [UnitRange(start=60, count=40)]
    assert after.history[-1].units == 60
    # Service attained past the window counts (the fair policy's order).
    assert after.attained_gpu_s > state.attained_gpu_s  # type: ignore[attr-defined]


def test_a_yield_within_the_planned_range_plans_the_rest_again() -> None:
    state, sj = first_subjob(command_spec(100), length_s=30.0)
    assert sj.units > 2
    after, _ = apply_completion(state, completion(sj, "ok", 2, 3.0), NOW + 3)  # type: ignore[arg-type]
    assert after.units_done == 2
    assert after.retry == [UnitRange(start=2, count=98)] and after.next_unit == 100


def test_a_program_that_does_not_stop_when_asked_to_yield_gets_bounded_ranges() -> None:
    state, sj = first_subjob(command_spec(100))
    after, _ = apply_completion(state, completion(sj, "timeout", 0, 50.0, yielded=True), NOW + 50)  # type: ignore[arg-type]
    assert after.bounded and after.units_done == 0
    offer = offer_for(window(NOW + 60, mem_mib=40960, profile="7g.40gb", share=1.0), NOW + 60)
    proposal = propose(after, offer, NOW + 60, LIMITS)
    assert proposal is not None
    mat = materialize(after, grant_for(after, offer, proposal, NOW + 60), NOW + 60, LIMITS, "agent-1")
    assert mat.subjob is not None and mat.subjob.max_units == 0


def test_contiguous_and_claimed_ranges() -> None:
    state = msgspec.structs.replace(
        new_job("j1", command_spec(100), NOW), retry=[UnitRange(start=10, count=5)], next_unit=15
    )
    assert contiguous_from(state, 10) == 90  # the retried range, then the fresh work after it
    gap = msgspec.structs.replace(state, next_unit=20)
    assert contiguous_from(gap, 10) == 5
    retry, nxt = claim_units([UnitRange(start=10, count=5), UnitRange(start=40, count=5)], 20, 12, 30)
    assert retry == [UnitRange(start=10, count=2), UnitRange(start=40, count=5)] and nxt == 30


def busy(contestable_at: float, submitted_at: float = NOW) -> SliceState:
    return SliceState(
        slice_id="local-g0-7g.40gb-0",
        node="local",
        pool="local",
        gpu_index=0,
        gpu_model="A100-40GB",
        profile="7g.40gb",
        mem_mib=40960,
        compute_slots=7,
        compute_share=1.0,
        status="busy",
        fence=3,
        holder_job="j1",
        grant_id="g-1",
        lease_until=NOW + 100,
        contestable_at=contestable_at,
        holder_attained_gpu_s=600.0,
        holder_submitted_at=submitted_at,
    )


@pytest.mark.parametrize(("contestable_at", "offered"), [(0.0, False), (NOW + 5, False), (NOW - 1, True)])
def test_a_held_slice_is_offered_and_granted_only_past_its_holders_window(
    contestable_at: float, offered: bool
) -> None:
    s = busy(contestable_at)
    windows = find_windows([s], WindowRequest(now=NOW, horizon_s=600.0, open_ended=True))
    assert bool(windows) == offered
    if offered:
        assert windows[0].start_s == NOW and windows[0].end_s is None
        taken = leases.grant(s, offered_fence=3, job_id="j2", grant_id="g-2", now=NOW, lease_s=5.0)
        assert taken.status == "leased" and taken.fence == 4 and taken.contestable_at == 0.0
        assert not leases.holds(taken, "g-1", 3), "the holder lost its lease"
    else:
        with pytest.raises(leases.LeaseConflict):
            leases.grant(s, offered_fence=3, job_id="j2", grant_id="g-2", now=NOW, lease_s=5.0)


def test_an_open_subjobs_start_marks_when_its_slice_is_offered_again() -> None:
    assert continuation.contestable_at(NOW, 30.0, max_units=100, units=10) == NOW + 30.0
    assert continuation.contestable_at(NOW, 30.0, max_units=0, units=10) == 0.0
    assert continuation.yield_grace_s(2.0, 3.5) == 5.5
    assert continuation.yield_grace_for({"stop_grace_s": 2}, 3.5, 30.0) == 5.5
    assert continuation.yield_grace_for({"stop_grace_s": True}, 3.5, 30.0) == 33.5
    assert continuation.yield_grace_for({}, 0.0, 30.0) == 30.0


def test_a_job_of_several_subjobs_at_once_cuts_each_an_open_share_of_its_own() -> None:
    # max_parallel 3, 90 units: each subjob holds its even share of what is not handed out, so the
    # three go on side by side over disjoint ranges; a yield gives the rest of its share back.
    state = new_job("j1", command_spec(90, max_parallel=3, sequential=False, merge_argv=["true"]), NOW)
    subjobs = []
    for i in range(3):
        w = msgspec.structs.replace(
            window(NOW, mem_mib=40960, profile="7g.40gb", share=1.0, length_s=10.0), slice_id=f"s{i}"
        )
        offer = offer_for(w, NOW)
        proposal = propose(state, offer, NOW, LIMITS)
        assert proposal is not None
        mat = materialize(state, grant_for(state, offer, proposal, NOW), NOW, LIMITS, "agent-1")
        assert mat.subjob is not None, mat.reason
        state, sj = mat.state, mat.subjob
        subjobs.append(sj)
    assert [(sj.unit_start, sj.max_units) for sj in subjobs] == [(0, 30), (30, 30), (60, 30)]
    assert all(sj.units < sj.max_units for sj in subjobs)
    assert state.next_unit == 90 and state.retry == []  # type: ignore[attr-defined]
    # The middle one yields after 12 units: the other 18 of its share are planned again.
    after, applied = apply_completion(state, completion(subjobs[1], "ok", 12, 40.0), NOW + 40)  # type: ignore[arg-type]
    assert applied and after.units_done == 12 and after.retry == [UnitRange(start=42, count=18)]
    # A lost one gives back its whole share.
    lost, _ = apply_completion(after, completion(subjobs[2], "lost", 0, 40.0), NOW + 40)
    assert lost.retry == [UnitRange(start=42, count=18), UnitRange(start=60, count=30)]


def test_a_job_does_not_bid_for_the_slice_its_own_open_subjob_holds() -> None:
    state = new_job("j1", command_spec(90, max_parallel=3, sequential=False, merge_argv=["true"]), NOW)
    s = busy(NOW - 1)  # held by j1 past its window
    [w] = find_windows([s], WindowRequest(now=NOW, horizon_s=600.0, open_ended=True))
    assert w.held_by == "j1"
    assert propose(state, offer_for(w, NOW), NOW, LIMITS) is None
    other = new_job("j2", command_spec(90), NOW)
    assert propose(other, offer_for(w, NOW), NOW, LIMITS) is not None
    free = msgspec.structs.replace(s, status="free", holder_job="", contestable_at=0.0)
    [fw] = find_windows([free], WindowRequest(now=NOW, horizon_s=600.0, open_ended=True))
    assert fw.held_by == ""


def test_a_waiting_job_takes_a_held_slice_only_from_a_job_that_has_had_more_service() -> None:
    s = busy(NOW - 100)  # its holder's job had 600 GPU-s at its start, and 100 s past its window
    [w] = find_windows([s], WindowRequest(now=NOW, horizon_s=600.0, open_ended=True))
    assert w.held_attained_gpu_s == pytest.approx(700.0)
    newcomer = new_job("j2", command_spec(90), NOW)
    assert propose(newcomer, offer_for(w, NOW), NOW, LIMITS) is not None
    # More service than the holder's job: it waits for a free slice or a more-served holder.
    served = msgspec.structs.replace(newcomer, attained_gpu_s=750.0)
    assert propose(served, offer_for(w, NOW), NOW, LIMITS) is None
    # The holder's service grows with the time it holds the slice past its window.
    later = NOW + 100
    [w2] = find_windows([s], WindowRequest(now=later, horizon_s=600.0, open_ended=True))
    assert w2.held_attained_gpu_s == pytest.approx(800.0)
    assert propose(served, offer_for(w2, later), later, LIMITS) is not None
    assert continuation.takes_held(0.0, 1.0) and not continuation.takes_held(1.0, 1.0)


def test_a_job_in_the_system_longer_is_forgiven_service_for_its_age() -> None:
    # The holder's job (submitted now) has had 700 GPU-s; a job with 750 submitted earlier goes
    # before it once its age makes up the 50 (continuation.AGEING per second), not before.
    s = busy(NOW - 100)
    [w] = find_windows([s], WindowRequest(now=NOW, horizon_s=600.0, open_ended=True))
    assert w.held_submitted_at == NOW
    gap = 50.0 / continuation.AGEING
    for earlier, takes in ((gap + 10, True), (gap - 10, False)):
        older = msgspec.structs.replace(new_job("j2", command_spec(90), NOW - earlier), attained_gpu_s=750.0)
        assert (propose(older, offer_for(w, NOW), NOW, LIMITS) is not None) is takes, earlier
    # The same order is fair's within a tenant, and it does not change with the clock.
    a = continuation.service_key(750.0, NOW - gap - 10)
    assert a < continuation.service_key(700.0, NOW)
    # A slice carries its holder's submission from the lease's start to its release.
    free = msgspec.structs.replace(s, status="free", holder_job="", grant_id="", contestable_at=0.0)
    started = leases.start(
        leases.grant(free, offered_fence=free.fence, job_id="j3", grant_id="g-9", now=NOW, lease_s=30.0),
        grant_id="g-9", fence=free.fence + 1, now=NOW, time_cap_s=600.0, expected_s=600.0, grace_s=30.0,
        contestable_at=NOW + 600, holder_attained_gpu_s=5.0, holder_submitted_at=NOW - 60,
    )  # fmt: skip
    assert started.holder_submitted_at == NOW - 60
    assert (
        leases.release(started, grant_id="g-9", fence=free.fence + 1, now=NOW + 1).holder_submitted_at == 0.0
    )


def test_the_clearers_ledger_learns_the_service_held_past_windows() -> None:
    # No grant charges the time an open subjob holds its slice past its window: the ledger learns
    # it from the held slice's window (its holder's service now) and from the jobs' own proposals.
    from sja.core import grants
    from sja.core.policies import Bid, Ledger
    from tests.unit.core.test_grants import proposal

    ledger = Ledger()
    ledger.charge("a", "j1", 600.0)  # its grant
    held = msgspec.structs.replace(busy(NOW - 100), holder_tenant="a")
    [w] = find_windows([held], WindowRequest(now=NOW, horizon_s=600.0, open_ended=True))
    assert (w.held_by, w.held_tenant) == ("j1", "a")
    learned = grants.learn_service(ledger, [offer_for(w, NOW)], [])
    assert learned == pytest.approx(100.0) and ledger.tenant_attained["a"] == pytest.approx(700.0)
    assert grants.learn_service(ledger, [offer_for(w, NOW)], []) == 0.0  # charged once
    p = msgspec.structs.replace(proposal(2, "b", 10.0, 1.0), attained_gpu_s=50.0)
    assert grants.learn_service(ledger, [], [Bid(agent_id="x", proposal=p)]) == pytest.approx(50.0)
    assert ledger.job_attained["j02"] == pytest.approx(50.0) and ledger.tenant_attained["b"] == 50.0
    stale = msgspec.structs.replace(p, attained_gpu_s=20.0)  # an older count never takes back
    assert grants.learn_service(ledger, [], [Bid(agent_id="x", proposal=stale)]) == 0.0
    started = leases.start(
        leases.grant(
            msgspec.structs.replace(held, status="free"), offered_fence=3, job_id="j3", grant_id="g-3",
            now=NOW, lease_s=5.0,
        ),
        grant_id="g-3", fence=4, now=NOW, time_cap_s=10.0, expected_s=5.0, grace_s=1.0,
        contestable_at=NOW + 10.0, holder_attained_gpu_s=40.0, holder_tenant="c",
    )  # fmt: skip
    assert (started.holder_tenant, started.holder_attained_gpu_s) == ("c", 40.0)
    bounded = leases.start(
        leases.grant(
            msgspec.structs.replace(held, status="free"), offered_fence=3, job_id="j3", grant_id="g-3",
            now=NOW, lease_s=5.0,
        ),
        grant_id="g-3", fence=4, now=NOW, time_cap_s=10.0, expected_s=5.0, grace_s=1.0,
        holder_attained_gpu_s=40.0, holder_tenant="c",
    )  # fmt: skip
    assert (bounded.holder_tenant, bounded.holder_attained_gpu_s) == ("", 0.0)


def test_a_job_left_out_of_a_held_window_still_bids_for_free_ones_of_its_shape() -> None:
    # The bid books rank jobs per window shape; a held window of a shape is bid for by fewer jobs,
    # and must not take those jobs out of the shape's ranking.
    from sja.core.bidder import Bidder
    from sja.core.policies import PolicyConfig

    bidder = Bidder(LIMITS, PolicyConfig(horizon_s=600.0))
    alike = msgspec.structs.replace(new_job("j2", command_spec(90), NOW), attained_gpu_s=800.0)
    bidder.own(alike)
    [held] = find_windows([busy(NOW - 1)], WindowRequest(now=NOW, horizon_s=600.0, open_ended=True))
    assert bidder.proposals_for(offer_for(held, NOW), NOW, 1, "fair") == []
    free = msgspec.structs.replace(held, held_by="", held_attained_gpu_s=0.0, held_tenant="")
    assert [p.job_id for p in bidder.proposals_for(offer_for(free, NOW), NOW, 1, "fair")] == ["j2"]
    assert [p.job_id for p in bidder.proposals_for(offer_for(held, NOW), NOW, 1, "")] == []
