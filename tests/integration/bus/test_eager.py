"""Eager subscriptions (``Service.subscribe(..., eager=True)``) against a real nats-server: a
message's handler starts as the message is read, ahead of the callbacks already due; what follows
its first wait goes on as a tracked task, in the handler's own context; nothing is lost or
reordered, a failing handler is contained, and ``stop()`` lets the rest of a handler finish."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from nats.aio.msg import Msg

from sja.bus.codec import DecodeError
from sja.bus.service import Service
from sja.bus.settings import BaseSettings
from tests.integration.waits import wait_until

SUBJECT = "test.eager"
current: contextvars.ContextVar[str] = contextvars.ContextVar("current", default="")


class EagerService(Service):
    name = "eager"

    def __init__(self, settings: BaseSettings) -> None:
        super().__init__(settings)
        self.order: list[str] = []
        self.gate = asyncio.Event()
        self.after_wait: list[tuple[str, str]] = []
        self.seen_in_caller: list[str] = []

    async def on_start(self) -> None:
        await self.subscribe(SUBJECT, self.handle, eager=True)
        await self.subscribe(SUBJECT + ".queued", self.queued)

    async def handle(self, msg: Msg) -> None:
        body = msg.data.decode()
        if body == "bad":
            raise DecodeError("not a message")
        if body == "boom":
            raise RuntimeError("handler bug")
        self.order.append(body)
        if body.startswith("wait"):
            current.set(body)
            await self.gate.wait()
            self.after_wait.append((body, current.get()))
            await self.bus.publish(SUBJECT + ".done", msg.data)

    async def queued(self, msg: Msg) -> None:
        self.order.append("queued:" + msg.data.decode())


async def until_handled(svc: EagerService, n: int) -> None:
    """Wait until ``n`` messages were handled; the assertions that follow say which."""
    await wait_until(lambda: len(svc.order) >= n, f"{n} messages handled", timeout_s=10.0, every_s=0.05)


def service(nats_url: str, tmp_path: Path) -> EagerService:
    return EagerService(BaseSettings(nats_url=nats_url, out_dir=str(tmp_path / "out"), instance="eager-0"))


@pytest.fixture
async def svc(nats_url: str, tmp_path: Path) -> AsyncIterator[EagerService]:
    """A started service, stopped after the test."""
    started = service(nats_url, tmp_path)
    await started.start()
    try:
        yield started
    finally:
        await started.stop()


async def test_messages_are_handled_in_order_and_none_is_lost(svc: EagerService, nc) -> None:
    for i in range(500):
        await nc.publish(SUBJECT, str(i).encode())
    await nc.flush()
    await until_handled(svc, 500)
    assert svc.order == [str(i) for i in range(500)]
    assert not svc._tasks, "handlers that never wait leave no task behind"


async def test_an_eager_message_overtakes_queued_ones_read_with_it(svc: EagerService, nc) -> None:
    # One write: the queued subscription's messages come first on the wire.
    for i in range(20):
        await nc.publish(SUBJECT + ".queued", str(i).encode())
    await nc.publish(SUBJECT, b"urgent")
    await nc.flush()
    await until_handled(svc, 21)
    assert sorted(svc.order) == sorted(["urgent", *(f"queued:{i}" for i in range(20))])
    assert svc.order.index("urgent") < svc.order.index("queued:19")


async def test_a_handler_that_waits_goes_on_in_its_own_context(svc: EagerService, nc) -> None:
    done = await nc.subscribe(SUBJECT + ".done")
    await nc.publish(SUBJECT, b"wait-1")
    await nc.publish(SUBJECT, b"wait-2")
    await nc.flush()
    await until_handled(svc, 2)
    assert svc.order == ["wait-1", "wait-2"]
    assert len(svc._tasks) == 2
    assert current.get() == "", "a handler's context leaked into the caller's"
    svc.gate.set()
    got = sorted([(await done.next_msg(timeout=10)).data for _ in range(2)])
    assert got == [b"wait-1", b"wait-2"]
    assert sorted(svc.after_wait) == [("wait-1", "wait-1"), ("wait-2", "wait-2")]


async def test_a_failing_handler_is_contained(svc: EagerService, nc) -> None:
    for body in (b"bad", b"boom", b"after"):
        await nc.publish(SUBJECT, body)
    await nc.flush()
    await until_handled(svc, 1)
    assert svc.order == ["after"], "the read loop survived both failures"


async def test_stop_lets_the_rest_of_an_eager_handler_finish(nats_url: str, tmp_path: Path, nc) -> None:
    svc = service(nats_url, tmp_path)
    await svc.start()
    done = await nc.subscribe(SUBJECT + ".done")
    await nc.publish(SUBJECT, b"wait-stop")
    await nc.flush()
    await until_handled(svc, 1)
    stopping = asyncio.ensure_future(svc.stop())
    await asyncio.wait_for(svc.stopping.wait(), timeout=10)
    svc.gate.set()
    await asyncio.wait_for(stopping, timeout=30)
    assert (await done.next_msg(timeout=10)).data == b"wait-stop"
    assert svc.after_wait == [("wait-stop", "wait-stop")]
