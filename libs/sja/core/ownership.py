"""Who holds a job and its subjobs, as pure decisions: the agent that owns a job (it claims it,
a live agent takes it over from a silent owner, the job's heir first) and the subjobs in flight
given up for lost (no completion long past their time cap, their slice moved on), whose units go
back to the job as a ``lost`` completion. The agent service writes what these decide by
compare-and-set on the job's revision.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping

import msgspec

from sja.core.jobs import is_terminal, settle, validate_spec
from sja.protocol.messages import Completion, InFlight, JobState
from sja.workloads import SpecError


def claim(state: JobState, agent_id: str, now: float) -> JobState | None:
    """The job taken on by ``agent_id``, or ``None`` when it already has an owner, is over, or is not
    a state the gateway could have written (no profile, inconsistent counters)."""
    if state.owner_agent or is_terminal(state) or not is_consistent(state):
        return None
    return settle(msgspec.structs.replace(state, owner_agent=agent_id), now)


def heir(job_id: str, agents: Iterable[str]) -> str:
    """The agent among ``agents`` first in line to take the job over (rendezvous hashing): every
    agent computes the same answer from the same set, and a dead owner's jobs spread evenly over
    the agents alive. ``""`` if there is none."""
    best, best_key = "", b""
    for agent in agents:
        key = hashlib.blake2b(f"{job_id}\x00{agent}".encode(), digest_size=8).digest()
        if key > best_key or (key == best_key and agent < best):
            best, best_key = agent, key
    return best


def takeover(
    state: JobState,
    new_agent: str,
    owner_last_seen: float,
    now: float,
    liveness_s: float,
    *,
    live_agents: Iterable[str] = (),
) -> JobState | None:
    """The job taken over by ``new_agent`` from an owner silent for longer than ``liveness_s``, or
    ``None`` when it stays where it is (its owner may be alive, it has none, it is over, or it is
    not a state this code could have written).

    ``owner_last_seen`` is when the owner was last known alive: its last heartbeat, or, for an owner
    never heard of, when the caller first found it owning a job (it may have just started, its
    first heartbeat still on its way: it gets a full ``liveness_s`` too). ``live_agents`` (the
    agents heard from lately, the caller included) spreads a dead owner's jobs: only the job's
    ``heir`` among them takes it at once, any of them after twice ``liveness_s`` (the heir may be
    dead too).

    The caller writes the result by compare-and-set on the job's revision, so two agents never
    both take one job. Subjobs in flight stay in flight: their completions reach the new owner (it
    reads back from the stream those it had dropped as another agent's), or they are given up
    (``overdue``) and their units planned again."""
    owner = state.owner_agent
    if not owner or owner == new_agent or is_terminal(state) or not is_consistent(state):
        return None
    silent_s = now - owner_last_seen
    if silent_s <= liveness_s:
        return None
    heirs = {a for a in live_agents if a != owner} | {new_agent}
    if silent_s <= 2 * liveness_s and heir(state.job_id, heirs) != new_agent:
        return None
    return settle(msgspec.structs.replace(state, owner_agent=new_agent), now)


def is_owned_by(state: JobState, agent_id: str) -> bool:
    """Whether ``agent_id`` owns the job: an agent that finds another owner in the store (the job was
    taken over while it was silent) disowns it, and writes nothing more to it."""
    return state.owner_agent == agent_id


def is_consistent(state: JobState) -> bool:
    """Whether a job state is one this code could have produced (checked on what arrives from the bus)."""
    try:
        _, total = validate_spec(state.spec)
    except SpecError:
        return False
    return (
        state.profile is not None
        and total == state.total_units
        and state.units_done <= state.total_units
        and state.next_unit <= state.total_units
    )


def overdue(state: JobState, holders: Mapping[str, str | None], now: float, lease_s: float) -> list[InFlight]:
    """In-flight subjobs given up for lost: no completion long after they could have finished
    (dispatch + their time cap + two leases) and their slice no longer holds their grant
    (``holders``: slice id -> the grant it holds now, ``None`` if none or no such slice). A subjob
    whose dispatch never reached an executor ends here; a late real completion is then ignored
    (``jobs.apply_completion`` only applies what is in flight)."""
    return [f for f in past_due(state, now, lease_s) if holders.get(f.slice_id) != f.grant_id]


def past_due(state: JobState, now: float, lease_s: float) -> list[InFlight]:
    """In-flight subjobs with no completion two leases past their time cap: the ones ``overdue``
    may give up, once the holders of their slices are known (a caller reads only those slices)."""
    return [f for f in state.in_flight if now > f.dispatched_at + f.time_cap_s + 2 * lease_s]


def lost_completion(state: JobState, flight: InFlight, now: float, why: str) -> Completion:
    """The completion that gives an overdue subjob's units back to the job (status ``lost``)."""
    return Completion(
        subjob_id=flight.subjob_id,
        job_id=state.job_id,
        grant_id=flight.grant_id,
        fence=0,
        slice_id=flight.slice_id,
        status="lost",
        unit_start=flight.unit_start,
        units=flight.units,
        units_done=0,
        peak_mem_mib=0.0,
        duration_s=0.0,
        mem_cap_mib=0,
        time_cap_s=flight.time_cap_s,
        started_at=flight.dispatched_at,
        finished_at=now,
        error=why,
        executor_id="",
    )
