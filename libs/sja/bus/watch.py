"""A live view of a KV bucket: a local cache kept current by a watcher, with change callbacks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

from nats.js.kv import KeyValue

from sja.bus.codec import DecodeError, decode
from sja.bus.tasks import cancel_all
from sja.protocol.messages import Message

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
STOP_TIMEOUT_S = 5.0
"""How long ``KvView.stop`` waits for its loop to end."""


class KvView(Generic[M]):
    """Every entry of a bucket as ``key -> (value, revision)``; deleted keys disappear."""

    def __init__(
        self,
        kv: KeyValue,
        typ: type[M],
        on_change: Callable[[str, M | None, int], Awaitable[None]] | None = None,
    ) -> None:
        self.kv = kv
        self.typ = typ
        self.on_change = on_change
        self.entries: dict[str, tuple[M, int]] = {}
        self.ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._watcher: Any = None

    async def start(self) -> None:
        self._watcher = await self.kv.watchall()
        self._task = asyncio.get_running_loop().create_task(self._run())
        await self.ready.wait()

    async def stop(self) -> None:
        if self._task is not None:
            # The watcher's updates await through asyncio.wait_for, which can drop a
            # cancellation: cancel until the loop has ended.
            await cancel_all([self._task], STOP_TIMEOUT_S, f"watch of {self.kv._name}")
        if self._watcher is not None:
            with contextlib.suppress(Exception):
                await self._watcher.stop()

    async def _run(self) -> None:
        assert self._watcher is not None
        async for entry in self._watcher:
            if entry is None:  # end of the initial values
                self.ready.set()
                continue
            key = entry.key
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                self.entries.pop(key, None)
                value = None
            else:
                try:
                    value = decode(entry.value, self.typ)
                except DecodeError as e:
                    log.error("bad entry %s in %s: %s", key, self.kv._name, e)
                    continue
                self.entries[key] = (value, int(entry.revision or 0))
            if self.on_change is not None:
                try:
                    await self.on_change(key, value, int(entry.revision or 0))
                except Exception:
                    log.exception("change handler failed for %s", key)

    def values(self) -> list[M]:
        return [v for v, _ in self.entries.values()]
