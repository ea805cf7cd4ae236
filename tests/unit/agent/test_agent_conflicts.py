"""The agent's conflict paths, without a server: its job store is a ``MemoryStore`` whose
``before_write`` hook writes as another service would between the agent's read and its write.

A completion is folded into its job at once and acknowledged only once a write carrying it lands,
also when that write first loses to another writer; an owner whose job was taken over lets it go
without writing it; a takeover that loses to the owner's own write takes nothing; a grant declined
for a reason seen before does not give its slice back again."""

from __future__ import annotations

import time

import msgspec
from opentelemetry import context as otel_context

from services.agent.service import AgentService, AgentSettings
from sja.bus.codec import encode
from sja.bus.store import MemoryStore
from sja.core import bidding, leases, ownership, proofs
from sja.core import jobs as J
from sja.core.planner import PlanLimits
from sja.protocol.messages import Completion, Grant, JobSpec, JobState, Offer, SliceState, Window
from sja.workloads import workload

ME = "agent-a"
T0 = time.time()


def owned_job(job_id: str = "j1", owner: str = ME, units: int = 400) -> JobState:
    spec = JobSpec(
        name=job_id,
        tenant="alice",
        workload="montecarlo",
        params={"units": units, "samples_per_unit": 10},
        max_parallel=2,
    )
    state = ownership.claim(J.new_job(job_id, spec, T0), owner, T0)
    assert state is not None
    return state


def slice_state() -> SliceState:
    return SliceState(
        slice_id="local-g0-3g.20gb-0",
        node="local",
        pool="local",
        gpu_index=0,
        gpu_model="A100-40GB",
        profile="3g.20gb",
        mem_mib=19968,
        compute_slots=3,
        compute_share=3 / 7,
    )


def grant_for(state: JobState, grant_id: str, now: float) -> Grant:
    """A grant for ``state`` of a fresh lease on the slice, carrying that lease."""
    s = slice_state()
    w = Window(
        slice_id=s.slice_id,
        node=s.node,
        pool=s.pool,
        gpu_model=s.gpu_model,
        profile=s.profile,
        mem_mib=s.mem_mib,
        compute_share=s.compute_share,
        start_s=now,
        end_s=now + 30.0,
    )
    offer = Offer(
        offer_id=f"o-{grant_id}",
        round=1,
        window=w,
        slice_fence=s.fence,
        slice_revision=1,
        issued_at=now,
        reply_by=now + 0.5,
        reply_to="sja.v1.offer.replied.local",
    )
    # Proposed as with nothing in flight: a grant may come for a job that has since filled up.
    proposal = bidding.propose(msgspec.structs.replace(state, in_flight=[]), offer, now, PlanLimits())
    assert proposal is not None
    leased = leases.grant(
        s, offered_fence=s.fence, job_id=state.job_id, grant_id=grant_id, now=now, lease_s=5.0
    )
    return Grant(
        grant_id=grant_id,
        offer_id=offer.offer_id,
        round=1,
        job_id=state.job_id,
        tenant=state.spec.tenant,
        agent_id=state.owner_agent,
        window=w,
        candidate=proposal.candidates[0],
        fence=leased.fence,
        lease_until=now + 5.0,
        policy="fair",
        granted_at=now,
        slice_revision=2,
        slice_state=leased,
    )


def dispatched(state: JobState, now: float, grant_id: str = "g-1") -> JobState:
    """``state`` with one subjob in flight, materialized from a grant at ``now``."""
    grant = grant_for(state, grant_id, now)
    m = J.materialize(state, grant, now, PlanLimits(), state.owner_agent, proof_key=KEY)
    assert m.subjob is not None
    return m.state


KEY = b"s" * 32
"""The subjobs' secret (``sja.core.proofs``)."""


def completion_of(state: JobState, now: float) -> Completion:
    """The successful completion of the job's first subjob in flight, as its executor signs it."""
    f = state.in_flight[0]
    w = workload(state.spec.workload)
    return proofs.signed(
        Completion(
            subjob_id=f.subjob_id,
            job_id=state.job_id,
            grant_id=f.grant_id,
            fence=1,
            slice_id=f.slice_id,
            status="ok",
            unit_start=f.unit_start,
            units=f.units,
            units_done=f.units,
            peak_mem_mib=50.0,
            duration_s=0.05,
            mem_cap_mib=1000,
            time_cap_s=f.time_cap_s,
            started_at=now,
            finished_at=now,
            output_checkpoint=w.run(w.validate(dict(state.spec.params)), f.unit_start, f.units, b""),
        ),
        KEY,
    )


class Delivery:
    """A delivered completion: records its acknowledgements (and any other settlement)."""

    def __init__(self, c: Completion) -> None:
        self.data = encode(c)
        self.headers: dict[str, str] | None = None
        self.subject = f"sja.v1.subjob.completed.{c.job_id}"
        self.acks = 0
        self.other: list[str] = []

    async def ack(self) -> None:
        self.acks += 1

    async def nak(self, delay: float | None = None) -> None:
        self.other.append("nak")

    async def term(self) -> None:
        self.other.append("term")


async def agent_with(
    *states: JobState, name: str = ME, **kw: object
) -> tuple[AgentService, MemoryStore[JobState]]:
    """An agent (not started) whose job store is an in-memory one holding ``states``; it takes back
    the ones it owns as after a restart."""
    agent = AgentService(AgentSettings(instance=name, **kw))  # type: ignore[arg-type]
    store: MemoryStore[JobState] = MemoryStore(JobState)
    for s in states:
        assert await store.create(s.job_id, s) is not None
    agent.jobs = store
    await agent.recover()
    return agent, store


async def stored(store: MemoryStore[JobState], job_id: str = "j1") -> tuple[JobState, int]:
    got = await store.get(job_id)
    assert got is not None
    return got


async def test_a_completion_is_acknowledged_only_once_written_even_after_losing_to_another_writer() -> None:
    state = dispatched(owned_job(), T0)
    agent, store = await agent_with(state)
    c = completion_of(state, T0 + 1)
    msg = Delivery(c)
    writes = store.writes

    await agent.on_completed(msg)  # type: ignore[arg-type]
    held, _ = agent.owned["j1"]
    assert held.units_done == c.units and not held.in_flight, "folded in here at once"
    assert not J.is_terminal(held)
    assert store.writes == writes and msg.acks == 0, "not written yet, so not acknowledged"
    assert (await stored(store))[0].units_done == 0

    acks_at_write: list[int] = []

    async def another_writer(key: str) -> None:
        acks_at_write.append(msg.acks)
        if len(acks_at_write) == 1:
            # Another service writes the job first (keeping its owner): the agent's revision is old.
            current, _ = await stored(store, key)
            await store.put(key, msgspec.structs.replace(current, rounds_won=current.rounds_won + 5))

    store.before_write = another_writer
    await agent.flush("j1")

    assert acks_at_write == [0, 0], "a first write that lost, then one that landed; no ack before either"
    assert store.conflicts == 1
    written, rev = await stored(store)
    assert written.units_done == c.units and [h.subjob_id for h in written.history] == [c.subjob_id]
    assert written.rounds_won == state.rounds_won + 5, "the other writer's change is kept"
    assert agent.owned["j1"] == (written, rev)
    assert msg.acks == 1 and msg.other == []
    assert agent.writer.pending("j1") == []


async def test_a_completion_delivered_again_before_its_write_is_acknowledged_with_that_write() -> None:
    state = dispatched(owned_job(), T0)
    agent, store = await agent_with(state)
    c = completion_of(state, T0 + 1)
    first, again = Delivery(c), Delivery(c)
    await agent.on_completed(first)  # type: ignore[arg-type]
    await agent.on_completed(again)  # type: ignore[arg-type]
    assert first.acks == again.acks == 0, "the redelivery waits for the first delivery's write"
    assert len(agent.writer.pending("j1")) == 2

    await agent.flush("j1")
    written, _ = await stored(store)
    assert [h.subjob_id for h in written.history] == [c.subjob_id], "applied once"
    assert written.units_done == c.units
    assert first.acks == again.acks == 1

    # Delivered once more after the write: a duplicate, acknowledged at once and not written.
    writes = store.writes
    late = Delivery(c)
    await agent.on_completed(late)  # type: ignore[arg-type]
    assert late.acks == 1 and store.writes == writes


async def test_a_lost_save_reapplies_the_transition_and_the_unwritten_completion_to_the_fresh_job() -> None:
    state = dispatched(dispatched(owned_job(), T0, "g-1"), T0, "g-2")
    agent, store = await agent_with(state)
    c = completion_of(state, T0 + 1)
    msg = Delivery(c)
    await agent.on_completed(msg)  # type: ignore[arg-type]
    seen: list[JobState] = []

    async def another_writer(key: str) -> None:
        if not seen[1:]:
            current, _ = await stored(store, key)
            await store.put(key, msgspec.structs.replace(current, grants_seen=current.grants_seen + 9))

    store.before_write = another_writer

    def cancel(s: JobState) -> JobState | None:
        seen.append(s)
        return J.request_cancel(s, T0 + 2)

    written = await agent.save("j1", cancel)

    assert len(seen) == 2
    assert seen[0].grants_seen == state.grants_seen and seen[1].grants_seen == state.grants_seen + 9
    assert seen[1].units_done == c.units, "the completion was folded into the job read back"
    assert written is not None and written.cancel_requested
    assert written == (await stored(store))[0]
    assert written.units_done == c.units and written.grants_seen == state.grants_seen + 9
    assert msg.acks == 1


async def test_an_owner_whose_job_was_taken_over_lets_it_go_without_writing() -> None:
    state = dispatched(owned_job(), T0)
    agent, store = await agent_with(state)
    msg = Delivery(completion_of(state, T0 + 1))
    await agent.on_completed(msg)  # type: ignore[arg-type]
    assert "j1" in agent.bidder.states, "bid for while held"

    async def taken_over(key: str) -> None:
        current, _ = await stored(store, key)
        taken = ownership.takeover(current, "agent-b", T0 - 100, T0, 10.0)
        assert taken is not None
        await store.put(key, taken)

    store.before_write = taken_over
    assert await agent.save("j1", lambda s: J.request_cancel(s, T0 + 2)) is None

    after, _ = await stored(store)
    assert after.owner_agent == "agent-b" and not after.cancel_requested
    assert after.units_done == 0, "the old owner wrote nothing over the new owner's job"
    assert "j1" not in agent.owned and "j1" not in agent.bidder.states, "no longer bid for"
    assert "j1" not in agent.writer.locks and agent.writer.pending("j1") == []
    # Acknowledged: the new owner reads it back from the stream (Takeover.replay_completions).
    assert msg.acks == 1


async def test_a_takeover_that_races_with_the_owners_write_takes_nothing() -> None:
    now = time.time()
    raced = owned_job("j1", owner="agent-old")
    free = owned_job("j2", owner="agent-old")
    taker, store = await agent_with(raced, free, name="agent-b")
    assert taker.owned == {}
    taker.takeover.last_seen["agent-old"] = now - 100  # silent long past the bound

    async def owner_writes_first(key: str) -> None:
        if key == "j1":
            current, _ = await stored(store, key)
            await store.put(key, msgspec.structs.replace(current, rounds_won=current.rounds_won + 1))

    store.before_write = owner_writes_first
    assert await taker.takeover.take_over(now) == 1

    kept, _ = await stored(store, "j1")
    assert kept.owner_agent == "agent-old" and kept.rounds_won == raced.rounds_won + 1
    moved, rev = await stored(store, "j2")
    assert moved.owner_agent == "agent-b"
    assert set(taker.owned) == {"j2"} and taker.owned["j2"] == (moved, rev)
    assert "j2" in taker.spans.traces and taker.spans.traces["j2"].recovered


async def test_a_grant_seen_before_keeps_its_slice_and_a_declined_one_gives_it_back() -> None:
    state = owned_job()
    agent, store = await agent_with(state)
    released: list[tuple[str, str]] = []

    async def release(grant: Grant, reason: str) -> bool:
        released.append((grant.grant_id, reason))
        return True

    agent.release = release  # type: ignore[method-assign]
    dispatched_ids: list[str] = []

    async def dispatch(sj: object, until: float) -> None:
        dispatched_ids.append(sj.subjob_id)  # type: ignore[attr-defined]

    agent.dispatch = dispatch  # type: ignore[method-assign]
    now = time.time()
    g1 = grant_for(state, "g-1", now)
    await agent._materialize(g1, otel_context.Context())
    assert dispatched_ids == ["j1.s0"] and released == []

    # The same grant again (a replay): its subjob exists; its slice is the subjob's.
    await agent._materialize(g1, otel_context.Context())
    assert dispatched_ids == ["j1.s0"] and released == []

    # A job that cannot take more (two subjobs in flight at most): declined, slice given back.
    await agent._materialize(grant_for(agent.owned["j1"][0], "g-2", now), otel_context.Context())
    assert len(dispatched_ids) == 2
    held = agent.owned["j1"][0]
    g3 = grant_for(held, "g-3", now)
    await agent._materialize(g3, otel_context.Context())
    assert released == [("g-3", J.Declined.CANNOT_TAKE_MORE)]
    assert released[0][1] == "job cannot take more work now", "the same words on the wire"

    # Declined before: not given back a second time.
    await agent._materialize(g3, otel_context.Context())
    assert len(released) == 1
    assert (await stored(store))[0].declined_grants[-1] == "g-3"
