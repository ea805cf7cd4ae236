"""The agent's memo of its jobs' plans: kept while a job's state is the same, renewed when it moves."""

from __future__ import annotations

import msgspec

from services.agent.service import AgentService, AgentSettings
from sja.core.jobs import claim, new_job
from sja.protocol.messages import JobSpec, JobState


def job(job_id: str = "j1") -> JobState:
    params = {"units": 8, "samples_per_unit": 10}
    spec = JobSpec(name=job_id, tenant="alice", workload="montecarlo", params=params)
    state = claim(new_job(job_id, spec, 1000.0), "agent-a", 1000.0)
    assert state is not None
    return state


def test_writing_the_same_state_again_keeps_its_plans_but_a_new_state_renews_them() -> None:
    agent = AgentService(AgentSettings(instance="agent-a"))
    state = job()
    agent._own(state, 1)
    version = agent._version["j1"]
    for book in agent.books.values():
        assert "j1" in book.jobs

    # Completions flushed: the job is written as it stands, and only its revision moves.
    agent._own(state, 2)
    assert agent.owned["j1"] == (state, 2)
    assert agent._version["j1"] == version, "the same state keeps its plans"

    moved = msgspec.structs.replace(state, grants_seen=state.grants_seen + 1)
    agent._own(moved, 3)
    assert agent.owned["j1"] == (moved, 3)
    assert agent._version["j1"] > version, "a changed state is planned again"

    # An equal state decoded afresh (a reload after a conflict) is planned again too: only the
    # very object this agent planned with is known to be unchanged.
    agent._own(msgspec.structs.replace(moved), 4)
    assert agent._version["j1"] > version + 1
