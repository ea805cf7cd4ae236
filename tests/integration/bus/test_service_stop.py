"""``Service.stop`` against a real nats-server: intake stops first, work already taken finishes and
its effect is visible, and the spans it wrote are on disk when ``stop()`` returns."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import nats.errors
import pytest
from nats.aio.msg import Msg

from sja.bus.service import Service
from sja.bus.settings import BaseSettings
from tests.integration.waits import wait_until

KEY_SUBJECT = "test.stop.work"
ENDPOINT_SUBJECT = "test.stop.request"


class HeldService(Service):
    """A service whose handlers wait for the test's go-ahead, then leave an effect behind."""

    name = "held"

    def __init__(self, settings: BaseSettings) -> None:
        super().__init__(settings)
        self.entered = asyncio.Event()
        self.release = asyncio.Event()
        self.handled: list[str] = []

    async def on_start(self) -> None:
        await self.subscribe(KEY_SUBJECT, self.work)

    async def work(self, msg: Msg) -> None:
        self.entered.set()
        await self.release.wait()
        # The effect: a message on the bus, which needs the connection still open.
        await self.bus.publish(f"{KEY_SUBJECT}.done", msg.data)
        self.handled.append(msg.data.decode())

    async def add_endpoints(self, micro: Any) -> None:
        async def answer(req: Any) -> None:
            self.entered.set()
            await self.release.wait()
            self.handled.append(req.data.decode())
            await req.respond(b"done " + req.data)

        await micro.add_endpoint(name="answer", subject=ENDPOINT_SUBJECT, handler=answer)


def held(nats_url: str, tmp_path: Path) -> HeldService:
    return HeldService(BaseSettings(nats_url=nats_url, out_dir=str(tmp_path / "out"), instance="held-0"))


async def test_stop_answers_the_request_in_flight_and_no_new_one(nats_url: str, tmp_path: Path, nc) -> None:
    svc = held(nats_url, tmp_path)
    await svc.start()
    first = asyncio.ensure_future(nc.request(ENDPOINT_SUBJECT, b"first", timeout=30))
    try:
        await asyncio.wait_for(svc.entered.wait(), timeout=10)
    except TimeoutError:
        # Say which way it failed: refused (no responder yet, a readiness bug) or never delivered.
        why = repr(first.exception()) if first.done() else "the request is still waiting"
        pytest.fail(f"the endpoint's handler did not run within 10 s: {why}")

    stopping = asyncio.ensure_future(svc.stop())
    # Intake stops before the request in flight is done: discovery and the endpoint are gone...
    await asyncio.wait_for(svc._micro.stopped.wait(), timeout=10)
    assert not first.done() and not stopping.done()
    with pytest.raises(nats.errors.NoRespondersError):
        await nc.request(ENDPOINT_SUBJECT, b"second", timeout=5)

    # ...and the request taken before the stop is still answered.
    svc.release.set()
    reply = await asyncio.wait_for(first, timeout=30)
    await asyncio.wait_for(stopping, timeout=30)
    assert reply.data == b"done first"
    assert svc.handled == ["first"]


async def test_stop_lets_a_subscription_handler_finish_its_effect(nats_url: str, tmp_path: Path, nc) -> None:
    svc = held(nats_url, tmp_path)
    await svc.start()
    done = await nc.subscribe(f"{KEY_SUBJECT}.done")
    await nc.publish(KEY_SUBJECT, b"job-1")
    await asyncio.wait_for(svc.entered.wait(), timeout=10)

    stopping = asyncio.ensure_future(svc.stop())
    await asyncio.wait_for(svc.stopping.wait(), timeout=10)
    svc.release.set()
    await asyncio.wait_for(stopping, timeout=30)

    effect = await done.next_msg(timeout=10)
    assert effect.data == b"job-1"
    assert svc.handled == ["job-1"]
    assert svc.nc is not None and svc.nc.is_closed


FLUSH_SCRIPT = textwrap.dedent(
    """
    import asyncio, json, os, sys

    from opentelemetry import trace

    from sja.bus.service import Service
    from sja.bus.settings import BaseSettings
    from sja.telemetry.setup import read_spans

    nats_url, out_dir = sys.argv[1], sys.argv[2]


    class Traced(Service):
        name = "traced"

        async def on_start(self):
            self.entered = asyncio.Event()
            self.release = asyncio.Event()
            await self.subscribe("test.stop.traced", self.work)

        async def work(self, msg):
            self.entered.set()
            await self.release.wait()
            with trace.get_tracer("test").start_as_current_span("test.handled") as span:
                span.set_attribute("sja.job_id", msg.data.decode())


    async def main():
        svc = Traced(BaseSettings(nats_url=nats_url, out_dir=out_dir, instance="traced-0"))
        await svc.start()
        await svc.bus.publish("test.stop.traced", b"job-7")
        await svc.entered.wait()
        stopping = asyncio.ensure_future(svc.stop())
        await svc.stopping.wait()
        svc.release.set()  # the span ends during stop(), moments before it returns
        await stopping
        print(json.dumps([[s["name"], s["attributes"]] for s in read_spans(out_dir)]), flush=True)


    asyncio.run(main())
    # Skip the exit-time flush of the tracer provider: only what stop() wrote counts.
    os._exit(0)
    """
)


def test_stop_flushes_spans_to_the_trace_files(nats_url: str, tmp_path: Path) -> None:
    out_dir = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-c", FLUSH_SCRIPT, nats_url, str(out_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    spans = json.loads(done.stdout.strip().splitlines()[-1])
    assert ["test.handled", {"sja.job_id": "job-7"}] in spans, spans


class StubbornService(Service):
    """A service whose loop loses the first cancellation it gets, as a loop can when a library
    awaits through ``asyncio.wait_for`` and the awaited result and the cancellation arrive together."""

    name = "stubborn"

    def __init__(self, settings: BaseSettings) -> None:
        super().__init__(settings)
        self.lost = 0
        self.ended = False
        self.turns = 0

    async def on_start(self) -> None:
        self.loop(self._forever())

    async def _forever(self) -> None:
        try:
            while True:
                self.turns += 1
                try:
                    await asyncio.sleep(0.01)  # the loop's own pace, where its cancellation lands
                except asyncio.CancelledError:
                    if self.lost < 1:
                        self.lost += 1
                        continue
                    raise
        finally:
            self.ended = True


async def test_stop_ends_a_loop_that_lost_its_cancellation(nats_url: str, tmp_path: Path) -> None:
    svc = StubbornService(
        BaseSettings(nats_url=nats_url, out_dir=str(tmp_path / "out"), instance="stubborn-0")
    )
    await svc.start()
    await wait_until(lambda: svc.turns >= 2, "the loop running")
    await asyncio.wait_for(svc.stop(), timeout=30)
    assert svc.lost == 1 and svc.ended
