"""Subjobs' states between runs: a sequential job's checkpoint is written by its subjob's run to the
JetStream object store ``sja-checkpoints`` (or, from ``state_url_min_mib`` on, to ``state_url``),
and its completion carries a reference to it (``sja.workloads.checkpoint``); the next subjob's input
is read back and checked against its digest. Each tenant's use of the store is counted against
``tenant_state_max_mib`` and a state over ``state_max_mib`` is refused: the subjob fails with the
reason, and nothing is stored."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec
import nats.js.errors
from nats.js.api import ObjectMeta

from services.executor.settings import ExecutorSettings
from sja.bus import streams
from sja.bus.jetstream import JetStream
from sja.execution.runner import RunResult
from sja.protocol.messages import Subjob
from sja.workloads import checkpoint as ckpt
from sja.workloads import statestore

log = logging.getLogger(__name__)

TENANT_USAGE_REFRESH_S = 10.0
"""How old the count of each tenant's states in the object store may be (``tenant_state_max_mib``)."""


class Checkpoints:
    """The executor's side of the states store. ``jetstream`` gives the service's JetStream context
    (there once the service is connected)."""

    def __init__(self, jetstream: Callable[[], JetStream], cfg: ExecutorSettings) -> None:
        self._jetstream = jetstream
        self.cfg = cfg
        self._store: Any = None
        self._held: dict[str, int] = {}
        """tenant -> bytes of its states in the object store (the per-tenant quota)."""
        self._held_at = -1e9

    async def bucket(self) -> Any:
        """The object store of checkpoints, made on first use (``checkpoint_store_max_mib``)."""
        if self._store is None:
            self._store = await streams.object_store(
                self._jetstream(),
                ckpt.BUCKET,
                "SJA checkpoints of sequential jobs",
                self.cfg.js_replicas,
                self.cfg.checkpoint_store_max_mib,
            )
        return self._store

    async def fetch(self, raw: bytes) -> bytes:
        """The full checkpoint (a blob) a reference points to, checked against its digest."""
        ref = ckpt.unpack_ref(raw)
        if statestore.is_external(ref.bucket):
            data = await asyncio.to_thread(statestore.get, ref.bucket, ref.name)
        else:
            store = await self.bucket()
            got = await store.get(ref.name)
            data = bytes(got.data or b"")
        if ckpt.digest(data) != ref.sha256:
            raise ValueError(f"checkpoint {ref.name} does not match its digest")
        return ckpt.pack_blob(ref.summary, data)

    async def store(self, sj: Subjob, result: RunResult) -> RunResult:
        """Put a subjob's checkpoint blob in the object store; its completion carries the reference."""
        blob = ckpt.unpack_blob(result.output)
        name = f"{sj.job_id}/{sj.subjob_id}"
        bucket = ckpt.BUCKET
        size = len(blob.data)
        external = bool(self.cfg.state_url) and size >= self.cfg.state_url_min_mib * ckpt.MIB
        try:
            held = None
            if not external and self.cfg.tenant_state_max_mib > 0:
                held = await self.tenant_held(sj.tenant)
            why = ckpt.refusal(size, held, sj.tenant, self.cfg.state_max_mib, self.cfg.tenant_state_max_mib)
            if why:
                log.warning("subjob %s: state not stored: %s", sj.subjob_id, why)
                return msgspec.structs.replace(result, status="failed", units_done=0, output=b"", error=why)
            if external:
                bucket = self.cfg.state_url
                await asyncio.to_thread(statestore.put, bucket, name, blob.data)
            else:
                store = await self.bucket()
                await store.put(
                    name, blob.data, meta=ObjectMeta(name=name, description=ckpt.describe(sj.tenant))
                )
                self._held[sj.tenant] = self._held.get(sj.tenant, 0) + size
        except Exception as e:
            log.error("subjob %s: checkpoint not stored: %s", sj.subjob_id, e)
            return msgspec.structs.replace(
                result, status="failed", units_done=0, output=b"", error=f"checkpoint not stored: {e}"
            )
        return msgspec.structs.replace(result, output=ckpt.make_ref(bucket, name, blob))

    async def tenant_held(self, tenant: str) -> int:
        """Bytes of ``tenant``'s states in the object store: counted from the store (every object's
        size, by the tenant its description names) when the last count is older than
        ``TENANT_USAGE_REFRESH_S``, else that count plus this executor's writes since."""
        if time.monotonic() - self._held_at >= TENANT_USAGE_REFRESH_S:
            store = await self.bucket()
            try:
                objects = await store.list()
            except nats.js.errors.NotFoundError:  # an empty store
                objects = []
            held: dict[str, int] = {}
            for o in objects:
                if not o.deleted:
                    t = ckpt.tenant_of(o.description)
                    held[t] = held.get(t, 0) + int(o.size or 0)
            self._held, self._held_at = held, time.monotonic()
        return self._held.get(tenant, 0)
