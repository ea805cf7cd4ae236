r"""The NATS client SJA connects with: nats-py's, with writes that gather more messages each and a
cheaper reading of headers.

nats-py queues every outgoing message and wakes a flusher task, which writes what is queued to the
socket. It runs as soon as the event loop gets to it: when a burst of tasks publish in one turn
of the loop (the grants of a batch, each writing its job and publishing its subjob; completions
acknowledged together), the first publish wakes the flusher and the write often goes out before
the other tasks of the same turn have queued theirs, so a burst takes several writes. Here the
flusher lets the loop turn once between being woken and writing: every callback already due runs
first and its messages join the same write. One turn costs microseconds; each write saved is a
system call here and a read on the server (on loopback, the receiving side's work is done in the
sender's system call). At (1000, 512) in the control-plane benchmark this gave more grants a
second in interleaved pairs of runs (CHANGELOG.md, item 27).

Most messages SJA receives carry headers (a ``traceparent``, a ``Nats-Msg-Id``). nats-py reads each
header line and drops one whose name holds whitespace, testing each character of the name with a
generator; here one regular expression does that test (the same characters: ``\s`` is what
``str.isspace`` calls whitespace), the rest as nats-py does it.

A message on a round's critical path can be handled as soon as it is read (``subscribe_eager``).
nats-py queues every message for its subscription's task, which wakes at the end of the event
loop's ready queue; ``Service.subscribe`` then hands it to a task of its own, at the end of the
queue again. Under load that is two passes over every callback already due (completions folded in,
grants materialized) before an offer is answered. An eager subscription's messages are handed to
their callback by the read loop itself, in the order read.

``flush()`` means what it says: nats-py writes its PING to the socket at once, ahead of the
commands still queued for the flusher, so the PONG could come back before the server had read a
subscription made just before; here what is queued is written first.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable
from typing import Any

import nats.aio.client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

_SPACE = re.compile(r"\s")


class Client(nats.aio.client.Client):
    """``nats.aio.client.Client`` whose flusher yields once before each write, whose ``flush()``
    writes what is queued before its PING, and which reads header lines with less Python per line
    (see the module)."""

    @staticmethod
    def _parse_header_lines(raw: bytes) -> dict[str, str]:
        # nats-py's ``Client._parse_header_lines`` (``Name: Value`` per line, a line without a
        # colon or with a non-ASCII or blank-holding name skipped), with the whitespace test of the
        # name made by one ``re.search``.
        out: dict[str, str] = {}
        for line in raw.split(b"\r\n"):
            if not line:
                continue
            name, sep, value = line.partition(b":")
            if not sep:
                continue
            try:
                key = name.strip().decode("ascii")
            except UnicodeDecodeError:
                continue
            if _SPACE.search(key) is not None:
                continue
            out[key] = value.strip().decode("utf-8", "replace")
        return out

    def __init__(self) -> None:
        super().__init__()
        self._eager: dict[int, Callable[[Msg], None]] = {}

    async def subscribe_eager(
        self, subject: str, deliver: Callable[[Msg], None], queue: str = ""
    ) -> Subscription:
        """A core NATS subscription whose messages go to ``deliver`` from the read loop, as each
        is read (see the module). ``deliver`` must not block and must not raise: whatever it does
        that waits belongs in a task. No JetStream, no ``max_msgs``."""
        sub = await self.subscribe(subject, queue=queue)
        self._eager[sub._id] = deliver
        return sub

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        deliver = self._eager.get(sid)
        if deliver is None:
            await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]
            return
        sub = self._subs.get(sid)
        if sub is None:  # unsubscribed: the server may still have sent a few
            del self._eager[sid]
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        sub._received += 1
        hdr = await self._process_headers(headers)
        msg: Any = self._build_message(sid, subject, reply, data, hdr)
        if msg:
            deliver(msg)

    def flush_now(self) -> None:
        """Write what is pending to the socket now, instead of when the flusher's turn comes.

        The flusher writes after everything already due on the event loop has run (one more turn,
        for coalescing), which under load can be milliseconds of other messages' handling. A
        message on a round's critical path (an offer batch, a reply, a grant) is written at once
        with this; what was pending before it goes with it, in order. Flow control stays the
        flusher's (it drains the transport); a connection not up keeps the data pending for the
        reconnect, as the flusher would."""
        if self._pending_data_size <= 0 or not self.is_connected or self._transport is None:
            return
        self._transport.writelines(self._pending[:])
        self._pending = []
        self._pending_data_size = 0

    async def _send_ping(self, future: asyncio.Future[Any] | None = None) -> None:
        # nats-py writes the PING straight to the socket, ahead of the commands still pending (a
        # SUB just made, a publish): its PONG, which ``flush()`` waits for, would then not mean
        # that the server has them, and a request sent on another connection right after a
        # service's ``start()`` could find no responder. What is pending goes first, in order.
        self.flush_now()
        await super()._send_ping(future)

    async def _flusher(self) -> None:
        # nats-py's ``Client._flusher`` with the one turn of the loop added.
        assert self._transport, "Client.connect must be called first"
        assert self._flush_queue, "Client.connect must be called first"
        while True:
            if not self.is_connected or self.is_connecting:
                break
            future: asyncio.Future[None] = await self._flush_queue.get()
            try:
                await asyncio.sleep(0)  # the publishes already due join this write
                if self._pending_data_size > 0:
                    self._transport.writelines(self._pending[:])
                    self._pending = []
                    self._pending_data_size = 0
                    await self._transport.drain()  # type: ignore[no-untyped-call]
            except OSError as e:
                await self._error_cb(e)
                await self._process_op_err(e)
                break
            except (asyncio.CancelledError, RuntimeError, AttributeError):
                # RuntimeError: the event loop is closed.
                break
            finally:
                if not future.done():
                    future.set_result(None)
