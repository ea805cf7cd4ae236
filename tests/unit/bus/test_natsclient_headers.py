"""``sja.bus.natsclient.Client`` reads header blocks exactly as nats-py does."""

from __future__ import annotations

import nats.aio.client
from hypothesis import given, settings
from hypothesis import strategies as st

from sja.bus.natsclient import Client

parts = st.sampled_from(
    [
        b"traceparent",
        b"Nats-Msg-Id",
        b"a b",
        b"x\tb",
        b"\xc3\xa9",
        b"k\x1cx",
        b" ",
        b":",
        b": ",
        b"v\xff",
        b"\r\n",
        b"-",
    ]
)
blocks = st.lists(st.one_of(parts, st.binary(max_size=8)), max_size=12).map(b"".join)


@settings(max_examples=500, deadline=None)
@given(blocks)
def test_header_lines_read_as_nats_py_reads_them(raw: bytes) -> None:
    assert Client._parse_header_lines(raw) == nats.aio.client.Client._parse_header_lines(raw)


def test_a_typical_block() -> None:
    raw = (
        b"traceparent: 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00\r\nNats-Msg-Id: s-1:12\r\n\r\n"
    )
    assert Client._parse_header_lines(raw) == {
        "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
        "Nats-Msg-Id": "s-1:12",
    }
