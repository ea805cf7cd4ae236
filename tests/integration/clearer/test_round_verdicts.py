"""A real clearer over a real nats-server: every bid of every offer of a batch gets its verdict in the
round records (read back whole through the gateway, as ``sja trace`` reads them) and in the agents'
outcomes, a second bid for a job is invalid, and an agent that replied with no bid is told so."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from rich.console import Console

from services.clearer.service import ClearerService, ClearerSettings
from services.gateway.service import GatewayService, GatewaySettings
from sja.bus.codec import decode, encode
from sja.bus.store import stores
from sja.cli.render import render_rounds
from sja.client import SjaClient
from sja.core.policies import NO_BID
from sja.protocol import subjects
from sja.protocol.messages import (
    AgentHeartbeat,
    BatchReply,
    Candidate,
    Offer,
    OfferBatch,
    Outcome,
    Proposal,
    ReplyGroup,
    RoundRecord,
    SliceState,
    Window,
)
from tests.integration.waits import wait_until

POOL = "p"


@contextlib.asynccontextmanager
async def running(*services: object) -> AsyncIterator[None]:
    async with contextlib.AsyncExitStack() as stack:
        for s in services:
            await stack.enter_async_context(s)  # type: ignore[arg-type]
        yield


def slice_state(i: int) -> SliceState:
    return SliceState(
        slice_id=f"n-g0-1g.10gb-{i}", node="n", pool=POOL, gpu_index=0, gpu_model="H100-80GB",
        profile="1g.10gb", mem_mib=10_000, compute_slots=1, compute_share=1 / 7, placement_start=i,
    )  # fmt: skip


def proposal(job: str, tenant: str, submitted_at: float) -> Proposal:
    c = Candidate(
        size=4, mem_q_mib=3000.0, p_fit_mem=0.99, duration_q_s=2.0, duration_mean_s=1.5, p_fit_time=0.97
    )
    return Proposal(
        job_id=job, tenant=tenant, mode="jasda", candidates=[c], submitted_at=submitted_at,
        remaining_units=10, total_units=10, capacity=1,
    )  # fmt: skip


async def test_every_bid_of_every_offer_has_a_verdict(nats_url: str, tmp_path: Path, nc: NATS) -> None:
    common: dict[str, Any] = {"nats_url": nats_url, "out_dir": str(tmp_path / "out")}
    clearer = ClearerService(
        ClearerSettings(**common, instance="clearer-v", policy="fair", agent_liveness_s=60.0)
    )
    gateway = GatewayService(GatewaySettings(**common, instance="gateway-v"))
    outcomes: dict[str, list[Outcome]] = {}
    heard = asyncio.Event()

    async def on_outcome(msg: Msg) -> None:
        got = decode(msg.data, Outcome)
        agent = msg.subject.rsplit(".", 1)[-1]
        outcomes.setdefault(agent, []).append(got)
        if {"ag-1", "ag-2", "ag-3"} <= set(outcomes):
            heard.set()

    await nc.subscribe(subjects.outcome_sent("*"), cb=on_outcome)
    async with running(clearer, gateway):
        js = nc.jetstream()
        slices, _ = await stores(js)
        now = time.time()
        offers = []
        for i in range(4):
            s = slice_state(i)
            rev = await slices.put(s.slice_id, s)
            w = Window(
                slice_id=s.slice_id, node=s.node, pool=POOL, gpu_model=s.gpu_model, profile=s.profile,
                mem_mib=s.mem_mib, compute_share=s.compute_share, start_s=now, end_s=now + 8.0,
            )  # fmt: skip
            offers.append(
                Offer(
                    offer_id=f"o-{i}",
                    round=i,
                    window=w,
                    slice_fence=0,
                    slice_revision=rev,
                    slice_state=s,
                    issued_at=now,
                    reply_by=now + 1.0,
                    reply_to=subjects.offer_replied(POOL),
                )
            )
        for agent in ("ag-1", "ag-2", "ag-3"):
            hb = AgentHeartbeat(agent_id=agent, jobs=3, sent_at=now, interval_s=1.0)
            await nc.publish(subjects.AGENT_HEARTBEAT, encode(hb))
        await nc.flush()
        batch = OfferBatch(
            batch_id="batch-v",
            offers=offers,
            issued_at=now,
            reply_by=now + 1.0,
            reply_to=subjects.offer_replied(POOL),
        )
        await nc.publish(subjects.offer_opened(POOL), encode(batch))
        ids = [o.offer_id for o in offers]
        replies = {
            "ag-1": [proposal("j1", "a", 1.0), proposal("j2", "a", 2.0), proposal("j3", "b", 3.0)],
            "ag-2": [],  # answered, with nothing for these windows
            "ag-3": [proposal("j3", "b", 3.0), *(proposal(f"j{k}", "b", float(k)) for k in (4, 5, 6))],
        }
        for agent, props in replies.items():
            groups = [ReplyGroup(offer_ids=ids, proposals=props)] if props else []
            reply = BatchReply(batch_id="batch-v", agent_id=agent, groups=groups)
            await nc.publish(subjects.offer_replied(POOL), encode(reply))
        await asyncio.wait_for(heard.wait(), 10.0)

        client = SjaClient(nc)

        async def four_rounds() -> list[RoundRecord] | None:
            rounds = await client.rounds("j6")
            return rounds if len(rounds) == 4 else None

        rounds = await wait_until(four_rounds, "the four offers' records", 5.0, every_s=0.1)

    # Every offer's record: one verdict per bid (seven bids, j3 twice) and one for ag-2.
    assert sorted(r.offer_id for r in rounds) == ids
    want = Counter({(f"j{k}", "ag-3" if k > 3 else "ag-1"): 1 for k in range(1, 7)})
    want.update([("j3", "ag-3"), ("", "ag-2")])
    winners = []
    for r in rounds:
        assert r.bids == 7
        assert Counter((v.job_id, v.agent_id) for v in r.verdicts) == want, r.offer_id
        won = [v for v in r.verdicts if v.won]
        assert len(won) == 1 and won[0].job_id == r.winner_job and r.grant_id
        winners.append(r.winner_job)
        reasons = {(v.job_id, v.agent_id): v.reason for v in r.verdicts}
        assert reasons[("", "ag-2")] == NO_BID
        assert reasons[("j3", "ag-3")] == "invalid: a second bid for job j3 (the bid from ag-1 stands)"
        for v in r.verdicts:
            assert v.won or v.reason.startswith(("lost", "invalid: ", "no bid: ")), v.reason
    assert len(set(winners)) == 4, "capacity 1: four jobs took the four windows"
    # Every agent that replied heard back, ag-2 that it sent no bid; each bid's verdict came.
    assert [v.reason for o in outcomes["ag-2"] for v in o.verdicts] == [NO_BID]
    heard_of = {(v.job_id, v.agent_id) for vs in outcomes.values() for o in vs for v in o.verdicts}
    assert heard_of == set(want)
    assert sum(v.won for vs in outcomes.values() for o in vs for v in o.verdicts) == 4
    # The trace shows, per round, who replied, who won and why.
    console = Console(record=True, width=200)
    console.print(render_rounds("j6", rounds))
    text = console.export_text()
    assert text.count("replies from: ag-1, ag-2, ag-3") == 4
    assert text.count("agent ag-2: no bid") == 4
    assert text.count("won: tenant") == 4
