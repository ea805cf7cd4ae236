"""The live rigid reference (``services.agent.reference``): the agent replays the submissions on the
inventory's slices and makes its jobs due when best-fit would have them finish too much earlier."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from sja.bus.codec import decode
from sja.bus.natsd import EmbeddedNats
from sja.core.shadow import DUE_SLACK, due_at, due_by_evidence, span_due_at
from sja.protocol import messages as m
from sja.protocol import subjects
from tests.integration.hostile_stack import capture, good_spec, running, wait_until

pytestmark = pytest.mark.timeout(120)

PER_UNIT_S = 0.85
"""A unit's declared time at full speed: 2 s on a 3g slice, as long as the stack holds a subjob."""


async def test_a_running_job_becomes_due_and_its_next_subjobs_carry_it(
    server: EmbeddedNats, tmp_path: Path
) -> None:
    """A job that declares 25,000 MiB and 6.8 s of work at full speed (8 units; the stack holds each
    subjob 2 s, a unit's declared time on a 3g slice): best-fit would start it at once on the
    smallest slice that holds it (3g.40gb, at 3/7 of the speed: 16 s). Alone in the stack it ends
    the reference's busy period, so it is due ``SPAN_SLACK - 1`` times that run after its start (the
    span bound, earlier than ``DUE_SLACK - 1`` times its rigid JCT), moved by what its measurements
    say. The agent marks it, and the subjobs it cuts from then on carry the due time (their slices
    are then taken by no job that is not due)."""
    dispatched: list[Msg] = []
    async with running(server, tmp_path, hold_s=2.0) as stack:
        await capture(stack.nc, f"{subjects.PREFIX}.subjob.dispatched.>", dispatched)
        spec = good_spec(
            "due",
            3,
            max_parallel=1,
            params={"units": 8, "samples_per_unit": 200, "seed": 3},
            memory=m.MemoryDecl(base_mib=25_000.0, per_unit_mib=0.0, rel_sd=0.1),
            time=m.TimeDecl(warmup_s=0.0, per_unit_s=PER_UNIT_S, rel_sd=0.1),
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
        # on the smallest slice that holds it, where it runs its declared 6.8 s at that slice's speed
        ref = agent.dues.ref
        basis = ref.bases[ack.job_id]
        rigid_s = PER_UNIT_S * 8 / (3 / 7)
        assert basis.run_s == pytest.approx(rigid_s) and basis.usable_mib < 41_000
        assert basis.submitted_at == state.submitted_at
        assert state.submitted_at <= basis.started_at <= state.submitted_at + 2.0
        span_end = ref.span_ends[basis.busy_since]
        assert span_end == pytest.approx(basis.started_at + rigid_s)  # nothing else in the reference
        due = ref.due_times[ack.job_id]
        assert due == basis.due_at(span_end=span_end)
        assert due == pytest.approx(
            min(
                due_at(state.submitted_at, basis.started_at, rigid_s),
                span_due_at(basis.busy_since, span_end, basis.started_at, rigid_s),
            )
        )
        assert due < due_at(state.submitted_at, basis.started_at, rigid_s)
        # its measurements (each subjob is held 2 s here) may move its due time a little
        # (``test_a_job_that_understates_its_run_is_unmarked_once_measured``)
        # marked, it carries the instant it is due to finish by: its due time plus its run
        assert state.due_at > due and agent.dues.ref.due_at(ack.job_id, time.time()) > 0
        assert agent.dues.marked >= 1
        await wait_until(
            lambda: any(decode(x.data, m.Subjob).due_at > 0 for x in dispatched),
            "a subjob cut after it is due carries the due time",
            timeout_s=30.0,
        )
        # no need to run it to the end: the due time is written with the job's next write
        await stack.client.cancel(ack.job_id)
        ended = (await stack.wait_done([ack.job_id], timeout_s=60.0))[0]
        assert ended.due_at > 0


async def test_a_job_that_understates_its_run_is_unmarked_once_measured(
    server: EmbeddedNats, tmp_path: Path
) -> None:
    """A tenant declares its 24 units at a millisecond each, so the reference has it run 0.06 s and
    due at once. Its subjobs take 2 s each (the stack holds every subjob that long): once they are
    measured its due time moves back (``core.shadow.due_by_evidence``) past the present, and the
    agent unmarks it. (Alone in the stack, it would end the reference's busy period by its measured
    run and be due by the span bound as an honest job of that run is: that bound is left out here.)"""
    async with running(server, tmp_path, hold_s=2.0) as stack:
        stack.agent.dues.ref.span_slack = math.inf
        spec = good_spec(
            "liar",
            5,
            max_parallel=1,
            params={"units": 24, "samples_per_unit": 200, "seed": 5},
            memory=m.MemoryDecl(base_mib=25_000.0, per_unit_mib=0.0, rel_sd=0.1),
            time=m.TimeDecl(warmup_s=0.0, per_unit_s=0.001, rel_sd=0.1),
        )
        ack = await stack.client.submit(spec)
        agent = stack.agent

        def state() -> m.JobState | None:
            held = agent.owned.get(ack.job_id)
            return held[0] if held is not None else None

        first = await wait_until(
            lambda: (s := state()) is not None and s.due_at > 0 and s,
            "the job is due by its declaration",
            timeout_s=30.0,
        )
        assert not first.history
        basis = agent.dues.ref.bases[ack.job_id]
        assert basis.run_s < 0.1

        def unmarked() -> m.JobState | None:
            s = state()
            return s if s is not None and s.history and s.due_at == 0 and agent.dues.unmarked else None

        def seen() -> str:
            s = state()
            if s is None:
                return "the job is not owned"
            runs = [(h.units, h.duration_s) for h in s.history]
            return f"due_at {s.due_at}, {len(s.history)} subjobs: {runs}"

        later = await wait_until(unmarked, lambda: "measured, it is unmarked; " + seen(), timeout_s=60.0)
        assert later.profile is not None
        at = due_by_evidence(basis, later, agent.profiles.of(later))
        assert at > basis.due_at() + (DUE_SLACK - 1) * 1.0
        await stack.client.cancel(ack.job_id)
        await stack.wait_done([ack.job_id], timeout_s=60.0)
