"""The NATS client SJA connects with: nats-py's, with writes that gather more messages each.

nats-py queues every outgoing message and wakes a flusher task, which writes what is queued to the
socket. It runs as soon as the event loop gets to it: when a burst of tasks publish in one turn
of the loop (the grants of a batch, each writing its job and publishing its subjob; completions
acknowledged together), the first publish wakes the flusher and the write often goes out before
the other tasks of the same turn have queued theirs, so a burst takes several writes. Here the
flusher lets the loop turn once between being woken and writing: every callback already due runs
first and its messages join the same write. One turn costs microseconds; each write saved is a
system call here and a read on the server (on loopback, the receiving side's work is done in the
sender's system call). At (1000, 512) in the control-plane benchmark this gave more grants a
second in each of four interleaved pairs of runs (see docs/performance.md).
"""

from __future__ import annotations

import asyncio

import nats.aio.client


class Client(nats.aio.client.Client):
    """``nats.aio.client.Client`` whose flusher yields once before each write (see the module)."""

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
