"""The bus layer against a real nats-server: JetStream set-up, KV compare-and-set, trace context."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from sja.bus.codec import DecodeError, decode, encode
from sja.bus.store import Store, stores
from sja.bus.streams import ensure_jetstream
from sja.bus.tracing import extract, publish
from sja.bus.watch import KvView, Views
from sja.inventory.declared import load_declared
from sja.protocol import subjects
from sja.protocol.messages import JobCancel, SliceState
from tests.integration.waits import wait_until


async def test_jetstream_setup_is_idempotent(nc) -> None:
    js = nc.jetstream()
    await ensure_jetstream(js)
    await ensure_jetstream(js)
    names = {s.config.name for s in await js.streams_info()}
    assert {s.name for s in subjects.STREAMS} <= names
    for bucket in subjects.BUCKETS:
        await js.key_value(bucket)
    rounds = await js.stream_info(subjects.STREAM_ROUNDS.name)
    assert rounds.config.max_bytes == 1 << 30, "round records keep the newest GiB, not everything"
    jobs = await js.stream_info(subjects.STREAM_JOBS.name)
    assert jobs.config.max_bytes in (None, -1), "submissions are never dropped for size"


async def test_kv_compare_and_set_lets_one_writer_win(nc) -> None:
    slices, _ = await stores(nc.jetstream())
    s = load_declared(None)[0]
    rev = await slices.create(s.slice_id, s)
    assert rev is not None
    assert await slices.create(s.slice_id, s) is None, "create must not overwrite"
    import msgspec

    a = msgspec.structs.replace(s, status="leased", fence=1, grant_id="g-a")
    b = msgspec.structs.replace(s, status="leased", fence=1, grant_id="g-b")
    results = await asyncio.gather(slices.cas(s.slice_id, a, rev), slices.cas(s.slice_id, b, rev))
    assert sum(r is not None for r in results) == 1
    got = await slices.get(s.slice_id)
    assert got is not None and got[0].grant_id in ("g-a", "g-b")


async def test_kv_view_follows_updates(nc) -> None:
    js = nc.jetstream()
    slices, _ = await stores(js)
    seen: list[str] = []
    changed = asyncio.Event()

    async def on_change(key: str, value: SliceState | None, rev: int) -> None:
        seen.append(key)
        changed.set()

    view = KvView(js, subjects.BUCKET_SLICES, SliceState, on_change)
    await view.start()
    try:
        s = load_declared(None)[1]
        await slices.put(s.slice_id, s)
        await asyncio.wait_for(changed.wait(), 5)
        assert s.slice_id in view.entries
        assert view.entries[s.slice_id][0] == s
    finally:
        await view.stop()


async def test_store_rejects_foreign_payload_with_clear_error(nc) -> None:
    js = nc.jetstream()
    kv = await js.key_value(subjects.BUCKET_SLICES)
    await kv.put("junk", b"\x01\x02not msgpack")
    store = Store(js, kv, subjects.BUCKET_SLICES, SliceState)
    with pytest.raises(DecodeError, match="invalid SliceState"):
        await store.get("junk")


async def test_trace_context_crosses_nats_headers(nc) -> None:
    provider = TracerProvider()
    tracer = provider.get_tracer("test")
    got: asyncio.Future[object] = asyncio.get_running_loop().create_future()

    async def cb(msg) -> None:
        got.set_result(msg)

    await nc.subscribe("sja.v1.test.trace", cb=cb)
    with tracer.start_as_current_span("parent") as span:
        await publish(nc, "sja.v1.test.trace", JobCancel(job_id="j-1"))
        sent = span.get_span_context()
    msg = await asyncio.wait_for(got, 5)
    ctx = extract(msg)
    remote = trace.get_current_span(ctx).get_span_context()
    assert remote.trace_id == sent.trace_id
    assert remote.span_id == sent.span_id
    assert decode(msg.data, JobCancel).job_id == "j-1"
    assert encode(decode(msg.data, JobCancel)) == msg.data


async def test_store_lists_every_entry_while_the_bucket_is_written(nc) -> None:
    """``Store.all`` and ``keys`` give the last value and revision of every key (deleted keys left
    out), an empty bucket gives nothing, and a listing taken while another writer keeps writing
    never comes back short (nats-py's own ``keys()`` could read a full bucket as empty when the
    deliveries were still on their way)."""
    import msgspec

    js = nc.jetstream()
    await ensure_jetstream(js)
    slices, _ = await stores(js)
    assert await slices.all() == [] and await slices.keys() == []
    base = load_declared(None)[0]
    made = {f"s{i:04d}": msgspec.structs.replace(base, slice_id=f"s{i:04d}") for i in range(600)}
    await asyncio.gather(*(slices.put(k, v) for k, v in made.items()))
    await slices.kv.delete("s0007")
    del made["s0007"]
    offline = msgspec.structs.replace(made["s0001"], status="offline")
    await slices.put("s0001", offline)
    made["s0001"] = offline

    got = await slices.all()
    assert {s.slice_id: s for s, _ in got} == made
    for s, rev in got[:50]:
        assert await slices.get(s.slice_id) == (s, rev)
    assert sorted(await slices.keys()) == sorted(made)

    stop = asyncio.Event()

    async def writer(start: int) -> None:
        # Several writers rewrite every key many times over: the bucket keeps 5 revisions per
        # key, so the entry a listing was about to deliver is often pushed out before its turn.
        i = start
        while not stop.is_set():
            key = f"s{i % 600:04d}"
            if key in made:
                await slices.put(key, made[key])
            i += 7

    tasks = [asyncio.create_task(writer(k * 150)) for k in range(4)]
    try:
        for _ in range(20):
            assert len(await slices.all()) == len(made)
            assert len(await slices.keys()) == len(made)
    finally:
        stop.set()
        await asyncio.gather(*tasks)


@pytest.mark.parametrize("how", ["consumer deleted", "deliveries stop"])
async def test_a_listing_whose_consumer_stops_delivering_reads_again(nc, monkeypatch, caplog, how) -> None:
    """The ordered consumer behind a listing stops part way: deleted on the server as soon as it is
    made (as a restarted server, or a recovery that fails under load, leaves it), or its deliveries
    stop after 100 entries (the client sees what a stalled consumer shows it: no message within the
    stall time). The listing starts again on a new consumer rather than fail or come back short."""
    import msgspec
    import nats.errors

    js = nc.jetstream()
    await ensure_jetstream(js)
    slices, _ = await stores(js)
    base = load_declared(None)[0]
    made = {f"s{i:04d}": msgspec.structs.replace(base, slice_id=f"s{i:04d}") for i in range(300)}
    await asyncio.gather(*(slices.put(k, v) for k, v in made.items()))

    made_consumers: list[str] = []
    subscribe = Store._subscribe_latest

    async def lost_first(self: Store, prefix: str, values: bool):  # type: ignore[no-untyped-def]
        sub = await subscribe(self, prefix, values)
        made_consumers.append(sub._consumer)
        if len(made_consumers) > 1:
            return sub
        if how == "consumer deleted":
            await js.delete_consumer(self.kv._stream, sub._consumer)
            return sub
        next_msg = sub.next_msg
        given = 0

        async def stalls_after_100(timeout: float):  # type: ignore[no-untyped-def]  # noqa: ASYNC109
            nonlocal given
            if given == 100:
                await asyncio.sleep(timeout)  # a stalled consumer: nothing comes within the timeout
                raise nats.errors.TimeoutError
            given += 1
            return await next_msg(timeout)

        sub.next_msg = stalls_after_100  # type: ignore[method-assign]
        return sub

    monkeypatch.setattr(Store, "_subscribe_latest", lost_first)
    with caplog.at_level("WARNING", logger="sja.bus.connection"):
        got = await slices._latest(values=True, stall_s=0.5)
    assert sorted(k for k, _, _ in got) == sorted(made)
    assert {k: decode(v, SliceState) for k, v, _ in got} == made
    assert len(made_consumers) == 2, "read again on a new consumer"
    assert any("reading again on a new consumer" in r.getMessage() for r in caplog.records)


async def test_a_listing_that_never_gets_a_delivery_fails_clearly(nc, monkeypatch) -> None:
    """Every consumer lost as soon as it is made: the listing gives up at its deadline with a
    ``TimeoutError`` naming the bucket, never a partial list."""
    import msgspec

    js = nc.jetstream()
    await ensure_jetstream(js)
    slices, _ = await stores(js)
    base = load_declared(None)[0]
    await asyncio.gather(
        *(slices.put(f"s{i:03d}", msgspec.structs.replace(base, slice_id=f"s{i:03d}")) for i in range(50))
    )
    subscribe = Store._subscribe_latest

    async def always_lost(self: Store, prefix: str, values: bool):  # type: ignore[no-untyped-def]
        sub = await subscribe(self, prefix, values)
        await js.delete_consumer(self.kv._stream, sub._consumer)
        return sub

    monkeypatch.setattr(Store, "_subscribe_latest", always_lost)
    with pytest.raises(TimeoutError, match="sja-slices"):
        await slices._latest(values=True, stall_s=0.3, deadline_s=1.5)


async def _bucket(nc, name: str) -> Store[SliceState]:
    from nats.js.api import KeyValueConfig

    js = nc.jetstream()
    kv = await js.create_key_value(KeyValueConfig(bucket=name, history=5))
    return Store(js, kv, name, SliceState)


async def test_kv_view_reads_the_bucket_as_it_stands_then_every_change_in_order(nc) -> None:
    """Start returns with every entry already there (the last value and revision of each key);
    then every write and delete is applied and reported, one at a time, in the stream's order."""
    import msgspec

    store = await _bucket(nc, "view-order")
    declared = load_declared(None)[:4]
    revs = {}
    for s in declared[:3]:
        revs[s.slice_id] = await store.put(s.slice_id, s)
    first = declared[0]
    leased = msgspec.structs.replace(first, status="leased", fence=1, grant_id="g-1")
    revs[first.slice_id] = await store.cas(first.slice_id, leased, revs[first.slice_id])
    seen: list[tuple[str, str | None, int]] = []

    async def on_change(key: str, value: SliceState | None, rev: int) -> None:
        seen.append((key, value.status if value else None, rev))

    view = KvView(store.js, store.bucket, SliceState, on_change)
    assert not view.watching
    await asyncio.wait_for(view.start(), 10)
    try:
        assert view.ready.is_set() and view.watching
        assert {k: rev for k, (_, rev) in view.entries.items()} == revs
        assert view.entries[first.slice_id][0] == leased  # the last value, not the first
        assert sorted(r for _, _, r in seen) == sorted(revs.values())
        seen.clear()
        # Changes after start: a new key, a change, a delete.
        r_new = await store.put(declared[3].slice_id, declared[3])
        r_free = await store.cas(first.slice_id, first, revs[first.slice_id])
        await store.kv.delete(declared[1].slice_id)
        await wait_until(lambda: len(seen) == 3, "the three changes after start seen", 4.0)
        assert [(k, st) for k, st, _ in seen] == [
            (declared[3].slice_id, "free"),
            (first.slice_id, "free"),
            (declared[1].slice_id, None),
        ]
        assert [r for _, _, r in seen][:2] == [r_new, r_free] and seen[2][2] > r_free
        assert declared[1].slice_id not in view.entries
        assert view.entries[first.slice_id] == (first, r_free)
        assert sorted(v.slice_id for v in view.values()) == sorted(
            s.slice_id for s in (declared[0], declared[2], declared[3])
        )
    finally:
        await view.stop()
    assert not view.watching


async def test_kv_view_of_an_empty_bucket_is_ready_at_once_and_skips_a_bad_entry(nc) -> None:
    store = await _bucket(nc, "view-empty")
    seen: list[str] = []

    async def on_change(key: str, value: SliceState | None, rev: int) -> None:
        seen.append(key)

    view = KvView(store.js, store.bucket, SliceState, on_change)
    await asyncio.wait_for(view.start(), 10)
    try:
        assert view.entries == {}
        await store.kv.put("junk", b"\x01\x02not msgpack")  # logged and left out
        s = load_declared(None)[0]
        await store.put(s.slice_id, s)
        await wait_until(lambda: seen, "the valid entry seen", 4.0)
        assert seen == [s.slice_id]
        assert list(view.entries) == [s.slice_id]
    finally:
        await view.stop()


async def test_kv_view_is_no_longer_watching_once_a_delivery_is_cancelled(nc) -> None:
    """A handler that fails goes to the log and the view goes on; a cancellation out of a delivery
    ends the subscription's task (nats-py), and the view says so."""
    store = await _bucket(nc, "view-cancelled")
    declared = load_declared(None)[:3]
    handled: list[str] = []
    cancelled = asyncio.Event()

    async def on_change(key: str, value: SliceState | None, rev: int) -> None:
        handled.append(key)
        if key == declared[0].slice_id:
            raise RuntimeError("a handler's bug")
        if key == declared[1].slice_id:
            cancelled.set()
            raise asyncio.CancelledError

    view = KvView(store.js, store.bucket, SliceState, on_change)
    await asyncio.wait_for(view.start(), 10)
    try:
        await store.put(declared[0].slice_id, declared[0])
        await store.put(declared[2].slice_id, declared[2])
        await wait_until(
            lambda: declared[2].slice_id in handled, "the entry after the failing one handled", 4.0
        )
        assert handled == [declared[0].slice_id, declared[2].slice_id]
        assert view.watching, "a handler's exception does not end the view"
        await store.put(declared[1].slice_id, declared[1])
        await asyncio.wait_for(cancelled.wait(), 5)
        # The cancellation ends the subscription's task once it leaves the handler.
        await wait_until(lambda: not view.watching, "the view no longer watching")
    finally:
        await view.stop()
    assert not view.watching


async def test_kv_view_goes_on_after_its_consumer_is_lost(nc) -> None:
    """The server drops the view's consumer (a restart, the inactivity limit): the ordered
    consumer is made again from where the view was, and no change is missed."""
    store = await _bucket(nc, "view-lost")
    declared = load_declared(None)[:2]
    await store.put(declared[0].slice_id, declared[0])
    view = KvView(store.js, store.bucket, SliceState)
    await asyncio.wait_for(view.start(), 10)
    try:
        js = nc.jetstream()
        await js.delete_consumer(store.stream, (await view._sub.consumer_info()).name)
        rev = await store.put(declared[1].slice_id, declared[1])
        await wait_until(  # the client notices by its missed heartbeats
            lambda: declared[1].slice_id in view.entries,
            "the change made while the consumer was gone",
            30.0,
            every_s=0.1,
        )
        assert view.entries.get(declared[1].slice_id) == (declared[1], rev)
        assert set(view.entries) == {s.slice_id for s in declared}
    finally:
        await view.stop()


async def _contract(store) -> list[object]:
    """The same reads and writes, and what each answered (revisions as 'rev', since the two
    stores number differently)."""
    s = load_declared(None)[0]
    other = msgspec.structs.replace(s, slice_id="other")
    out: list[object] = []
    r1 = await store.create("a", s)
    out.append(r1 is not None)
    out.append(await store.create("a", s))  # exists: None
    r2 = await store.cas("a", other, r1)
    out.append(r2 is not None and r2 > r1)
    out.append(await store.cas("a", s, r1))  # stale revision: None
    out.append(await store.cas("missing", s, 1))  # no entry: None
    got = await store.get("a")
    out.append(got is not None and got[0].slice_id == "other" and got[1] == r2)
    out.append(await store.get("missing"))
    await store.put("b", s)
    out.append(sorted(await store.keys()))
    out.append(sorted(v.slice_id for v, _ in await store.all()))
    return out


async def test_memory_store_answers_as_the_bucket_does(nc) -> None:
    """``MemoryStore`` stands in for the bucket in unit tests: the same sequence of reads and
    writes, including the refused ones, answers the same on both."""
    from sja.bus.store import MemoryStore

    on_bus = await _contract(await _bucket(nc, "contract-test"))
    in_memory = await _contract(MemoryStore(SliceState))
    assert on_bus == in_memory
    assert on_bus[:5] == [True, None, True, None, None]


async def test_views_of_a_process_watch_a_bucket_once_for_all_its_holders(nats_url, nc) -> None:
    """Co-hosted services share one view per bucket: a later holder catches up on the entries as
    they stand, every holder sees every change in order, and when the holder whose connection
    carries the view lets go first, the view goes on over another's, which is told what changed."""
    from sja.bus.connection import connect

    store = await _bucket(nc, "view-shared")
    declared = load_declared(None)[:4]
    for s in declared[:2]:
        await store.put(s.slice_id, s)
    other = await connect(nats_url, "test-other")
    views = Views()
    seen_a: list[tuple[str, str | None]] = []
    seen_b: list[tuple[str, str | None]] = []

    def recorder(seen: list[tuple[str, str | None]]):  # type: ignore[no-untyped-def]
        async def on_change(key: str, value: SliceState | None, rev: int) -> None:
            seen.append((key, value.status if value else None))

        return on_change

    try:
        a = await asyncio.wait_for(views.view(nc.jetstream(), store.bucket, SliceState, recorder(seen_a)), 10)
        b = await asyncio.wait_for(
            views.view(other.jetstream(), store.bucket, SliceState, recorder(seen_b)), 10
        )
        assert a.entries is b.entries and len(a.entries) == 2
        assert sorted(seen_a) == sorted(seen_b) == sorted((s.slice_id, "free") for s in declared[:2])
        seen_a.clear()
        seen_b.clear()
        await store.put(declared[2].slice_id, declared[2])
        await store.kv.delete(declared[0].slice_id)
        want = [(declared[2].slice_id, "free"), (declared[0].slice_id, None)]
        await wait_until(lambda: seen_b == want, "both changes seen by the later holder", 4.0)
        assert seen_a == want
        # The first holder's connection carries the view: it lets go, and the view is made again
        # on the other's; a change made meanwhile reaches the holder left.
        seen_b.clear()
        await a.stop()
        assert not a.watching and b.watching
        leased = msgspec.structs.replace(declared[1], status="leased", fence=1, grant_id="g-1")
        await store.put(declared[1].slice_id, leased)
        await store.put(declared[3].slice_id, declared[3])
        await wait_until(
            lambda: (declared[3].slice_id, "free") in seen_b, "a change after the hand-over seen", 6.0
        )
        assert (declared[1].slice_id, "leased") in seen_b
        assert b.entries[declared[1].slice_id][0] == leased and declared[0].slice_id not in b.entries
        await b.stop()
        assert not b.watching
        assert views._shared == {}, "the last holder gone, the view is stopped and forgotten"
    finally:
        await other.close()


async def test_store_get_reads_the_headers_of_an_entry_as_nats_py_does(nc) -> None:
    """A read entry's headers come through the client's header parser (``sja.bus.jetstream``): an
    entry written by compare-and-set (which carries a header) reads back whole, a deleted or purged
    one reads as absent, and the stream message's headers are those written."""
    store = await _bucket(nc, "get-headers")
    s = load_declared(None)[0]
    rev = await store.create(s.slice_id, s)
    assert rev is not None
    leased = msgspec.structs.replace(s, status="leased", fence=1, grant_id="g-1")
    rev2 = await store.cas(s.slice_id, leased, rev)
    assert await store.get(s.slice_id) == (leased, rev2)
    raw = await store.js.get_msg(store.stream, subject=f"$KV.{store.bucket}.{s.slice_id}")
    assert raw.headers == {"Nats-Expected-Last-Subject-Sequence": str(rev)}
    await store.kv.delete(s.slice_id)
    assert await store.get(s.slice_id) is None
    await store.put(s.slice_id, s)
    await store.kv.purge(s.slice_id)
    assert await store.get(s.slice_id) is None
    assert await store.get("never-written") is None
