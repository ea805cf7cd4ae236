"""A live view of a KV bucket: a local cache kept current by an ordered consumer, with change
callbacks.

nats-py's ``KeyValue.watchall`` hands each update through two queues: the subscription's task
builds a ``KeyValue.Entry`` (the message's metadata parsed, its timestamp as a ``datetime``) and
puts it in the watcher's queue, and the reader takes it out through ``asyncio.wait_for`` (a task of
its own for every update in Python 3.11). The advertiser watches ``sja-slices``, which changes
twice per grant (the lease, the free), and that hand-over was a third of each update's cost in
the client (10.2 against 6.8 us without it). Here the view subscribes to the bucket's stream
itself, on the same kind of consumer ``watchall`` makes (ordered, the last value of each key
first, then every change; nats-py starts it again after a gap or two missed heartbeats), and
handles each update in the subscription's callback: the key, the revision and what is still
pending read from the reply subject, the value decoded, the callback awaited, in the order the
stream has them.

The view takes the JetStream context and the bucket's name: a bucket's stream is ``KV_<bucket>`` and
its keys the subjects under ``$KV.<bucket>.``, as every NATS client names them (the KV protocol,
not a client's internals).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from nats.aio.msg import Msg
from nats.js import JetStreamContext, api
from nats.js.kv import KV_DEL, KV_MARKER_REASON, KV_OP, KV_PURGE

from sja.bus.codec import DecodeError, decode
from sja.bus.jetstream import delivery
from sja.protocol.messages import Message

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

INACTIVE_THRESHOLD_S = 300.0
"""The server removes the view's consumer after this long without its subscription (as nats-py's
watchers)."""

HEARTBEAT_S = 1.0
"""The server's heartbeat to the view's consumer while nothing changes; two missed (the consumer
gone with a restarted server, say) and it is made again from the last revision seen. nats-py's
default, 5 s, left an advertiser blind to freed slices for 10-20 s."""


def _operation(headers: dict[str, str] | None) -> str | None:
    """``DEL`` or ``PURGE`` for a removal, ``None`` for a value, ``""`` for a server marker of a
    kind not known here (skipped, as nats-py's watcher does)."""
    if not headers:
        return None
    op = headers.get(KV_OP)
    if op is not None:
        return op
    reason = headers.get(KV_MARKER_REASON)
    if reason is None:
        return None
    if reason in ("MaxAge", "Purge"):
        return KV_PURGE
    return KV_DEL if reason == "Remove" else ""


class KvView(Generic[M]):
    """Every entry of a bucket as ``key -> (value, revision)``; deleted keys disappear.

    ``start`` returns once the bucket's entries as they stood have been read (``ready``); after
    that every change is applied, then ``on_change(key, value or None, revision)`` is awaited, one
    change at a time in the stream's order."""

    def __init__(
        self,
        js: JetStreamContext,
        bucket: str,
        typ: type[M],
        on_change: Callable[[str, M | None, int], Awaitable[None]] | None = None,
    ) -> None:
        self.js = js
        self.bucket = bucket
        self.typ = typ
        self.on_change = on_change
        self.entries: dict[str, tuple[M, int]] = {}
        self.ready = asyncio.Event()
        self._sub: Any = None
        self._prefix = f"$KV.{bucket}."
        self._ended = False
        """A cancellation came out of a delivery: the subscription's task that hands the view its
        updates stops on one (nats-py), so the view no longer follows the bucket."""

    async def start(self) -> None:
        self._ended = False
        self._sub = await self.js.subscribe(
            f"{self._prefix}>",
            stream=f"KV_{self.bucket}",
            cb=self._on_msg,
            ordered_consumer=True,
            deliver_policy=api.DeliverPolicy.LAST_PER_SUBJECT,
            inactive_threshold=INACTIVE_THRESHOLD_S,
            idle_heartbeat=HEARTBEAT_S,
        )
        # An empty bucket delivers nothing to say that it is read; otherwise the delivery with
        # nothing pending after it does (``_on_msg``), whether or not it came before this answer.
        info = await self._sub.consumer_info()
        delivered = info.delivered.consumer_seq if info.delivered is not None else 0
        if info.num_pending == 0 and not delivered:
            self.ready.set()
        await self.ready.wait()

    @property
    def watching(self) -> bool:
        """Whether the view still follows the bucket: started, not stopped, and no delivery ended
        the subscription's task that hands it the updates (a handler raises anything else into a
        log line, and the view goes on). Its connection closing ends it too: the connection's
        owner knows that (``Client.is_closed``)."""
        return self._sub is not None and not self._ended

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    async def _on_msg(self, msg: Msg) -> None:
        d = delivery(msg.reply)
        if d is None:
            log.error("watch of %s: a delivery without JetStream metadata (%r)", self.bucket, msg.reply)
            return
        try:
            await self._apply(msg, d.stream_seq)
        except asyncio.CancelledError:
            self._ended = True
            log.error("watch of %s: cancelled in a delivery; the view no longer follows it", self.bucket)
            raise
        finally:
            if d.pending == 0 and not self.ready.is_set():
                self.ready.set()

    async def _apply(self, msg: Msg, revision: int) -> None:
        op = _operation(msg.headers)
        if op == "":
            return
        key = msg.subject[len(self._prefix) :]
        value: M | None
        if op in (KV_DEL, KV_PURGE) or not msg.data:
            self.entries.pop(key, None)
            value = None
        else:
            try:
                value = decode(msg.data, self.typ)
            except DecodeError as e:
                log.error("bad entry %s in %s: %s", key, self.bucket, e)
                return
            self.entries[key] = (value, revision)
        if self.on_change is not None:
            try:
                await self.on_change(key, value, revision)
            except Exception:
                log.exception("change handler failed for %s", key)

    def values(self) -> list[M]:
        return [v for v, _ in self.entries.values()]


Change = Callable[[str, M | None, int], Awaitable[None]]


async def read_bucket(js: JetStreamContext, bucket: str, typ: type[M]) -> list[M]:
    """Every entry of a bucket as it stands: a view started and stopped (for a reader that needs the
    entries now and then, not each of their changes)."""
    view = KvView(js, bucket, typ)
    try:
        await view.start()
        return view.values()
    finally:
        await view.stop()


class SharedView(Generic[M]):
    """One holder's share of a view of a bucket kept once for its process (``Views``): the view's
    entries, and its own ``on_change``. ``stop`` lets go of it."""

    def __init__(self, shared: _Shared[M], js: JetStreamContext) -> None:
        self._shared = shared
        self.js = js
        self.stopped = False

    @property
    def entries(self) -> dict[str, tuple[M, int]]:
        return self._shared.view.entries

    @property
    def ready(self) -> asyncio.Event:
        return self._shared.view.ready

    @property
    def watching(self) -> bool:
        return not self.stopped and self._shared.view.watching

    def values(self) -> list[M]:
        return self._shared.view.values()

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            await self._shared.detach(self)


class _Shared(Generic[M]):
    """A bucket's view and the holders it is handed to, change by change in the stream's order."""

    def __init__(self, views: Views, bucket: str, typ: type[M]) -> None:
        self.views = views
        self.bucket = bucket
        self.typ = typ
        self.holders: list[tuple[SharedView[M], Change[M]]] = []
        self.view: KvView[M] = self._new_view(None)  # replaced with the first holder's (``attach``)
        """The view whose entries the holders read."""
        self.live: KvView[M] | None = None
        """The view whose changes are handed out (``None`` while one is being replaced)."""
        self.started = asyncio.Event()
        self.lock = asyncio.Lock()
        """Held while a change is handed out and while a holder joins (its catching up and the next
        change are never interleaved)."""

    def _new_view(self, js: JetStreamContext | None) -> KvView[M]:
        view: KvView[M] = KvView(js, self.bucket, self.typ)  # type: ignore[arg-type]
        view.on_change = lambda key, value, rev: self._dispatch(view, key, value, rev)
        return view

    async def _dispatch(self, source: KvView[M], key: str, value: M | None, revision: int) -> None:
        if source is not self.live:
            return  # a view being replaced, or its replacement catching up (``detach``)
        async with self.lock:
            await self._hand_out(list(self.holders), key, value, revision)

    async def _hand_out(
        self, holders: list[tuple[SharedView[M], Change[M]]], key: str, value: M | None, revision: int
    ) -> None:
        for _, on_change in holders:
            try:
                await on_change(key, value, revision)
            except Exception:
                log.exception("change handler failed for %s", key)

    async def attach(self, js: JetStreamContext, on_change: Change[M]) -> SharedView[M]:
        holder = SharedView(self, js)
        if not self.holders and not self.started.is_set():
            # The first holder: the view is started on its connection, and every entry as it stood
            # reaches it as it would from a view of its own.
            self.holders.append((holder, on_change))
            self.view = self.live = self._new_view(js)
            try:
                await self.view.start()
            except BaseException:
                self.holders.remove((holder, on_change))
                self.views.forget(self)
                raise
            self.started.set()
            return holder
        await self.started.wait()
        # A later holder catches up on every entry as it stands, then follows the changes.
        async with self.lock:
            entries = list(self.view.entries.items())
            for key, (value, revision) in entries:
                await self._hand_out([(holder, on_change)], key, value, revision)
            self.holders.append((holder, on_change))
        return holder

    async def detach(self, holder: SharedView[M]) -> None:
        self.holders = [(h, cb) for h, cb in self.holders if h is not holder]
        old = self.view
        if not self.holders:
            self.views.forget(self)
            await old.stop()
            return
        if holder.js is not old.js:
            return
        # The view ran on the connection of the holder leaving (which closes it): it is made again
        # on another holder's, and the holders are told what changed in between.
        self.live = None  # neither view's deliveries are handed out until the new one has caught up
        before = dict(old.entries)
        new = self._new_view(self.holders[0][0].js)
        await old.stop()
        try:
            await new.start()
        except Exception:
            log.exception("watch of %s: could not be made again on another connection", self.bucket)
            return
        now = dict(new.entries)
        self.view = self.live = new
        async with self.lock:
            holders = list(self.holders)
            for key, (value, revision) in now.items():
                if before.get(key, (None, -1))[1] != revision:
                    await self._hand_out(holders, key, value, revision)
            for key, (_, revision) in before.items():
                if key not in now:
                    await self._hand_out(holders, key, None, revision)


class Views:
    """The KV views of the services run in one process (``run_services``): one view per bucket,
    whatever the number of co-hosted services watching it, so each change of the bucket is sent to
    the process and decoded once. The view runs on the connection of the first service to ask for
    it; a later one catches up on the entries as they stand (each handed to its ``on_change``) and
    then follows the changes. When the service whose connection carries the view lets go of it
    first, the view is made again on another's connection, and the others are told of the entries
    that changed in between."""

    def __init__(self) -> None:
        self._shared: dict[tuple[str, type[Any]], _Shared[Any]] = {}

    async def view(
        self, js: JetStreamContext, bucket: str, typ: type[M], on_change: Change[M]
    ) -> SharedView[M]:
        shared = self._shared.get((bucket, typ))
        if shared is None:
            shared = self._shared[(bucket, typ)] = _Shared(self, bucket, typ)
        return await shared.attach(js, on_change)

    def forget(self, shared: _Shared[Any]) -> None:
        if self._shared.get((shared.bucket, shared.typ)) is shared:
            del self._shared[(shared.bucket, shared.typ)]


View = KvView[M] | SharedView[M]
"""A service's view of a bucket: its own, or its share of its process's (``Service.watch``)."""
