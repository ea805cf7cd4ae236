"""Reading what clearers publish per offer batch: the round records of ``SJA_ROUNDS`` (a message
holds one ``RoundRecord``, for a lone offer, or a ``RoundBatch``) and the grants to an agent (one
``Grant`` or a ``GrantBatch``); readers see records and grants either way."""

from __future__ import annotations

import datetime
from collections.abc import AsyncIterator

from nats.js.api import ConsumerConfig, DeliverPolicy
from nats.js.client import JetStreamContext
from nats.js.errors import NotFoundError

from sja.bus.codec import decode
from sja.core.rounds import unpack_records
from sja.protocol import subjects
from sja.protocol.messages import Grant, GrantBatch, RoundBatch, RoundRecord


def decode_rounds(data: bytes, whole: bool = True) -> list[RoundRecord]:
    """The records in one ``SJA_ROUNDS`` message (``DecodeError`` if it is neither kind), each with
    every verdict of its offer (``whole``; else only its own: the winner's, as written)."""
    got = decode(data, RoundRecord | RoundBatch)  # type: ignore[arg-type]
    if not isinstance(got, RoundBatch):
        return [got]
    return unpack_records(got) if whole else list(got.records)


def decode_grants(data: bytes) -> list[Grant]:
    """The grants in one message on ``grant_issued`` (``DecodeError`` if it is neither kind)."""
    got = decode(data, Grant | GrantBatch)  # type: ignore[arg-type]
    return list(got.grants) if isinstance(got, GrantBatch) else [got]


async def iter_rounds(
    js: JetStreamContext,
    timeout_s: float = 2.0,
    strict: bool = False,
    whole: bool = True,
    since: float | None = None,
    until: float | None = None,
) -> AsyncIterator[RoundRecord]:
    """Every round record in ``SJA_ROUNDS``, oldest first, read with an ordered consumer up to the
    stream's last message when reading started. A message that is not a round record is skipped,
    and no message for ``timeout_s`` ends the reading; ``strict``: both raise (``DecodeError``,
    ``TimeoutError``), for readers that must see every record. ``whole``: as ``decode_rounds``.

    ``since`` / ``until`` (Unix times): only the messages the stream stored in that span (the
    server seeks to ``since``; reading stops at the first message stored after ``until``), so a
    reader interested in one job reads the rounds of its lifetime, not the whole stream."""
    info = await js.stream_info(subjects.STREAM_ROUNDS.name)
    if not info.state.messages:
        return
    last_seq = info.state.last_seq
    if since is not None:
        try:
            last = await js.get_msg(subjects.STREAM_ROUNDS.name, seq=last_seq)
        except NotFoundError:
            last = None
        if last is not None and last.time is not None and last.time.timestamp() < since:
            return  # nothing stored since: no consumer to wait on
    config = None
    if since is not None:
        config = ConsumerConfig(opt_start_time=datetime.datetime.fromtimestamp(since, tz=datetime.UTC))
    sub = await js.subscribe(
        f"{subjects.PREFIX}.round.cleared.>",
        stream=subjects.STREAM_ROUNDS.name,  # no lookup by subject: one request less to the meta leader
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL if since is None else DeliverPolicy.BY_START_TIME,
        config=config,
        pending_msgs_limit=10_000_000,
    )
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=timeout_s)
            except TimeoutError:
                if strict:
                    raise
                return
            meta = msg.metadata
            if until is not None and meta.timestamp is not None and meta.timestamp.timestamp() > until:
                return
            try:
                records = decode_rounds(msg.data, whole)
            except ValueError:
                if strict:
                    raise
                records = []
            for rec in records:
                yield rec
            # Up to the last record when reading began: a stack that goes on clearing rounds while
            # it is read (idle windows re-offered) must not keep the reader going.
            if meta.num_pending == 0 or meta.sequence.stream >= last_seq:
                return
    finally:
        await sub.unsubscribe()
