"""Warm continuation: a ``command`` job's program kept alive between its subjobs on one slice.

A job that opts in (``params.warm: true``) runs its program with a channel (``SJA_WARM_FD``). When
the program's range is done it says so on the channel (``ctx.next_range()`` in the SDK) instead of
exiting; its state is written as always, so the subjob completes exactly as a cold one would. The
process is then parked here, per (job, slice), for ``grace_s()`` seconds. If the next subjob of the
same job comes to the same slice in time, its range is handed to the parked process instead of
starting a new one; and when the state that subjob starts from is the very state the process left
(same SHA-256 of the archive), the process is told so (``ctx.resumed``) and neither the executor
nor the program reads the state back. Anything else falls back to a cold start, as without warm:

- the process is gone (it died, was killed, or the grace ran out): a new process, the state restored;
- another job's subjob or another slice: the parked process is killed first (it holds the slice's
  memory), the new subjob starts cold;
- the subjob starts from another state (a retry after a lost completion): the parked process gets
  the range but restores from ``SJA_STATE_IN`` (``ctx.resumed`` false).

Correctness never depends on the process surviving: every state is written and kept as for a cold
subjob; warm only saves the start-up and the state read.

The registry lives in the process that runs subjobs (the slice's actor: one per slice).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from sja.execution.program import Running
from sja.workloads import checkpoint as ckpt

DEFAULT_GRACE_S = 10.0


def grace_s() -> float:
    """How long a parked program waits for its job's next subjob (``SJA_WARM_GRACE_S``)."""
    try:
        return max(0.0, float(os.environ.get("SJA_WARM_GRACE_S", DEFAULT_GRACE_S)))
    except ValueError:
        return DEFAULT_GRACE_S


def state_digest(raw: bytes) -> str:
    """The identity of a state checkpoint (inline or referenced): the SHA-256 of its archive."""
    if not raw:
        return ""
    try:
        if ckpt.is_ref(raw):
            return ckpt.unpack_ref(raw).sha256
        return ckpt.digest(ckpt.unpack_blob(raw).data)
    except Exception:
        return ""


@dataclass
class Parked:
    job_id: str
    slice_id: str
    running: Running
    digest: str
    """The state the process holds (the digest of the state its last range left)."""
    timer: threading.Timer | None = field(default=None, repr=False)


_parked: dict[tuple[str, str], Parked] = {}
_lock = threading.Lock()


def park(job_id: str, slice_id: str, running: Running, digest: str) -> None:
    """Keep ``running`` for the job's next subjob on this slice, for ``grace_s()``."""
    if grace_s() <= 0:
        running.kill()
        return
    p = Parked(job_id, slice_id, running, digest)
    key = (job_id, slice_id)

    def expire() -> None:
        with _lock:
            if _parked.get(key) is not p:
                return
            del _parked[key]
        running.kill()

    with _lock:
        old = _parked.pop(key, None)
        _parked[key] = p
    if old is not None:
        _stop(old)
    p.timer = threading.Timer(grace_s(), expire)
    p.timer.daemon = True
    p.timer.start()


def _stop(p: Parked) -> None:
    if p.timer is not None:
        p.timer.cancel()
    p.running.kill()


def take(job_id: str, slice_id: str) -> Parked | None:
    """The live process parked for this job on this slice, no longer parked; ``None`` if none."""
    with _lock:
        p = _parked.pop((job_id, slice_id), None)
    if p is None:
        return None
    if p.timer is not None:
        p.timer.cancel()
    if not p.running.alive():
        p.running.kill()
        return None
    return p


def evict_except(job_id: str, slice_id: str) -> int:
    """Stop every parked process but this job's on this slice (a subjob of another job is about to
    use the slice); returns how many were stopped."""
    with _lock:
        gone = [p for k, p in _parked.items() if k != (job_id, slice_id)]
        for p in gone:
            del _parked[(p.job_id, p.slice_id)]
    for p in gone:
        _stop(p)
    return len(gone)


def parked() -> list[tuple[str, str]]:
    with _lock:
        return list(_parked)


__all__ = ["DEFAULT_GRACE_S", "Parked", "evict_except", "grace_s", "park", "parked", "state_digest", "take"]
