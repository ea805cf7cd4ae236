"""``sja.bus.jetstream.JetStream.publish`` against a real nats-server: the same acknowledgements and
errors as nats-py's own publish, for streams and for KV compare-and-set through it."""

from __future__ import annotations

import asyncio
import contextlib
import time

import nats
import nats.errors
import nats.js.errors
import pytest
from nats.js.api import ConsumerInfo, KeyValueConfig

from sja.bus.jetstream import Fetcher, FetcherStopped, JetStream, jetstream
from sja.bus.store import Store
from sja.inventory.declared import load_declared
from sja.protocol import subjects
from sja.protocol.messages import SliceState
from tests.integration.waits import wait_until


async def test_publish_acknowledges_like_nats_py(nc) -> None:
    js = jetstream(nc)
    plain = nc.jetstream()
    subject = subjects.subjob_completed("j-1")
    ours = await js.publish(subject, b"one", headers={"Nats-Msg-Id": "m-1"})
    theirs = await plain.publish(subject, b"two", headers={"Nats-Msg-Id": "m-2"})
    assert ours.stream == theirs.stream == subjects.STREAM_COMPLETIONS.name
    assert ours.seq + 1 == theirs.seq
    assert not ours.duplicate
    again = await js.publish(subject, b"one", headers={"Nats-Msg-Id": "m-1"})
    assert again.duplicate and again.seq == ours.seq, "the de-duplication id is kept"
    # SJA's client hands acknowledgements over from its read loop (an eager subscription).
    assert js._ack_sub is not None and js._ack_sub._id in nc._eager


async def test_publish_on_a_plain_nats_py_client(nc, nats_url: str) -> None:
    """Without SJA's client (no eager subscriptions) the acknowledgements come through an ordinary
    subscription, with the same results (``nc`` declares the streams)."""
    plain_nc = await nats.connect(nats_url)
    try:
        js = jetstream(plain_nc, timeout=1.0)
        ack = await js.publish(subjects.subjob_completed("j-plain"), b"x", headers={"Nats-Msg-Id": "p-1"})
        assert ack.stream == subjects.STREAM_COMPLETIONS.name and not ack.duplicate
        again = await js.publish(subjects.subjob_completed("j-plain"), b"x", headers={"Nats-Msg-Id": "p-1"})
        assert again.duplicate and again.seq == ack.seq
        with pytest.raises(nats.js.errors.NoStreamResponseError):
            await js.publish("no.stream.listens.here", b"x")
    finally:
        await plain_nc.close()


async def test_publish_raises_nats_py_errors(nc) -> None:
    js = jetstream(nc, timeout=1.0)
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await js.publish("no.stream.listens.here", b"x")
    subject = subjects.subjob_completed("j-2")
    first = await js.publish(subject, b"x")
    with pytest.raises(nats.js.errors.APIError) as err:
        await js.publish(subject, b"y", headers={"Nats-Expected-Last-Subject-Sequence": str(first.seq - 1)})
    assert err.value.err_code == 10071, "a wrong last sequence is the server's own error"
    # The stream check (a header nats-py adds) goes through nats-py's path, with the same result.
    with pytest.raises(nats.js.errors.APIError):
        await js.publish(subject, b"z", stream="NOT_THIS_ONE")


async def test_publish_times_out_when_no_acknowledgement_comes(nc) -> None:
    js = jetstream(nc)

    # A plain subscriber that never answers: the request has a responder but no acknowledgement.
    async def silent(msg: object) -> None:
        return None

    await nc.subscribe("silent.subject", cb=silent)
    with pytest.raises(nats.errors.TimeoutError):
        await js.publish("silent.subject", b"x", timeout=0.2)
    assert js._acks == {}, "a publish that timed out leaves nothing behind"


async def test_publish_until_stores_once_when_the_stream_comes_back(nc) -> None:
    """A stream that cannot take the message yet (here: none listens on the subject, as while a
    stream has no leader) is tried again until it can; the message is stored once."""
    js = jetstream(nc, timeout=0.5)
    subject = "sja.test.late.x"
    tries = 0
    real_publish = js.publish

    async def counted(*args: object, **kwargs: object) -> object:
        nonlocal tries
        tries += 1
        return await real_publish(*args, **kwargs)  # type: ignore[arg-type]

    js.publish = counted  # type: ignore[method-assign]

    async def make_stream_later() -> None:
        # Once a try has failed (the first) and the next one has begun: the stream comes meanwhile.
        await wait_until(lambda: tries >= 2, "a try refused for want of a stream, then another")
        await js.add_stream(name="SJA_TEST_LATE", subjects=["sja.test.late.>"])

    maker = asyncio.get_running_loop().create_task(make_stream_later())
    ack = await js.publish_until(subject, b"x", {"Nats-Msg-Id": "late-1"}, until=time.time() + 30)
    await maker
    assert ack.stream == "SJA_TEST_LATE" and ack.seq == 1 and not ack.duplicate
    again = await js.publish_until(subject, b"x", {"Nats-Msg-Id": "late-1"}, until=time.time() + 10)
    assert again.duplicate and again.seq == 1, "a try that reached the stream is kept once"
    info = await js.stream_info("SJA_TEST_LATE")
    assert info.state.messages == 1


async def test_publish_until_gives_up_at_its_deadline_and_on_the_message_own_error(nc) -> None:
    js = jetstream(nc, timeout=0.5)
    began = time.monotonic()
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await js.publish_until(
            "no.stream.listens.here", b"x", {"Nats-Msg-Id": "n-1"}, until=time.time() + 0.4
        )
    assert time.monotonic() - began >= 0.2, "tried again until its deadline"
    # An error the server gives for the message itself comes back at once, not after the deadline.
    subject = subjects.subjob_completed("j-until")
    first = await js.publish(subject, b"x")
    headers = {"Nats-Msg-Id": "w-1", "Nats-Expected-Last-Subject-Sequence": str(first.seq - 1)}
    tries = 0
    real_publish = js.publish

    async def counted(*args: object, **kwargs: object) -> object:
        nonlocal tries
        tries += 1
        return await real_publish(*args, **kwargs)  # type: ignore[arg-type]

    js.publish = counted  # type: ignore[method-assign]
    with pytest.raises(nats.js.errors.APIError) as err:
        await js.publish_until(subject, b"y", headers, until=time.time() + 30)
    assert err.value.err_code == 10071 and tries == 1
    with pytest.raises(ValueError, match="Nats-Msg-Id"):
        await js.publish_until(subject, b"z", {}, until=time.time() + 1)


async def test_kv_compare_and_set_through_it(nc) -> None:
    js = jetstream(nc)
    assert isinstance(js, JetStream)
    kv = await js.create_key_value(KeyValueConfig(bucket="jsp-test", history=2))
    store = Store(js, kv, "jsp-test", SliceState)
    s = load_declared(None)[0]
    rev = await store.create(s.slice_id, s)
    assert rev is not None
    assert await store.create(s.slice_id, s) is None
    writes = await asyncio.gather(*(store.cas(s.slice_id, s, rev) for _ in range(8)))
    assert sum(w is not None for w in writes) == 1, "one writer wins a compare-and-set"
    got = await store.get(s.slice_id)
    assert got is not None and got[1] == next(w for w in writes if w is not None)


async def test_many_publishes_in_flight(nc) -> None:
    js = jetstream(nc)
    subject = subjects.subjob_completed("j-3")
    acks = await asyncio.gather(*(js.publish(subject, str(i).encode()) for i in range(500)))
    seqs = sorted(a.seq for a in acks)
    assert seqs == list(range(seqs[0], seqs[0] + 500)), "each publish gets its own acknowledgement"
    assert js._acks == {}


async def completions_fetcher(nc: object, name: str, **config: object) -> tuple[JetStream, Fetcher, str]:
    """A ``JetStream`` on ``nc``, a ``Fetcher`` of a new durable consumer ``name`` of
    ``SJA_COMPLETIONS``, and a subject of that stream to publish on."""
    from nats.js.api import AckPolicy, ConsumerConfig

    js = jetstream(nc)  # type: ignore[arg-type]
    fetcher = await js.pull_consumer(
        subjects.subjob_completed("*"),
        durable=name,
        stream=subjects.STREAM_COMPLETIONS.name,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, **config),  # type: ignore[arg-type]
    )
    return js, fetcher, subjects.subjob_completed(f"j-{name}")


async def test_fetcher_returns_what_is_there_at_once(nc) -> None:
    js, fetcher, subject = await completions_fetcher(nc, "f1")
    for i in range(10):
        await js.publish(subject, str(i).encode())
    loop = asyncio.get_running_loop()
    started = loop.time()
    first = await fetcher.fetch(4, timeout=5.0)
    rest = await fetcher.fetch(32, timeout=5.0)
    # Fewer than asked are there: returned at once, not when the request would expire.
    assert loop.time() - started < 2.5
    assert [m.data for m in first + rest] == [str(i).encode() for i in range(10)]
    for m in first + rest:
        await m.ack()
    with pytest.raises(nats.errors.TimeoutError):
        await fetcher.fetch(8, timeout=0.3)
    await fetcher.stop()


async def test_fetcher_waits_for_the_first_and_keeps_what_follows(nc) -> None:
    js, fetcher, subject = await completions_fetcher(nc, "f2")

    async def waiting_requests() -> int:
        return (await js.consumer_info(subjects.STREAM_COMPLETIONS.name, "f2")).num_waiting

    async def publish_later() -> None:
        # Once the fetch's request waits at the server with nothing to bring.
        await wait_until(waiting_requests, "the fetch's request waiting at the consumer")
        for i in range(5):
            await js.publish(subject, str(i).encode())

    task = asyncio.get_running_loop().create_task(publish_later())
    got = await fetcher.fetch(8, timeout=20.0)
    await task
    assert got and got[0].data == b"0", "the lingering request returns at its first message"
    # The request stays open until it expires: the messages it brings meanwhile are kept for the
    # next fetch (delivered already: nothing waits for a redelivery), in order.
    seen = list(got)
    while len(seen) < 5:
        seen += await fetcher.fetch(8, timeout=3.0)
    assert [m.data for m in seen] == [str(i).encode() for i in range(5)]
    for m in seen:
        await m.ack()
    await nc.flush()

    async def acked() -> ConsumerInfo | None:
        info = await js.consumer_info(subjects.STREAM_COMPLETIONS.name, "f2")
        return info if info.num_ack_pending == 0 else None

    info = await wait_until(acked, "every fetched message acknowledged", 2.5, every_s=0.05)
    assert info.num_ack_pending == 0 and info.num_redelivered == 0
    await fetcher.stop()


async def test_fetcher_of_a_consumer_at_its_ack_limit_does_not_spin(nc) -> None:
    js, fetcher, subject = await completions_fetcher(nc, "f3", max_ack_pending=2)
    for i in range(4):
        await js.publish(subject, str(i).encode())
    held = await fetcher.fetch(4, timeout=1.0)
    assert len(held) == 2, "no more than the consumer may have unacknowledged"
    sent = nc.stats["out_msgs"]
    with pytest.raises(nats.errors.TimeoutError):
        await fetcher.fetch(4, timeout=0.5)
    assert nc.stats["out_msgs"] - sent < 20, "refused requests are not repeated in a tight loop"
    for m in held:
        await m.ack()
    more = await fetcher.fetch(4, timeout=2.0)
    assert [m.data for m in more] == [b"2", b"3"]
    await fetcher.stop()


async def test_fetcher_asks_again_when_its_open_request_expires(nc) -> None:
    js, fetcher, subject = await completions_fetcher(nc, "f4")
    await js.publish(subject, b"0")
    assert [m.data for m in await fetcher.fetch(1, timeout=1.0)] == [b"0"]
    # A lingering request for 4, which brings one message and stays open until it expires.
    later = asyncio.get_running_loop().call_later(
        0.1, lambda: asyncio.ensure_future(js.publish(subject, b"1"))
    )
    got = await fetcher.fetch(4, timeout=0.6)
    assert [m.data for m in got] == [b"1"]
    later.cancel()
    # The next fetch waits on that open request; once it expires (0.6 s) the fetch must not sit
    # out its whole timeout with nothing open: a message published after the expiry comes at once.
    loop = asyncio.get_running_loop()
    loop.call_later(1.0, lambda: asyncio.ensure_future(js.publish(subject, b"2")))
    started = loop.time()
    got = []
    while not got:
        with contextlib.suppress(nats.errors.TimeoutError):
            got = await fetcher.fetch(4, timeout=5.0)
    assert [m.data for m in got] == [b"2"]
    assert loop.time() - started < 2.5, "a fetch was left waiting with no request open"
    await fetcher.stop()


async def test_fetcher_stopped_for_good(nc) -> None:
    _, fetcher, _ = await completions_fetcher(nc, "f5")
    with pytest.raises(nats.errors.TimeoutError):
        await fetcher.fetch(4, timeout=0.2)
    await fetcher.stop()
    # A loop still fetching after stop() must end, not subscribe again.
    with pytest.raises(FetcherStopped):
        await fetcher.fetch(4, timeout=0.2)
    assert fetcher._sub is None


async def test_pull_consumer_makes_the_consumer_once_and_keeps_an_existing_one(nc) -> None:
    js, fetcher, subject = await completions_fetcher(nc, "f6", max_ack_pending=7)
    info = await js.consumer_info(subjects.STREAM_COMPLETIONS.name, "f6")
    assert info.config.durable_name == "f6" and info.config.max_ack_pending == 7
    assert info.config.filter_subject == subjects.subjob_completed("*")
    # Asked again with another config: the consumer is kept as it is (its pending work with it).
    _, again, _ = await completions_fetcher(nc, "f6", max_ack_pending=9)
    info = await js.consumer_info(subjects.STREAM_COMPLETIONS.name, "f6")
    assert info.config.max_ack_pending == 7
    await js.publish(subject, b"x")
    assert [m.data for m in await again.fetch(4, timeout=2.0)] == [b"x"]
    await fetcher.stop()
    await again.stop()
