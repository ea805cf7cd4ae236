"""Run one subjob and measure it. Used inside the slice's Ray actor.

Tenant code never runs in the actor: ``run_subjob`` starts it in a sandbox (``sja.execution.sandbox``)
and supervises it (its deadline, its memory on an emulated slice, its result). A ``command`` job's
program is started directly (``sja.execution.commands``); a Python workload (built-in or the
tenant's own) runs in ``python -m sja.execution.child``, which calls ``run_workload`` on a request
file of its work directory and writes its ``RunResult`` next to it. That result is untrusted: the
actor decodes it with a size limit and checks each field (``check_result``); a process that wrote
none, or garbage, fails its own subjob saying so.

``run_workload`` runs a subjob in the current process:

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

import math
import os
import signal
import stat
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import msgspec

from sja import job
from sja.core.stopping import stop_grace
from sja.execution import commands, stopclock, warm
from sja.execution import sandbox as sbx
from sja.execution.meters import Meter, NvmlProcessMeter, RssMeter, TorchCudaMeter, TracemallocMeter
from sja.execution.program import last_lines, start_program, watch
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
    yielded: bool = False
    """An open subjob asked to yield (``core.continuation``)."""
    final: bool = False
    """A failure no retry can mend (``job.Stopped.final``): the job fails at once."""


_result_dec = msgspec.msgpack.Decoder(RunResult)


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
        yielded=r.yielded,
        final=r.final and r.status == "failed",
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
    open_ = sj.max_units > sj.units  # goes on past its window until asked to yield
    return job.Context(
        job_id=sj.job_id,
        subjob_id=sj.subjob_id,
        unit_start=sj.unit_start,
        count=sj.max_units if open_ else sj.units,
        total_units=total_units,
        attempt=sj.attempt,
        deadline=math.inf if open_ else started + sj.time_cap_s,
        continues=open_,
        stop_grace_s=stop_grace(sj.time_cap_s, sj.first_unit_s, grace),
        first_unit_s=sj.first_unit_s,
        slice_id=sj.slice_id,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        mem_cap_mib=sj.mem_cap_mib,
    )


def nothing_done(
    status: str,
    started: float,
    error: str,
    *,
    now: float | None = None,
    timed: bool = True,
    final: bool = False,
) -> RunResult:
    """A run that did no unit (it failed, was lost or stopped before any): ``timed`` counts its
    duration from ``started``; a run that never began has none."""
    at = time.time() if now is None else now
    return RunResult(
        status=status,
        units_done=0,
        peak_mem_mib=0.0,
        duration_s=round(at - started, 6) if timed else 0.0,
        started_at=started,
        finished_at=at,
        error=error[:4000],
        final=final,
    )


def _failed(started: float, error: str) -> RunResult:
    return nothing_done("failed", started, error)


STATUSES = ("ok", "oom", "timeout", "failed")
DEVICES = ("cpu", "cuda")
KILL_AFTER_S = 0.1
"""How long after its deadline (and ``SIGTERM``) a Python workload's process is killed."""


class ChildRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What ``sja.execution.child`` is given (a file of its work directory): the subjob, its input
    checkpoint included, and when it started."""

    subjob: Subjob
    """The subjob, without its input checkpoint (a subjob's field holds no more than a message)."""
    checkpoint: bytes = b""
    """Its input checkpoint: the full state the executor fetched, however large."""
    started: float


def run_subjob(sj: Subjob, nvml: Any = None, code_dir: str = "") -> RunResult:
    """Run ``sj`` in its sandbox and supervise it (the slice's actor calls it); ``code_dir``: the
    job's code, unpacked on this node (``sja.execution.code``)."""
    started = time.time()
    # A program kept warm for another job (or another slice) holds memory this subjob may need.
    warm.evict_except(sj.job_id, sj.slice_id)
    if sj.workload == "command":
        # Its program is started in a sandbox.
        return run_workload(sj, nvml, started=started, code_dir=code_dir)
    return run_sandboxed(sj, started)


def run_sandboxed(sj: Subjob, started: float) -> RunResult:
    """A Python workload's subjob in ``python -m sja.execution.child``, in the subjob's sandbox."""
    box = sbx.current()
    try:
        work = box.workdir(f"{sj.job_id}-{sj.subjob_id}")
    except (OSError, sbx.SandboxError) as e:
        return _failed(started, f"no work directory for the subjob: {e}")
    try:
        request, result = work / "request.msgpack", work / "result.msgpack"
        bare = msgspec.structs.replace(sj, input_checkpoint=b"")
        request.write_bytes(
            msgspec.msgpack.encode(ChildRequest(subjob=bare, checkpoint=sj.input_checkpoint, started=started))
        )
        box.own(work)
        cuda = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        contract = {
            "SJA_SLICE_ID": sj.slice_id,
            "SJA_JOB_ID": sj.job_id,
            "SJA_SUBJOB_ID": sj.subjob_id,
            "CUDA_VISIBLE_DEVICES": cuda,
        }
        if os.environ.get("PYTHONPATH"):
            contract["PYTHONPATH"] = os.environ["PYTHONPATH"]
        env = sbx.environment(contract, {}, box.settings.env, home=box.home(work))
        argv = [
            sys.executable,
            "-m",
            "sja.execution.child",
            box.inside(work, request),
            box.inside(work, result),
        ]
        try:
            running = start_program(argv, env, sandbox=box, work=work, cwd=None)
        except (OSError, sbx.SandboxError) as e:
            return _failed(started, f"the workload's process did not start: {e}")
        deadline = started + sj.time_cap_s
        # NVML names processes by their host pids, which the sandboxed process cannot know: its GPU
        # memory is sampled here (the CUDA context included), beside what it measures itself.
        nvml_handle, device = commands.nvml_for(cuda)
        r = watch(
            running,
            term_at=deadline,
            kill_at=deadline + KILL_AFTER_S,
            nvml=nvml_handle,
            device_uuid=device,
            mem_cap_bytes=commands.mem_cap_bytes(sj.mem_cap_mib, cuda, box.settings.python_mib),
        )
        now = time.time()
        tail = last_lines(r.stderr) or last_lines(r.stdout)
        base: dict[str, Any] = dict(
            units_done=0,
            duration_s=round(now - started, 6),
            started_at=started,
            finished_at=now,
            stdout=r.stdout[-OUTPUT_TAIL_CHARS:],
            stderr=r.stderr[-OUTPUT_TAIL_CHARS:],
        )
        if r.over_cap_mib:
            return RunResult(
                status="oom",
                peak_mem_mib=round(r.over_cap_mib, 3),
                meter="rss-tree",
                error=(
                    f"stopped: the workload's process's resident memory {r.over_cap_mib:.1f} MiB exceeded "
                    f"the slice's {sj.mem_cap_mib} MiB (with {box.settings.python_mib:g} MiB for the "
                    "interpreter)"
                ),
                **base,
            )
        if r.signalled == "kill":
            return RunResult(
                status="timeout",
                peak_mem_mib=0.0,
                error=f"exceeded the window of {sj.time_cap_s:.2f}s",
                **base,
            )
        raw = read_result(result, box.settings.result_max_mib)
        if r.signalled == "term" and isinstance(raw, str) and r.returncode == -signal.SIGTERM:
            # SJA's stop signal at the deadline ended it (still starting, or not stopping at a unit's
            # end) before it wrote a result: the window was too short, not a failure of the workload.
            return RunResult(
                status="timeout",
                peak_mem_mib=0.0,
                error=f"stopped at the window's end ({sj.time_cap_s:.2f}s) before it wrote a result. "
                f"Last output:\n{tail}",
                **base,
            )
        got = check_result(sj, raw, r.returncode, tail)
        if r.gpu_peak_mib > got.peak_mem_mib:
            got = msgspec.structs.replace(got, peak_mem_mib=round(r.gpu_peak_mib, 3), meter="nvml")
        return msgspec.structs.replace(
            got, started_at=started, finished_at=now, stdout=base["stdout"], stderr=base["stderr"]
        )
    finally:
        sbx.remove_workdir(work)


def read_result(path: Path, max_mib: float) -> bytes | str:
    """The bytes a workload's process left as its result, or why there are none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return "it wrote no result"
    except OSError as e:
        return f"its result is not readable: {e}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "its result is not a regular file"
        limit = int(max_mib * 1024 * 1024)
        if st.st_size > limit:
            return f"its result is {st.st_size} bytes, over the limit of {limit}"
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)[:limit]
    except OSError as e:
        return f"its result is not readable: {e}"
    finally:
        os.close(fd)


def check_result(sj: Subjob, raw: bytes | str, returncode: int, tail: str) -> RunResult:
    """A workload process's result as its subjob may report it: decoded, each field checked; a
    result that is missing or not one fails the subjob with the reason."""
    now = time.time()
    how = f"killed by signal {-returncode}" if returncode < 0 else f"exited with {returncode}"
    if isinstance(raw, str) and returncode == -signal.SIGXFSZ:
        return _failed(
            now,
            "the workload's process was killed by SIGXFSZ: a file passed the sandbox's size limit. "
            f"Last output:\n{tail}",
        )
    if isinstance(raw, str):
        oom = returncode == -9 or any(m in tail for m in ("MemoryError", "Cannot allocate memory"))
        r = _failed(now, f"the workload's process {how} and {raw}. Last output:\n{tail}")
        return msgspec.structs.replace(r, status="oom") if oom else r
    try:
        got = _result_dec.decode(raw)
    except msgspec.DecodeError as e:
        return _failed(now, f"the workload's process ({how}) wrote a result that is not one: {e}")
    status = got.status if got.status in STATUSES else "failed"
    done = got.units_done if 0 <= got.units_done <= sj.units else 0
    if status == "ok" and got.units_done != done:
        status = "failed"
    peak = got.peak_mem_mib if math.isfinite(got.peak_mem_mib) and got.peak_mem_mib >= 0 else 0.0
    duration = got.duration_s if math.isfinite(got.duration_s) and got.duration_s >= 0 else 0.0
    error = got.error[:4000]
    if status == "failed" and got.status != "failed":
        error = f"the workload's process reported status {got.status[:40]!r}, units_done {got.units_done}"
    return RunResult(
        status=status,
        units_done=done if status == "ok" else 0,
        peak_mem_mib=peak,
        duration_s=duration,
        started_at=now,
        finished_at=now,
        output=got.output if status == "ok" else b"",
        error=error,
        device=got.device if got.device in DEVICES else "cpu",
        meter=got.meter[:32],
    )


def run_workload(sj: Subjob, nvml: Any = None, started: float | None = None, code_dir: str = "") -> RunResult:
    """Run ``sj`` in this process (``sja.execution.child`` calls it, in the subjob's sandbox)."""
    started = time.time() if started is None else started
    try:
        w = workload(sj.workload)
        params = w.validate(dict(sj.params))
        total = w.total_units(params)
    except Exception as e:
        return _failed(started, f"workload {sj.workload!r} not usable on this node: {type(e).__name__}: {e}")
    framework = getattr(w, "framework", "numpy")
    dev = prepare_device(framework, sj.mem_cap_mib, nvml=nvml)
    ctx = subjob_context(sj, params, total, started)
    clock = stopclock.StopClock(window_end=started + sj.time_cap_s)
    if ctx.continues:
        # An open subjob: no deadline until it is asked to yield (``SliceActor.yield_subjob``).
        stopclock.register(sj.subjob_id, clock)
    ctx.code_dir = code_dir
    meters = _start(dev.meters)
    t0 = time.perf_counter()
    status, output, error = "ok", b"", ""
    final = False
    job.set_current(ctx)
    try:
        output = w.run(params, sj.unit_start, ctx.count, sj.input_checkpoint)
        if not isinstance(output, bytes):
            status, output = "failed", b""
            error = f"the workload's run returned {type(output).__name__}, not bytes"
    except job.Stopped as e:
        status, error = (e.status if e.status in ("oom", "timeout") else "failed"), e.error
        final = e.final and status == "failed"
    except Exception as e:
        if isinstance(e, MemoryError):
            status, error = "oom", "MemoryError"
        elif is_oom(e):
            status, error = "oom", f"{type(e).__name__}: {str(e)[:1000]}"
        else:
            status, error = "failed", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=5)}"
    finally:
        job.set_current(None)
        stopclock.unregister(sj.subjob_id)
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
        units_done=(ctx.count if ctx.units_done is None else ctx.units_done) if status == "ok" else 0,
        peak_mem_mib=round(peak_mib, 3),
        duration_s=round(duration, 6),
        started_at=started,
        finished_at=time.time(),
        output=output,
        error=error,
        device=dev.device,
        meter=meter,
        warm=ctx.warm,
        yielded=clock.yielded_at > 0,
        stdout=ctx.stdout_tail[-OUTPUT_TAIL_CHARS:],
        stderr=ctx.stderr_tail[-OUTPUT_TAIL_CHARS:],
        final=final,
    )
