"""Hostile input to the clearer: its policy endpoint, replies to rounds that are over or never
opened, and stopping with a round open."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from services.clearer.service import MAX_EARLY_REPLIES, ClearerService, ClearerSettings
from sja.bus.codec import MAX_MESSAGE_BYTES, decode, encode
from sja.bus.connection import connect
from sja.bus.natsd import EmbeddedNats
from sja.protocol import messages as m
from sja.protocol import subjects
from tests.integration.hostile_stack import NODE, POLICY_SUBJECT, POOL, request_retrying, settled, wait_until

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize(
    "name", [b"\xff\xfefair", b"x" * (MAX_MESSAGE_BYTES + 1)], ids=["invalid-utf8", "4MiB"]
)
async def test_policy_endpoint_answers_with_a_typed_error(
    server: EmbeddedNats, tmp_path: Path, name: bytes
) -> None:
    nc = await connect(server.url, "fuzzer")
    try:
        settings_ = {"nats_url": server.url, "out_dir": str(tmp_path / "out"), "instance": "clearer-t"}
        async with ClearerService(ClearerSettings(**settings_)):
            reply = await request_retrying(nc, POLICY_SUBJECT, name)
            assert decode(reply.data, m.ErrorReply).code == "bad_request"
    finally:
        await nc.close()


async def test_late_replies_are_not_kept(server: EmbeddedNats, tmp_path: Path) -> None:
    settings_ = {"nats_url": server.url, "out_dir": str(tmp_path / "out"), "instance": "clearer-t"}
    nc = await connect(server.url, "fuzzer")
    try:
        async with ClearerService(ClearerSettings(**settings_)) as clearer:
            assert isinstance(clearer, ClearerService)
            now = time.time()
            window = m.Window(
                slice_id="zz-slice", node=NODE, pool=POOL, gpu_model="x", profile="1g.5gb", mem_mib=5000,
                compute_share=0.1, start_s=now, end_s=now + 2,
            )  # fmt: skip
            offer = m.Offer(
                offer_id="zz-closed", round=1, window=window, slice_fence=10**9, slice_revision=0,
                issued_at=now, reply_by=now + 0.05, reply_to=subjects.offer_replied(POOL),
            )  # fmt: skip
            await nc.publish(subjects.offer_opened(POOL), encode(offer))
            await nc.flush()
            await wait_until(lambda: "zz-closed" in clearer.closed, "the round closed at its deadline")
            assert "zz-closed" not in clearer.rounds
            late = encode(m.Reply(offer_id="zz-closed", agent_id="zz-slow-agent"))
            for _ in range(100):
                await nc.publish(subjects.offer_replied(POOL), late)
            # Then one reply that is kept: handled after the late ones (one publisher, in order).
            marker = encode(m.Reply(offer_id="zz-marker", agent_id="zz-slow-agent"))
            await nc.publish(subjects.offer_replied(POOL), marker)
            await nc.flush()
            await settled(nc, [clearer], "the late replies")
            assert ("zz-marker", "zz-slow-agent") in clearer.early, "the replies were handled"
            assert not any(k == "zz-closed" for k, _ in clearer.early), "late replies kept"
            # Replies to offers never seen are kept once per (round, agent), and bounded in all.
            early = encode(m.Reply(offer_id="zz-never-offered", agent_id="zz-agent"))
            for _ in range(200):
                await nc.publish(subjects.offer_replied(POOL), early)
            for i in range(MAX_EARLY_REPLIES + 100):
                await nc.publish(
                    subjects.offer_replied(POOL), encode(m.Reply(offer_id=f"zz-x{i}", agent_id="zz-a"))
                )
            await nc.flush()
            await settled(nc, [clearer], "the early replies")
            assert (f"zz-x{MAX_EARLY_REPLIES + 99}", "zz-a") in clearer.early, "the last reply was handled"
            assert len(clearer.early) <= MAX_EARLY_REPLIES
    finally:
        await nc.close()


# --- found on the way: stopping ------------------------------------------------------------------------


async def test_stopped_clearer_leaves_no_round_timer(server: EmbeddedNats, tmp_path: Path) -> None:
    settings_ = {"nats_url": server.url, "out_dir": str(tmp_path / "out"), "instance": "clearer-t"}
    nc = await connect(server.url, "fuzzer")
    clearer = ClearerService(ClearerSettings(**settings_))
    try:
        await clearer.start()
        await nc.publish(subjects.AGENT_HEARTBEAT, encode(m.AgentHeartbeat(
            agent_id="zz-silent", jobs=1, sent_at=time.time(), interval_s=1.0)))  # fmt: skip
        now = time.time()
        window = m.Window(
            slice_id="zz-slice", node=NODE, pool=POOL, gpu_model="x", profile="1g.5gb", mem_mib=5000,
            compute_share=0.1, start_s=now, end_s=now + 2,
        )  # fmt: skip
        offer = m.Offer(
            offer_id="zz-open", round=1, window=window, slice_fence=10**9, slice_revision=0,
            issued_at=now, reply_by=now + 0.5, reply_to=subjects.offer_replied(POOL),
        )  # fmt: skip
        await nc.publish(subjects.offer_opened(POOL), encode(offer))
        await nc.flush()
        await wait_until(
            lambda: "zz-open" in clearer.rounds, "the round is open, waiting for the silent agent"
        )
        await clearer.stop()
        assert all(r.timer is None or r.timer.cancelled() for r in clearer.rounds.values())
    finally:
        await clearer.stop()
        await nc.close()
