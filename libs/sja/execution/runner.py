"""Run one subjob in the current process and measure it. Used inside the slice's Ray actor.

Peak memory is what the subjob allocated through Python and NumPy (``tracemalloc``), on top of the
process's steady state. On an emulated slice (no GPU) the slice's memory cap is enforced after the
fact: a subjob whose peak exceeded the cap is reported ``oom`` and its result discarded, as a real
slice would have failed it. A ``MemoryError`` is an OOM too. Any other exception is ``failed``.
"""

from __future__ import annotations

import time
import traceback
import tracemalloc

import msgspec

from sja.protocol.messages import Subjob
from sja.workloads import workload

_MIB = 1024.0 * 1024.0


class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    status: str
    units_done: int
    peak_mem_mib: float
    duration_s: float
    started_at: float
    finished_at: float
    output: bytes = b""
    error: str = ""


def run_subjob(sj: Subjob) -> RunResult:
    w = workload(sj.workload)
    params = w.validate(dict(sj.params))
    if not tracemalloc.is_tracing():
        tracemalloc.start()
    tracemalloc.clear_traces()
    tracemalloc.reset_peak()
    base, _ = tracemalloc.get_traced_memory()
    started = time.time()
    t0 = time.perf_counter()
    status, output, error = "ok", b"", ""
    try:
        output = w.run(params, sj.unit_start, sj.units, sj.input_checkpoint)
    except MemoryError:
        status, error = "oom", "MemoryError"
    except Exception as e:
        status, error = "failed", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"
    duration = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    peak_mib = max(peak - base, 0) / _MIB
    if status == "ok" and peak_mib > sj.mem_cap_mib:
        status, output = "oom", b""
        error = f"peak {peak_mib:.1f} MiB exceeded the slice's {sj.mem_cap_mib} MiB"
    return RunResult(
        status=status,
        units_done=sj.units if status == "ok" else 0,
        peak_mem_mib=round(peak_mib, 3),
        duration_s=round(duration, 6),
        started_at=started,
        finished_at=time.time(),
        output=output,
        error=error,
    )
