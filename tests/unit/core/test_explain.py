"""``sja.core.explain``: the reasons a job sends no bid, deadlines judged under every policy, and the
order of the waiting jobs."""

from __future__ import annotations

import math
from collections.abc import Sequence

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from sja.core import jobs as J
from sja.core.continuation import AGEING, DUE_KEY
from sja.core.explain import (
    NoBidKind,
    deadline_note,
    deadline_status,
    explain,
    is_waiting,
    memory_overrun,
    queue_order,
    why_no_bid,
)
from sja.core.planner import PlanLimits
from sja.core.policies import POLICIES
from sja.core.profiles import JobProfile
from sja.core.shadow import DUE_SLACK
from sja.protocol.messages import (
    InFlight,
    JobSpec,
    JobState,
    MemoryDecl,
    RoundRecord,
    SubjobSummary,
    Verdict,
    Window,
)

LIMITS = PlanLimits(mem_reserve_mib=256.0, start_overhead_s=0.3, horizon_s=8.0)


def window(mem: int = 40_448, profile: str = "3g.40gb") -> Window:
    return Window(
        slice_id=f"n-g0-{profile}-0", node="n", pool="p", gpu_model="A100", profile=profile,
        mem_mib=mem, compute_share=0.5, start_s=0.0,
    )  # fmt: skip


def job(**spec: object) -> J.JobState:
    s = JobSpec(name="j", tenant="t", workload="montecarlo", params={"units": 10}, **spec)  # type: ignore[arg-type]
    state = J.new_job("j-1", s, 100.0, window_s=7.7)
    return msgspec.structs.replace(state, owner_agent="agent-0")


def test_too_much_memory_names_the_planners_quantile_and_the_slice() -> None:
    state = job(memory=MemoryDecl(base_mib=100_000, per_unit_mib=10))
    assert state.profile is not None
    need = JobProfile.from_state(state.profile).mem_quantile(1, 0.95)
    no_bid = why_no_bid(state, window(), 101.0, LIMITS)
    assert no_bid.kind is NoBidKind.TOO_LITTLE_MEMORY
    assert no_bid.text == (
        f"its smallest subjob (1 unit) needs {need:,.0f} MiB at eps_mem 0.05, and this 3g.40gb slice "
        "holds 40,448 MiB (40,192 usable after the 256 MiB reserve)"
    )


def test_other_reasons() -> None:
    state = job(max_parallel=1)
    flight = InFlight(
        subjob_id="j-1.s0", grant_id="g", slice_id="x", unit_start=0, units=2, dispatched_at=100.0,
        time_cap_s=5.0, profile="1g.5gb", compute_share=0.14, planned_mem_q_mib=1.0, planned_duration_q_s=1.0,
    )  # fmt: skip
    busy = msgspec.structs.replace(state, in_flight=[flight], next_unit=2)
    assert why_no_bid(busy, window(), 101.0, LIMITS) == (
        NoBidKind.AT_MAX_PARALLEL,
        "it is at its max_parallel (1): 1 subjob running",
    )
    cancelling = msgspec.structs.replace(state, cancel_requested=True)
    assert "cancellation was requested" in why_no_bid(cancelling, window(), 101.0, LIMITS).text
    unowned = msgspec.structs.replace(state, owner_agent="")
    assert why_no_bid(unowned, window(), 101.0, LIMITS).text == "no agent had taken the job on yet"
    assert "could have bid" in why_no_bid(state, window(), 101.0, LIMITS).text
    assert why_no_bid(state, window(), 101.0, LIMITS).kind is NoBidKind.SAT_OUT
    assert why_no_bid(cancelling, window(), 101.0, LIMITS).kind is NoBidKind.CANCELLING


def test_deadlines_are_judged_whatever_the_policy() -> None:
    state = job(deadline_s=10.0)
    assert deadline_status(state, 105.0).verdict == "open"  # type: ignore[union-attr]
    late = msgspec.structs.replace(state, status="done", finished_at=112.5)
    d = deadline_status(late, 200.0)
    assert d is not None and d.verdict == "missed" and "missed by 2.5 s" in d.text
    on_time = msgspec.structs.replace(state, status="done", finished_at=104.0)
    assert deadline_status(on_time, 200.0).verdict == "met"  # type: ignore[union-attr]
    assert deadline_status(job(), 200.0) is None
    assert deadline_note("sla", state.spec) is None and deadline_note("jasda", state.spec) is None
    assert "fair" in (deadline_note("fair", state.spec) or "")
    assert deadline_note("fair", job().spec) is None


def test_queue_order_under_fair_and_sla() -> None:
    a = msgspec.structs.replace(job(), job_id="a", attained_gpu_s=5.0)
    b = msgspec.structs.replace(job(deadline_s=50.0), job_id="b", submitted_at=101.0)
    c = msgspec.structs.replace(job(deadline_s=20.0), job_id="c", submitted_at=102.0)
    fair, _ = queue_order("fair", [a, b, c])
    assert [s.job_id for s in fair] == ["b", "c", "a"]  # one tenant: the least attained job first
    sla, words = queue_order("sla", [a, b, c])
    assert [s.job_id for s in sla] == ["c", "b", "a"] and "deadline" in words


# --- the same as before the policies were asked: a frozen copy of what explain did -----------------


def queue_order_before(policy: str, jobs: Sequence[JobState]) -> tuple[list[JobState], str]:
    waiting = [s for s in jobs if is_waiting(s)]
    if policy == "fair":
        tenant_gpu_s: dict[str, float] = {}
        for s in jobs:
            tenant_gpu_s[s.spec.tenant] = tenant_gpu_s.get(s.spec.tenant, 0.0) + s.attained_gpu_s
        # fair's order within a tenant has since counted a job's age, and put a job due against the
        # rigid reference first (continuation.service_key)
        waiting.sort(
            key=lambda s: (
                tenant_gpu_s[s.spec.tenant],
                DUE_KEY + s.due_at if s.due_at > 0 else s.attained_gpu_s + AGEING * s.submitted_at,
                s.submitted_at,
                s.job_id,
            )
        )
        return waiting, (
            "fair: the tenant with the least GPU-seconds first (shares taken as equal), then its jobs due "
            "against the rigid reference, earliest to finish by first, then its job with the least "
            "GPU-seconds, "
            f"less {AGEING:g} GPU-s per second since its submission, then the earliest submitted"
        )
    if policy == "sla":

        def due(s: JobState) -> float:
            return s.submitted_at + s.spec.deadline_s if s.spec.deadline_s is not None else math.inf

        waiting.sort(key=lambda s: (due(s), s.submitted_at, s.job_id))
        return waiting, "sla: the earliest deadline first, jobs without one after, by submission"
    waiting.sort(key=lambda s: (s.submitted_at, s.job_id))
    what = f"{policy}: " if policy else ""
    return waiting, (
        f"{what}by submission (this policy ranks the bids of each window by how well they fit it, "
        "so the order changes from one window to the next)"
    )


def deadline_note_before(policy: str, spec: JobSpec) -> str | None:
    if spec.deadline_s is None or policy in ("sla", "jasda"):
        return None
    if not policy:
        return (
            "deadline_s is read only by the sla and jasda policies (no round cleared lately tells "
            "which one runs): `sja status` shows whether the deadline is met"
        )
    return (
        f"deadline_s is read only by the sla and jasda policies; rounds are cleared under {policy}, "
        "which does not: `sja status` shows whether the deadline is met"
    )


def queued(
    n: int, tenant: str, at: float, attained: float, deadline: float | None, done: bool, due: float = 0.0
) -> JobState:
    spec = JobSpec(name="j", tenant=tenant, workload="montecarlo", params={"units": 10}, deadline_s=deadline)
    state = J.new_job(f"j{n:02d}", spec, at, window_s=7.7)
    return msgspec.structs.replace(
        state, attained_gpu_s=attained, status="done" if done else state.status, due_at=due
    )


queued_st = st.builds(
    queued,
    st.integers(0, 30),
    st.sampled_from(["a", "b", "c"]),
    st.sampled_from([100.0, 101.0]) | st.floats(0.0, 1_000.0),
    st.sampled_from([0.0, 5.0]) | st.floats(0.0, 100.0),
    st.none() | st.sampled_from([10.0, 20.0]) | st.floats(0.5, 500.0),
    st.booleans(),
    st.sampled_from([0.0, 0.0, 150.0, 200.0]),
)


@settings(max_examples=300, deadline=None)
@given(
    policy=st.sampled_from(["", "unknown", *POLICIES]),
    jobs=st.lists(queued_st, max_size=12, unique_by=lambda s: s.job_id),
)
def test_the_queue_and_the_deadline_note_are_what_they_were(policy: str, jobs: list[JobState]) -> None:
    assert queue_order(policy, jobs) == queue_order_before(policy, jobs)
    for s in jobs:
        assert deadline_note(policy, s.spec) == deadline_note_before(policy, s.spec)


def test_explain_reports_each_window_shapes_last_offer() -> None:
    state = job(memory=MemoryDecl(base_mib=100_000, per_unit_mib=10))
    other = msgspec.structs.replace(job(), job_id="k-2")

    def record(offer: str, at: float, w: Window, verdicts: list[Verdict]) -> RoundRecord:
        return RoundRecord(
            offer_id=offer, round=1, window=w, policy="fair", replies_from=["agent-0"], verdicts=verdicts,
            opened_at=at,
        )  # fmt: skip

    lost = Verdict(job_id="j-1", tenant="t", agent_id="agent-0", won=False, reason="lost to k-2: x vs y")
    records = [
        record("o1", 101.0, window(), [lost]),
        record("o2", 102.0, window(), []),  # the later offer of the same shape stands
        record("o3", 101.5, window(4_864, "1g.5gb"), [lost]),
    ]
    e = explain(state, records, [state, other], 103.0, LIMITS)
    assert [(w.offer_id, w.outcome) for w in e.windows] == [("o2", "no_bid"), ("o3", "lost")]
    assert e.windows[1].reason == "lost to k-2: x vs y" and e.policy == "fair"
    assert (e.position, e.waiting) == (1, 2)  # equal attained service: by submission, then id
    assert not any("fits none" in n for n in e.notes)  # it did bid on one shape


def ran(seq: int, units: int, peak: float, status: str = "ok") -> SubjobSummary:
    return SubjobSummary(
        subjob_id=f"j-1.s{seq}", slice_id="x", profile="1g.5gb", status=status, unit_start=seq * units,
        units=units, planned_mem_q_mib=400.0, peak_mem_mib=peak, mem_cap_mib=4608, planned_duration_q_s=1.0,
        duration_s=0.5, time_cap_s=5.0, started_at=100.0, finished_at=101.0,
    )  # fmt: skip


def test_a_peak_above_the_declaration_is_said_with_the_subjobs_and_what_to_declare() -> None:
    # the case: declared 400 MiB, measured 805-986 MiB in some subjobs
    state = job(memory=MemoryDecl(base_mib=400, per_unit_mib=0))
    history = [ran(0, 1, 350.0), ran(1, 1, 399.0), ran(3, 1, 805.0), ran(4, 1, 986.0), ran(7, 1, 900.0)]
    state = msgspec.structs.replace(state, history=history)
    over = memory_overrun(state)
    assert over is not None
    assert over.subjobs == (3, 4, 7)
    assert over.text == (
        "measured 986 MiB, above the declared 400 MiB (subjobs 3, 4, 7): declare at least 986 MiB"
    )
    # explain (and so the dashboard's job page) says it, whatever the job's state
    e = explain(msgspec.structs.replace(state, status="done"), [], [], 200.0, LIMITS)
    assert over.text in e.notes


def test_a_per_unit_declaration_is_scaled_by_the_worst_overrun() -> None:
    state = job(memory=MemoryDecl(base_mib=100, per_unit_mib=10))
    # 4 units declared 140 MiB and peaked at 280 (2x); 8 units declared 180 and peaked at 200
    state = msgspec.structs.replace(state, history=[ran(2, 4, 280.0), ran(5, 8, 200.0)])
    over = memory_overrun(state)
    assert over is not None and over.subjobs == (2, 5)
    assert over.text == (
        "measured 280 MiB, above the declared 140 MiB (100 + 10 per unit) (subjobs 2, 5): "
        "declare at least 200 MiB + 20 MiB per unit"
    )
    assert all(
        h.peak_mem_mib <= over.suggest_base_mib + over.suggest_per_unit_mib * h.units for h in state.history
    )


def test_no_memory_note_within_the_declaration_or_without_one() -> None:
    within = msgspec.structs.replace(
        job(memory=MemoryDecl(base_mib=400, per_unit_mib=0)), history=[ran(0, 1, 400.0)]
    )
    assert memory_overrun(within) is None
    undeclared = msgspec.structs.replace(
        job(memory=MemoryDecl(base_mib=0, per_unit_mib=0)), history=[ran(0, 1, 5000.0)]
    )
    assert memory_overrun(undeclared) is None
    assert not any("declare" in n for n in explain(within, [], [], 200.0, LIMITS).notes)


def test_many_overrunning_subjobs_are_counted_not_all_named() -> None:
    state = job(memory=MemoryDecl(base_mib=10, per_unit_mib=0))
    state = msgspec.structs.replace(state, history=[ran(i, 1, 20.0 + i) for i in range(12)])
    over = memory_overrun(state)
    assert over is not None
    assert "(subjobs 0, 1, 2, 3, 4, 5, 6, 7 and 4 more)" in over.text


def test_a_job_kept_at_its_declaration_for_want_of_evidence_is_told_so() -> None:
    # one small peak: the job stays planned at its declaration, and the slice it cannot have says why
    state = job(memory=MemoryDecl(base_mib=30_000, per_unit_mib=0))
    assert state.profile is not None
    p = JobProfile.from_state(state.profile)
    p.observe(1, 299.0, 0.1, "7g.40gb", 1.0, 39_936.0)
    state = msgspec.structs.replace(state, profile=p.to_state())
    no_bid = why_no_bid(state, window(4864, "1g.5gb"), 101.0, LIMITS)
    assert no_bid.kind is NoBidKind.TOO_LITTLE_MEMORY
    assert (
        "needs 30,000 MiB at eps_mem 0.05 (its declaration: 1 measured peak says too little of how its "
        in no_bid.text
    )


def test_a_due_job_is_told_it_is_due() -> None:
    state = job(memory=MemoryDecl(base_mib=400, per_unit_mib=0))
    assert not any("due against" in n for n in explain(state, [], [], 200.0, LIMITS).notes)
    due = msgspec.structs.replace(state, due_at=250.0)  # due to finish by 250
    (note,) = [n for n in explain(due, [], [], 200.0, LIMITS).notes if "due against" in n]
    assert note.startswith(
        "due against the rigid reference, to finish within 50 s: "
        f"it would finish more than {DUE_SLACK:g} times"
    )
    (note,) = [n for n in explain(due, [], [], 300.0, LIMITS).notes if "due against" in n]
    assert note.startswith("due against the rigid reference, 50 s past when it was to finish")
