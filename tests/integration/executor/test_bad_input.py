"""Hostile input to the executor: a subjob of a lease the slice does not hold, and a subjob replayed
while it runs."""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec
import pytest
from nats.aio.msg import Msg

from sja.bus.codec import decode, encode
from sja.bus.natsd import EmbeddedNats
from sja.bus.store import stores
from sja.execution import slicelease
from sja.protocol import messages as m
from sja.protocol import subjects
from tests.integration.hostile_stack import (
    AGENT,
    InstantExecutor,
    capture,
    every_slice_taken,
    good_spec,
    logged,
    one_subjob,
    running,
    slice_states,
    wait_until,
)

pytestmark = pytest.mark.timeout(120)


async def test_grant_that_agrees_with_its_lease_but_not_the_slice_never_runs(
    server: EmbeddedNats, tmp_path: Path
) -> None:
    """A grant for a lease the slice does not hold (a replay of an earlier fence's grant), for a job
    with room for more: it agrees with the lease it carries, so the agent, which reads no slice
    before materializing, makes a subjob of it; the executor admits a subjob only against the
    slice's current lease, so that subjob is refused (``stale``) and the slice does not move."""
    async with running(server, tmp_path, executor=False) as stack:
        spec = good_spec("old-grant", 13, max_parallel=64, params={"units": 200, "samples_per_unit": 2000})
        job_id, grant, sj = await one_subjob(stack, spec)
        await wait_until(lambda: every_slice_taken(stack, job_id), "the job holds every slice")
        assert grant.slice_state is not None
        dispatched: list[Msg] = []
        await capture(stack.nc, f"{subjects.PREFIX}.subjob.dispatched.>", dispatched)
        old_id, old_fence = "g-zz-earlier", grant.fence - 1 if grant.fence > 1 else grant.fence + 1
        # As a replay of an earlier lease: its own id and fence, the lease it carries agreeing with
        # them, written at an earlier revision of the slice.
        old = msgspec.structs.replace(
            grant,
            grant_id=old_id,
            fence=old_fence,
            slice_state=msgspec.structs.replace(grant.slice_state, grant_id=old_id, fence=old_fence),
            slice_revision=grant.slice_revision - 1,
        )
        await stack.nc.publish(subjects.grant_issued(AGENT), encode(old))
        await stack.nc.flush()
        await wait_until(lambda: dispatched, "the agent made a subjob of the grant")
        (made,) = [decode(d.data, m.Subjob) for d in dispatched]
        assert (made.grant_id, made.fence) == (old_id, old_fence)
        slices, _ = await stores(stack.nc.jetstream())
        before = await slices.get(sj.slice_id)
        admitted = await slicelease.start(slices, made, known=True, grace_s=1.0)
        assert admitted.verdict == "stale"
        assert await slices.get(sj.slice_id) == before
        assert before is not None and (before[0].grant_id, before[0].fence) == (grant.grant_id, grant.fence)


async def test_replayed_subjob_does_not_free_a_running_slice(
    server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    async with running(server, tmp_path, executor=True, hold_s=1.5) as stack:
        completions: list[Msg] = []
        await capture(stack.nc, subjects.subjob_completed("*"), completions)
        dispatched: list[Msg] = []
        await capture(stack.nc, f"{subjects.PREFIX}.subjob.dispatched.>", dispatched)
        await stack.client.submit(good_spec("dup", 12, max_parallel=1))
        await wait_until(lambda: dispatched, "a subjob dispatched")
        first = dispatched[0]
        sj = decode(first.data, m.Subjob)
        executor = stack.services["executor"]
        assert isinstance(executor, InstantExecutor)

        async def running_now() -> bool:
            held, _ = (await slice_states(stack))[sj.slice_id]
            return held.status == "busy" and sj.subjob_id in executor.running

        await wait_until(running_now, "the subjob running (the slice busy)")
        await stack.nc.jetstream().publish(first.subject, first.data, headers={"Nats-Msg-Id": "zz-replay"})
        await wait_until(
            lambda: logged(caplog, f"subjob {sj.subjob_id} delivered again while it runs"),
            "the executor saw the replayed subjob",
        )
        held, _ = (await slice_states(stack))[sj.slice_id]
        assert (held.status, held.grant_id) == ("busy", sj.grant_id)
        lost = [c for c in (decode(x.data, m.Completion) for x in completions) if c.status == "lost"]
        assert not lost
