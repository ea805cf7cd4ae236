"""When a running subjob's program gets its stop signal and when it is killed, movable while it runs.

A bounded subjob's clock is fixed when it starts (``SIGTERM`` before its deadline, ``SIGKILL`` at
it). An open subjob (``core.continuation``) has no deadline: it runs until it is asked to yield,
which sets its clock from another thread of the slice's actor (``request_yield``) while the thread
supervising the program (``program.watch``) reads it on every poll.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field


@dataclass
class StopClock:
    term_at: float = math.inf
    """Unix seconds: the program gets ``SIGTERM`` (``should_stop()`` turns true)."""
    kill_at: float = math.inf
    """Unix seconds: everything in its sandbox is killed."""
    yielded_at: float = 0.0
    """When a yield was asked (0: never)."""
    window_end: float = 0.0
    """The end of the window the subjob was planned for (``SJA_DEADLINE`` of an open subjob: it
    may go on past it)."""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def request_yield(self, grace_s: float, now: float | None = None) -> None:
        """Stop now: ``SIGTERM`` at once, ``SIGKILL`` ``grace_s`` later (never later than already set)."""
        at = time.time() if now is None else now
        with self._lock:
            if not self.yielded_at:
                self.yielded_at = at
            self.term_at = min(self.term_at, at)
            self.kill_at = min(self.kill_at, at + max(0.0, grace_s))


_CLOCKS: dict[str, StopClock] = {}
_LOCK = threading.Lock()


def register(subjob_id: str, clock: StopClock) -> None:
    with _LOCK:
        _CLOCKS[subjob_id] = clock


def unregister(subjob_id: str) -> None:
    with _LOCK:
        _CLOCKS.pop(subjob_id, None)


def get(subjob_id: str) -> StopClock | None:
    with _LOCK:
        return _CLOCKS.get(subjob_id)


def request_yield(subjob_id: str, grace_s: float) -> bool:
    """Ask the running subjob ``subjob_id`` to yield; False when it does not run in this process."""
    with _LOCK:
        clock = _CLOCKS.get(subjob_id)
    if clock is None:
        return False
    clock.request_yield(grace_s)
    return True


__all__ = ["StopClock", "get", "register", "request_yield", "unregister"]
