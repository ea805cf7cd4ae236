"""Stopping asyncio tasks reliably."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)


async def cancel_all(tasks: Iterable[asyncio.Task[Any]], timeout_s: float, owner: str) -> None:
    """Cancel ``tasks`` and wait for them to end, cancelling again those still running: a
    cancellation can be lost (``asyncio.wait_for`` in Python 3.11 drops one that arrives as the
    awaited future completes, and client libraries await through it: nats-py's requests,
    ``next_msg``, a KV watcher's updates), and a loop that lost it would go on for ever and hold
    up whatever waits for it. Gives up on those still running after ``timeout_s``."""
    tasks = list(tasks)
    pending = {t for t in tasks if not t.done()}
    for t in pending:
        t.cancel()
    deadline = asyncio.get_running_loop().time() + max(timeout_s, 0.5)
    while pending:
        _done, pending = await asyncio.wait(pending, timeout=0.2)
        if not pending:
            break
        if asyncio.get_running_loop().time() > deadline:
            log.warning("%s: %d tasks did not stop when cancelled", owner, len(pending))
            break
        for t in pending:
            t.cancel()
    await asyncio.gather(*(t for t in tasks if t.done()), return_exceptions=True)
