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
