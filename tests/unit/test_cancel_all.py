"""Stopping tasks that lose a cancellation: ``asyncio.wait_for`` in Python 3.11 can drop one that
arrives as the awaited future completes, and nats-py awaits through it (requests, ``next_msg``, a KV
watcher's updates). A loop that lost it would run for ever and hold up whoever waits for it."""

from __future__ import annotations

import asyncio
from typing import Any

from sja.bus.tasks import cancel_all
from sja.bus.watch import KvView
from sja.protocol.messages import SliceState


class Stubborn:
    """Awaits forever, swallowing the first ``lose`` cancellations."""

    def __init__(self, lose: int = 1) -> None:
        self.lose = lose
        self.lost = 0
        self.ended = False

    async def wait(self) -> None:
        try:
            while True:
                try:
                    await asyncio.sleep(0.01)
                except asyncio.CancelledError:
                    if self.lost < self.lose:
                        self.lost += 1
                        continue
                    raise
        finally:
            self.ended = True


async def test_cancel_all_cancels_again_until_the_tasks_end() -> None:
    a, b = Stubborn(lose=1), Stubborn(lose=3)
    tasks = [asyncio.create_task(c) for c in (a.wait(), b.wait(), asyncio.sleep(0))]
    await asyncio.sleep(0.02)
    await asyncio.wait_for(cancel_all(tasks, 5.0, "test"), timeout=10)
    assert (a.lost, b.lost) == (1, 3) and a.ended and b.ended
    assert all(t.done() for t in tasks)


async def test_cancel_all_gives_up_on_a_task_that_never_ends() -> None:
    never = Stubborn(lose=10**9)
    task = asyncio.create_task(never.wait())
    await asyncio.sleep(0.02)
    await asyncio.wait_for(cancel_all([task], 0.5, "test"), timeout=10)
    assert not task.done() and never.lost >= 2
    never.lose = 0
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


class StubbornWatcher:
    """A KV watcher that reports its initial values, then waits for updates and loses the first
    cancellation on the way."""

    def __init__(self) -> None:
        self.waiter = Stubborn(lose=1)
        self.first = True
        self.stopped = False

    def __aiter__(self) -> StubbornWatcher:
        return self

    async def __anext__(self) -> Any:
        if self.first:
            self.first = False
            return None  # the end of the initial values
        await self.waiter.wait()
        raise StopAsyncIteration

    async def stop(self) -> None:
        self.stopped = True


class FakeKv:
    _name = "sja-slices"

    def __init__(self) -> None:
        self.watcher = StubbornWatcher()

    async def watchall(self) -> StubbornWatcher:
        return self.watcher


async def test_a_watched_view_stops_even_when_its_loop_loses_a_cancellation() -> None:
    kv = FakeKv()
    view = KvView(kv, SliceState)  # type: ignore[arg-type]
    await view.start()
    await asyncio.sleep(0.02)
    # Not wait_for: its own cancellation at the deadline would reach the loop and end it too.
    stop = asyncio.create_task(view.stop())
    done, _ = await asyncio.wait([stop], timeout=10)
    assert done, "stop() hung on a loop that lost its cancellation"
    assert kv.watcher.waiter.lost == 1 and kv.watcher.waiter.ended and kv.watcher.stopped
