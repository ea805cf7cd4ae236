"""Crash tests: every service kind is killed with SIGKILL during a run and restarted; every job still
completes with the correct result, and no slice is ever held by two grants at once."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator

import pytest
from nats.js.api import DeliverPolicy

from sja.bus.codec import decode
from sja.bus.connection import connect
from sja.client import SjaClient
from sja.protocol import subjects
from sja.protocol.messages import JobSpec, JobState, RoundRecord
from sja.stack import LocalStack
from sja.workloads import run_in_one_piece

pytestmark = pytest.mark.slow

KILL_ORDER = ["agent-0", "clearer-0", "executor-0", "advertiser-0", "inventory-0", "gateway-0"]


@pytest.fixture
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    out = tmp_path_factory.mktemp("crash")
    s = LocalStack(out_dir=out, env={"SJA_HORIZON_S": "2.0", "SJA_LEASE_S": "3.0", "SJA_RAY_NUM_CPUS": "2"})
    try:
        s.start()
        asyncio.run(s.wait_ready())
        yield s
    finally:
        s.stop()


def specs(n: int) -> list[JobSpec]:
    out = []
    for i in range(n):
        if i % 2:
            out.append(
                JobSpec(
                    name=f"mc{i}",
                    tenant=f"t{i % 3}",
                    workload="montecarlo",
                    max_parallel=2,
                    params={"units": 60, "samples_per_unit": 50_000, "seed": i},
                )
            )
        else:
            out.append(
                JobSpec(
                    name=f"mm{i}",
                    tenant=f"t{i % 3}",
                    workload="matmul",
                    params={"rows": 1500, "inner": 512, "cols": 512, "seed": i},
                )
            )
    return out


async def call(url: str, fn: str, *args: object) -> object:
    """A client call that rides out a gateway restart."""
    for _ in range(120):
        try:
            c = await SjaClient.connect(url, timeout_s=2.0)
            try:
                return await getattr(c, fn)(*args)
            finally:
                await c.close()
        except (TimeoutError, OSError, Exception) as e:
            last = e
            await asyncio.sleep(0.5)
    raise AssertionError(f"{fn} kept failing: {last}")


async def rounds(url: str) -> list[RoundRecord]:
    nc = await connect(url, "crash-check")
    js = nc.jetstream()
    out: list[RoundRecord] = []
    sub = await js.subscribe(
        f"{subjects.PREFIX}.round.cleared.>", ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
    )
    while True:
        msg = await sub.next_msg(timeout=5.0)
        out.append(decode(msg.data, RoundRecord))
        if msg.metadata.num_pending == 0:
            break
    await nc.close()
    return out


def test_every_service_killed_and_restarted_loses_nothing(stack: LocalStack) -> None:
    url = stack.nats_url
    jobs = specs(16)
    ids = [asyncio.run(call(url, "submit", s)).job_id for s in jobs]  # type: ignore[attr-defined]
    for victim in KILL_ORDER:
        time.sleep(1.5)
        stack.kill(victim)
        time.sleep(1.0)
        stack.restart(victim)
    asyncio.run(stack.wait_ready())

    deadline = time.monotonic() + 300
    while True:
        states: list[JobState] = [asyncio.run(call(url, "status", j)) for j in ids]  # type: ignore[misc]
        if all(s.status in ("done", "failed", "cancelled") for s in states) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    for s in states:
        assert s.status == "done", (s.job_id, s.status, s.error, s.units_done, s.total_units)
        assert s.result == run_in_one_piece(s.spec.workload, s.spec.params), s.job_id
        ok = [h for h in s.history if h.status == "ok"]
        covered = sorted((h.unit_start, h.unit_start + h.units) for h in ok)
        assert covered[0][0] == 0 and covered[-1][1] == s.total_units
        assert all(a[1] == b[0] for a, b in itertools.pairwise(covered)), "units applied once"

    # No (slice, fence) granted twice, and the ok subjobs on one slice never overlap in time.
    recs = [r for r in asyncio.run(rounds(url)) if r.grant_id]
    keys = [(r.window.slice_id, r.fence) for r in recs]
    assert len(keys) == len(set(keys))
    by_slice: dict[str, list[tuple[float, float]]] = {}
    for s in states:
        for h in s.history:
            if h.status == "ok":
                by_slice.setdefault(h.slice_id, []).append((h.started_at, h.finished_at))
    for slice_id, spans in by_slice.items():
        spans.sort()
        for (_a0, a1), (b0, _b1) in itertools.pairwise(spans):
            assert b0 >= a1 - 1e-3, f"two subjobs ran at once on {slice_id}"
