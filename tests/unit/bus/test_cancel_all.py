"""Stopping tasks that lose a cancellation: ``asyncio.wait_for`` in Python 3.11 can drop one that
arrives as the awaited future completes, and nats-py awaits through it (requests, ``next_msg``, a KV
watcher's updates). A loop that lost it would run for ever and hold up whoever waits for it."""

from __future__ import annotations

import asyncio

from sja.bus.tasks import cancel_all


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
