"""``DeferredWriter`` over an in-memory store: a compare-and-set that loses to another writer is
retried on what that writer wrote, with the transition and the deferred changes applied again; a
deferred change's message is acknowledged only once a write carrying it has landed; a key another
owner took, or one that is gone, is let go."""

from __future__ import annotations

import time

import msgspec
import pytest

from sja.bus import persist
from sja.bus.persist import DeferredWriter
from sja.bus.store import MemoryStore
from sja.core import jobs as J
from sja.core import ownership
from sja.protocol.messages import JobSpec, JobState

OWNER = "agent-a"


def job(job_id: str = "j1", owner: str = OWNER) -> JobState:
    spec = JobSpec(name=job_id, tenant="t", workload="montecarlo", params={"units": 8})
    state = ownership.claim(J.new_job(job_id, spec, 1000.0), owner, 1000.0)
    assert state is not None
    return state


def tagged(state: JobState, tag: str) -> JobState:
    """``state`` with ``tag`` recorded (a stand-in for a change, e.g. a completion folded in)."""
    return msgspec.structs.replace(state, declined_grants=[*state.declined_grants, tag])


class Delivery:
    """A message that brought a deferred change: records when it is acknowledged."""

    def __init__(self, log: list[str], name: str) -> None:
        self.log = log
        self.name = name
        self.acks = 0

    async def ack(self) -> None:
        self.acks += 1
        self.log.append(f"ack {self.name}")


class Harness:
    """A writer over a ``MemoryStore``, holding what it reads and writes as the agent does, and
    recording every callback in order (with the store's writes in the same log)."""

    def __init__(self) -> None:
        self.store: MemoryStore[JobState] = MemoryStore(JobState)
        self.held: dict[str, tuple[JobState, int]] = {}
        self.log: list[str] = []
        self.lost: list[tuple[str, JobState | None]] = []
        self.writer: DeferredWriter[JobState, str] = DeferredWriter(
            lambda: self.store,
            self.held,
            refold=tagged,
            still_mine=lambda s: ownership.is_owned_by(s, OWNER),
            on_saved=self.saved,
            on_reloaded=self.reloaded,
            on_lost=self.on_lost,
        )

    def saved(self, state: JobState, rev: int) -> None:
        self.log.append(f"saved {rev}")
        self.held[state.job_id] = (state, rev)

    def reloaded(self, state: JobState, rev: int) -> None:
        self.log.append(f"reloaded {rev}")
        self.held[state.job_id] = (state, rev)

    def on_lost(self, key: str, state: JobState | None) -> None:
        self.log.append(f"lost {key}")
        self.lost.append((key, state))
        self.held.pop(key, None)

    async def hold(self, state: JobState) -> int:
        rev = await self.store.create(state.job_id, state)
        assert rev is not None
        self.held[state.job_id] = (state, rev)
        return rev

    async def stored(self, key: str = "j1") -> tuple[JobState, int]:
        got = await self.store.get(key)
        assert got is not None
        return got


def interfere_once(store: MemoryStore[JobState], write: object) -> list[int]:
    """Before the next write to the store, run ``write(key)`` (another writer's, awaited) once.
    Returns a list that gets the revision the other writer wrote."""
    done: list[int] = []

    async def hook(key: str) -> None:
        if not done:
            done.append(await write(key))  # type: ignore[operator]

    store.before_write = hook
    return done


async def test_a_lost_compare_and_set_applies_the_transition_again_to_the_other_writers_state() -> None:
    h = Harness()
    await h.hold(job())
    seen: list[JobState] = []

    async def other_writer(key: str) -> int:
        state, _ = await h.stored(key)
        return await h.store.put(key, msgspec.structs.replace(state, rounds_won=7))

    other = interfere_once(h.store, other_writer)

    def cancel(state: JobState) -> JobState | None:
        seen.append(state)
        return J.request_cancel(state, 1001.0)

    written = await h.writer.save("j1", cancel)

    assert other, "the other writer wrote between the read and the write"
    assert len(seen) == 2, "applied once to the held state, once to the state read back"
    assert seen[0].rounds_won != 7 and seen[1].rounds_won == 7
    assert written is not None and written.cancel_requested and written.rounds_won == 7
    stored, rev = await h.stored()
    assert stored == written and h.held["j1"] == (stored, rev)
    assert h.store.conflicts == 1
    assert h.log == [f"reloaded {other[0]}", f"saved {rev}"]


async def test_deferred_changes_are_folded_into_the_state_read_back_and_acknowledged_once_written() -> None:
    h = Harness()
    await h.hold(job())
    state = h.held["j1"][0]
    first, second = Delivery(h.log, "c1"), Delivery(h.log, "c2")
    # Two changes made to the held state at once, their messages not yet acknowledged.
    h.held["j1"] = (tagged(tagged(state, "c1"), "c2"), h.held["j1"][1])
    h.writer.defer("j1", first, "c1")
    h.writer.defer("j1", second, "c2")
    assert [c for _, c in h.writer.pending("j1")] == ["c1", "c2"]

    async def other_writer(key: str) -> int:
        # Another writer (not the owner) writes: the held state is stale now.
        assert first.acks == second.acks == 0, "nothing is acknowledged before a write lands"
        stored, _ = await h.stored(key)
        h.log.append("other write")
        return await h.store.put(key, msgspec.structs.replace(stored, rounds_won=3))

    interfere_once(h.store, other_writer)
    written = await h.writer.write_deferred("j1")

    assert written is not None
    assert written.declined_grants == ["c1", "c2"], "both deferred changes, folded in once each"
    assert written.rounds_won == 3, "the other writer's change is kept"
    stored, rev = await h.stored()
    assert stored == written
    assert first.acks == second.acks == 1
    # Acknowledged after the write that carries them, not after the write that lost.
    assert h.log.index("ack c1") > h.log.index(f"reloaded {rev - 1}")
    assert h.log[-3:] == ["ack c1", "ack c2", f"saved {rev}"]
    assert h.writer.pending("j1") == [] and "j1" not in h.writer.deferred_since


async def test_a_deferred_change_is_not_acknowledged_while_its_write_keeps_losing() -> None:
    h = Harness()
    await h.hold(job())
    msg = Delivery(h.log, "c1")
    h.held["j1"] = (tagged(h.held["j1"][0], "c1"), h.held["j1"][1])
    h.writer.defer("j1", msg, "c1")
    writes = 0

    async def always_first(key: str) -> None:
        nonlocal writes
        writes += 1
        assert msg.acks == 0
        stored, _ = await h.stored(key)
        await h.store.put(key, msgspec.structs.replace(stored, rounds_won=writes))

    h.store.before_write = always_first
    with pytest.raises(RuntimeError, match="too much contention"):
        await h.writer.write_deferred("j1")
    assert writes == persist.MAX_TRIES
    assert msg.acks == 0, "never written: left unacknowledged, to be delivered again"
    assert [c for _, c in h.writer.pending("j1")] == ["c1"]


async def test_a_key_taken_by_another_owner_is_let_go_unwritten_and_its_deferred_changes_acknowledged() -> (
    None
):
    h = Harness()
    await h.hold(job())
    msg = Delivery(h.log, "c1")
    h.writer.defer("j1", msg, "c1")
    lock = h.writer.lock("j1")

    async def takeover(key: str) -> int:
        stored, _ = await h.stored(key)
        taken = ownership.takeover(stored, "agent-b", 0.0, 1000.0, 10.0)
        assert taken is not None
        return await h.store.put(key, taken)

    interfere_once(h.store, takeover)
    written = await h.writer.save("j1", lambda s: J.request_cancel(s, 1001.0))

    assert written is None
    stored, _ = await h.stored()
    assert stored.owner_agent == "agent-b" and not stored.cancel_requested, "nothing written over it"
    assert h.lost == [("j1", stored)] and "j1" not in h.held
    assert msg.acks == 1 and h.writer.pending("j1") == []
    assert h.writer.lock("j1") is not lock, "its lock was dropped"


async def test_a_key_gone_from_the_store_is_let_go() -> None:
    h = Harness()
    await h.hold(job())
    msg = Delivery(h.log, "c1")
    h.writer.defer("j1", msg, "c1")

    async def delete(key: str) -> int:
        await h.store.delete(key)
        return 0

    interfere_once(h.store, delete)
    assert await h.writer.save("j1", lambda s: J.request_cancel(s, 1001.0)) is None
    assert h.lost == [("j1", None)] and "j1" not in h.held
    assert msg.acks == 1
    assert await h.store.get("j1") is None


async def test_no_change_writes_nothing_unless_forced_with_deferred_changes() -> None:
    h = Harness()
    rev = await h.hold(job())
    state = h.held["j1"][0]
    assert await h.writer.save("j1", lambda s: None) is None
    assert await h.writer.save("j1", lambda s: s) == state
    assert await h.writer.save("j1", lambda s: None, force=True) is None, "forced, but nothing deferred"
    assert h.store.writes == 1 and (await h.stored())[1] == rev
    assert await h.writer.save("j2", lambda s: J.request_cancel(s, 1.0)) is None, "a key not held"

    msg = Delivery(h.log, "c1")
    h.writer.defer("j1", msg, "c1")
    assert await h.writer.write_deferred("j1") == state
    assert h.store.writes == 2 and (await h.stored())[1] > rev
    assert msg.acks == 1


async def test_only_keys_whose_changes_waited_long_enough_are_flushed() -> None:
    h = Harness()
    await h.hold(job("j1"))
    await h.hold(job("j2"))
    old, new = Delivery(h.log, "old"), Delivery(h.log, "new")
    h.writer.defer("j1", old, "old")
    h.writer.defer("j2", new, "new")
    h.writer.deferred_since["j1"] = time.monotonic() - 10.0
    writes = h.store.writes

    await h.writer.flush_due(1.0)
    assert old.acks == 1 and new.acks == 0
    assert h.store.writes == writes + 1
    assert list(h.writer.deferred) == ["j2"]

    await h.writer.flush_all()
    assert new.acks == 1 and h.writer.deferred == {} and h.writer.deferred_since == {}
    assert h.store.writes == writes + 2
