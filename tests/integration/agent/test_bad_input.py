"""Hostile input to the agent: replayed and stale grants, completions delivered twice, a forged
submission, an offer whose reply subject points elsewhere, subjobs JetStream cannot take, and
stopping."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.msg import Msg

from services.agent.service import JOBS_CONSUMER, AgentService, AgentSettings
from sja.bus.codec import DecodeError, decode, encode
from sja.bus.natsd import EmbeddedNats
from sja.bus.streams import ensure_jetstream
from sja.core import jobs as J
from sja.core import proofs
from sja.protocol import messages as m
from sja.protocol import subjects
from sja.workloads import workload
from tests.integration.hostile_stack import (
    AGENT,
    NODE,
    POOL,
    Stack,
    assert_intact,
    capture,
    consumed,
    every_slice_taken,
    good_spec,
    logged,
    one_subjob,
    running,
    slice_states,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


async def test_replayed_grant_of_a_running_subjob_changes_nothing(
    server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with running(server, tmp_path, executor=False) as stack:
        job_id, grant, sj = await one_subjob(stack, good_spec("held", 10, max_parallel=1))
        dispatched: list[Msg] = []
        await capture(stack.nc, f"{subjects.PREFIX}.subjob.dispatched.>", dispatched)
        await stack.nc.publish(subjects.grant_issued(AGENT), encode(grant))
        await stack.nc.flush()
        await wait_until(
            lambda: logged(
                caplog, f"ignoring grant {grant.grant_id} for {job_id}: grant already materialized"
            ),
            "the agent saw the grant again",
        )
        held, _ = (await slice_states(stack))[sj.slice_id]
        assert (held.status, held.grant_id, held.fence) == ("leased", grant.grant_id, grant.fence)
        assert not dispatched


async def test_stale_grant_is_not_materialized(
    server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A grant the slice never held (an old fence, an unknown grant id) for a job with room for more:
    no subjob, no change to the job."""
    caplog.set_level(logging.WARNING)
    async with running(server, tmp_path, executor=False) as stack:
        spec = good_spec("stale", 11, max_parallel=64, params={"units": 200, "samples_per_unit": 2000})
        job_id, grant, _sj = await one_subjob(stack, spec)
        await wait_until(lambda: every_slice_taken(stack, job_id), "the job holds every slice")
        got = await stack.agent.jobs.get(job_id)  # type: ignore[union-attr]
        assert got is not None
        before, _ = got
        dispatched: list[Msg] = []
        await capture(stack.nc, f"{subjects.PREFIX}.subjob.dispatched.>", dispatched)
        stale = [
            msgspec.structs.replace(grant, grant_id="g-zz-unknown"),
            msgspec.structs.replace(grant, grant_id="g-zz-old-fence", fence=max(grant.fence - 1, 1)),
            msgspec.structs.replace(grant, fence=grant.fence + 1),
        ]
        for g in stale:
            await stack.nc.publish(subjects.grant_issued(AGENT), encode(g))
        await stack.nc.flush()
        for g in stale:
            await wait_until(
                lambda g=g: logged(caplog, f"ignoring stale grant {g.grant_id} ", f"(fence {g.fence})"),
                f"the agent refused the stale grant {g.grant_id} (fence {g.fence})",
            )
        forged = {(g.grant_id, g.fence) for g in stale}
        assert not [
            d
            for d in dispatched
            if (decode(d.data, m.Subjob).grant_id, decode(d.data, m.Subjob).fence) in forged
        ]
        got = await stack.agent.jobs.get(job_id)  # type: ignore[union-attr]
        assert got is not None and not [f for f in got[0].in_flight if f.grant_id.startswith("g-zz")]
        assert got[0].rounds_won == before.rounds_won


async def test_a_completion_is_written_with_the_jobs_next_write(server: EmbeddedNats, tmp_path: Path) -> None:
    """With a long flush interval, each completion reaches ``sja-jobs`` with the write of the job's
    next subjob (and the last with the job's end): one write per subjob, not two, and the result is
    still every unit once. With flushing off, two."""
    for flush_s, per_subjob in ((30.0, 1), (0.0, 2)):
        async with running(
            server, tmp_path / str(flush_s), completion_flush_s=flush_s, peak_mib_per_unit=3000.0
        ) as stack:
            writes: list[m.JobState] = []

            async def on_write(msg: Msg, writes: list[m.JobState] = writes) -> None:
                with contextlib.suppress(DecodeError):
                    writes.append(decode(msg.data, m.JobState))

            await stack.nc.subscribe(f"$KV.{subjects.BUCKET_JOBS}.>", cb=on_write)
            # 3 GB a unit: a subjob takes 1 to 13 units, depending on its slice.
            spec = good_spec(
                f"write-behind-{per_subjob}",
                14,
                max_parallel=1,
                params={"units": 40, "samples_per_unit": 2000},
                memory=m.MemoryDecl(base_mib=0.0, per_unit_mib=3000.0, rel_sd=0.05),
            )
            job = await stack.client.submit(spec)
            (state,) = await stack.wait_done([job.job_id])
            assert_intact(state)
            n = len(state.history)
            mine = [w for w in writes if w.job_id == job.job_id]
            assert n >= 3, state.history
            # The gateway's, the claim, then per subjob; the last completion on its own.
            assert len(mine) == 2 + per_subjob * n + (1 if per_subjob == 1 else 0), [
                (w.status, w.next_seq, len(w.in_flight), w.units_done) for w in mine
            ]


async def test_a_completion_delivered_again_before_it_is_written_is_acknowledged_with_the_write(
    server: EmbeddedNats, tmp_path: Path
) -> None:
    """A completion folded in and not yet written, delivered again (its acknowledgement was late): the
    second delivery is not acknowledged before the first is written either, so an agent dying in
    between loses neither; once the job is written, both are acknowledged and applied once."""
    async with running(server, tmp_path, executor=False, completion_flush_s=30.0) as stack:
        spec = good_spec(
            "late-write",
            15,
            max_parallel=1,
            params={"units": 40, "samples_per_unit": 2000},
            memory=m.MemoryDecl(base_mib=0.0, per_unit_mib=3000.0, rel_sd=0.05),  # not all in one
        )
        job_id, _grant, sj = await one_subjob(stack, spec)
        assert sj.units < 40
        await stack.remove("advertiser")  # no next grant: nothing writes the job but the flush
        w = workload(sj.workload)
        output = w.run(w.validate(dict(sj.params)), sj.unit_start, sj.units, sj.input_checkpoint)
        now = time.time()
        done = m.Completion(
            subjob_id=sj.subjob_id,
            job_id=job_id,
            grant_id=sj.grant_id,
            fence=sj.fence,
            slice_id=sj.slice_id,
            status="ok",
            unit_start=sj.unit_start,
            units=sj.units,
            units_done=sj.units,
            peak_mem_mib=1.0,
            duration_s=0.01,
            mem_cap_mib=sj.mem_cap_mib,
            time_cap_s=sj.time_cap_s,
            started_at=now,
            finished_at=now,
            output_checkpoint=output,
        )
        done = proofs.signed(done, sj.proof_key)  # the executor's proof
        js = stack.nc.jetstream()
        for copy in ("first", "again"):
            await js.publish(
                subjects.subjob_completed(job_id), encode(done), headers={"Nats-Msg-Id": f"zz-{copy}"}
            )
        durable = "agent-" + subjects._key(AGENT)

        async def ack_pending() -> int:
            info = await js.consumer_info(subjects.STREAM_COMPLETIONS.name, durable)
            return int(info.num_ack_pending)

        # Both handled: the first folded into the job in memory, both held to be acknowledged with
        # the job's write (the agent writer's pending changes); neither acknowledged before it.
        await wait_until(
            lambda: stack.agent.owned[job_id][0].units_done == sj.units, "the first delivery folded in"
        )
        await wait_until(
            lambda: len(stack.agent.writer.pending(job_id)) >= 2, "both deliveries held for the write"
        )
        await wait_until(
            lambda: _at_least(ack_pending, 2), "both delivered, neither acknowledged before the write"
        )
        written = await stack.agent.jobs.get(job_id)  # type: ignore[union-attr]
        assert written is not None and written[0].units_done == 0
        await stack.agent.flush(job_id)
        await wait_until(lambda: _at_most(ack_pending, 0), "both acknowledged once the job is written")
        written = await stack.agent.jobs.get(job_id)  # type: ignore[union-attr]
        assert written is not None and written[0].units_done == sj.units
        assert [h.subjob_id for h in written[0].history] == [sj.subjob_id]


async def _at_least(value: Callable[[], Awaitable[int]], n: int) -> bool:
    return await value() >= n


async def _at_most(value: Callable[[], Awaitable[int]], n: int) -> bool:
    return await value() <= n


async def in_flight(stack: Stack, job_id: str) -> list[m.InFlight]:
    got = await stack.agent.jobs.get(job_id)  # type: ignore[union-attr]
    return list(got[0].in_flight) if got is not None else []


async def stored_subjobs(js: Any) -> int:
    return int((await js.stream_info(subjects.STREAM_SUBJOBS.name)).state.messages)


def publish_failures(agent: AgentService) -> list[BaseException]:
    """The agent's JetStream publishes that fail from now on, as they fail (each still the real one)."""
    failures: list[BaseException] = []
    real = agent.jetstream.publish

    async def publish(*args: Any, **kwargs: Any) -> Any:
        try:
            return await real(*args, **kwargs)
        except Exception as e:
            failures.append(e)
            raise

    agent.jetstream.publish = publish  # type: ignore[method-assign]
    return failures


# --- bugs found by the storms, pinned -----------------------------------------------------------------


async def test_forged_submission_does_not_stall_the_agent(server: EmbeddedNats, tmp_path: Path) -> None:
    async with running(server, tmp_path) as stack:
        forged = msgspec.structs.replace(
            J.new_job("zz-forged", good_spec("zz", 0), time.time()), profile=None
        )
        ack = await stack.nc.jetstream().publish(subjects.job_submitted(forged.job_id), encode(forged))
        await wait_until(
            lambda: consumed(stack.nc, subjects.STREAM_JOBS.name, JOBS_CONSUMER, ack.seq),
            "the agent handled the forged submission",
        )
        job = await stack.client.submit(good_spec("victim", 13))
        (state,) = await stack.wait_done([job.job_id], timeout_s=6.0)
        assert_intact(state)


async def test_offer_reply_to_cannot_redirect_the_agent(
    server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with running(server, tmp_path, executor=False, advertiser=False) as stack:
        job = await stack.client.submit(good_spec("victim", 14))
        await wait_until(lambda: job.job_id in stack.agent.owned, "the agent claimed the job")
        now = time.time()
        window = m.Window(
            slice_id="zz-slice", node=NODE, pool=POOL, gpu_model="x", profile="1g.5gb", mem_mib=5000,
            compute_share=0.1, start_s=now, end_s=now + 2,
        )  # fmt: skip
        offer = m.Offer(
            offer_id="zz-offer", round=1, window=window, slice_fence=10**9, slice_revision=0,
            issued_at=now, reply_by=now + 0.05, reply_to=f"$KV.{subjects.BUCKET_JOBS}.{job.job_id}",
        )  # fmt: skip
        await stack.nc.publish(subjects.offer_opened(POOL), encode(offer))
        await stack.nc.flush()
        await wait_until(
            lambda: logged(caplog, "ignoring offer zz-offer with reply subject"),
            "the agent refused the offer",
        )
        assert (await stack.client.status(job.job_id)).job_id == job.job_id


# --- found on the way: a subjob whose dispatch failed ------------------------------------------------


async def test_failed_dispatch_is_planned_again(server: EmbeddedNats, tmp_path: Path) -> None:
    async with running(server, tmp_path, executor=False) as stack:
        failed = publish_failures(stack.agent)
        js = stack.nc.jetstream()
        await js.delete_stream(subjects.STREAM_SUBJOBS.name)  # JetStream cannot take a subjob now
        job = await stack.client.submit(good_spec("undispatched", 16, max_parallel=1))
        await wait_until(
            lambda: in_flight(stack, job.job_id), "the agent took a grant and recorded its subjob"
        )
        await wait_until(lambda: failed, "its publish failed")
        await ensure_jetstream(js)  # JetStream is back
        # The lease (3 s) lapses, the slice returns; the units must be planned again.
        await wait_until(
            lambda: stored_subjobs(js), "no subjob dispatched again after JetStream came back", timeout_s=9.0
        )


async def test_a_subjob_never_dispatched_is_given_up_and_planned_again(
    server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """JetStream stays away past the lease: the agent stops retrying, its reaper gives the subjob
    up once its slice has moved on, and the units go to a new subjob when JetStream is back."""
    caplog.set_level(logging.WARNING)
    async with running(server, tmp_path, executor=False) as stack:
        js = stack.nc.jetstream()
        await js.delete_stream(subjects.STREAM_SUBJOBS.name)
        job = await stack.client.submit(good_spec("given-up", 16, max_parallel=1))
        made = await wait_until(
            lambda: in_flight(stack, job.job_id), "the agent took a grant and recorded its subjob"
        )
        first = made[0]
        await wait_until(
            lambda: logged(caplog, f"could not dispatch subjob {first.subjob_id} before its lease lapsed"),
            "the agent stopped retrying once the lease had lapsed",
        )
        await ensure_jetstream(js)

        async def given_up() -> m.JobState | None:
            got = await stack.agent.jobs.get(job.job_id)  # type: ignore[union-attr]
            state = got[0] if got else None
            if state is not None and all(f.subjob_id != first.subjob_id for f in state.in_flight):
                return state
            return None

        state = await wait_until(given_up, "never given up", timeout_s=first.time_cap_s + 20)
        assert any(r.start <= first.unit_start < r.start + r.count for r in state.retry) or any(
            f.unit_start == first.unit_start for f in state.in_flight
        ), "its units are to be planned again"
        await wait_until(lambda: stored_subjobs(js), "the units were dispatched again", timeout_s=10.0)


async def test_stop_does_not_wait_out_the_drain_timeout(server: EmbeddedNats, tmp_path: Path) -> None:
    settings_ = {"nats_url": server.url, "out_dir": str(tmp_path / "out"), "instance": AGENT}
    agent = AgentService(AgentSettings(**settings_))
    await agent.start()
    assert agent.nc is not None
    js = agent.nc.jetstream()
    consumers = [
        (subjects.STREAM_JOBS.name, JOBS_CONSUMER),
        (subjects.STREAM_COMPLETIONS.name, "agent-" + subjects._key(AGENT)),
    ]

    async def fetching() -> bool:
        infos = [await js.consumer_info(stream, name) for stream, name in consumers]
        return all(i.num_waiting for i in infos)

    # Stopped while both pull requests wait at the server (whose late status messages kept drain waiting).
    await wait_until(fetching, "the agent's pull requests waiting at the server")
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(agent.stop(), timeout=2.0)
    except TimeoutError:
        pass
    finally:
        if agent.nc is not None and not agent.nc.is_closed:
            await agent.nc.close()
    assert time.monotonic() - t0 < 2.0
