"""Compare-and-set writes of the values a process holds, with acknowledgements deferred until the
write lands.

A service that owns some keys of a ``KvStore`` (the agent: its jobs) holds each as it last read or
wrote it, with that revision. A change is a *transition*: a function of the held value that answers
the new value (or ``None``: nothing to write). ``DeferredWriter.save`` applies it and writes by
compare-and-set; when another writer got there first it reads the key again and applies the
transition again to what it read.

Some changes are made to the held value at once but written later (the agent folds a completion
into its job as it arrives and writes it with the job's next write): each is *deferred* with the
message that brought it, and that message is acknowledged only once a write carrying the change
lands. A crash in between leaves it unacknowledged, so it is delivered again. Whenever a
compare-and-set loses, the deferred changes are folded into the value read back before the
transition is applied again, so they are never lost to the conflict. ``flush_forever`` writes the
keys whose changes have waited ``every_s``.

The writer does not change what the caller holds: it reads it (``held``) and reports what happened
(``on_saved``, ``on_reloaded``, ``on_lost``), and the caller updates it there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from typing import Generic, Protocol, TypeVar

from sja.bus.store import KvStore
from sja.protocol.messages import Message

log = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)
D = TypeVar("D")

MAX_TRIES = 20
"""Compare-and-set attempts of one save before it gives up (``RuntimeError``)."""


class Ackable(Protocol):
    """What brought a deferred change (a NATS message): acknowledged once the change is written."""

    async def ack(self) -> None: ...


class DeferredWriter(Generic[M, D]):
    """Per-key locks, compare-and-set saves with a transition, and deferred changes of type ``D``
    whose messages are acknowledged once written.

    ``store``: the store, looked up at each write (a service opens its stores when it starts).
    ``held``: key -> (value, revision) as the caller holds it; a key not in it is not written.
    ``refold(value, change)``: ``value`` with a deferred change folded in again (after a conflict).
    ``still_mine(value)``: whether a value read back after a conflict is still the caller's to write.
    ``on_saved(value, revision)``: a save wrote ``value``.
    ``on_reloaded(value, revision)``: after a conflict, the value read back (deferred changes folded
    in again): the caller holds it now, and the transition is applied again to it.
    ``on_lost(key, value)``: the key is gone (``value`` None) or no longer the caller's (``value``:
    what the store holds); its deferred changes were acknowledged (there is nothing to fold them
    into here) and the caller lets it go."""

    def __init__(
        self,
        store: Callable[[], KvStore[M] | None],
        held: Mapping[str, tuple[M, int]],
        *,
        refold: Callable[[M, D], M],
        still_mine: Callable[[M], bool],
        on_saved: Callable[[M, int], None],
        on_reloaded: Callable[[M, int], None],
        on_lost: Callable[[str, M | None], None],
    ) -> None:
        self._store = store
        self.held = held
        self._refold = refold
        self._still_mine = still_mine
        self._on_saved = on_saved
        self._on_reloaded = on_reloaded
        self._on_lost = on_lost
        self.locks: dict[str, asyncio.Lock] = {}
        self.deferred: dict[str, list[tuple[Ackable, D]]] = {}
        """key -> changes made to the held value and not yet written, with the messages that
        brought them (acknowledged once written)."""
        self.deferred_since: dict[str, float] = {}
        """key -> when (``time.monotonic``) its oldest unwritten change was deferred."""

    def lock(self, key: str) -> asyncio.Lock:
        """The key's lock: a caller holds it around a save, and around changing the held value."""
        return self.locks.setdefault(key, asyncio.Lock())

    def forget(self, key: str) -> None:
        """Drop the key's lock (the key is done with here)."""
        self.locks.pop(key, None)

    def defer(self, key: str, msg: Ackable, change: D) -> None:
        """``change`` is in the held value now and is written with the key's next write (or by the
        flusher); ``msg`` is acknowledged then, never before."""
        self.deferred.setdefault(key, []).append((msg, change))
        self.deferred_since.setdefault(key, time.monotonic())

    def pending(self, key: str) -> list[tuple[Ackable, D]]:
        """The key's deferred changes not yet written, oldest first."""
        return self.deferred.get(key, [])

    async def save(self, key: str, transition: Callable[[M], M | None], force: bool = False) -> M | None:
        """Apply ``transition`` to the held value and compare-and-set it (with the changes deferred
        and not yet written); on conflict read it again, fold those changes in again, and apply the
        transition again. ``force``: write even if the transition changes nothing (to write those
        changes). Returns what was written, or the transition's answer when nothing was; ``None``
        when the key is not held (or no longer the caller's)."""
        for _ in range(MAX_TRIES):
            got = self.held.get(key)
            if got is None:
                return None
            value, rev = got
            new = transition(value)
            if new is None or new == value:
                if not (force and self.deferred.get(key)):
                    return new
                new = value
            store = self._store()
            assert store is not None, "the store is not open"
            new_rev = await store.cas(key, new, rev)
            if new_rev is not None:
                await self._written(key)
                self._on_saved(new, new_rev)
                return new
            read = await store.get(key)
            if read is None:
                await self._written(key)  # the key is gone: nothing to fold them into
                self._on_lost(key, None)
                return None
            fresh, fresh_rev = read
            if not self._still_mine(fresh):
                # Another writer's now. Its deferred changes reach that writer too (or are made good
                # there): acknowledged here.
                await self._written(key)
                self._on_lost(key, fresh)
                self.forget(key)
                return None
            self._on_reloaded(self.refolded(key, fresh), fresh_rev)
        raise RuntimeError(f"could not update {key}: too much contention")

    def refolded(self, key: str, value: M) -> M:
        """``value`` (as read from the store) with the key's deferred changes folded in again."""
        for _msg, change in self.deferred.get(key, []):
            value = self._refold(value, change)
        return value

    async def _written(self, key: str) -> None:
        """The key's deferred changes are in the store now: acknowledge them."""
        self.deferred_since.pop(key, None)
        for msg, _ in self.deferred.pop(key, []):
            with contextlib.suppress(Exception):
                await msg.ack()

    async def write_deferred(self, key: str) -> M | None:
        """Write the key as held, with its deferred changes (the caller holds its lock)."""
        return await self.save(key, lambda _: None, force=True)

    async def flush(self, key: str) -> None:
        """Write the key's deferred changes, if any."""
        async with self.lock(key):
            if self.deferred.get(key):
                await self.write_deferred(key)

    async def flush_all(self) -> None:
        await asyncio.gather(*(self.flush(k) for k in list(self.deferred)), return_exceptions=True)

    async def flush_due(self, every_s: float) -> None:
        """Write the keys whose oldest deferred change has waited ``every_s`` or longer."""
        due = time.monotonic() - every_s
        keys = [k for k, since in list(self.deferred_since.items()) if since <= due]
        if keys:
            results = await asyncio.gather(*(self.flush(k) for k in keys), return_exceptions=True)
            for key, r in zip(keys, results, strict=True):
                if isinstance(r, Exception):
                    log.warning("writing the deferred changes of %s failed: %r", key, r)

    async def flush_forever(self, every_s: float) -> None:
        """Write deferred changes at most about ``every_s`` after they were made."""
        while True:
            await asyncio.sleep(every_s / 2)
            await self.flush_due(every_s)
