"""A job's life through the pure transitions, with subjobs executed in-process (no bus)."""

from __future__ import annotations

import itertools
import math
from typing import Any

import msgspec
import pytest

from sja.core.bidding import propose, resting
from sja.core.explain import NoBidKind, why_no_bid
from sja.core.jobs import (
    MAX_CONSECUTIVE_FAILURES,
    MAX_CONSECUTIVE_TIMEOUTS,
    Declined,
    apply_completion,
    can_take_more,
    capacity,
    fit_key,
    give_up,
    gpu_budget,
    held_gpus,
    hopeless,
    largest_live,
    materialize,
    never_fits,
    new_job,
    next_range,
    reference_width,
    request_cancel,
    settle,
    slots_left,
    timeout_backoff_s,
    validate_spec,
)
from sja.core.planner import PlanLimits
from sja.protocol.messages import (
    JobState,
    MemoryDecl,
    SliceState,
    TimeDecl,
)
from sja.workloads import SpecError, run_in_one_piece
from tests.unit.core._jobs_in_process import (
    LIMITS,
    MM_PARAMS,
    T0,
    assert_covers_exactly,
    execute,
    grant_for,
    offer_for,
    ok_ranges,
    run_to_completion,
    spec,
    win_window,
    window,
)

MC_PARAMS = {"units": 40, "samples_per_unit": 500, "seed": 5}


# --- the happy path ------------------------------------------------------------------------------


def test_new_job_is_pending_with_normalized_params_and_a_profile() -> None:
    state = new_job("j1", spec(params={"rows": 48}), T0)
    assert state.status == "pending"
    assert state.total_units == 48
    assert state.spec.params == {"rows": 48, "inner": 1024, "cols": 1024, "seed": 0}
    assert state.profile is not None
    assert state.submitted_at == T0
    assert next_range(state) == (0, 48)
    assert can_take_more(state)


@pytest.mark.parametrize(
    ("name", "params", "mode"),
    [
        ("matmul", MM_PARAMS, "sja"),
        ("matmul", MM_PARAMS, "jasda"),
        ("montecarlo", MC_PARAMS, "sja"),
        ("montecarlo", MC_PARAMS, "jasda"),
    ],
)
def test_job_cut_into_subjobs_gives_the_one_piece_result(
    name: str, params: dict[str, Any], mode: str
) -> None:
    state = new_job("j1", spec(workload=name, params=dict(params), mode=mode), T0)
    state, _ = run_to_completion(state, T0)
    assert state.status == "done"
    assert state.finished_at is not None and state.first_started_at is not None
    assert state.result == run_in_one_piece(name, params)
    assert state.units_done == state.total_units
    assert state.in_flight == [] and state.retry == []
    oks = ok_ranges(state)
    assert len(oks) >= 2, "the window should be too small for the job in one piece"
    assert_covers_exactly(state)
    # every subjob fitted what was planned for it
    for h in state.history:
        assert h.peak_mem_mib <= h.mem_cap_mib
    assert state.profile is not None and state.profile.observations == len(oks)


def test_materialize_never_exceeds_the_granted_candidate() -> None:
    state = new_job("j1", spec(), T0)
    big = window(T0, mem_mib=40_192, profile="7g.40gb", share=1.0)
    offer = offer_for(big, T0)
    proposal = propose(state, offer, T0, LIMITS)
    assert proposal is not None
    granted = msgspec.structs.replace(proposal.candidates[0], size=5)
    g = msgspec.structs.replace(grant_for(state, offer, proposal, T0), candidate=granted)
    mat = materialize(state, g, T0, LIMITS, "agent-1")
    assert mat.subjob is not None and mat.subjob.units == 5
    assert mat.state.next_unit == 5
    assert mat.subjob.mem_cap_mib == 40_192 - int(LIMITS.mem_reserve_mib)
    assert mat.subjob.fence == g.fence and mat.subjob.grant_id == g.grant_id


def test_a_subjob_carries_its_planned_start_up_and_first_unit_and_is_not_stopped_before() -> None:
    from sja.core.stopping import stop_grace

    state = new_job("j1", spec(time=TimeDecl(warmup_s=5.0, per_unit_s=0.5, rel_sd=0.2)), T0)
    big = window(T0, mem_mib=40_192, profile="7g.40gb", share=1.0)
    offer = offer_for(big, T0)
    proposal = propose(state, offer, T0, LIMITS)
    assert proposal is not None
    mat = materialize(state, grant_for(state, offer, proposal, T0), T0, LIMITS, "agent-1")
    sj = mat.subjob
    assert sj is not None
    # Its start-up and one unit, at the planning quantile: more than the declared 5.5 s, within the cap.
    assert 5.5 < sj.first_unit_s <= sj.time_cap_s
    grace = stop_grace(sj.time_cap_s, sj.first_unit_s, 30.0)
    assert sj.time_cap_s - grace >= sj.first_unit_s - 1e-9
    # What the job asks, when the window leaves room; never before half the window nor before the
    # start-up and first unit.
    assert stop_grace(100.0, 10.0, 30.0) == 30.0
    assert stop_grace(8.0, 5.0, 30.0) == 3.0
    assert stop_grace(8.0, 0.0, 30.0) == 4.0
    assert stop_grace(8.0, 0.5, 30.0) == 4.0
    assert stop_grace(8.0, 9.0, 30.0) == 0.0


def test_a_declined_grant_delivered_again_never_becomes_a_subjob() -> None:
    """A job at its ``max_parallel`` declines a second grant (its slice is given back); once the job
    can take work again, a copy of that grant must not become a subjob: its lease may belong to
    another job by then."""
    state, _ = win_window(new_job("j1", spec(), T0), T0)  # max_parallel 1: one subjob in flight
    offer = offer_for(window(T0, slice_id="local-g0-1g.5gb-3"), T0)
    other = new_job("j2", spec(), T0)
    proposal = propose(other, offer, T0, LIMITS)
    assert proposal is not None
    g = msgspec.structs.replace(grant_for(state, offer, proposal, T0), job_id="j1")
    declined = materialize(state, g, T0, LIMITS, "agent-1")
    assert declined.subjob is None and declined.reason == "job cannot take more work now"
    assert declined.state.declined_grants == [g.grant_id]
    (flight,) = declined.state.in_flight
    freed = msgspec.structs.replace(declined.state, in_flight=[], next_unit=flight.unit_start)
    again = materialize(freed, g, T0 + 1, LIMITS, "agent-1")
    assert again.subjob is None and again.reason == "grant already declined" and again.state == freed
    fresh = msgspec.structs.replace(g, grant_id="g-other")
    assert materialize(freed, fresh, T0 + 1, LIMITS, "agent-1").subjob is not None, "only that grant"


def test_duplicate_completion_is_ignored() -> None:
    state = new_job("j1", spec(), T0)
    state, sj = win_window(state, T0)
    c = execute(sj, T0 + 0.2)
    once, applied = apply_completion(state, c, T0 + 1.0)
    assert applied
    twice, applied_again = apply_completion(once, c, T0 + 2.0)
    assert not applied_again
    assert twice == once
    assert twice.units_done == sj.units


def test_completion_from_a_stale_grant_is_ignored() -> None:
    state = new_job("j1", spec(), T0)
    state, sj = win_window(state, T0)
    stale = msgspec.structs.replace(execute(sj, T0), grant_id="g-someone-else")
    after, applied = apply_completion(state, stale, T0 + 1.0)
    assert not applied and after == state


# --- failures --------------------------------------------------------------------------------------


def test_oom_puts_the_range_back_and_a_smaller_subjob_covers_it() -> None:
    state = new_job("j1", spec(), T0)
    state, first = win_window(state, T0)
    # the subjob needed far more memory than declared
    state, applied = apply_completion(
        state, execute(first, T0, status="oom", peak=first.mem_cap_mib + 1.0), T0 + 1.0
    )
    assert applied
    assert state.status == "running"
    assert state.units_done == 0
    assert [(r.start, r.count) for r in state.retry] == [(first.unit_start, first.units)]
    assert next_range(state) == (first.unit_start, first.units)
    # the same slice is planned smaller now
    state, retry_sj = win_window(state, T0 + 1.0)
    assert retry_sj.unit_start == first.unit_start
    assert retry_sj.units < first.units
    assert retry_sj.planned_mem_q_mib > first.planned_mem_q_mib * retry_sj.units / first.units
    state, _ = apply_completion(state, execute(retry_sj, T0 + 1.2), T0 + 2.0)
    state, _ = run_to_completion(state, T0 + 2.0)
    assert state.status == "done"
    assert state.result == run_in_one_piece("matmul", MM_PARAMS)
    assert_covers_exactly(state)
    assert [h.status for h in state.history].count("oom") == 1


def test_timeout_puts_the_range_back_and_the_job_still_finishes() -> None:
    state = new_job("j1", spec(), T0)
    state, first = win_window(state, T0)
    state, applied = apply_completion(state, execute(first, T0, status="timeout"), T0 + 31.0)
    assert applied
    assert state.retry and state.retry[0].start == first.unit_start
    assert state.profile is not None and state.profile.timeout_bounds
    # the rest runs on a whole GPU (seven times faster than the slice that timed out)
    state, _ = run_to_completion(
        state, T0 + 31.0, mem_mib=40_192, profile="7g.40gb", share=1.0, slice_id="local-g1-7g"
    )
    assert state.status == "done"
    assert state.result == run_in_one_piece("matmul", MM_PARAMS)
    assert_covers_exactly(state)


def test_repeated_failures_fail_the_job() -> None:
    state = new_job("j1", spec(), T0)
    now = T0
    for i in range(MAX_CONSECUTIVE_FAILURES):
        assert state.status == "running" or i == 0
        state, sj = win_window(state, now)
        state, _ = apply_completion(state, execute(sj, now, status="failed"), now + 1.0)
        now += 1.0
    assert state.status == "failed"
    assert "gave up" in state.error
    assert state.finished_at == now
    assert propose(state, offer_for(window(now), now), now, LIMITS) is None


def test_a_final_failure_fails_the_job_at_once_with_its_reason() -> None:
    """A subjob whose job names what its node cannot give it (an interpreter that is not there):
    retrying cannot help, so the first such failure ends the job, with the subjob's reason."""
    state = new_job("j1", spec(), T0)
    state, sj = win_window(state, T0)
    why = "params.python: /opt/v/bin/python does not exist on node n1: install it on every executor node"
    failed = msgspec.structs.replace(execute(sj, T0, status="failed"), error=why, final=True)
    state, applied = apply_completion(state, failed, T0 + 1.0)
    assert applied and state.status == "failed" and state.error == why
    assert propose(state, offer_for(window(T0 + 2), T0 + 2), T0 + 2, LIMITS) is None


def test_a_subjob_lost_to_the_infrastructure_is_not_the_jobs_error() -> None:
    """A lease that lapsed before the subjob started (``lost``) is the infrastructure's loss, not the
    job's: the range runs again, the job ends ``done`` with no error, and the loss stays visible in
    the subjob's own entry of the history."""
    state = new_job("j1", spec(), T0)
    state, sj = win_window(state, T0)
    stale = msgspec.structs.replace(
        execute(sj, T0, status="lost"), error="lease lapsed before start (stale fence)"
    )
    state, applied = apply_completion(state, stale, T0 + 1.0)
    assert applied and state.status == "running"
    assert state.error == "", "a lost subjob is not the job's error while it runs"
    now = T0 + 1.0
    while state.status == "running":
        state, sj = win_window(state, now)
        state, _ = apply_completion(state, execute(sj, now), now + 1.0)
        now += 1.0
    assert state.status == "done" and state.error == ""
    assert state.result == run_in_one_piece("matmul", MM_PARAMS)
    lost = [h for h in state.history if h.status == "lost"]
    assert [h.error for h in lost] == ["lease lapsed before start (stale fence)"]


def test_a_done_job_shows_no_error_from_a_subjob_that_was_tried_again() -> None:
    """A subjob that timed out (which is the job's error while it runs) and whose range then
    completes: the job is done, without that error; the timeout stays in the history."""
    state = new_job("j1", spec(), T0)
    state, sj = win_window(state, T0)
    late = msgspec.structs.replace(execute(sj, T0, status="timeout"), error="exceeded the window of 3.00s")
    state, _ = apply_completion(state, late, T0 + 1.0)
    assert state.error == "exceeded the window of 3.00s"
    now = max(T0 + 1.0, state.bids_again_at)
    while state.status == "running":
        now = max(now, state.bids_again_at)
        state, sj = win_window(state, now)
        state, _ = apply_completion(state, execute(sj, now), now + 1.0)
        now += 1.0
    assert state.status == "done" and state.error == ""
    assert any(h.status == "timeout" and h.error.startswith("exceeded") for h in state.history)


def test_a_success_resets_the_failure_count() -> None:
    state = new_job("j1", spec(), T0)
    now = T0
    for _ in range(MAX_CONSECUTIVE_FAILURES - 1):
        state, sj = win_window(state, now)
        state, _ = apply_completion(state, execute(sj, now, status="lost"), now + 1.0)
        now += 1.0
    state, sj = win_window(state, now)
    state, _ = apply_completion(state, execute(sj, now), now + 1.0)
    assert state.attempt_failures == 0
    state, sj = win_window(state, now + 1.0)
    state, _ = apply_completion(state, execute(sj, now + 1.0, status="failed"), now + 2.0)
    assert state.status == "running"


def test_a_job_that_keeps_timing_out_fails_with_the_reason() -> None:
    """Timeouts count toward giving up: each one makes the next subjob smaller and the job wait
    longer before its next bid; after ``MAX_CONSECUTIVE_TIMEOUTS`` with no subjob done between, the
    job fails saying so (before, it retried for ever)."""
    state = new_job("j1", spec(), T0)
    now = T0
    waits: list[float] = []
    sizes: list[int] = []
    for i in range(MAX_CONSECUTIVE_TIMEOUTS):
        assert state.status == "running" or i == 0
        now = max(now, state.bids_again_at)
        assert not resting(state, now)
        state, sj = win_window(state, now)
        sizes.append(sj.units)
        c = msgspec.structs.replace(execute(sj, now, status="timeout"), error="exceeded the window of 3.00s")
        now += 1.0
        state, applied = apply_completion(state, c, now)
        assert applied and state.timeouts_in_row == i + 1
        waits.append(state.bids_again_at - now if state.bids_again_at else 0.0)
        if state.status == "running":
            assert resting(state, now) == (waits[-1] > 0)
    assert state.status == "failed"
    assert state.error.startswith(f"timed out {MAX_CONSECUTIVE_TIMEOUTS} times in a row: exceeded the window")
    assert state.finished_at == now
    # Nothing after the first (it plans smaller at once), then longer after each further one.
    assert waits[0] == 0.0 and all(b > a for a, b in itertools.pairwise(waits[1:-1]))
    assert waits[1:-1] == [timeout_backoff_s(n) for n in range(2, MAX_CONSECUTIVE_TIMEOUTS)]
    assert sizes[-1] < sizes[0]


def test_work_done_resets_the_timeouts_and_the_back_off() -> None:
    state = new_job("j1", spec(), T0)
    now = T0
    for _ in range(MAX_CONSECUTIVE_TIMEOUTS - 1):
        now = max(now, state.bids_again_at)
        state, sj = win_window(state, now)
        now += 1.0
        state, _ = apply_completion(state, execute(sj, now, status="timeout"), now)
    assert state.timeouts_in_row == MAX_CONSECUTIVE_TIMEOUTS - 1 and resting(state, now)
    now = state.bids_again_at
    state, sj = win_window(state, now)
    state, _ = apply_completion(state, execute(sj, now), now + 1.0)
    assert state.status == "running" and state.timeouts_in_row == 0 and not resting(state, now + 1.0)
    state, sj = win_window(state, now + 1.0)
    state, _ = apply_completion(state, execute(sj, now + 1.0, status="timeout"), now + 2.0)
    assert state.status == "running" and state.timeouts_in_row == 1


# --- cancel and parallelism -----------------------------------------------------------------------


def test_cancel_with_nothing_in_flight_is_immediate() -> None:
    state = new_job("j1", spec(), T0)
    cancelled = request_cancel(state, T0 + 5.0)
    assert cancelled.status == "cancelled"
    assert cancelled.finished_at == T0 + 5.0
    assert propose(cancelled, offer_for(window(T0), T0), T0 + 6.0, LIMITS) is None
    # cancelling a finished job changes nothing
    assert request_cancel(cancelled, T0 + 9.0) == cancelled


def test_cancel_with_work_in_flight_waits_for_it() -> None:
    state = new_job("j1", spec(), T0)
    state, sj = win_window(state, T0)
    state = request_cancel(state, T0 + 0.5)
    assert state.cancel_requested and state.status == "running"
    assert propose(state, offer_for(window(T0), T0 + 0.6), T0 + 0.6, LIMITS) is None
    state, applied = apply_completion(state, execute(sj, T0 + 0.2), T0 + 1.0)
    assert applied
    assert state.status == "cancelled"
    assert state.finished_at == T0 + 1.0


def test_cancel_of_a_done_job_is_a_no_op() -> None:
    state, _ = run_to_completion(new_job("j1", spec(), T0), T0)
    assert request_cancel(state, T0 + 100.0) == state


def test_max_parallel_is_respected() -> None:
    mc = spec(workload="montecarlo", params=dict(MC_PARAMS), max_parallel=2)
    state = new_job(
        "j1",
        msgspec.structs.replace(mc, memory=MemoryDecl(base_mib=100.0, per_unit_mib=500.0, rel_sd=0.1)),
        T0,
    )
    state, a = win_window(state, T0, window(T0, slice_id="s-a"))
    p = propose(state, offer_for(window(T0, slice_id="s-b"), T0), T0, LIMITS)
    assert p is not None and p.capacity == 1
    state, b = win_window(state, T0, window(T0, slice_id="s-b"))
    assert len(state.in_flight) == 2
    assert propose(state, offer_for(window(T0, slice_id="s-c"), T0), T0, LIMITS) is None
    # a grant that arrives anyway is declined, and counted as seen
    stale_offer = offer_for(window(T0, slice_id="s-c"), T0)
    g = grant_for(state, stale_offer, p, T0)
    mat = materialize(state, g, T0, LIMITS, "agent-1")
    assert mat.subjob is None and mat.reason
    assert mat.state.grants_seen == state.grants_seen + 1
    assert mat.state.in_flight == state.in_flight
    # completions arrive out of order; the slots free up
    state, _ = apply_completion(state, execute(b, T0 + 0.3), T0 + 1.0)
    assert propose(state, offer_for(window(T0 + 1.0), T0 + 1.0), T0 + 1.0, LIMITS) is not None
    state, _ = apply_completion(state, execute(a, T0 + 0.3), T0 + 1.1)
    state, _ = run_to_completion(state, T0 + 2.0)
    assert state.result == run_in_one_piece("montecarlo", MC_PARAMS)
    assert_covers_exactly(state)


def _mig_window(now: float, profile: str, slice_id: str) -> Any:
    sevenths = int(profile[0])
    return window(now, mem_mib=20000, profile=profile, share=sevenths / 7, slice_id=slice_id)


def test_a_one_gpu_budget_runs_on_a_4g_and_a_3g_slice_and_no_more() -> None:
    mc = spec(workload="montecarlo", params=dict(MC_PARAMS), max_parallel=7, gpus=1.0)
    state = new_job("j1", mc, T0)
    assert gpu_budget(state.spec) == 1.0 and reference_width(state.spec) == 1
    assert capacity(state, 4 / 7) == 1 and capacity(state, 3 / 7) == 2 and capacity(state, 1.0) == 1
    state, a = win_window(state, T0, _mig_window(T0, "4g.20gb", "s-4g"))
    # the 4g slice's subjob holds 4/7 of the work left, open to the end of it
    assert a.unit_start + (a.max_units or a.units) == math.ceil(40 * 4 / 7)
    assert held_gpus(state) == pytest.approx(4 / 7)
    assert capacity(state, 4 / 7) == 0 and capacity(state, 3 / 7) == 1 and slots_left(state) == 1
    assert propose(state, offer_for(_mig_window(T0, "4g.20gb", "s-4g-b"), T0), T0, LIMITS) is None
    owned = msgspec.structs.replace(state, owner_agent="agent-1")
    why = why_no_bid(owned, _mig_window(T0, "4g.20gb", "s-4g-b"), T0, LIMITS)
    assert why.kind is NoBidKind.AT_GPUS and "0.57 of its 1 GPUs" in why.text
    state, b = win_window(state, T0, _mig_window(T0, "3g.20gb", "s-3g"))
    assert b.unit_start == a.unit_start + (a.max_units or a.units)  # the rest of the units
    assert b.unit_start + (b.max_units or b.units) == 40
    assert held_gpus(state) == pytest.approx(1.0)
    assert not can_take_more(state) and slots_left(state) == 0
    # a grant for one more slice, however small, is declined: one GPU's worth is held
    offer = offer_for(window(T0, slice_id="s-1g"), T0)
    mat = materialize(state, grant_for(state, offer, _any_proposal(state, offer), T0), T0, LIMITS, "a")
    assert mat.subjob is None and mat.reason is Declined.CANNOT_TAKE_MORE
    state, _ = apply_completion(state, execute(a, T0 + 0.3), T0 + 1.0)
    assert capacity(state, 4 / 7) == 1
    state, _ = apply_completion(state, execute(b, T0 + 0.3), T0 + 1.1)
    state, _ = run_to_completion(state, T0 + 2.0)
    assert state.result == run_in_one_piece("montecarlo", MC_PARAMS)
    assert_covers_exactly(state)


def _any_proposal(state: JobState, offer: Any) -> Any:
    """A proposal as the job made it for an earlier offer (a grant that arrives anyway)."""
    fresh = new_job(state.job_id, state.spec, T0)
    p = propose(fresh, offer, T0, LIMITS)
    assert p is not None
    return p


def test_a_budget_under_a_slice_still_starts_one_subjob_and_the_default_is_whole_gpus() -> None:
    small = new_job("j1", spec(workload="montecarlo", params=dict(MC_PARAMS), max_parallel=4, gpus=0.3), T0)
    assert capacity(small, 4 / 7) == 1 and slots_left(small) == 1
    small, _ = win_window(small, T0, _mig_window(T0, "4g.20gb", "s-4g"))
    assert capacity(small, 1 / 7) == 0 and not can_take_more(small)
    # no gpus: max_parallel subjobs, each on a slice of any size (as before budgets)
    plain = new_job("j2", spec(workload="montecarlo", params=dict(MC_PARAMS), max_parallel=2), T0)
    plain, _ = win_window(plain, T0, window(T0, mem_mib=80000, profile="7g.80gb", share=1.0, slice_id="s-7g"))
    assert capacity(plain, 1.0) == 1 and gpu_budget(plain.spec) == 2.0 and reference_width(plain.spec) == 2


def test_settle_leaves_a_job_with_work_left_alone() -> None:
    state = new_job("j1", spec(), T0)
    assert settle(state, T0) == state


# --- bad specs -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"workload": "sorting"}, "facts"),  # not built in: a tenant's, planned by its facts
        ({"params": {"rows": 10, "colz": 3}}, "params.colz"),
        ({"params": {"rows": 0}}, "params.rows"),
        ({"params": {"rows": "ten"}}, "params.rows"),
        ({"params": {"rows": 10}, "min_units": 11}, "min_units"),
        ({"workload": "montecarlo", "params": {"units": 5, "seed": -1}}, "params.seed"),
        ({"gpus": 2.0, "max_parallel": 1}, "gpus"),
    ],
)
def test_bad_specs_raise_spec_error_naming_the_field(overrides: dict[str, Any], field: str) -> None:
    bad = spec(**overrides)
    with pytest.raises(SpecError) as exc:
        new_job("j1", bad, T0)
    assert exc.value.field == field
    assert str(exc.value).startswith(f"{field}: ")
    with pytest.raises(SpecError):
        validate_spec(bad)


def test_min_units_equal_to_total_is_accepted() -> None:
    _, total = validate_spec(spec(params={"rows": 10}, min_units=10))
    assert total == 10


def test_a_job_whose_smallest_subjob_failed_and_fits_no_window_offered_fails_with_the_reason() -> None:
    # room for one unit at its declared peak (100 + 200 k MiB), in 700 - 256 MiB usable
    tiny = dict(mem_mib=700, profile="1g.5gb", slice_id="local-g0-1g.5gb-3")
    state = new_job("j1", spec(), T0)
    state, sj = win_window(state, T0, window(T0, **tiny))  # type: ignore[arg-type]
    assert sj.units == 1
    never_failed = settle(state, T0)
    assert hopeless(never_failed, window(T0, mem_mib=300, length_s=30.0), T0, LIMITS) is None, (
        "a job that has not failed yet waits for a window it fits, however long"
    )
    state, applied = apply_completion(state, execute(sj, T0, status="oom", peak=2_000.0), T0 + 1.0)
    assert applied and state.status not in ("failed", "done") and not state.in_flight
    small = msgspec.structs.replace(window(T0 + 2, **tiny), end_s=None)  # type: ignore[arg-type]
    reason = hopeless(state, small, T0 + 2, LIMITS)
    assert reason is not None and "ran out of memory" in reason and "700 MiB" in reason
    assert hopeless(state, window(T0 + 2, mem_mib=4864), T0 + 2, LIMITS) is None, (
        "a larger slice still takes it"
    )
    failed = give_up(state, reason, T0 + 2)
    assert failed.status == "failed" and failed.error == reason and failed.finished_at == T0 + 2


def test_a_job_whose_smallest_subjob_timed_out_gets_a_longer_window_and_never_fails_for_time() -> None:
    # A free slice's window is open-ended: it is as long as the smallest subjob needs at its
    # quantile, which a timeout raises. A rigid scheduler would hold the slice for the whole job.
    slow = spec(time=TimeDecl(warmup_s=0.1, per_unit_s=0.01, rel_sd=0.3), min_units=48)
    state = new_job("j1", slow, T0)
    whole = dict(mem_mib=40_192, profile="7g.40gb", share=1.0, slice_id="local-g1-7g")
    state, sj = win_window(state, T0, window(T0, length_s=5.0, **whole))  # type: ignore[arg-type]
    assert sj.units == 48
    state, _ = apply_completion(state, execute(sj, T0, status="timeout"), T0 + 5.0)
    longest = msgspec.structs.replace(window(T0 + 6, **whole), end_s=None)  # type: ignore[arg-type]
    short_horizon = PlanLimits(horizon_s=5.0)  # as long as the window it ran out of
    assert hopeless(state, longest, T0 + 6, short_horizon) is None
    offer = offer_for(longest, T0 + 6)
    proposal = propose(state, offer, T0 + 6, short_horizon)
    assert proposal is not None and proposal.candidates[0].size == 48
    granted = materialize(state, grant_for(state, offer, proposal, T0 + 6), T0 + 6, short_horizon, "a")
    assert granted.subjob is not None and granted.subjob.time_cap_s > sj.time_cap_s


def a_slice(slice_id: str, profile: str, mem_mib: int, share: float, **fields: Any) -> SliceState:
    return SliceState(
        slice_id=slice_id,
        node="n",
        pool="n",
        gpu_index=0,
        gpu_model="A100-40GB",
        profile=profile,
        mem_mib=mem_mib,
        compute_slots=max(1, round(7 * share)),
        compute_share=share,
        **fields,
    )


def test_never_fits_answers_of_the_largest_live_slice_alone_as_of_every_slice() -> None:
    """The gateway keeps ``largest_live`` and asks ``never_fits`` of it alone: the same answer."""
    small = a_slice("s-1g", "1g.5gb", 4864, 1 / 7)
    mid = a_slice("s-3g", "3g.20gb", 19968, 3 / 7)
    big = a_slice("s-7g", "7g.40gb", 40192, 1.0)
    twin = a_slice("s-7g-b", "7g.40gb", 40192, 1.0)
    recuttable = a_slice("s-1g-r", "1g.5gb", 4864, 1 / 7, recut_mib=40192)
    offline_big = msgspec.structs.replace(big, status="offline")
    inventories = [
        [],
        [small],
        [small, mid],
        [small, mid, big],
        [small, mid, offline_big],
        [offline_big],
        [big, twin, small],
        [small, recuttable, mid],
    ]
    jobs = [
        new_job(f"j{mib}", spec(memory=MemoryDecl(base_mib=mib, per_unit_mib=0.0)), T0)
        for mib in (100.0, 4000.0, 10_000.0, 30_000.0, 60_000.0)
    ]
    jobs.append(new_job("j-unknown", spec(memory=None), T0))
    for slices in inventories:
        largest = largest_live(slices)
        for state in jobs:
            alone = never_fits(state, [largest] if largest is not None else [], LIMITS)
            assert alone == never_fits(state, slices, LIMITS), ([s.slice_id for s in slices], state.job_id)
    assert largest_live([small, mid, offline_big]) is mid
    assert largest_live([offline_big]) is None
    assert largest_live([twin, big]) is twin  # ties broken by id, whatever the order
    assert largest_live([small, recuttable, mid]) is recuttable


def test_a_lease_leaves_what_never_fits_reads_of_a_slice_as_it_was() -> None:
    free = a_slice("s-7g", "7g.40gb", 40192, 1.0)
    leased = msgspec.structs.replace(
        free, status="busy", fence=4, holder_job="j1", grant_id="g-4", lease_until=T0 + 60, updated_at=T0
    )
    assert fit_key(leased) == fit_key(free)
    assert fit_key(msgspec.structs.replace(free, status="offline")) != fit_key(free)
    assert fit_key(msgspec.structs.replace(free, mem_mib=19968, profile="3g.20gb")) != fit_key(free)
    assert fit_key(msgspec.structs.replace(free, recut_mib=81920)) != fit_key(free)
