"""A JetStream context whose publishes wait for their acknowledgement, and whose pull consumers
deliver, at less cost per message.

Every durable write of a grant's path is a JetStream publish that waits for the server's
acknowledgement: the clearer's lease and the agent's job (KV compare-and-sets, which nats-py's
``KeyValue`` sends through its context's ``publish``), the subjob, the completion, the slice freed.
nats-py's ``publish`` goes through the client's general request path: a NUID and random bytes for
a token, a done-callback, ``asyncio.wait_for`` (a wrapper future and a timer), then ``json.loads``
and a dataclass built from a dict. ``JetStream.publish`` keeps the same contract (same arguments,
``PubAck``, the same errors: ``APIError`` by the server's error code, ``NoStreamResponseError``,
``nats.errors.TimeoutError``) and sends the acknowledgements to one reply subscription of its own,
with a counter for the token, one timer per publish and the acknowledgement decoded by msgspec.

``Fetcher.fetch`` does what nats-py's ``PullSubscription.fetch`` does, without an
``asyncio.wait_for`` per message received (see ``Fetcher``).

A message read from a stream (``get_msg``, which a KV ``get`` is) has its headers read by the
client's own header parser (``Client._parse_header_lines``: ``Name: Value`` lines) rather than
Python's e-mail parser, which nats-py uses there and which costs tens of microseconds a message
(an entry written by compare-and-set carries a header).

Everything else (streams, consumers, ``key_value``) is nats-py's, unchanged.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, NamedTuple

import msgspec
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext, api

from sja.bus.natsclient import Client as NatsClient

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


class _HeaderParser:
    """What nats-py's ``get_msg`` asks of its header parser (``parsebytes(raw).items()``), answered
    by the client's parser of message headers (see the module)."""

    @staticmethod
    def parsebytes(raw: bytes) -> dict[str, str]:
        return NatsClient._parse_header_lines(raw)


class JetStream(JetStreamContext):
    """``JetStreamContext`` with a leaner ``publish`` (see the module's docstring), and
    ``fetcher`` for a leaner ``fetch`` from a pull consumer."""

    def __init__(self, conn: Client, **opts: Any) -> None:
        super().__init__(conn, **opts)
        self._hdr_parser = _HeaderParser()  # type: ignore[assignment]
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
            eager = getattr(self._nc, "subscribe_eager", None)
            if eager is not None:
                # SJA's client hands each acknowledgement to its publisher from the read loop,
                # without a pass through a subscription queue and its task (about 1 us a publish).
                self._ack_sub = await eager(f"{prefix}.*", self._deliver_ack)
            else:
                self._ack_sub = await self._nc.subscribe(
                    f"{prefix}.*", cb=self._on_ack, pending_msgs_limit=1_000_000
                )
            self._ack_prefix = f"{prefix}."

    async def _on_ack(self, msg: Msg) -> None:
        self._deliver_ack(msg)

    def _deliver_ack(self, msg: Msg) -> None:
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

    async def publish_until(
        self,
        subject: str,
        payload: bytes,
        headers: dict[str, Any],
        until: float,
        first_delay_s: float = 0.05,
        max_delay_s: float = 1.0,
    ) -> api.PubAck:
        """``publish``, tried again while JetStream cannot take the message (a stream with no
        leader yet after a server is lost, no acknowledgement in time, a reconnect), after
        ``first_delay_s`` doubling up to ``max_delay_s``, until the wall-clock time ``until``: then
        the last error is raised. ``headers`` must carry a ``Nats-Msg-Id``: the stream keeps one
        copy however many tries reach it (within its duplicate window, which ``until`` should not
        outlast). An error the server gives for the message itself (an ``APIError`` other than
        503, unavailable) is raised at once: trying again would get it again."""
        if not headers.get("Nats-Msg-Id"):
            raise ValueError("publish_until needs a Nats-Msg-Id header: a retry must not store twice")
        delay = first_delay_s
        while True:
            try:
                return await self.publish(subject, payload, headers=headers)
            except nats.js.errors.APIError as e:
                if e.code != 503:
                    raise
                error: Exception = e
            except Exception as e:  # no leader, timeout, reconnecting: JetStream may take it later
                error = e
            if time.time() + delay > until:
                raise error
            await asyncio.sleep(delay)
            delay = min(delay * 2, max_delay_s)

    def fetcher(self, stream: str, durable: str) -> Fetcher:
        """Batches from the durable pull consumer ``durable`` of ``stream``, which must exist."""
        return Fetcher(self, stream, durable)

    async def pull_consumer(
        self, subject: str, durable: str, stream: str, config: api.ConsumerConfig
    ) -> Fetcher:
        """The durable pull consumer ``durable`` of ``stream`` on ``subject``, made with ``config``
        if it does not exist yet (an existing one is kept as it is, as ``pull_subscribe`` does),
        and a ``Fetcher`` of it."""
        try:
            await self.consumer_info(stream, durable)
        except nats.js.errors.NotFoundError:
            if not config.filter_subjects:
                config.filter_subject = subject
            config.name = config.durable_name = durable
            await self.add_consumer(stream, config=config)
        return self.fetcher(stream, durable)


def jetstream(nc: Client, **opts: Any) -> JetStream:
    """The JetStream context SJA uses on ``nc`` (``nc.jetstream()`` with the leaner ``publish``)."""
    return JetStream(nc, **opts)


_V1_ACK_TOKENS = 9
"""``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>``"""
_V2_ACK_TOKENS = 12
"""The same with the domain and account hash after ``ACK`` (and room for more at the end)."""


class Delivery(NamedTuple):
    """What a JetStream delivery's reply subject says of it."""

    delivered: int
    """How many times it has been delivered."""
    stream_seq: int
    """Its sequence in the stream (a KV entry's revision)."""
    pending: int
    """Messages still pending for the consumer after it."""


def delivery(reply: str | None) -> Delivery | None:
    """The numbers a JetStream delivery's reply subject carries (both its forms), or ``None`` for a
    reply that is not one. ``Msg.metadata`` builds every field, a ``datetime`` among them, to be
    asked for one or two of these: 3.1 against 0.3 us, on every subjob and every watched change."""
    tokens = reply.split(".") if reply else []
    if len(tokens) < _V1_ACK_TOKENS or tokens[0] != "$JS" or tokens[1] != "ACK":
        return None
    try:
        if len(tokens) == _V1_ACK_TOKENS:
            return Delivery(int(tokens[4]), int(tokens[5]), int(tokens[8]))
        if len(tokens) >= _V2_ACK_TOKENS - 1:
            return Delivery(
                int(tokens[Msg.Ack.NumDelivered]),
                int(tokens[Msg.Ack.StreamSeq]),
                int(tokens[Msg.Ack.NumPending]),
            )
    except ValueError:
        pass
    return None


def delivery_count(msg: Msg) -> int:
    """How many times JetStream has delivered ``msg`` (1 for a message not from a consumer)."""
    d = delivery(msg.reply)
    return max(d.delivered, 1) if d is not None else 1


STATUS_NO_MESSAGES = "404"
STATUS_REQUEST_TIMEOUT = "408"
STATUS_CONFLICT = "409"
STATUS_HEARTBEAT = "100"


class FetcherStopped(nats.errors.Error):
    """``Fetcher.fetch`` after ``Fetcher.stop``."""


class _Waiter:
    """A caller of ``fetch`` waiting for messages: done at ``wanted`` of them, or at the end of the
    request ``until`` names (its status), or at its first message when ``first_only``."""

    __slots__ = ("done", "first_only", "msgs", "status", "until", "wanted")

    def __init__(self, wanted: int, first_only: bool, until: str, done: asyncio.Future[None]) -> None:
        self.wanted = wanted
        self.first_only = first_only
        self.until = until
        self.msgs: list[Msg] = []
        self.done = done
        self.status = ""
        """The status that ended the request waited for (``404``, ``408``, ``409``), if one did."""


class Fetcher:
    """Batches from a durable pull consumer: ``fetch(batch, timeout)`` as nats-py's
    ``PullSubscription.fetch`` (what is available now, up to ``batch``, at once; else the first
    message to come, up to ``timeout``), with every message delivered to one subscription's
    callback instead of awaited one by one (nats-py wraps each in ``asyncio.wait_for``).

    A waiting (lingering) request stays open on the server until it has brought what it asked
    for or expires; while one is open no other is sent: what it brings is kept for the callers
    of ``fetch`` as it comes, so a steady flow costs one request per batch, not one per message.
    The server serves requests in order, so each message counts against the oldest open one.
    Each request has a reply subject of its own, which its end (a status: 404 no more messages,
    408 expired, 409 refused) is sent to; one whose end never came (a lost connection) is given
    up once it would have expired."""

    def __init__(self, js: JetStream, stream: str, durable: str) -> None:
        self._nc: Client = js._nc
        self._next_subject = f"{js._prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self._prefix = ""
        self._sub: Subscription | None = None
        self._sent = 0
        self._open: dict[str, list[float]] = {}
        """reply subject -> [messages still to come, when it is given up], oldest first."""
        self._waiter: _Waiter | None = None
        self._kept: list[Msg] = []
        self._stopped = False

    async def start(self) -> None:
        if self._stopped:
            raise FetcherStopped("this fetcher was stopped")
        if self._sub is None:
            prefix = self._nc.new_inbox()
            self._sub = await self._nc.subscribe(f"{prefix}.*", cb=self._on_msg, pending_msgs_limit=1_000_000)
            self._prefix = f"{prefix}."

    async def stop(self) -> None:
        """Stop for good: the subscription goes (before the connection drains, which would wait for
        an open request's late status), and a ``fetch`` from now on raises ``FetcherStopped``."""
        self._stopped = True
        sub, self._sub = self._sub, None
        if sub is not None:
            await sub.unsubscribe()
        self._open.clear()
        if self._waiter is not None:
            _finish(self._waiter.done)

    async def _on_msg(self, msg: Msg) -> None:
        status = msg.headers.get(api.Header.STATUS) if msg.headers else None
        if status:
            if status == STATUS_HEARTBEAT:
                return
            # No more messages (404), expired (408), or refused (409: the consumer is gone, holds
            # as many unacknowledged as it may, ...): that request is over.
            self._open.pop(msg.subject, None)
            w = self._waiter
            # The wait ends with the request it is for; a wait for what an open request brings
            # ends when no request is left open (nothing more would come).
            if w is not None and (w.until == msg.subject or (w.first_only and not self._open)):
                w.status = status
                _finish(w.done)
            return
        for reply, left in self._open.items():
            left[0] -= 1
            if left[0] <= 0:
                del self._open[reply]
            break
        w = self._waiter
        if w is None or w.done.done():
            self._kept.append(msg)
            return
        w.msgs.append(msg)
        if w.first_only or len(w.msgs) >= w.wanted:
            w.done.set_result(None)

    async def _request(self, batch: int, timeout: float, no_wait: bool) -> str:  # noqa: ASYNC109
        if self._sub is None:
            await self.start()
        self._sent += 1
        reply = f"{self._prefix}{self._sent}"
        req: dict[str, Any] = {"batch": batch}
        if no_wait:
            req["no_wait"] = True
        else:
            req["expires"] = max(int(timeout * 1e9), 1_000_000)
        self._open[reply] = [batch, time.monotonic() + timeout + 0.5]
        await self._nc.publish(self._next_subject, msgspec.json.encode(req), reply=reply)
        return reply

    async def _wait(self, w: _Waiter, timeout: float) -> _Waiter:  # noqa: ASYNC109
        if self._kept:  # came before this wait began
            w.msgs, self._kept = self._kept[: w.wanted], self._kept[w.wanted :]
            if w.first_only or len(w.msgs) >= w.wanted:
                return w
        self._waiter = w
        timer = asyncio.get_running_loop().call_later(timeout, _finish, w.done)
        try:
            await w.done
        finally:
            timer.cancel()
            if self._waiter is w:
                self._waiter = None
        return w

    def _lingering(self) -> bool:
        """Whether a request is open that will bring messages as they come."""
        now = time.monotonic()
        for reply in [r for r, (_, give_up) in self._open.items() if give_up < now]:
            del self._open[reply]
        return bool(self._open)

    async def fetch(self, batch: int, timeout: float = 1.0) -> list[Msg]:  # noqa: ASYNC109
        """Up to ``batch`` messages: those kept (brought by an open request) and, when no request
        is open, what the consumer has now; if none, the first to come within ``timeout`` (then
        ``nats.errors.TimeoutError``)."""
        msgs, self._kept = self._kept[:batch], self._kept[batch:]
        loop = asyncio.get_running_loop()
        if len(msgs) < batch and not self._lingering():
            reply = await self._request(batch - len(msgs), timeout, no_wait=True)
            w = await self._wait(_Waiter(batch - len(msgs), False, reply, loop.create_future()), timeout)
            msgs += w.msgs
        if msgs:
            return msgs
        until = ""
        if not self._lingering():
            until = await self._request(batch, timeout, no_wait=False)
        w = await self._wait(_Waiter(batch, True, until, loop.create_future()), timeout)
        if w.msgs:
            return w.msgs
        if w.status == STATUS_CONFLICT:
            # Refused at once (the consumer is gone, or holds as many unacknowledged messages as
            # it may): not again at once.
            await asyncio.sleep(min(timeout, 0.1))
        raise nats.errors.TimeoutError


def _finish(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


async def stream_subjects(
    js: JetStreamContext, stream: str, subjects_filter: str, strip: int = 0
) -> set[str]:
    """Every subject with a message in ``stream`` that matches ``subjects_filter`` (less its first
    ``strip`` characters), page by page: the server lists at most 100,000 a page.

    nats-py's ``stream_info(name, subjects_filter)`` asks for the first page only and has no
    offset, so this sends the same API request itself, through the context's connection and API
    prefix (nats-py's ``_nc`` and ``_prefix``: the one place SJA reads them, and why
    ``pyproject.toml`` bounds nats-py below 3)."""
    nc: Client = js._nc
    found: set[str] = set()
    while True:
        req = msgspec.json.encode({"subjects_filter": subjects_filter, "offset": len(found)})
        reply = await nc.request(f"{js._prefix}.STREAM.INFO.{stream}", req, timeout=10)
        resp = msgspec.json.decode(reply.data)
        if resp.get("error"):
            nats.js.errors.APIError.from_error(resp["error"])  # raises the typed error
        page = (resp.get("state") or {}).get("subjects") or {}
        before = len(found)
        found.update(subject[strip:] for subject in page)
        if len(found) == before or len(found) >= int(resp.get("total") or 0):
            return found
