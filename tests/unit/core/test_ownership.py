"""Who holds a job: taking over a silent agent's jobs (its heir first, any live agent later), and
which in-flight subjobs are past due or given up for lost."""

from __future__ import annotations

from collections import Counter

import msgspec

from sja.core.bidding import propose
from sja.core.jobs import apply_completion, materialize, new_job, request_cancel
from sja.core.ownership import claim, heir, is_owned_by, lost_completion, overdue, past_due, takeover
from sja.core.planner import PlanLimits
from sja.protocol.messages import Grant, JobSpec, JobState, Offer, Window
from tests.unit.core._jobs_in_process import assert_covers_exactly, execute, run_to_completion, win_window
from tests.unit.core._jobs_in_process import spec as job_spec

T0 = 10_000.0
LIVENESS_S = 10.0
LIMITS = PlanLimits()


def owned_job(job_id: str = "j1", owner: str = "agent-a", max_parallel: int = 1) -> JobState:
    spec = JobSpec(
        name=job_id,
        tenant="alice",
        workload="montecarlo",
        params={"units": 40, "samples_per_unit": 100},
        max_parallel=max_parallel,
    )
    state = claim(new_job(job_id, spec, T0), owner, T0)
    assert state is not None
    return state


def offer(now: float, start_s: float | None = None) -> Offer:
    w = Window(
        slice_id="local-g0-3g.20gb-0",
        node="local",
        pool="local",
        gpu_model="A100-40GB",
        profile="3g.20gb",
        mem_mib=19968,
        compute_share=3 / 7,
        start_s=now if start_s is None else start_s,
        end_s=now + 30.0,
    )
    return Offer(
        offer_id="o-1",
        round=1,
        window=w,
        slice_fence=0,
        slice_revision=0,
        issued_at=now,
        reply_by=now + 0.5,
        reply_to="_INBOX.x",
    )


def dispatched(state: JobState, now: float) -> JobState:
    """The job with one subjob in flight (granted and materialized at ``now``)."""
    o = offer(now)
    p = propose(state, o, now, LIMITS)
    assert p is not None
    grant = Grant(
        grant_id="g-1",
        offer_id=o.offer_id,
        round=1,
        job_id=state.job_id,
        tenant=state.spec.tenant,
        agent_id=state.owner_agent,
        window=o.window,
        candidate=p.candidates[0],
        fence=1,
        lease_until=now + 5.0,
        policy="fair",
        granted_at=now,
    )
    m = materialize(state, grant, now, LIMITS, state.owner_agent)
    assert m.subjob is not None
    return m.state


# --- takeover ----------------------------------------------------------------------------------------


def test_a_job_of_an_agent_heard_lately_stays_with_it() -> None:
    state = owned_job()
    for silent_s in (0.0, 5.0, LIVENESS_S):
        now = T0 + 100
        assert takeover(state, "agent-b", now - silent_s, now, LIVENESS_S) is None, silent_s


def test_a_job_of_a_silent_agent_is_taken_over_with_its_work_in_flight() -> None:
    state = dispatched(owned_job(), T0)
    now = T0 + 100
    taken = takeover(state, "agent-b", now - LIVENESS_S - 0.1, now, LIVENESS_S)
    assert taken is not None
    assert taken.owner_agent == "agent-b" and is_owned_by(taken, "agent-b")
    assert not is_owned_by(taken, "agent-a"), "the old owner finds it is no longer its job"
    # Nothing else changes: the subjob in flight is still awaited (or given up as overdue later).
    assert msgspec.structs.replace(taken, owner_agent="agent-a") == state
    assert len(taken.in_flight) == 1


def test_no_takeover_of_ones_own_unowned_finished_or_forged_jobs() -> None:
    now = T0 + 100
    long_ago = now - 10 * LIVENESS_S
    state = owned_job()
    assert takeover(state, "agent-a", long_ago, now, LIVENESS_S) is None, "its own job"
    unowned = msgspec.structs.replace(state, owner_agent="")
    assert takeover(unowned, "agent-b", long_ago, now, LIVENESS_S) is None, "claimed, not taken"
    cancelled = request_cancel(state, now)
    assert cancelled.status == "cancelled"
    assert takeover(cancelled, "agent-b", long_ago, now, LIVENESS_S) is None
    forged = msgspec.structs.replace(state, units_done=state.total_units + 1)
    assert takeover(forged, "agent-b", long_ago, now, LIVENESS_S) is None


def test_a_dead_agents_jobs_spread_over_the_live_ones_and_anyone_takes_them_later() -> None:
    live = ["agent-b", "agent-c", "agent-d"]
    jobs = [owned_job(f"job-{i}") for i in range(90)]
    now = T0 + 100
    just_dead = now - LIVENESS_S - 1.0
    takers: Counter[str] = Counter()
    for state in jobs:
        got = [a for a in live if takeover(state, a, just_dead, now, LIVENESS_S, live_agents=live)]
        assert got == [heir(state.job_id, live)], "exactly one agent, the job's heir, takes it first"
        takers[got[0]] += 1
    assert set(takers) == set(live) and min(takers.values()) >= 15, takers
    # The heir may be dead too: past twice the bound, any live agent takes it.
    long_dead = now - 2 * LIVENESS_S - 1.0
    for state in jobs[:10]:
        for a in live:
            taken = takeover(state, a, long_dead, now, LIVENESS_S, live_agents=live)
            assert taken is not None and taken.owner_agent == a


def test_the_heir_is_the_same_whatever_the_order_and_never_the_dead_owner() -> None:
    agents = ["agent-a", "agent-b", "agent-c"]
    for i in range(50):
        job = f"job-{i}"
        assert heir(job, agents) == heir(job, reversed(agents)) in agents
    assert heir("job-1", []) == ""
    state = owned_job("job-7", owner="agent-a")
    now = T0 + 100
    silent = now - LIVENESS_S - 1.0
    # The dead owner is in the caller's list (its last heartbeats): it is no heir.
    takers = [a for a in agents[1:] if takeover(state, a, silent, now, LIVENESS_S, live_agents=agents)]
    assert takers == [heir("job-7", agents[1:])]


# --- reaping -----------------------------------------------------------------------------------------


def test_past_due_is_overdues_time_test_alone() -> None:
    lease_s = 5.0
    state = dispatched(owned_job(), T0)
    (f,) = state.in_flight
    due = f.dispatched_at + f.time_cap_s + 2 * lease_s
    assert past_due(state, due - 0.01, lease_s) == []
    assert past_due(state, due + 0.01, lease_s) == [f]
    # overdue adds the slice's holder: still holding the grant, the subjob is not given up.
    assert overdue(state, {f.slice_id: f.grant_id}, due + 0.01, lease_s) == []
    assert overdue(state, {f.slice_id: None}, due + 0.01, lease_s) == [f]
    assert overdue(state, {f.slice_id: None}, due - 0.01, lease_s) == []


def test_a_subjob_with_no_completion_whose_slice_moved_on_is_given_up() -> None:
    state = new_job("j1", job_spec(), T0)
    state, sj = win_window(state, T0)
    (flight,) = state.in_flight
    late = flight.dispatched_at + flight.time_cap_s + 2 * 5.0 + 0.1
    # Too early, or the slice still holds the grant (running, or its completion is on its way).
    assert overdue(state, {sj.slice_id: None}, late - 1.0, lease_s=5.0) == []
    assert overdue(state, {sj.slice_id: sj.grant_id}, late, lease_s=5.0) == []
    for holder in (None, "g-someone-else"):
        assert overdue(state, {sj.slice_id: holder}, late, lease_s=5.0) == [flight]
    lost, applied = apply_completion(state, lost_completion(state, flight, late, "gone"), late)
    assert applied and not lost.in_flight and lost.units_done == 0
    assert [(r.start, r.count) for r in lost.retry] == [(sj.unit_start, sj.units)]
    # The real completion turning up afterwards is not applied: the units are done once.
    after, applied_late = apply_completion(lost, execute(sj, late + 1), late + 2)
    assert not applied_late and after == lost
    done, _ = run_to_completion(lost, late + 3)
    assert_covers_exactly(done)
