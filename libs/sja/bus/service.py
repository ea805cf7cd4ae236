"""The service base: an async context manager with graceful drain, and ``run_service``.

``stop()`` stops intake first (the micro endpoints and discovery, then the subscriptions), waits for
in-flight handlers up to the drain timeout, drains the connection, then flushes telemetry.
``start()`` and ``stop()`` are idempotent. A request an endpoint is handling when ``stop()`` begins
is answered: endpoint handlers run as tracked tasks, like subscription handlers.

A service connects with the credentials of its settings (``settings.nats``: ``SJA_NATS_USER`` and
friends, see ``sja.bus.auth.NatsSettings``); every publish or subscribe the server refuses is logged
at ERROR by ``connect`` and counted here (``permission_violations``, also exported as
``sja_permission_violations_total``), so a deployment with a wrong permission is visible.

Metrics (``sja.telemetry.metrics``): ``start()`` installs the process's meter provider and, with
``SJA_METRICS_PORT`` set, serves ``/metrics``; every service records through ``self.metrics`` (points
labeled ``service=<name>``). A message a handler cannot decode (``DecodeError``) is counted in
``sja_rejected_messages_total`` and logged at WARNING with its subject, without a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import gc
import logging
import os
import signal
import socket
import types
from collections.abc import Awaitable, Callable, Coroutine, Generator, Sequence
from contextlib import AsyncExitStack
from typing import Any, TypeVar

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from sja import __version__
from sja.bus.codec import DecodeError
from sja.bus.connection import connect
from sja.bus.jetstream import JetStream, jetstream
from sja.bus.natsclient import Client
from sja.bus.permissions import PermissionViolation
from sja.bus.settings import BaseSettings
from sja.bus.store import KvStore, stores
from sja.bus.streams import ensure_jetstream
from sja.bus.tasks import cancel_all
from sja.bus.watch import Change, KvView, View, Views
from sja.protocol.messages import JobState, Message, SliceState
from sja.telemetry.metrics import MetricsEndpoint, ServiceMetrics, flush_metrics, serve_metrics, setup_metrics
from sja.telemetry.setup import flush_tracing, setup_tracing

log = logging.getLogger(__name__)

LOOP_LAG_PROBE_S = 0.1
"""How often a service times its event loop's lag (``sja_event_loop_lag_seconds``)."""
T = TypeVar("T")
M = TypeVar("M", bound=Message)

Handler = Callable[[Msg], Awaitable[None]]


class Service:
    """Base of every SJA service process."""

    name = "service"

    def __init__(self, settings: BaseSettings) -> None:
        self.settings = settings
        self.instance = settings.instance or f"{self.name}-{socket.gethostname()}-{os.getpid()}"
        self.nc: Client | None = None
        self.js: JetStream | None = None
        self.slices: KvStore[SliceState] | None = None
        self.jobs: KvStore[JobState] | None = None
        self._subs: list[Subscription] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._loops: list[asyncio.Task[Any]] = []
        self._micro: Any = None
        self._started = False
        self._stopped = False
        self.stopping = asyncio.Event()
        self.permission_violations = 0
        """Publishes and subscriptions the NATS server refused for this service's user."""
        self.last_permission_violation: PermissionViolation | None = None
        self.metrics = ServiceMetrics(self.name)
        """This service's instruments (no-ops until ``start()`` installs the meter provider)."""
        self._metrics_endpoint: MetricsEndpoint | None = None
        self.views: Views | None = None
        """The views of KV buckets shared with the services co-hosted in this process
        (``run_services``), or ``None``: each view of this service is its own (``watch``)."""

    # --- lifecycle ---------------------------------------------------------------------------------

    async def start(self) -> None:
        if self._started:
            return
        self._started = True
        setup_tracing(f"sja-{self.name}", out_dir=self.settings.out_dir)
        setup_metrics(f"sja-{self.name}")
        # The series exists from the start, so "no violation" reads 0 rather than "no data".
        self.metrics.permission_violations.add(0)
        self.nc = await connect(
            self.settings.nats_url,
            self.instance,
            auth=self.settings.nats,
            on_permission_violation=self._on_permission_violation,
        )
        self.js = jetstream(self.nc)
        await ensure_jetstream(self.js, replicas=self.settings.js_replicas)
        self.slices, self.jobs = await stores(self.js)
        await self.on_start()
        self.loop(self._measure_loop_lag())
        # Discovery answers only once the service is serving: readiness = answers $SRV.PING.
        await self._register_micro()
        # Round-trip to the server: every subscription above is in place before anyone is told
        # the service is up (a request right after start() must find its responder).
        await self.bus.flush()
        # Last, like discovery: a scrape target that is up is a service that is serving.
        self._metrics_endpoint = serve_metrics(self.settings.metrics_port)
        log.info("%s started (%s)", self.instance, self.settings.nats_url)

    async def stop(self) -> None:
        if self._stopped or not self._started:
            return
        self._stopped = True
        self.stopping.set()
        # Intake first: no new request is taken while the work already taken drains.
        if self._micro is not None:
            with contextlib.suppress(Exception):
                await self._micro.stop()
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.drain()  # type: ignore[no-untyped-call]
        await cancel_all(self._loops, self.settings.drain_timeout_s, self.instance)
        if self._tasks:
            _done, pending = await asyncio.wait(set(self._tasks), timeout=self.settings.drain_timeout_s)
            await cancel_all(list(pending), self.settings.drain_timeout_s, self.instance)
        with contextlib.suppress(Exception):
            await self.on_stop()
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.drain()
        flush_tracing()
        await self._release_metrics()
        log.info("%s stopped", self.instance)

    async def _measure_loop_lag(self) -> None:
        """Record, every ``LOOP_LAG_PROBE_S``, how late the event loop woke this task's timer
        (``sja_event_loop_lag_seconds``): what every message handled here waits on top of its own
        handling. A few wake-ups a second, so short stalls between probes go unseen; the
        histogram's tail still shows how often and how long the loop stalls."""
        loop = asyncio.get_running_loop()
        while True:
            due = loop.time() + LOOP_LAG_PROBE_S
            await asyncio.sleep(LOOP_LAG_PROBE_S)
            self.metrics.loop_lag.record(max(0.0, loop.time() - due))

    async def _release_metrics(self) -> None:
        """Drop this service's gauge series, push pending OTLP metrics and release the endpoint
        (both may block briefly, so off the event loop)."""
        self.metrics.close()
        endpoint, self._metrics_endpoint = self._metrics_endpoint, None
        with contextlib.suppress(Exception):
            await asyncio.to_thread(flush_metrics)
            if endpoint is not None:
                await asyncio.to_thread(endpoint.release)

    async def __aenter__(self) -> Service:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _on_permission_violation(self, violation: PermissionViolation) -> None:
        self.permission_violations += 1
        self.last_permission_violation = violation
        self.metrics.permission_violations.add(1)

    # --- hooks for subclasses ----------------------------------------------------------------------

    async def on_start(self) -> None:
        """Subscribe and start loops."""

    async def on_stop(self) -> None:
        """Release what ``on_start`` took, after in-flight work is done."""

    async def add_endpoints(self, micro: Any) -> None:
        """Add NATS micro endpoints (request/reply API)."""

    # --- helpers -----------------------------------------------------------------------------------

    @property
    def bus(self) -> Client:
        assert self.nc is not None, "service not started"
        return self.nc

    @property
    def jetstream(self) -> JetStream:
        assert self.js is not None, "service not started"
        return self.js

    async def subscribe(
        self, subject: str, handler: Handler, queue: str = "", eager: bool = False
    ) -> Subscription:
        """Subscribe with every message handled as a tracked task (so stop() can wait for it).

        ``eager``: for a round's critical path. Each message's handler starts as soon as the
        message is read, ahead of the callbacks already due on the event loop, and runs up to its
        first wait there; only what follows a wait continues as a tracked task (``run_eagerly``).
        A handler that finishes without waiting (an agent answering an offer) costs no task."""
        if eager:

            def deliver(msg: Msg) -> None:
                self.run_eagerly(self._guarded(handler, msg, subject))

            sub = await self.bus.subscribe_eager(subject, deliver, queue=queue)
        else:

            async def cb(msg: Msg) -> None:
                self.spawn(self._guarded(handler, msg, subject))

            sub = await self.bus.subscribe(subject, queue=queue, cb=cb, pending_msgs_limit=1_000_000)
        self._subs.append(sub)
        return sub

    async def watch(self, bucket: str, typ: type[M], on_change: Change[M]) -> View[M]:
        """A live view of ``bucket`` (``sja.bus.watch``), started: this process's shared one when
        services are co-hosted (``views``; see ``Views``), else one of this service's own. Either
        way ``on_change`` sees every entry as it stands, then every change, in the stream's order;
        ``stop()`` on the view lets go of it."""
        if self.views is not None:
            return await self.views.view(self.jetstream, bucket, typ, on_change)
        view = KvView(self.jetstream, bucket, typ, on_change=on_change)
        await view.start()
        return view

    def run_eagerly(self, coro: Coroutine[Any, Any, None]) -> None:
        """Run ``coro`` now, up to its first wait; if it waits, the rest runs as a tracked task.

        It runs in a context of its own (a copy of the current one), which the task keeps: a span
        it makes current before a wait is still current after it, and never leaks to the caller.
        Up to its first wait it runs inside the caller's task (the connection's read loop, for an
        eager subscription): it must not use ``asyncio.current_task()`` there, nor what reads it
        (``asyncio.timeout``, which would cancel the read loop); ``asyncio.wait_for`` and locks
        are fine."""
        ctx = contextvars.copy_context()
        try:
            waiting_on = ctx.run(coro.send, None)
        except StopIteration:
            return
        self.spawn(_resume(coro, waiting_on), context=ctx)

    async def _guarded(self, handler: Handler, msg: Msg, subject: str) -> None:
        try:
            await handler(msg)
        except asyncio.CancelledError:
            raise
        except DecodeError as e:
            # A malformed message is the sender's fault, not a bug here: count it, no traceback.
            self.metrics.rejected(subject, e)
            log.warning("%s: dropped a message on %s (%s): %s", self.instance, msg.subject, subject, e)
        except Exception:
            log.exception("%s: handler for %s failed", self.instance, subject)

    def spawn(
        self, coro: Coroutine[Any, Any, Any], context: contextvars.Context | None = None
    ) -> asyncio.Task[Any]:
        """Run ``coro`` as a task that ``stop()`` waits for (in ``context``, if given)."""
        task = asyncio.get_running_loop().create_task(coro, context=context)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    def loop(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A long-running loop, cancelled at stop (intake)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._loops.append(task)
        return task

    async def _register_micro(self) -> None:
        from nats.micro import add_service

        self._micro = await add_service(
            self.bus,
            name=f"sja-{self.name}",
            version=__version__,
            description=f"SJA {self.name}",
            metadata={"instance": self.instance},
        )
        await self.add_endpoints(_TrackedEndpoints(self._micro, self))

    def _tracked(
        self, handler: Callable[[Any], Coroutine[Any, Any, None]]
    ) -> Callable[[Any], Coroutine[Any, Any, None]]:
        """An endpoint handler run as a tracked task, so ``stop()`` waits for it.

        nats.micro runs a handler inside its endpoint's subscription and cancels it when the
        endpoint stops; stopping the endpoints first would then cancel a request half done (a
        submission written but never answered). Shielded, the request goes on to its reply while
        only the endpoint's wait for it is cancelled."""

        async def run(request: Any) -> None:
            await asyncio.shield(self.spawn(handler(request)))

        return run


class _TrackedEndpoints:
    """What ``Service.add_endpoints`` receives: the micro service, with every endpoint handler
    tracked by the service (``Service._tracked``)."""

    def __init__(self, micro: Any, service: Service) -> None:
        self._micro = micro
        self._service = service

    async def add_endpoint(self, config: Any = None, **kwargs: Any) -> Any:
        if config is not None:
            config = dataclasses.replace(config, handler=self._service._tracked(config.handler))
            return await self._micro.add_endpoint(config)
        kwargs["handler"] = self._service._tracked(kwargs["handler"])
        return await self._micro.add_endpoint(**kwargs)

    def add_group(self, config: Any = None, **kwargs: Any) -> _TrackedEndpoints:
        group = (
            self._micro.add_group(config, **kwargs) if config is not None else self._micro.add_group(**kwargs)
        )
        return _TrackedEndpoints(group, self._service)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._micro, name)


@types.coroutine
def _resume(coro: Coroutine[Any, Any, None], waiting_on: Any) -> Generator[Any, Any, None]:
    """The rest of a coroutine already started by hand (``Service.run_eagerly``), stopped at
    ``waiting_on`` (what it yielded: the future it awaits). A task driving this drives the
    coroutine exactly as it would have from the start: results and exceptions, cancellation
    included, go on into it."""
    while True:
        try:
            sent = yield waiting_on
        except GeneratorExit:
            coro.close()
            raise
        except BaseException as e:  # thrown in by the task (a failed future, a cancellation)
            try:
                waiting_on = coro.throw(e)
            except StopIteration:
                return
        else:
            try:
                waiting_on = coro.send(sent)
            except StopIteration:
                return


async def run_service(service: Service, ready: Callable[[], None] | None = None) -> None:
    """Run until SIGINT/SIGTERM, then stop gracefully."""
    await run_services([service], ready)


async def run_services(services: Sequence[Service], ready: Callable[[], None] | None = None) -> None:
    """Run several services in this process, on one event loop, until SIGINT/SIGTERM; start them in
    the order given and stop them gracefully in the reverse order.

    Each keeps its own connection, subscriptions, consumers and instance id, so it behaves on the
    bus exactly as it would in a process of its own. What the process has once is shared: its
    tracer and meter providers (named ``sja-<a>+<b>+...``; every metric point still carries its
    service's ``service`` label, every span its own name), its ``/metrics`` endpoint and its cycle
    collector. Co-hosting the services that are mostly idle, or on the same round's path, takes
    processes off a small machine's cores (docs/operations.md, "Co-hosting services")."""
    if not services:
        raise ValueError("no service to run")
    if len(services) > 1:
        # The first service to start would otherwise name the whole process's telemetry.
        name = "sja-" + "+".join(s.name for s in services)
        setup_tracing(name, out_dir=services[0].settings.out_dir)
        setup_metrics(name)
        # A bucket two of them watch (the slices: the gateway and the advertiser) is watched once.
        views = Views()
        for service in services:
            service.views = views
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    async with AsyncExitStack() as stack:
        for service in services:
            await stack.enter_async_context(service)
        # After start: libraries started there (Ray) install their own handlers; ours win.
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError):
                loop.add_signal_handler(sig, stop.set)
        if ready is not None:
            ready()
        await stop.wait()


GC_GEN0_THRESHOLD = 10_000
"""Allocations between young-generation collections (CPython's default is 700)."""


def tune_gc() -> None:
    """Set a service process's cycle collector for a long-running server holding many objects.

    With CPython's defaults, an agent holding a thousand jobs spent a fifth of its CPU in the
    collector at hundreds of grants a second (full collections scanning every live object). A
    larger young generation makes collections ten times rarer; ``freeze_after_start`` moves what
    start-up made (modules, classes, connections) out of every later collection. Garbage cycles
    still get collected, only later. For the process entry point only, not for a library caller."""
    _g0, g1, g2 = gc.get_threshold()
    gc.set_threshold(GC_GEN0_THRESHOLD, g1, g2)


def freeze_after_start() -> None:
    """What start-up allocated is permanent: leave it out of every later collection."""
    gc.collect()
    gc.freeze()


EVENT_LOOPS = ("uvloop", "asyncio")


def run_loop(coro: Coroutine[Any, Any, T], loop: str | None = None) -> T:
    """Run a process's main coroutine on its event loop: uvloop by default (``SJA_EVENT_LOOP``,
    ``uvloop`` or ``asyncio``). A service spends much of its CPU dispatching messages (callbacks,
    futures, socket reads); uvloop does that part in C. Where uvloop is not installed (it has no
    Windows build) the standard loop runs instead, as it does with ``SJA_EVENT_LOOP=asyncio``."""
    choice = (loop or os.environ.get("SJA_EVENT_LOOP") or "uvloop").strip().lower()
    if choice not in EVENT_LOOPS:
        coro.close()
        raise ValueError(f"SJA_EVENT_LOOP must be one of {', '.join(EVENT_LOOPS)}, not {choice!r}")
    if choice == "uvloop":
        try:
            import uvloop
        except ImportError:
            log.info("uvloop is not installed: the standard asyncio loop runs")
        else:
            return uvloop.run(coro)
    return asyncio.run(coro)
