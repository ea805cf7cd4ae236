"""Run one subjob in the current process and measure it. Used inside the slice's Ray actor.

Where peak memory comes from depends on where the workload allocates (``sja.execution.meters``):
Python and NumPy workloads are measured with ``tracemalloc``; PyTorch workloads on a GPU with the
CUDA allocator's peak (and NVML's per-process accounting where the driver gives it), on the CPU
with the process's resident high-water mark.

On a GPU the slice's memory is a hard limit: a MIG instance has only its own memory, and a soft
slice is held to its share with ``torch.cuda.set_per_process_memory_fraction``; going past it
raises CUDA's out-of-memory error, reported ``oom`` with the peak reached, after which the
allocator's cache is emptied so the actor serves the next subjob. Elsewhere (an emulated slice, a
CPU) the cap is enforced after the fact: a subjob whose peak exceeded it is reported ``oom`` and its
result discarded, as a real slice would have failed it. A ``MemoryError`` is an OOM too. Any other
exception is ``failed``.
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import msgspec

from sja import job
from sja.execution import warm
from sja.execution.meters import Meter, NvmlProcessMeter, RssMeter, TorchCudaMeter, TracemallocMeter
from sja.protocol.messages import OUTPUT_TAIL_CHARS, Completion, Subjob
from sja.workloads import workload
from sja.workloads.command import DEFAULT_STOP_GRACE_S


class RunResult(msgspec.Struct, frozen=True, kw_only=True):
    status: str
    units_done: int
    peak_mem_mib: float
    duration_s: float
    started_at: float
    finished_at: float
    output: bytes = b""
    error: str = ""
    device: str = "cpu"
    """Where the subjob computed: ``cpu`` or ``cuda`` (the slice's device)."""
    meter: str = ""
    """What measured ``peak_mem_mib`` (``tracemalloc``, ``rss``, ``torch.cuda``, ``nvml``)."""
    node_id: str = ""
    """The Ray node the actor ran on."""
    stdout: str = ""
    stderr: str = ""
    """The end of a command's output (``OUTPUT_TAIL_CHARS`` of each)."""
    warm: str = ""
    """A warm command job's range: ``cold``, ``handed`` or ``resumed`` (``sja.execution.warm``)."""


def completion_of(sj: Subjob, r: RunResult, executor_id: str = "") -> Completion:
    """The completion that reports ``r``, the run of ``sj`` (an error cut to 4,000 characters, the
    program's output to ``OUTPUT_TAIL_CHARS`` of each stream)."""
    return Completion(
        subjob_id=sj.subjob_id,
        job_id=sj.job_id,
        grant_id=sj.grant_id,
        fence=sj.fence,
        slice_id=sj.slice_id,
        status=r.status,  # type: ignore[arg-type]
        unit_start=sj.unit_start,
        units=sj.units,
        units_done=r.units_done,
        peak_mem_mib=r.peak_mem_mib,
        duration_s=r.duration_s,
        mem_cap_mib=sj.mem_cap_mib,
        time_cap_s=sj.time_cap_s,
        started_at=r.started_at,
        finished_at=r.finished_at,
        output_checkpoint=r.output,
        error=r.error[:4000],
        executor_id=executor_id,
        stdout=r.stdout[-OUTPUT_TAIL_CHARS:],
        stderr=r.stderr[-OUTPUT_TAIL_CHARS:],
    )


def is_oom(e: BaseException) -> bool:
    """An allocation failure: ``MemoryError``, CUDA's ``OutOfMemoryError``, an allocator's message."""
    if isinstance(e, MemoryError) or type(e).__name__ == "OutOfMemoryError":
        return True
    text = str(e)
    return isinstance(e, RuntimeError) and (
        "CUDA out of memory" in text or "can't allocate memory" in text or "out of memory" in text.lower()
    )


OOM_KILL_MARKERS = ("running low on memory", "memory usage threshold", "killed by the memory monitor")
"""How an execution engine says it killed a worker for memory (Ray's memory monitor)."""


def failure_status(e: BaseException) -> str:
    """The status of a subjob whose run failed outside the workload (its actor, or the engine around
    it): ``oom`` for an allocation failure (``is_oom``), an engine's out-of-memory error (any class
    named ``OutOfMemoryError``, as Ray's), or a worker killed for memory; else ``failed``. Wrapped
    causes (``cause``, ``__cause__``) are looked at too. Pure: no engine is imported."""
    seen: set[int] = set()
    current: BaseException | None = e
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if is_oom(current) or any(c.__name__ == "OutOfMemoryError" for c in type(current).__mro__):
            return "oom"
        text = str(current)[:10_000].lower()
        if any(marker in text for marker in OOM_KILL_MARKERS):
            return "oom"
        cause = getattr(current, "cause", None)
        current = cause if isinstance(cause, BaseException) else current.__cause__
    return "failed"


class _Device:
    """The device a subjob runs on and how it is measured and capped."""

    def __init__(self, meters: list[Meter], device: str, enforced: bool, torch: Any = None) -> None:
        self.meters = meters
        self.device = device
        self.enforced = enforced
        """The cap is held by the device itself (an allocation past it fails)."""
        self.torch = torch


def _torch_cuda(torch: Any) -> bool:
    try:
        return bool(torch.cuda.is_available())
    except Exception:
        return False


def prepare_device(framework: str, mem_cap_mib: int, nvml: Any = None) -> _Device:
    """Meters and cap for a workload of ``framework`` (``numpy``, ``torch``) under ``mem_cap_mib``."""
    if framework == "command":
        return _Device([], "cpu", enforced=False)  # its own processes are measured (``program``)
    if framework != "torch":
        return _Device([TracemallocMeter()], "cpu", enforced=False)
    from sja.workloads.torch_common import import_torch

    torch = import_torch()
    if not _torch_cuda(torch):
        return _Device([RssMeter()], "cpu", enforced=False, torch=torch)
    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, mem_cap_mib * 1024 * 1024 / total)
    torch.cuda.set_per_process_memory_fraction(fraction, 0)
    meters: list[Meter] = [TorchCudaMeter(torch)]
    device_uuid = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    if nvml is None and device_uuid:
        from sja.inventory.nvml import load_nvml

        nvml = load_nvml()
    if nvml is not None and device_uuid:
        meters.append(NvmlProcessMeter(nvml, device_uuid))
    return _Device(meters, "cuda", enforced=True, torch=torch)


def _start(meters: list[Meter]) -> list[Meter]:
    started = []
    for m in meters:
        try:
            m.start()
        except Exception:
            continue  # a meter that cannot read this device (NVML without it) is left out
        started.append(m)
    return started


def _peak(meters: list[Meter]) -> tuple[float, str]:
    best, name = 0.0, ""
    for m in meters:
        try:
            value = m.stop()
        except Exception:
            continue
        if value > best or not name:
            best, name = value, m.name
    return best, name


def subjob_context(sj: Subjob, params: dict[str, Any], total_units: int, started: float) -> job.Context:
    """What ``sja.job.context()`` gives the subjob's code (and the ``command`` contract's variables)."""
    grace = params.get("stop_grace_s", DEFAULT_STOP_GRACE_S)
    grace = float(grace) if isinstance(grace, int | float) and not isinstance(grace, bool) else 0.0
    return job.Context(
        job_id=sj.job_id,
        subjob_id=sj.subjob_id,
        unit_start=sj.unit_start,
        count=sj.units,
        total_units=total_units,
        attempt=sj.attempt,
        deadline=started + sj.time_cap_s,
        stop_grace_s=min(grace, sj.time_cap_s / 2),
        slice_id=sj.slice_id,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        mem_cap_mib=sj.mem_cap_mib,
    )


def _failed(started: float, error: str) -> RunResult:
    now = time.time()
    return RunResult(
        status="failed",
        units_done=0,
        peak_mem_mib=0.0,
        duration_s=round(now - started, 6),
        started_at=started,
        finished_at=now,
        error=error[:4000],
    )


def run_subjob(sj: Subjob, nvml: Any = None) -> RunResult:
    started = time.time()
    # A program kept warm for another job (or another slice) holds memory this subjob may need.
    warm.evict_except(sj.job_id, sj.slice_id)
    try:
        w = workload(sj.workload)
        params = w.validate(dict(sj.params))
        total = w.total_units(params)
    except Exception as e:
        return _failed(started, f"workload {sj.workload!r} not usable on this node: {type(e).__name__}: {e}")
    framework = getattr(w, "framework", "numpy")
    dev = prepare_device(framework, sj.mem_cap_mib, nvml=nvml)
    ctx = subjob_context(sj, params, total, started)
    meters = _start(dev.meters)
    t0 = time.perf_counter()
    status, output, error = "ok", b"", ""
    job.set_current(ctx)
    try:
        output = w.run(params, sj.unit_start, sj.units, sj.input_checkpoint)
        if not isinstance(output, bytes):
            status, output = "failed", b""
            error = f"the workload's run returned {type(output).__name__}, not bytes"
    except job.Stopped as e:
        status, error = (e.status if e.status in ("oom", "timeout") else "failed"), e.error
    except Exception as e:
        if isinstance(e, MemoryError):
            status, error = "oom", "MemoryError"
        elif is_oom(e):
            status, error = "oom", f"{type(e).__name__}: {str(e)[:1000]}"
        else:
            status, error = "failed", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"
    finally:
        job.set_current(None)
    duration = time.perf_counter() - t0
    peak_mib, meter = _peak(meters)
    if framework == "command":
        # The program's own process tree was measured while it ran (``ProcessTreeMeter``).
        peak_mib, meter = ctx.peak_mem_mib, "rss-tree"
        dev.device = "cuda" if ctx.cuda_visible_devices else "cpu"
    if dev.torch is not None and dev.device == "cuda":
        # Give the cache back: the next subjob on this slice starts from an empty allocator.
        dev.torch.cuda.empty_cache()
    if status == "ok" and not dev.enforced and peak_mib > sj.mem_cap_mib:
        status, output = "oom", b""
        error = f"peak {peak_mib:.1f} MiB exceeded the slice's {sj.mem_cap_mib} MiB"
    elif status == "oom" and not error.startswith("MemoryError"):
        error = f"{error} (peak {peak_mib:.1f} MiB of the slice's {sj.mem_cap_mib} MiB)"
    return RunResult(
        status=status,
        units_done=(sj.units if ctx.units_done is None else ctx.units_done) if status == "ok" else 0,
        peak_mem_mib=round(peak_mib, 3),
        duration_s=round(duration, 6),
        started_at=started,
        finished_at=time.time(),
        output=output,
        error=error,
        device=dev.device,
        meter=meter,
        warm=ctx.warm,
        stdout=ctx.stdout_tail[-OUTPUT_TAIL_CHARS:],
        stderr=ctx.stderr_tail[-OUTPUT_TAIL_CHARS:],
    )
