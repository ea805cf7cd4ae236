"""Takeover between agent processes' services against a real nats-server: an agent that is slow but
heartbeating keeps its jobs; one that falls silent loses them to a live agent (compare-and-set on the
owner), and when it speaks again it finds the job taken and disowns it instead of writing it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import msgspec
from nats.aio.client import Client
from nats.js.api import ConsumerInfo
from nats.js.errors import NotFoundError

from services.agent.service import AgentService, AgentSettings
from sja.bus.codec import encode
from sja.bus.store import stores
from sja.bus.streams import ensure_jetstream
from sja.core import jobs as J
from sja.core import ownership, proofs
from sja.protocol import subjects
from sja.protocol.messages import Completion, InFlight, JobSpec, JobState
from sja.workloads import workload
from tests.integration.waits import wait_until

LIVENESS_S = 1.0
KEY = b"k" * 32
"""A subjob's secret, as an agent makes it (sja.core.proofs)."""


def settings(nats_url: str, tmp_path: Path, name: str, **kw: object) -> AgentSettings:
    fields: dict[str, object] = {"takeover_after_s": LIVENESS_S, "takeover_scan_s": 1.0, **kw}
    return AgentSettings(nats_url=nats_url, out_dir=str(tmp_path / "out"), instance=name, **fields)  # type: ignore[arg-type]


def owned_job(job_id: str, owner: str) -> JobState:
    spec = JobSpec(name=job_id, tenant="t", workload="montecarlo", params={"units": 8})
    state = ownership.claim(J.new_job(job_id, spec, time.time()), owner, time.time())
    assert state is not None
    return state


async def owner_of(agent: AgentService, job_id: str) -> str:
    assert agent.jobs is not None
    got = await agent.jobs.get(job_id)
    assert got is not None
    return got[0].owner_agent


async def owned_by(agent: AgentService, job_id: str, owner: str) -> bool:
    """Whether the store, read through ``agent``, names ``owner`` as the job's owner."""
    return await owner_of(agent, job_id) == owner


async def test_a_silent_agents_job_moves_and_a_heartbeating_ones_stays(
    nats_url: str, tmp_path: Path, nc: Client
) -> None:
    # The slow agent heartbeats every 0.2 s but does no work (no offers come: no advertiser); the
    # silent one heartbeats once, at its start, and never again. Only the taker takes jobs over.
    slow = AgentService(settings(nats_url, tmp_path, "agent-slow", heartbeat_s=0.2, takeover_after_s=0))
    silent = AgentService(
        settings(nats_url, tmp_path, "agent-silent", heartbeat_s=1_000.0, takeover_after_s=0)
    )
    taker = AgentService(settings(nats_url, tmp_path, "agent-taker", heartbeat_s=0.2))
    js = nc.jetstream()
    await ensure_jetstream(js)
    _, jobs = await stores(js)
    await jobs.create("job-slow", owned_job("job-slow", "agent-slow"))
    await jobs.create("job-silent", owned_job("job-silent", "agent-silent"))
    # The times of the taker's finished scans for jobs to take over.
    scanned: list[float] = []
    take_over = taker.takeover.take_over

    async def counted_take_over(now: float) -> int:
        taken = await take_over(now)
        scanned.append(now)
        return taken

    taker.takeover.take_over = counted_take_over  # type: ignore[method-assign]
    async with contextlib.AsyncExitStack() as stack:
        # Each takes its job back at start (an agent restarted under the same id).
        await stack.enter_async_context(slow)
        await stack.enter_async_context(silent)
        assert "job-slow" in slow.owned and "job-silent" in silent.owned
        await stack.enter_async_context(taker)

        await wait_until(
            lambda: owned_by(taker, "job-silent", "agent-taker"),
            "the silent agent's job taken over",
            20.0,
            every_s=0.1,
        )
        assert "job-silent" in taker.owned
        # Well past the bound (time running out is the scenario) and several scans later the slow
        # agent still has its job: wait for two scans that began that long after the takeover.
        past_bound = time.time() + 4 * LIVENESS_S
        await wait_until(
            lambda: sum(t >= past_bound for t in scanned) >= 2, "two scans well past the bound", 30.0
        )
        assert await owner_of(taker, "job-slow") == "agent-slow"
        assert "job-slow" in slow.owned and "job-slow" not in taker.owned

        # The silent agent wakes up and writes its job: the compare-and-set fails, the store names
        # another owner, so it lets the job go and writes nothing.
        assert "job-silent" in silent.owned, "it has not noticed yet"
        written = await silent.save("job-silent", lambda s: J.request_cancel(s, time.time()))
        assert written is None
        assert "job-silent" not in silent.owned
        assert silent.jobs is not None
        got = await silent.jobs.get("job-silent")
        assert got is not None and got[0].owner_agent == "agent-taker" and not got[0].cancel_requested


async def test_a_gone_agents_completion_consumer_is_deleted_by_the_server(
    nats_url: str, tmp_path: Path, nc: Client
) -> None:
    """A recreated agent never comes back under its old id: the server drops its consumer."""
    agent = AgentService(settings(nats_url, tmp_path, "agent-gone", completions_inactive_s=1.0))
    js = nc.jetstream()
    async with agent:
        info = await js.consumer_info("SJA_COMPLETIONS", "agent-agent-gone")
        assert info.config.inactive_threshold == 1.0
        # Time going by is the scenario: twice the inactivity threshold, after which a consumer no
        # one pulled from would be gone; the agent pulls from it all along.
        await asyncio.sleep(2 * info.config.inactive_threshold)
        # Pulled from all along: alive.
        assert (await js.consumer_info("SJA_COMPLETIONS", "agent-agent-gone")).name == "agent-agent-gone"

    async def deleted() -> bool:
        try:
            await js.consumer_info("SJA_COMPLETIONS", "agent-agent-gone")
        except NotFoundError:
            return True
        return False

    await wait_until(deleted, "the consumer of an agent gone for good deleted", 15.0, every_s=0.2)


async def test_a_completion_dropped_before_the_takeover_is_read_back(
    nats_url: str, tmp_path: Path, nc: Client
) -> None:
    """A subjob of a silent agent's job ends while another agent runs: that agent is not the owner
    yet, so it acknowledges the completion and drops it. Once it takes the job over it reads the
    completion back from the stream: the subjob counts, instead of being given up as overdue and
    run again."""
    js = nc.jetstream()
    await ensure_jetstream(js)
    _, jobs = await stores(js)
    flight = InFlight(
        subjob_id="job-x.s0",
        grant_id="g-x",
        slice_id="s0",
        unit_start=0,
        units=1,
        dispatched_at=time.time(),
        time_cap_s=600.0,  # never overdue within the test
        profile="1g.10gb",
        compute_share=1 / 7,
        planned_mem_q_mib=100.0,
        planned_duration_q_s=0.1,
        proof_key=KEY,
    )
    state = msgspec.structs.replace(
        owned_job("job-x", "agent-gone"), status="running", next_unit=1, next_seq=1, in_flight=[flight]
    )
    await jobs.create("job-x", state)
    w = workload("montecarlo")
    output = w.run(w.validate(dict(state.spec.params)), 0, 1, b"")
    now = time.time()
    done = Completion(
        subjob_id="job-x.s0",
        job_id="job-x",
        grant_id="g-x",
        fence=1,
        slice_id="s0",
        status="ok",
        unit_start=0,
        units=1,
        units_done=1,
        peak_mem_mib=50.0,
        duration_s=0.05,
        mem_cap_mib=1000,
        time_cap_s=600.0,
        started_at=now,
        finished_at=now,
        output_checkpoint=output,
    )
    done = proofs.signed(done, KEY)  # as the executor holding the grant signs it
    taker = AgentService(settings(nats_url, tmp_path, "agent-taker", heartbeat_s=0.2))
    async with taker:
        await js.publish(
            subjects.subjob_completed("job-x"), encode(done), headers={"Nats-Msg-Id": "job-x.s0:1"}
        )
        consumer = "agent-" + subjects._key("agent-taker")

        async def handled() -> ConsumerInfo | None:
            info = await js.consumer_info("SJA_COMPLETIONS", consumer)
            return info if info.ack_floor.stream_seq >= 1 else None

        info = await wait_until(handled, "the completion handled by the agent", 10.0, every_s=0.05)
        assert info.num_ack_pending == 0 and "job-x" not in taker.owned, "dropped: not its job yet"

        await wait_until(
            lambda: owned_by(taker, "job-x", "agent-taker"), "the job taken over", 20.0, every_s=0.1
        )

        async def read_back() -> JobState | None:
            got = await jobs.get("job-x")
            assert got is not None
            return got[0] if not got[0].in_flight else None

        written = await wait_until(read_back, "the completion read back", 5.0, every_s=0.05)
        assert written.units_done == 1 and written.owner_agent == "agent-taker"
        assert [(h.subjob_id, h.status) for h in written.history] == [("job-x.s0", "ok")]
        # Read back once: taking another look applies nothing more.
        assert await taker.takeover.replay_completions("job-x") == 0


async def test_a_scan_reads_whole_only_the_jobs_of_silent_owners(
    nats_url: str, tmp_path: Path, nc: Client
) -> None:
    """The scan for jobs to take over decodes three fields of every stored job and the whole state
    only of a silent owner's unfinished jobs: a store of thousands owned by live agents costs the
    agent little."""
    js = nc.jetstream()
    await ensure_jetstream(js)
    _, jobs = await stores(js)
    live = [owned_job(f"job-live-{i}", "agent-live") for i in range(600)]
    dead = [owned_job(f"job-dead-{i}", "agent-dead") for i in range(3)]
    over = msgspec.structs.replace(owned_job("job-over", "agent-dead"), status="done")
    await asyncio.gather(*(jobs.create(s.job_id, s) for s in [*live, *dead, over]))
    # No takeover loop (takeover_after_s 0): the scan below is the only one.
    taker = AgentService(settings(nats_url, tmp_path, "agent-taker", takeover_after_s=0))
    async with taker:
        assert taker.jobs is not None
        now = time.time()
        taker.takeover.last_seen.update({"agent-live": now, "agent-dead": now - 100})
        loaded: list[str] = []
        load = taker.jobs.load

        def counting_load(raw: bytes) -> JobState:
            state = load(raw)
            loaded.append(state.job_id)
            return state

        taker.jobs.load = counting_load  # type: ignore[method-assign]
        assert await taker.takeover.take_over(now) == 3
        assert sorted(loaded) == sorted(s.job_id for s in dead)
        assert set(taker.owned) == {s.job_id for s in dead}
        assert await owner_of(taker, "job-over") == "agent-dead"
        assert await owner_of(taker, "job-live-7") == "agent-live"


async def test_an_agent_takes_back_its_own_job_when_its_copy_and_the_store_disagree(
    nats_url: str, tmp_path: Path, nc: Client
) -> None:
    # What a write whose answer was lost in a leader election, or a read that found nothing during
    # one, leaves behind: the store says the job is this agent's, and this agent holds an older copy,
    # or none. The agent's scan of the store takes the stored one back (and bids from it again).
    js = nc.jetstream()
    await ensure_jetstream(js)
    _, jobs = await stores(js)
    await jobs.create("job-dropped", owned_job("job-dropped", "agent-a"))
    await jobs.create("job-stale", owned_job("job-stale", "agent-a"))
    async with AgentService(settings(nats_url, tmp_path, "agent-a", takeover_scan_s=0.5)) as agent:
        assert {"job-dropped", "job-stale"} <= agent.owned.keys()
        agent._disown("job-dropped")
        stale, rev = agent.owned["job-stale"]
        newer = msgspec.structs.replace(stale, next_unit=3)
        new_rev = await jobs.cas("job-stale", newer, rev)
        assert new_rev is not None
        await wait_until(
            lambda: "job-dropped" in agent.owned and agent.owned["job-stale"][1] == new_rev,
            what="the agent holding its jobs as stored",
            timeout_s=30,
        )
        assert agent.owned["job-stale"][0].next_unit == 3
        assert agent.bidder.states["job-stale"].next_unit == 3  # bid from the stored copy
        assert "job-dropped" in agent.bidder.states
