"""``delivery`` / ``delivery_count``: what ``msg.metadata`` says of a delivery, read from the reply
subject alone."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nats.aio.msg import Msg

from sja.bus.jetstream import Delivery, delivery, delivery_count


def _nats_py(reply: str) -> int:
    try:
        return int(Msg(_client=None, subject="s", reply=reply, data=b"").metadata.num_delivered or 1)  # type: ignore[arg-type]
    except Exception:
        return 1


def _count(reply: str) -> int:
    return delivery_count(Msg(_client=None, subject="s", reply=reply, data=b""))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "reply",
    [
        "$JS.ACK.SJA_SUBJOBS.executor-n0.3.12345.678.1732486400000000000.0",
        "$JS.ACK.hub.ACCHASH.SJA_SUBJOBS.executor-n0.2.1.1.1732486400000000000.0.rnd",
        "$JS.ACK.hub.ACCHASH.SJA_SUBJOBS.executor-n0.5.1.1.1732486400000000000.0",
        "$JS.ACK._.ACCHASH.S.c.7.1.1.1732486400000000000.0.x.more",
        "$JS.ACK.S.c.0.1.1.1.0",
        "",
        "_INBOX.abc.1",
        "$JS.ACK.S.c",
        "$JS.NAK.S.c.3.1.1.1.0",
    ],
)
def test_the_count_nats_py_reads(reply: str) -> None:
    assert _count(reply) == _nats_py(reply)


@given(
    delivered=st.integers(min_value=1, max_value=10**9),
    seqs=st.lists(st.integers(min_value=0, max_value=2**63), min_size=4, max_size=4),
    domain=st.booleans(),
)
def test_any_delivery(delivered: int, seqs: list[int], domain: bool) -> None:
    s, c, t, p = seqs
    reply = (
        f"$JS.ACK.dom.acc.SJA_SUBJOBS.ex.{delivered}.{s}.{c}.{t}.{p}.tok"
        if domain
        else f"$JS.ACK.SJA_SUBJOBS.ex.{delivered}.{s}.{c}.{t}.{p}"
    )
    assert _count(reply) == delivered == _nats_py(reply)
    meta = Msg(_client=None, subject="s", reply=reply, data=b"").metadata  # type: ignore[arg-type]
    assert (
        delivery(reply)
        == Delivery(delivered, s, p)
        == (
            meta.num_delivered,
            meta.sequence.stream,
            meta.num_pending,
        )
    )


@pytest.mark.parametrize("reply", [None, "", "_INBOX.a.b", "$JS.ACK.S.c", "$JS.ACK.S.c.x.1.1.1.0"])
def test_not_a_delivery(reply: str | None) -> None:
    assert delivery(reply) is None
