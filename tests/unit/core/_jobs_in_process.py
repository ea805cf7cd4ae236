"""A job driven through the pure transitions with its subjobs executed in-process (no bus): the
spec, windows, offers and grants the tests of ``jobs``, ``bidding``, ``ownership`` and
``profile_cache`` share."""

from __future__ import annotations

from typing import Any

from sja.core.bidding import propose
from sja.core.jobs import apply_completion, materialize
from sja.core.planner import PlanLimits
from sja.protocol.messages import (
    Completion,
    Grant,
    JobSpec,
    JobState,
    MemoryDecl,
    Offer,
    Proposal,
    Subjob,
    TimeDecl,
    Window,
)
from sja.workloads import workload

LIMITS = PlanLimits(start_overhead_s=0.3)
T0 = 1_000.0
BASE_MIB = 100.0
PER_UNIT_MIB = 200.0


def true_peak(units: int) -> float:
    return BASE_MIB + PER_UNIT_MIB * units


MM_PARAMS = {"rows": 48, "inner": 16, "cols": 16, "seed": 11}


def spec(**overrides: Any) -> JobSpec:
    fields: dict[str, Any] = dict(
        name="mm",
        tenant="alice",
        workload="matmul",
        params=dict(MM_PARAMS),
        mode="sja",
        # big enough per unit that a 1g.5gb slice (4608 MiB usable) holds only ~20 rows
        memory=MemoryDecl(base_mib=BASE_MIB, per_unit_mib=PER_UNIT_MIB, rel_sd=0.1),
        time=TimeDecl(warmup_s=0.1, per_unit_s=0.01, rel_sd=0.3),
    )
    fields.update(overrides)
    return JobSpec(**fields)


def window(
    now: float,
    mem_mib: int = 4864,
    profile: str = "1g.5gb",
    share: float = 1 / 7,
    length_s: float = 30.0,
    slice_id: str = "local-g0-1g.5gb-2",
) -> Window:
    return Window(
        slice_id=slice_id,
        node="local",
        pool="local",
        gpu_model="A100-40GB",
        profile=profile,
        mem_mib=mem_mib,
        compute_share=share,
        start_s=now,
        end_s=now + length_s,
    )


_counter = {"n": 0}


def offer_for(w: Window, now: float) -> Offer:
    _counter["n"] += 1
    return Offer(
        offer_id=f"o-{_counter['n']}",
        round=_counter["n"],
        window=w,
        slice_fence=0,
        slice_revision=0,
        issued_at=now,
        reply_by=now + 0.5,
        reply_to="_INBOX.x",
    )


def grant_for(state: JobState, offer: Offer, proposal: Proposal, now: float) -> Grant:
    return Grant(
        grant_id=f"g-{offer.offer_id}",
        offer_id=offer.offer_id,
        round=offer.round,
        job_id=state.job_id,
        tenant=state.spec.tenant,
        agent_id="agent-1",
        window=offer.window,
        candidate=proposal.candidates[0],
        fence=offer.slice_fence + 1,
        lease_until=now + 10.0,
        policy="fair",
        granted_at=now,
    )


def win_window(state: JobState, now: float, w: Window | None = None) -> tuple[JobState, Subjob]:
    """Offer a window, let the job propose, grant it, materialize the subjob."""
    offer = offer_for(w or window(now), now)
    proposal = propose(state, offer, now, LIMITS)
    assert proposal is not None, "the job should want this window"
    mat = materialize(state, grant_for(state, offer, proposal, now), now + 0.1, LIMITS, "agent-1")
    assert mat.subjob is not None, mat.reason
    assert mat.subjob.units <= proposal.candidates[0].size
    return mat.state, mat.subjob


def execute(sj: Subjob, now: float, status: str = "ok", peak: float | None = None) -> Completion:
    """Run a subjob locally with its workload, as an executor would."""
    out = b""
    if status == "ok":
        out = workload(sj.workload).run(sj.params, sj.unit_start, sj.units, sj.input_checkpoint)
    return Completion(
        subjob_id=sj.subjob_id,
        job_id=sj.job_id,
        grant_id=sj.grant_id,
        fence=sj.fence,
        slice_id=sj.slice_id,
        status=status,  # type: ignore[arg-type]
        unit_start=sj.unit_start,
        units=sj.units,
        units_done=sj.units if status == "ok" else 0,
        peak_mem_mib=true_peak(sj.units) if peak is None else peak,
        duration_s=0.5,
        mem_cap_mib=sj.mem_cap_mib,
        time_cap_s=sj.time_cap_s,
        started_at=now,
        finished_at=now + 0.5,
        output_checkpoint=out,
        error="" if status == "ok" else f"subjob {status}",
    )


def run_to_completion(
    state: JobState, now: float, max_rounds: int = 50, **window_kw: Any
) -> tuple[JobState, float]:
    for _ in range(max_rounds):
        if state.status == "done":
            return state, now
        state, sj = win_window(state, now, window(now, **window_kw))
        state, applied = apply_completion(state, execute(sj, now + 0.2), now + 1.0)
        assert applied
        now += 1.0
    raise AssertionError(f"job not done after {max_rounds} rounds: {state.status}")


def ok_ranges(state: JobState) -> list[tuple[int, int]]:
    return sorted((h.unit_start, h.units) for h in state.history if h.status == "ok")


def assert_covers_exactly(state: JobState) -> None:
    pos = 0
    for start, units in ok_ranges(state):
        assert start == pos, ok_ranges(state)
        pos += units
    assert pos == state.total_units
