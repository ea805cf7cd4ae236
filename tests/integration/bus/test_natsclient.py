"""``sja.bus.natsclient.Client`` against a real nats-server: the messages of work that becomes due
while a write is being prepared share that write, and nothing is lost or reordered."""

from __future__ import annotations

import asyncio
from typing import Any

import nats.aio.client
import nats.errors

from sja.bus.connection import connect
from sja.bus.natsclient import Client
from tests.integration.waits import wait_until


def count_writes(nc: nats.aio.client.Client) -> list[int]:
    """Count the client's socket writes (each ``writelines`` of the flusher is one)."""
    writes = [0]
    transport: Any = nc._transport
    real = transport.writelines

    def writelines(data: list[bytes]) -> None:
        writes[0] += 1
        real(data)

    transport.writelines = writelines
    return writes


async def bursts(nc: nats.aio.client.Client, rounds: int, size: int) -> None:
    """``rounds`` bursts: one publish, then ``size`` tasks that each publish once, started after
    it (so they become due after the flusher was woken by the first)."""
    for r in range(rounds):
        await nc.publish("burst.x", f"{r}.first".encode())
        tasks = [
            asyncio.get_running_loop().create_task(nc.publish("burst.x", f"{r}.{i}".encode()))
            for i in range(size)
        ]
        await asyncio.gather(*tasks)
        await nc.flush()


async def test_work_due_meanwhile_joins_the_write(nats_url: str) -> None:
    ours = await connect(nats_url, "coalescing")
    plain = await nats.connect(nats_url)
    reader = await nats.connect(nats_url)
    try:
        assert isinstance(ours, Client)
        got: list[bytes] = []

        async def on_msg(msg: Any) -> None:
            got.append(msg.data)

        await reader.subscribe("burst.x", cb=on_msg)
        await reader.flush()
        rounds, size = 20, 10
        ours_writes, plain_writes = count_writes(ours), count_writes(plain)
        await bursts(plain, rounds, size)
        await bursts(ours, rounds, size)
        expected = [f"{r}.{i}".encode() for r in range(rounds) for i in ("first", *range(size))]
        await wait_until(lambda: len(got) >= 2 * len(expected), "both bursts' messages delivered", 15.0)
        assert got == expected * 2, "every message, in order"
        # nats-py writes a burst's first message alone, then the rest (and a PING per flush);
        # here the burst goes out in one write.
        assert plain_writes[0] >= 3 * rounds, plain_writes
        assert ours_writes[0] <= 2 * rounds + 2, (ours_writes, plain_writes)
    finally:
        for nc in (ours, plain, reader):
            await nc.close()


async def test_request_reply_and_reconnect_still_work(nats_server: Any) -> None:
    nc = await connect(nats_server.url, "coalescing")
    try:

        async def echo(msg: Any) -> None:
            await msg.respond(msg.data)

        await nc.subscribe("echo", cb=echo)
        assert (await nc.request("echo", b"hi", timeout=2)).data == b"hi"
        nats_server.stop()
        nats_server.start()
        # Reconnected (the subscription replayed): requests are answered again.

        async def answered() -> bytes | None:
            try:
                return (await nc.request("echo", b"again", timeout=0.5)).data
            except (nats.errors.TimeoutError, nats.errors.NoRespondersError):
                return None

        answer = await wait_until(answered, "a request answered after the reconnect", 30.0, every_s=0.25)
        assert answer == b"again"
        assert isinstance(nc, Client) and nc.stats["reconnects"] >= 1
    finally:
        await nc.close()


async def test_flush_now_writes_at_once_and_in_order(nats_url: str) -> None:
    nc = await connect(nats_url, "urgent")
    reader = await nats.connect(nats_url)
    try:
        got: list[bytes] = []

        async def on_msg(msg: Any) -> None:
            got.append(msg.data)

        await reader.subscribe("urgent.x", cb=on_msg)
        await reader.flush()
        writes = count_writes(nc)
        for r in range(20):
            # Ordinary publishes wait for the flusher; an urgent one takes them along, in order,
            # in one write made before this task yields.
            await nc.publish("urgent.x", f"{r}.a".encode())
            await nc.publish("urgent.x", f"{r}.b".encode())
            before = writes[0]
            nc.flush_now()
            assert writes[0] == before + 1 and nc.pending_data_size == 0
            nc.flush_now()  # nothing pending: no write
            assert writes[0] == before + 1
            await nc.publish("urgent.x", f"{r}.c".encode())
            await asyncio.sleep(0)  # a yield between rounds, where the flusher may write the last publish
        await nc.flush()
        expected = [f"{r}.{x}".encode() for r in range(20) for x in "abc"]
        await wait_until(lambda: len(got) >= len(expected), "every urgent message delivered", 15.0)
        assert got == expected
    finally:
        await nc.close()
        await reader.close()


async def test_flush_now_while_disconnected_keeps_the_data_for_the_reconnect(nats_server: Any) -> None:
    nc = await connect(nats_server.url, "urgent")
    try:
        nats_server.stop()
        await wait_until(lambda: not nc.is_connected, "the client disconnected", 15.0)
        assert not nc.is_connected
        await nc.publish("later.x", b"kept")
        nc.flush_now()  # not connected: nothing written, nothing dropped
        assert nc.pending_data_size > 0
        nats_server.start()
        await wait_until(lambda: nc.is_connected, "the client reconnected", 10.0, every_s=0.05)
        assert nc.is_connected
        await nc.flush(timeout=5)
        assert nc.pending_data_size == 0  # written on the reconnect, as the flusher would have
    finally:
        await nc.close()


def record_bytes(nc: nats.aio.client.Client) -> bytearray:
    """Everything the client writes to its socket, in order (``write`` and ``writelines``)."""
    out = bytearray()
    transport: Any = nc._transport
    real_write, real_writelines = transport.write, transport.writelines

    def write(data: bytes) -> None:
        out.extend(data)
        real_write(data)

    def writelines(data: list[bytes]) -> None:
        for chunk in data:
            out.extend(chunk)
        real_writelines(data)

    transport.write, transport.writelines = write, writelines
    return out


async def test_flush_sends_what_is_queued_before_its_ping(nats_url: str) -> None:
    """A subscription made just before ``flush()`` reaches the server before the PING, so the PONG
    means the server has it: a request from another connection right after finds its responder.
    (nats-py wrote the PING ahead of the queued SUB; a service answered "no responders" right
    after its ``start()`` on a loaded machine.)"""
    nc = await connect(nats_url, "responder")
    requester = await nats.connect(nats_url)
    try:
        wire = record_bytes(nc)
        for i in range(50):

            async def answer(msg: Any) -> None:
                await msg.respond(b"here")

            subject = f"ready.{i}"
            sub = await nc.subscribe(subject, queue="q", cb=answer)
            await nc.flush(timeout=10)
            sub_at = wire.rfind(f"SUB {subject} q ".encode())
            ping_at = wire.rfind(b"PING\r\n")
            assert 0 <= sub_at < ping_at, f"round {i}: the PING went out before the SUB"
            reply = await requester.request(subject, b"?", timeout=10)
            assert reply.data == b"here"
            await sub.unsubscribe()
    finally:
        await nc.close()
        await requester.close()
