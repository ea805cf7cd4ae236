"""Waits on events for the integration tests, instead of fixed sleeps.

``wait_until`` polls a condition up to a generous deadline (a wait on a condition, not a guess at
how long handling takes; ``wait_until_sync`` outside a coroutine), ``until_state`` a job's state
through the gateway; ``settled`` waits until services have read (``$SRV.PING`` answered after them)
and handled (no message waiting, no handler running) what a connection sent before it; ``rejected``
reads a service's count of dropped messages; ``logged`` finds a log line; ``consumed`` tells whether
a JetStream consumer acknowledged everything up to a message. A test that asserts an input changed
nothing first proves with one of them that the input was handled.

Sleeps left in the integration tests are the scenario itself (a lease or a liveness bound running
out, timestamps spaced apart), each saying so, or the pause inside a poll like these.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from nats.aio.client import Client

    from sja.bus.service import Service
    from sja.client import SjaClient
    from sja.protocol.messages import JobState

PING_TIMEOUT_S = 3.0


async def wait_until(
    cond: Callable[[], Any], what: str | Callable[[], str], timeout_s: float = 20.0, every_s: float = 0.02
) -> Any:
    """Poll ``cond`` (a function or a coroutine function) until it returns something true, and return
    that; fail saying ``what`` was awaited after ``timeout_s`` (a generous deadline: a wait on a
    condition, not a guess at how long handling takes). ``what`` may be a function, called only on
    failure, so that the message also says what was seen last."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what() if callable(what) else what}")
        await asyncio.sleep(every_s)


def wait_until_sync(
    cond: Callable[[], Any], what: str | Callable[[], str], timeout_s: float = 20.0, every_s: float = 0.02
) -> Any:
    """``wait_until`` for a test that is not a coroutine (one that watches a process with blocking
    calls): it runs no event loop of its own and leaves the tests' one alone."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what() if callable(what) else what}")
        time.sleep(every_s)


async def until_state(
    client: SjaClient,
    job_id: str,
    check: Callable[[JobState], bool],
    timeout_s: float,
    what: str,
    every_s: float = 0.05,
) -> JobState:
    """Poll the state of ``job_id`` through ``client`` until ``check`` holds, and return that state;
    fail saying ``what`` was awaited and where the job stood last (status, units, history, subjobs
    in flight, retry)."""
    last: list[JobState] = []

    async def holds() -> JobState | None:
        state = await client.status(job_id)
        last[:] = [state]
        return state if check(state) else None

    def stood() -> str:
        (state,) = last
        history = [(h.subjob_id, h.status, h.unit_start, h.units, h.slice_id) for h in state.history]
        return (
            f"{what}: {state.status} {state.units_done}/{state.total_units}, history {history}, "
            f"in flight {state.in_flight}, retry {state.retry}"
        )

    found: JobState = await wait_until(holds, stood, timeout_s, every_s)
    return found


async def settled(nc: Client, services: list[Service], what: str = "", timeout_s: float = 20.0) -> None:
    """Every message ``nc`` sent on core NATS before this call has been handled by ``services``.

    Each service answers a ``$SRV.PING`` sent after those messages: the server delivers one
    connection's messages to a subscriber in order, so the service had read them all (into its
    subscriptions' queues, or handed them to an eager handler) when it answered. Then each service
    has no message waiting in a subscription and no handler task running: every one of them has
    been handled to the end (what a handler scheduled for later, a round's timer, is not covered)."""
    pings = [
        nc.request(f"$SRV.PING.sja-{s.name}.{s._micro.id}", b"", timeout=PING_TIMEOUT_S) for s in services
    ]
    for s, r in zip(services, await asyncio.gather(*pings, return_exceptions=True), strict=True):
        assert not isinstance(r, BaseException), f"{what}: no $SRV.PING answer from {s.instance}: {r!r}"

    def idle() -> bool:
        return all(not s._tasks and not any(sub.pending_msgs for sub in s._subs) for s in services)

    await wait_until(idle, f"{what}: every message handled", timeout_s, every_s=0.005)


def rejected(svc: Service, subject: str | None = None, reason: str | None = None) -> float:
    """How many messages services of ``svc``'s kind (every instance in this process) have dropped
    as undecodable so far: their ``sja_rejected_messages`` counter, only on subscriptions that take
    ``subject`` (a subject, or the subscription's own wildcard subject) and for ``reason``
    (``too_large``, ``malformed``, ``invalid``) if given. A total over the process: compare a
    reading before the input with one after."""
    counter = svc.metrics.rejected_messages
    with counter._store.lock:
        series = [(dict(labels), total) for (service, labels), (total, _) in counter._store.totals.items()
                  if service == counter.service]  # fmt: skip
    return sum(
        total
        for labels, total in series
        if (subject is None or _takes(str(labels.get("subject")), subject))
        and (reason is None or labels.get("reason") == reason)
    )


def _takes(pattern: str, subject: str) -> bool:
    """Whether a subscription on ``pattern`` receives ``subject`` (or ``pattern`` is ``subject``)."""
    if pattern == subject:
        return True
    want, got = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(got) > i
        if i >= len(got) or (token != "*" and token != got[i]):
            return False
    return len(want) == len(got)


async def consumed(nc: Client, stream: str, durable: str, seq: int) -> bool:
    """Whether the consumer ``durable`` of ``stream`` has been delivered the messages up to stream
    sequence ``seq`` and holds none unacknowledged (each handled: acknowledged or terminated)."""
    info = await nc.jetstream().consumer_info(stream, durable)
    return bool(info.delivered.stream_seq >= seq and info.num_ack_pending == 0)


def logged(caplog: pytest.LogCaptureFixture, *parts: str) -> list[logging.LogRecord]:
    """The records captured so far whose message contains every one of ``parts``."""
    return [r for r in caplog.records if all(p in r.getMessage() for p in parts)]
