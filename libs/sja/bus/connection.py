"""Connecting to NATS and declaring the JetStream streams and KV buckets SJA uses."""

from __future__ import annotations

import logging
from typing import Generic, TypeVar

import nats
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, KeyValueConfig, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from sja.bus.codec import decode, encode
from sja.protocol import subjects
from sja.protocol.messages import JobState, Message, SliceState

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)

DAY_S = 86_400.0


async def connect(url: str, name: str, *, connect_timeout_s: float = 5.0) -> Client:
    """Connect with unbounded reconnects: a restarted server is rejoined, not fatal."""

    async def on_error(e: Exception) -> None:
        log.warning("nats error in %s: %s", name, e)

    async def on_disconnect() -> None:
        log.info("%s disconnected from nats", name)

    async def on_reconnect() -> None:
        log.info("%s reconnected to nats", name)

    return await nats.connect(
        servers=url.split(","),
        name=name,
        connect_timeout=connect_timeout_s,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.25,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        pending_size=64 * 1024 * 1024,
        drain_timeout=5,
    )


async def ensure_jetstream(js: JetStreamContext, replicas: int = 1) -> None:
    """Declare every stream and bucket (idempotent: existing ones are kept as they are)."""
    for spec in subjects.STREAMS:
        cfg = StreamConfig(
            name=spec.name,
            subjects=list(spec.subjects),
            retention=RetentionPolicy.WORK_QUEUE if spec.work_queue else RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=spec.duplicate_window_s,
            max_age=0 if spec.work_queue else 7 * DAY_S,
            discard=DiscardPolicy.OLD,
            num_replicas=replicas,
        )
        try:
            await js.stream_info(spec.name)
        except nats.js.errors.NotFoundError:
            await js.add_stream(cfg)
    for bucket in subjects.BUCKETS:
        try:
            await js.key_value(bucket)
        except nats.js.errors.BucketNotFoundError:
            await js.create_key_value(
                KeyValueConfig(bucket=bucket, history=5, replicas=replicas, storage=StorageType.FILE)
            )


class Store(Generic[M]):
    """Typed access to a KV bucket with compare-and-set."""

    def __init__(self, kv: KeyValue, typ: type[M]) -> None:
        self.kv = kv
        self.typ = typ

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
        try:
            return int(await self.kv.create(key, encode(value)))
        except KeyWrongLastSequenceError:
            return None
        except nats.js.errors.APIError as e:
            if "wrong last sequence" in str(e).lower() or e.err_code == 10071:
                return None
            raise

    async def cas(self, key: str, value: M, revision: int) -> int | None:
        """Write only if the entry is still at ``revision``; ``None`` when someone else wrote."""
        try:
            return int(await self.kv.update(key, encode(value), last=revision))
        except KeyWrongLastSequenceError:
            return None
        except nats.js.errors.APIError as e:
            if "wrong last sequence" in str(e).lower() or e.err_code == 10071:
                return None
            raise

    async def put(self, key: str, value: M) -> int:
        return int(await self.kv.put(key, encode(value)))

    async def keys(self) -> list[str]:
        try:
            return list(await self.kv.keys())
        except nats.js.errors.NoKeysError:
            return []

    async def all(self) -> list[tuple[M, int]]:
        out: list[tuple[M, int]] = []
        for key in await self.keys():
            got = await self.get(key)
            if got is not None:
                out.append(got)
        return out


async def stores(js: JetStreamContext) -> tuple[Store[SliceState], Store[JobState]]:
    slices = Store(await js.key_value(subjects.BUCKET_SLICES), SliceState)
    jobs = Store(await js.key_value(subjects.BUCKET_JOBS), JobState)
    return slices, jobs
