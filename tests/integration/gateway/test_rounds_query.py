"""``sja trace``'s query against a real gateway and nats-server: the rounds of a job are read from
the span of its lifetime in ``SJA_ROUNDS`` (a GiB of every job's rounds on a busy cluster), not
from the whole stream."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NATS

import services.gateway.service as gateway_module
from services.gateway.service import GatewayService, GatewaySettings
from sja.bus.codec import encode
from sja.bus.rounds import iter_rounds
from sja.bus.store import stores
from sja.bus.streams import ensure_jetstream
from sja.client import SjaClient
from sja.core import jobs as J
from sja.protocol import subjects
from sja.protocol.messages import JobSpec, RoundRecord, Verdict, Window

GAP_S = 0.3
"""Time between the stored rounds and the job's submission and finish: the records' own timestamps
fall before, within and after the job's lifetime (the scenario, not a wait for anything)."""


def record(offer_id: str, job_id: str) -> RoundRecord:
    window = Window(
        slice_id="s0", node="n", pool="p", gpu_model="H100-80GB", profile="1g.10gb", mem_mib=10_000,
        compute_share=1 / 7, start_s=0.0, end_s=None,
    )  # fmt: skip
    verdict = Verdict(job_id=job_id, tenant="t", agent_id="a", won=True, reason="best")
    return RoundRecord(
        offer_id=offer_id, round=1, window=window, policy="fair", replies_from=["a"], verdicts=[verdict]
    )


async def test_a_jobs_rounds_are_those_of_its_lifetime(
    nats_url: str, tmp_path: Path, nc: NATS, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gateway_module, "ROUNDS_CLOCK_SKEW_S", 0.0)
    js = nc.jetstream()
    await ensure_jetstream(js)
    _, jobs = await stores(js)

    async def store(offer_id: str, job_id: str) -> None:
        await js.publish(subjects.round_cleared("p"), encode(record(offer_id, job_id)))

    # A job id used again: the rounds of an earlier job of that name come before its submission.
    await store("o-before", "j")
    await store("o-gone", "gone")
    # Spacing timestamps (GAP_S), not waiting for the stores: each publish was acknowledged.
    await asyncio.sleep(GAP_S)
    submitted = time.time()
    await asyncio.sleep(GAP_S)
    await store("o-during", "j")
    await asyncio.sleep(GAP_S)
    finished = time.time()
    await asyncio.sleep(GAP_S)
    await store("o-after", "j")

    spec = JobSpec(name="j", tenant="t", workload="montecarlo", params={"units": 8})
    done = msgspec.structs.replace(J.new_job("j", spec, submitted), status="done", finished_at=finished)
    await jobs.create("j", done)
    running = msgspec.structs.replace(J.new_job("k", spec, submitted), status="running")
    await jobs.create("k", running)
    await jobs.create("late", J.new_job("late", spec, time.time() + 60))

    gateway = GatewayService(GatewaySettings(nats_url=nats_url, out_dir=str(tmp_path), instance="gw"))
    async with gateway:
        client = SjaClient(nc)
        assert [r.offer_id for r in await client.rounds("j")] == ["o-during"]
        # An operator asking about a job no longer in the store reads the whole stream.
        assert [r.offer_id for r in await client.rounds("gone")] == ["o-gone"]
        # Nothing stored since its submission.
        assert await client.rounds("late") == []

    # A job still running: from its submission to the last record (``iter_rounds`` itself).
    k = [r.offer_id async for r in iter_rounds(js, since=running.submitted_at) if r.verdicts[0].job_id == "j"]
    assert k == ["o-during", "o-after"]
    assert [r.offer_id async for r in iter_rounds(js, until=submitted)] == ["o-before", "o-gone"]
