"""The agent's memo of its jobs' plans: kept while a job's state is the same, renewed when it moves."""

from __future__ import annotations

import msgspec

from services.agent.service import AgentService, AgentSettings
from sja.core.jobs import new_job
from sja.core.ownership import claim
from sja.protocol.messages import JobSpec, JobState, Offer, Window


def job(job_id: str = "j1") -> JobState:
    params = {"units": 8, "samples_per_unit": 10}
    spec = JobSpec(name=job_id, tenant="alice", workload="montecarlo", params=params)
    state = claim(new_job(job_id, spec, 1000.0), "agent-a", 1000.0)
    assert state is not None
    return state


def window(now: float, mem_mib: int = 4864, profile: str = "1g.5gb") -> Window:
    return Window(
        slice_id=f"local-g0-{profile}-2",
        node="local",
        pool="local",
        gpu_model="A100-40GB",
        profile=profile,
        mem_mib=mem_mib,
        compute_share=1 / 7,
        start_s=now,
        end_s=now + 30.0,
    )


def offer_for(w: Window, now: float, n: int) -> Offer:
    return Offer(
        offer_id=f"o-{n}",
        round=n,
        window=w,
        slice_fence=0,
        slice_revision=0,
        issued_at=now,
        reply_by=now + 0.5,
        reply_to="sja.v1.offer.replied.local",
    )


def test_writing_the_same_state_again_keeps_its_plans_but_a_new_state_renews_them() -> None:
    agent = AgentService(AgentSettings(instance="agent-a"))
    state = job()
    agent._own(state, 1)
    for book in agent.bidder.books.values():
        assert "j1" in book.jobs
    now = 1001.0
    agent.proposals_for(offer_for(window(now), now, 0), now)
    plans = agent.bidder.plans["j1"]
    assert len(plans) == 1

    # Completions flushed: the job is written as it stands, and only its revision moves.
    agent._own(state, 2)
    assert agent.owned["j1"] == (state, 2)
    assert agent.bidder.plans["j1"] is plans, "the same state keeps its plans"

    moved = msgspec.structs.replace(state, grants_seen=state.grants_seen + 1)
    agent._own(moved, 3)
    assert agent.owned["j1"] == (moved, 3)
    assert "j1" not in agent.bidder.plans, "a changed state is planned again"

    # An equal state decoded afresh (a reload after a conflict) is planned again too: only the
    # very object this agent planned with is known to be unchanged.
    agent.proposals_for(offer_for(window(now), now, 1), now)
    assert len(agent.bidder.plans["j1"]) == 1
    agent._own(msgspec.structs.replace(moved), 4)
    assert "j1" not in agent.bidder.plans


def test_a_job_holds_only_its_current_states_plans_and_none_once_disowned() -> None:
    agent = AgentService(AgentSettings(instance="agent-a"))
    state = job()
    agent._own(state, 1)
    now = 1001.0
    small, large = window(now), window(now, mem_mib=9984, profile="1g.10gb")
    for n, w in enumerate((small, large, small)):
        agent.proposals_for(offer_for(w, now, n), now)
    assert len(agent.bidder.plans["j1"]) == 2, "one plan per window shape"

    moved = msgspec.structs.replace(state, grants_seen=state.grants_seen + 1)
    agent._own(moved, 2)
    agent.proposals_for(offer_for(small, now, 3), now)
    assert len(agent.bidder.plans["j1"]) == 1, "the earlier state's plans are gone"

    agent._disown("j1")
    assert "j1" not in agent.bidder.plans
