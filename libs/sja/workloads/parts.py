"""The partial results of an independent workload whose ``merge`` the control plane does not run (a
tenant's own workload): kept as they come, in unit order, and merged where the result is fetched."""

from __future__ import annotations

from typing import Any

import msgspec

PARTS_LIMIT_BYTES = 1 << 20
"""What a job's kept parts may hold in all (the size of a job state's accumulator)."""

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(list[tuple[int, bytes]])


def parts_of(acc: bytes) -> list[tuple[int, bytes]]:
    """``(unit_start, partial)`` in unit order; an empty accumulator has none."""
    return _dec.decode(acc) if acc else []


def add_part(acc: bytes, unit_start: int, partial: bytes) -> bytes:
    """``acc`` with one more part. ``ValueError`` when the parts would pass ``PARTS_LIMIT_BYTES``:
    a workload with large partial results returns them as checkpoint blobs (kept in the object
    store, only their references here)."""
    got = parts_of(acc)
    got.append((unit_start, partial))
    got.sort(key=lambda p: p[0])
    out = _enc.encode(got)
    if len(out) > PARTS_LIMIT_BYTES:
        raise ValueError(
            f"the job's unmerged partial results would take {len(out)} bytes, over {PARTS_LIMIT_BYTES}: "
            "return large partial results as checkpoint blobs (sja.workloads.checkpoint.pack_blob)"
        )
    return out


def count_parts(acc: bytes) -> int:
    return len(parts_of(acc))


def combine(w: Any, params: dict[str, Any], acc: bytes, *, sequential: bool) -> dict[str, Any]:
    """The job's result from what the control plane kept: the parts merged in unit order, then the
    workload's ``finalize``. Runs the workload's code: only where the result is fetched (the tenant's
    own ``sja result``). ``ValueError`` says what the code did wrong."""
    try:
        if sequential:
            merged = acc
        else:
            merged = b""
            for _, partial in parts_of(acc):
                merged = w.merge(merged, partial)
                if not isinstance(merged, bytes):
                    raise TypeError(f"merge returned {type(merged).__name__}, not bytes")
        result = w.finalize(params, merged)
    except Exception as e:
        raise ValueError(f"the workload's merge or finalize failed: {type(e).__name__}: {e}") from None
    if not isinstance(result, dict):
        raise ValueError(f"the workload's finalize returned {type(result).__name__}, not a map")
    return result


__all__ = ["PARTS_LIMIT_BYTES", "add_part", "combine", "count_parts", "parts_of"]
