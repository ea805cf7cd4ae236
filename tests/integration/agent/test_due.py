"""The live rigid reference (``services.agent.reference``): the agent replays the submissions on the
inventory's slices and makes its jobs due when best-fit would have them finish too much earlier."""

from __future__ import annotations

from pathlib import Path

import pytest
from nats.aio.msg import Msg

from sja.bus.codec import decode
from sja.bus.natsd import EmbeddedNats
from sja.core.shadow import DUE_SLACK
from sja.protocol import messages as m
from sja.protocol import subjects
from tests.integration.hostile_stack import capture, good_spec, running, wait_until

pytestmark = pytest.mark.timeout(120)


async def test_a_running_job_becomes_due_and_its_next_subjobs_carry_it(
    server: EmbeddedNats, tmp_path: Path
) -> None:
    """A job that declares 25,000 MiB and 6 s of work at full speed: best-fit would start it at once
    on the smallest slice that holds it (3g.40gb, at 3/7 of the speed: 14 s), so it is due
    ``(DUE_SLACK - 1) x 14 s`` after its submission. The agent marks it, and the subjobs it cuts from
    then on carry the due time (their slices are then taken by no job that is not due)."""
    dispatched: list[Msg] = []
    async with running(server, tmp_path, hold_s=2.0) as stack:
        await capture(stack.nc, f"{subjects.PREFIX}.subjob.dispatched.>", dispatched)
        spec = good_spec(
            "due",
            3,
            max_parallel=1,
            params={"units": 24, "samples_per_unit": 200, "seed": 3},
            memory=m.MemoryDecl(base_mib=25_000.0, per_unit_mib=0.0, rel_sd=0.1),
            time=m.TimeDecl(warmup_s=0.0, per_unit_s=0.25, rel_sd=0.1),
        )
        ack = await stack.client.submit(spec)
        agent = stack.agent

        def due_state() -> m.JobState | None:
            held = agent.owned.get(ack.job_id)
            return held[0] if held is not None and held[0].due_at > 0 else None

        def seen() -> str:
            ref = agent.dues.ref
            held = agent.owned.get(ack.job_id)
            return (
                f"the job is made due; the reference has {len(ref.shadow.units)} slices, jobs "
                f"{list(ref.jobs)}, due times {ref.due_times}; the job: "
                f"{held[0].status if held else 'not owned'}"
            )

        state = await wait_until(due_state, seen, timeout_s=30.0)
        # best-fit starts it at once, when the agent hears of it (a moment after its submission),
        # on the smallest slice that holds it, where it runs its declared 12 s at that slice's speed
        ref = agent.dues.ref
        run = next(r for r in ref.shadow.running if r.job_id == ack.job_id)
        assert ref.shadow.units[run.units[0]].share == pytest.approx(3 / 7)
        rigid_s = 0.25 * 24 / (3 / 7)
        assert (
            state.due_at
            == ref.due_times[ack.job_id]
            == pytest.approx(run.ends - rigid_s + (DUE_SLACK - 1) * (run.ends - state.submitted_at))
        )
        assert state.submitted_at <= run.ends - rigid_s <= state.submitted_at + 2.0
        assert agent.dues.marked >= 1
        await wait_until(
            lambda: any(decode(x.data, m.Subjob).due_at == state.due_at for x in dispatched),
            "a subjob cut after it is due carries the due time",
            timeout_s=30.0,
        )
        # no need to run it to the end: the due time is written with the job's next write
        await stack.client.cancel(ack.job_id)
        ended = (await stack.wait_done([ack.job_id], timeout_s=60.0))[0]
        assert ended.due_at == state.due_at
