"""Reading a job's completions back from ``SJA_COMPLETIONS`` (kept for the stream's age limit, not
removed when acknowledged): what an agent that takes a job over replays, since the completions that
reached it before the job was its own were acknowledged and dropped."""

from __future__ import annotations

from collections.abc import AsyncIterator

from nats.js.api import DeliverPolicy
from nats.js.client import JetStreamContext

from sja.bus.codec import DecodeError, decode
from sja.protocol import subjects
from sja.protocol.messages import Completion


async def iter_completions(
    js: JetStreamContext, job_id: str, timeout_s: float = 2.0
) -> AsyncIterator[Completion]:
    """The completions of ``job_id`` in the stream, oldest first, up to the last one stored when
    reading began (a job's own subject: as many messages as it had subjobs end, at most). A message
    that is not a completion is skipped."""
    subject = subjects.subjob_completed(job_id)
    info = await js.stream_info(subjects.STREAM_COMPLETIONS.name, subjects_filter=subject)
    if not (info.state.subjects or {}).get(subject):
        return  # none at all: no consumer to make
    last_seq = info.state.last_seq
    sub = await js.subscribe(
        subject,
        stream=subjects.STREAM_COMPLETIONS.name,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
    )
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=timeout_s)
            except TimeoutError:
                return
            try:
                c: Completion | None = decode(msg.data, Completion)
            except DecodeError:
                c = None
            if c is not None:
                yield c
            meta = msg.metadata
            if meta.num_pending == 0 or meta.sequence.stream >= last_seq:
                return
    finally:
        await sub.unsubscribe()
