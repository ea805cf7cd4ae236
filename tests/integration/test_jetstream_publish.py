"""``sja.bus.jetstream.JetStream.publish`` against a real nats-server: the same acknowledgements and
errors as nats-py's own publish, for streams and for KV compare-and-set through it."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
import pytest
from nats.js.api import KeyValueConfig

from sja.bus.connection import Store
from sja.bus.jetstream import JetStream, jetstream
from sja.inventory.declared import load_declared
from sja.protocol import subjects
from sja.protocol.messages import SliceState


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


async def test_kv_compare_and_set_through_it(nc) -> None:
    js = jetstream(nc)
    assert isinstance(js, JetStream)
    kv = await js.create_key_value(KeyValueConfig(bucket="jsp-test", history=2))
    store = Store(kv, SliceState)
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
