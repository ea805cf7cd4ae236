"""A JetStream context whose publishes wait for their acknowledgement at less cost per message.

Every durable write of a grant's path is a JetStream publish that waits for the server's
acknowledgement: the clearer's lease and the agent's job (KV compare-and-sets, which nats-py's
``KeyValue`` sends through its context's ``publish``), the subjob, the completion, the slice freed.
nats-py's ``publish`` goes through the client's general request path: a NUID and random bytes for
a token, a done-callback, ``asyncio.wait_for`` (a wrapper future and a timer), then ``json.loads``
and a dataclass built from a dict. ``JetStream.publish`` keeps the same contract (same arguments,
``PubAck``, the same errors: ``APIError`` by the server's error code, ``NoStreamResponseError``,
``nats.errors.TimeoutError``) and sends the acknowledgements to one reply subscription of its own,
with a counter for the token, one timer per publish and the acknowledgement decoded by msgspec.

Everything else (streams, consumers, ``key_value``) is nats-py's, unchanged.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api

NO_RESPONDERS = "503"


class _Ack(msgspec.Struct):
    """A publish acknowledgement as the server sends it (JSON)."""

    stream: str = ""
    seq: int = 0
    domain: str | None = None
    duplicate: bool | None = None
    error: dict[str, Any] | None = None


_decode_ack = msgspec.json.Decoder(_Ack).decode


def _expire(fut: asyncio.Future[Msg]) -> None:
    if not fut.done():
        fut.set_exception(nats.errors.TimeoutError())


class JetStream(JetStreamContext):
    """``JetStreamContext`` with a leaner ``publish`` (see the module's docstring)."""

    def __init__(self, conn: Client, **opts: Any) -> None:
        super().__init__(conn, **opts)
        self._acks: dict[str, asyncio.Future[Msg]] = {}
        self._ack_prefix = ""
        self._ack_sub: Subscription | None = None
        self._ack_lock = asyncio.Lock()
        self._sent = 0

    async def _start_acks(self) -> None:
        async with self._ack_lock:
            if self._ack_sub is not None:
                return
            # Under the connection's inbox prefix, so a server that lets each user read only its
            # own replies (_INBOX.<user>.>) delivers these too.
            prefix = self._nc.new_inbox()
            self._ack_sub = await self._nc.subscribe(
                f"{prefix}.*", cb=self._on_ack, pending_msgs_limit=1_000_000
            )
            self._ack_prefix = f"{prefix}."

    async def _on_ack(self, msg: Msg) -> None:
        fut = self._acks.get(msg.subject)
        if fut is None or fut.done():
            return  # timed out already
        if msg.headers and msg.headers.get(api.Header.STATUS) == NO_RESPONDERS:
            fut.set_exception(nats.js.errors.NoStreamResponseError())
        else:
            fut.set_result(msg)

    async def publish(
        self,
        subject: str,
        payload: bytes = b"",
        timeout: float | None = None,  # noqa: ASYNC109 (nats-py's signature)
        stream: str | None = None,
        headers: dict[str, Any] | None = None,
        msg_ttl: float | None = None,
    ) -> api.PubAck:
        if stream is not None or msg_ttl is not None:
            return await super().publish(subject, payload, timeout, stream, headers, msg_ttl)
        if self._ack_sub is None:
            await self._start_acks()
        self._sent += 1
        reply = f"{self._ack_prefix}{self._sent}"
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Msg] = loop.create_future()
        self._acks[reply] = fut
        timer = loop.call_later(self._timeout if timeout is None else timeout, _expire, fut)
        try:
            await self._nc.publish(subject, payload, reply=reply, headers=headers)
            msg = await fut
        finally:
            timer.cancel()
            del self._acks[reply]
        try:
            ack = _decode_ack(msg.data)
        except msgspec.DecodeError as e:
            raise nats.js.errors.Error(f"unreadable publish acknowledgement: {e}") from None
        if ack.error is not None:
            raise nats.js.errors.APIError.from_error(ack.error)
        return api.PubAck(stream=ack.stream, seq=ack.seq, domain=ack.domain, duplicate=ack.duplicate)


def jetstream(nc: Client, **opts: Any) -> JetStream:
    """The JetStream context SJA uses on ``nc`` (``nc.jetstream()`` with the leaner ``publish``)."""
    return JetStream(nc, **opts)
