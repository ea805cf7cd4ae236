"""Typed key-value stores with compare-and-set: the slices and jobs buckets.

``KvStore`` is what services use. ``Store`` keeps it in a JetStream KV bucket; ``MemoryStore``
keeps it in a dict, with the same revisions and the same compare-and-set answers, for unit tests
that reach a service's conflict paths (another writer got there first) without a server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from sja.bus.codec import decode, encode
from sja.bus.jetstream import stream_subjects
from sja.protocol import subjects
from sja.protocol.messages import JobState, Message, SliceState

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
H = TypeVar("H")

SCAN_CHUNK = 256
"""Entries a bucket read handles between two turns of the event loop. Reading a bucket of
thousands of jobs in one go stalled a busy agent for tens of milliseconds (its periodic scan for
the jobs of silent agents), and every message waiting on it with it."""


class KvStore(Protocol[M]):
    """A bucket of ``M`` values by key. Every write gets a revision, higher than any before it in
    the bucket; ``create`` and ``cas`` answer ``None`` instead of writing when another writer got
    there first."""

    typ: type[M]

    async def get(self, key: str) -> tuple[M, int] | None: ...

    async def create(self, key: str, value: M) -> int | None: ...

    async def cas(self, key: str, value: M, revision: int) -> int | None: ...

    async def put(self, key: str, value: M) -> int: ...

    async def keys(self) -> list[str]: ...

    async def all(self) -> list[tuple[M, int]]: ...

    async def heads(self, head: type[H]) -> list[tuple[H, bytes, int]]: ...

    def load(self, raw: bytes) -> M: ...


class MemoryStore(Generic[M]):
    """A ``KvStore`` in a dict. Values are kept encoded, as the bucket keeps them, so a caller that
    changes a value it read changes nothing stored, and a value that cannot be encoded fails the
    write as it would on the bus.

    ``before_write(key)``, when set, is awaited before each ``create``, ``cas`` and ``put`` decides:
    a test writes there as another service would, between a caller's read and its write."""

    def __init__(self, typ: type[M]) -> None:
        self.typ = typ
        self.entries: dict[str, tuple[bytes, int]] = {}
        self.revision = 0
        self.before_write: Callable[[str], Awaitable[None]] | None = None
        self.writes = 0
        self.conflicts = 0

    def _write(self, key: str, value: M) -> int:
        raw = encode(value)
        self.revision += 1
        self.writes += 1
        self.entries[key] = (raw, self.revision)
        return self.revision

    async def _interfere(self, key: str) -> None:
        if self.before_write is not None:
            hook, self.before_write = self.before_write, None  # the other writer does not recurse
            try:
                await hook(key)
            finally:
                self.before_write = hook

    async def get(self, key: str) -> tuple[M, int] | None:
        got = self.entries.get(key)
        return None if got is None else (decode(got[0], self.typ), got[1])

    async def create(self, key: str, value: M) -> int | None:
        await self._interfere(key)
        if key in self.entries:
            self.conflicts += 1
            return None
        return self._write(key, value)

    async def cas(self, key: str, value: M, revision: int) -> int | None:
        await self._interfere(key)
        got = self.entries.get(key)
        if got is None or got[1] != revision:
            self.conflicts += 1
            return None
        return self._write(key, value)

    async def put(self, key: str, value: M) -> int:
        await self._interfere(key)
        return self._write(key, value)

    async def delete(self, key: str) -> None:
        self.entries.pop(key, None)

    async def keys(self) -> list[str]:
        return list(self.entries)

    async def all(self) -> list[tuple[M, int]]:
        return [(decode(raw, self.typ), rev) for raw, rev in self.entries.values()]

    async def heads(self, head: type[H]) -> list[tuple[H, bytes, int]]:
        return [(decode(raw, head), raw, rev) for raw, rev in self.entries.values()]

    def load(self, raw: bytes) -> M:
        return decode(raw, self.typ)


async def _unless_taken(write: Awaitable[int]) -> int | None:
    """The revision ``write`` made, or ``None`` when the server refused it because the key was not
    at the revision it expected (another writer got there first)."""
    try:
        return int(await write)
    except KeyWrongLastSequenceError:
        return None
    except nats.js.errors.APIError as e:
        if "wrong last sequence" in str(e).lower() or e.err_code == 10071:
            return None
        raise


class Store(Generic[M]):
    """Typed access to a KV bucket with compare-and-set."""

    def __init__(self, js: JetStreamContext, kv: KeyValue, bucket: str, typ: type[M]) -> None:
        self.js = js
        self.kv = kv
        self.bucket = bucket
        self.stream = f"KV_{bucket}"
        self.typ = typ

    @classmethod
    async def open(cls, js: JetStreamContext, bucket: str, typ: type[M]) -> Store[M]:
        """The bucket ``bucket`` (declared already, see ``ensure_jetstream``) as a store of ``typ``."""
        return cls(js, await js.key_value(bucket), bucket, typ)

    async def get(self, key: str) -> tuple[M, int] | None:
        try:
            entry = await self.kv.get(key)
        except KeyNotFoundError:
            return None
        if entry.value is None or not entry.value:
            return None
        return decode(entry.value, self.typ), int(entry.revision or 0)

    async def create(self, key: str, value: M) -> int | None:
        """Create if absent; ``None`` when the key already exists."""
        return await _unless_taken(self.kv.create(key, encode(value)))

    async def cas(self, key: str, value: M, revision: int) -> int | None:
        """Write only if the entry is still at ``revision``; ``None`` when someone else wrote."""
        return await _unless_taken(self.kv.update(key, encode(value), last=revision))

    async def put(self, key: str, value: M) -> int:
        return int(await self.kv.put(key, encode(value)))

    async def keys(self) -> list[str]:
        return [key for key, _, _ in await self._latest(values=False)]

    async def all(self) -> list[tuple[M, int]]:
        """Every entry (value and revision) of the bucket as it stands: one ordered consumer over
        the last message of each key, no read per key."""
        return [(value, rev) for value, _, rev in await self._decoded(self.typ)]

    async def heads(self, head: type[H]) -> list[tuple[H, bytes, int]]:
        """Every entry as ``all`` reads it, with only ``head`` decoded: a struct of a few of the
        value's fields, which msgspec reads without building the rest. A scan that acts on a few
        entries decodes those whole (``load``) and skips the others for a fraction of the cost."""
        return await self._decoded(head)

    async def _decoded(self, typ: type[H]) -> list[tuple[H, bytes, int]]:
        """Every entry's value decoded as ``typ``, with its raw bytes and revision. A large bucket
        is decoded a part at a time (``SCAN_CHUNK``), the event loop served in between."""
        out: list[tuple[H, bytes, int]] = []
        for i, (_, raw, rev) in enumerate(await self._latest(values=True)):
            if i and i % SCAN_CHUNK == 0:
                await asyncio.sleep(0)
            out.append((decode(raw, typ), raw, rev))
        return out

    def load(self, raw: bytes) -> M:
        """A value read by ``heads``, decoded whole."""
        return decode(raw, self.typ)

    async def _latest(
        self, values: bool, stall_s: float = 5.0, deadline_s: float = 60.0
    ) -> list[tuple[str, bytes, int]]:
        """(key, value, revision) of every key whose last entry is a value (not a delete or purge).

        nats-py's ``KeyValue.keys()`` decides a bucket is empty when the consumer reports nothing
        pending and its callback has not yet counted a delivery, which also happens when the
        deliveries are on their way: under load a full bucket read as empty. Here the consumer's
        own counts say whether the bucket is empty (nothing delivered and nothing pending), and
        otherwise messages are read until one arrives with nothing pending behind it.

        That alone can still miss a key written meanwhile. The consumer's list of last entries is
        fixed when it is created; the bucket keeps a few revisions per key, and an entry pushed
        out by newer writes before its turn is skipped, while the count of pending messages only
        covers the list. So when the stream holds anything past what the read saw, the keys it
        holds are listed afterwards (one paged request) and any the read missed is read on its
        own: rare, and only under heavy rewriting.

        A consumer can also stop delivering part way (it is an ephemeral, in-memory one: a server
        that restarts or a consumer that the client's own recovery fails to recreate under load
        leaves nothing sending). When no message comes for ``stall_s`` the read starts again on a
        new consumer, keeping what it has (the newest entry of a key wins), until ``deadline_s``.

        Every key present when the read began comes back, each with a value it held during the
        read; writes made meanwhile are folded in. A read that cannot finish (it keeps stalling, or
        cannot catch up with the writers) within ``deadline_s`` raises ``TimeoutError`` rather than
        return part of the bucket."""
        prefix = f"$KV.{self.bucket}."
        latest: dict[str, tuple[bytes, int]] = {}
        gone: dict[str, int] = {}
        seen_seq = 0
        give_up = time.monotonic() + deadline_s
        attempt = 0
        while True:
            attempt += 1
            sub = await self._subscribe_latest(prefix, values)
            read = 0
            try:
                info = await sub.consumer_info()
                delivered = info.delivered.consumer_seq if info.delivered is not None else 0
                empty = (info.num_pending or 0) + (delivered or 0) == 0
                while not empty:
                    if time.monotonic() > give_up:
                        raise TimeoutError(
                            f"reading bucket {self.bucket}: the writers kept ahead for {deadline_s:.0f} s"
                        )
                    msg = await sub.next_msg(timeout=stall_s)
                    read += 1
                    if read % SCAN_CHUNK == 0:
                        # Deliveries already queued come back without a pause: serve the loop.
                        await asyncio.sleep(0)
                    meta = msg.metadata
                    key = msg.subject[len(prefix) :]
                    rev = int(meta.sequence.stream)
                    seen_seq = max(seen_seq, rev)
                    if rev >= max(latest.get(key, (b"", 0))[1], gone.get(key, 0)):
                        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or (
                            values and not msg.data
                        ):
                            latest.pop(key, None)
                            gone[key] = rev
                        else:
                            latest[key] = (msg.data, rev)
                            gone.pop(key, None)
                    if meta.num_pending == 0:
                        break
                break
            except (nats.errors.TimeoutError, NotFoundError) as e:
                # Nothing delivered for stall_s, or the consumer is gone already.
                what = (
                    "its consumer is gone" if isinstance(e, NotFoundError) else f"nothing for {stall_s:g} s"
                )
                if time.monotonic() + stall_s > give_up:
                    raise TimeoutError(
                        f"reading bucket {self.bucket} stalled after {len(latest)} keys "
                        f"({what}, {attempt} consumers tried)"
                    ) from None
                log.warning(
                    "reading bucket %s: %s after %d entries; reading again on a new consumer",
                    self.bucket,
                    what,
                    read,
                )
                await asyncio.sleep(min(0.05 * 2**attempt, 1.0))
            finally:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        # An entry is skipped only when a write made after the consumer was created pushed it out;
        # with nothing stored past what the read saw, no key can be missing.
        if not empty and (await self.js.stream_info(self.stream)).state.last_seq > seen_seq:
            for key in sorted(await self._stream_keys() - latest.keys() - gone.keys()):
                try:
                    entry = await self.kv.get(key)
                except KeyNotFoundError:  # deleted or purged since (KeyDeletedError is one)
                    continue
                if entry.value:
                    latest[key] = (entry.value, int(entry.revision or 0))
        return [(key, data, rev) for key, (data, rev) in latest.items()]

    async def _subscribe_latest(self, prefix: str, values: bool) -> JetStreamContext.PushSubscription:
        """An ordered consumer of the last entry of every key (only headers unless ``values``)."""
        return await self.js.subscribe(
            prefix + ">",
            stream=self.stream,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            headers_only=not values,
            pending_msgs_limit=10_000_000,
        )

    async def _stream_keys(self) -> set[str]:
        """Every key with an entry (a value or a delete marker) in the bucket's stream, from the
        stream's subject listing, page by page (the server sends at most 100,000 a page)."""
        return await stream_subjects(
            self.js, self.stream, f"$KV.{self.bucket}.>", strip=len(f"$KV.{self.bucket}.")
        )


async def stores(js: JetStreamContext) -> tuple[Store[SliceState], Store[JobState]]:
    """The slices and jobs buckets."""
    return (
        await Store.open(js, subjects.BUCKET_SLICES, SliceState),
        await Store.open(js, subjects.BUCKET_JOBS, JobState),
    )
