"""How a subjob's peak memory is measured, by where it allocates.

- ``TracemallocMeter``: Python and NumPy allocations (the built-in CPU workloads). Exact, and
  unaffected by what the rest of the process holds.
- ``RssMeter``: the process's resident high-water mark, reset before the subjob (Linux
  ``/proc/self/clear_refs``), for frameworks whose CPU allocator ``tracemalloc`` does not see
  (PyTorch on the CPU). Falls back to sampling the resident size where the reset is refused.
- ``TorchCudaMeter``: the CUDA caching allocator's peak (``torch.cuda.max_memory_reserved``: what
  the subjob took from the slice; ``max_memory_allocated`` is kept alongside).
- ``NvmlProcessMeter``: NVML's per-process accounting on the slice's device
  (``nvmlDeviceGetComputeRunningProcesses``), sampled: it sees the CUDA context and any allocator,
  where the driver reports it (not for MIG devices without privileges).
- ``ProcessTreeMeter``: a program run under the ``command`` contract: the resident size of its
  process and all its descendants (``psutil``), summed and sampled, and with NVML the GPU memory
  those processes hold on the slice's device.

A meter is started, the subjob runs, ``stop()`` returns the peak in MiB above the start.
"""

from __future__ import annotations

import contextlib
import os
import threading
import tracemalloc
from typing import Any, Protocol

_MIB = 1024.0 * 1024.0


class Meter(Protocol):
    name: str

    def start(self) -> None: ...

    def stop(self) -> float:
        """Peak MiB used since ``start``."""


class TracemallocMeter:
    name = "tracemalloc"

    def __init__(self) -> None:
        self._base = 0
        self._started = False

    def start(self) -> None:
        # Tracing slows every allocation of the process several times over: it runs only while a
        # subjob is measured, unless something else in the process had it on already.
        self._started = not tracemalloc.is_tracing()
        if self._started:
            tracemalloc.start()
        tracemalloc.clear_traces()
        tracemalloc.reset_peak()
        self._base, _ = tracemalloc.get_traced_memory()

    def stop(self) -> float:
        _, peak = tracemalloc.get_traced_memory()
        if self._started:
            tracemalloc.stop()
            self._started = False
        return max(peak - self._base, 0) / _MIB


def _status_kib(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(f"{field} not in /proc/self/status")


class _Sampler:
    """Calls ``read()`` every ``interval_s`` on a thread and keeps the maximum."""

    def __init__(self, read: Any, interval_s: float) -> None:
        self.read = read
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _sample(self) -> None:
        try:
            value = self.read()
        except Exception:
            return
        if value is not None and value > self.peak:
            self.peak = value

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> None:
        self._sample()
        self._thread = threading.Thread(target=self._loop, name="sja-meter", daemon=True)
        self._thread.start()

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._sample()
        return self.peak


class RssMeter:
    name = "rss"

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self._base_kib = 0
        self._sampler: _Sampler | None = None

    def start(self) -> None:
        self._base_kib = _status_kib("VmRSS")
        try:
            # "5" resets the peak resident size (VmHWM) to the current one.
            with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
                f.write("5")
            self._sampler = None
        except OSError:
            self._sampler = _Sampler(lambda: _status_kib("VmRSS"), self.interval_s)
            self._sampler.start()

    def stop(self) -> float:
        peak_kib = self._sampler.stop() if self._sampler is not None else _status_kib("VmHWM")
        return max(peak_kib - self._base_kib, 0) * 1024 / _MIB


class TorchCudaMeter:
    name = "torch.cuda"

    def __init__(self, torch: Any) -> None:
        self.torch = torch
        self.allocated_mib = 0.0

    def start(self) -> None:
        self.torch.cuda.synchronize()
        self.torch.cuda.empty_cache()
        self.torch.cuda.reset_peak_memory_stats()

    def stop(self) -> float:
        cuda = self.torch.cuda
        # After an error the stream may refuse to synchronize; the counters still hold.
        with contextlib.suppress(Exception):
            cuda.synchronize()
        self.allocated_mib = cuda.max_memory_allocated() / _MIB
        return float(cuda.max_memory_reserved() / _MIB)


class NvmlProcessMeter:
    """Peak memory NVML accounts to this process on one device (MIG or GPU UUID), sampled."""

    name = "nvml"

    def __init__(self, nvml: Any, device_uuid: str, pid: int | None = None, interval_s: float = 0.02) -> None:
        self.nvml = nvml
        self.device_uuid = device_uuid
        self.pid = os.getpid() if pid is None else pid
        self.interval_s = interval_s
        self._handle: Any = None
        self._sampler: _Sampler | None = None
        self.available = False

    def _read(self) -> int | None:
        used = None
        for p in self.nvml.nvmlDeviceGetComputeRunningProcesses(self._handle):
            if p.pid == self.pid and p.usedGpuMemory is not None:
                used = int(p.usedGpuMemory)
                self.available = True
        return used

    def _find(self) -> Any:
        for i in range(self.nvml.nvmlDeviceGetCount()):
            gpu = self.nvml.nvmlDeviceGetHandleByIndex(i)
            if _text(self.nvml.nvmlDeviceGetUUID(gpu)) == self.device_uuid:
                return gpu
            try:
                count = self.nvml.nvmlDeviceGetMaxMigDeviceCount(gpu)
            except self.nvml.NVMLError:
                continue
            for j in range(count):
                try:
                    mig = self.nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, j)
                except self.nvml.NVMLError:
                    continue
                if _text(self.nvml.nvmlDeviceGetUUID(mig)) == self.device_uuid:
                    return mig
        raise LookupError(f"no NVML device {self.device_uuid}")

    def start(self) -> None:
        self.nvml.nvmlInit()
        self._handle = self._find()
        self._sampler = _Sampler(self._read, self.interval_s)
        self._sampler.start()

    def stop(self) -> float:
        try:
            peak = self._sampler.stop() if self._sampler is not None else 0
        finally:
            self.nvml.nvmlShutdown()
        return peak / _MIB


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class ProcessTreeMeter:
    """Peak resident memory of a process and its descendants, summed per sample (``psutil``), and
    with ``nvml`` and a device the peak of GPU memory NVML accounts to them on that device. Every
    process seen is remembered (``seen``), so that those left behind can be stopped at the end.

    ``exclude``: pids of the tree that are not the program (its sandbox's ``unshare`` and pid 1),
    left out of the sum. ``cap_bytes``: once a sample's sum passes it, ``on_over`` is called (once)
    and ``over`` is set: the subjob is stopped while it runs, not only judged after the fact."""

    name = "rss-tree"

    def __init__(
        self,
        pid: int,
        nvml: Any = None,
        device_uuid: str = "",
        interval_s: float = 0.05,
        *,
        exclude: set[int] | None = None,
        cap_bytes: float = 0.0,
        on_over: Any = None,
    ) -> None:
        import psutil

        self._psutil = psutil
        self.root = psutil.Process(pid)
        self.nvml = nvml
        self.device_uuid = device_uuid
        self.interval_s = interval_s
        self.exclude = set(exclude or ())
        self.cap_bytes = cap_bytes
        self.on_over = on_over
        self.over = 0
        """The resident bytes that passed ``cap_bytes`` (0: never passed)."""
        self.seen: dict[int, Any] = {pid: self.root}
        self.gpu_peak = 0
        self._gpu: NvmlProcessMeter | None = None
        self._sampler: _Sampler | None = None

    def processes(self) -> list[Any]:
        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except self._psutil.Error:
            procs = []
        for p in procs:
            self.seen.setdefault(p.pid, p)
        return procs

    def _read(self) -> int:
        total = 0
        procs = self.processes()
        for p in procs:
            if p.pid in self.exclude:
                continue
            try:
                total += p.memory_info().rss
            except self._psutil.Error:
                continue
        if self.cap_bytes and total > self.cap_bytes and not self.over:
            self.over = total
            if self.on_over is not None:
                with contextlib.suppress(Exception):
                    self.on_over()
        if self._gpu is not None:
            pids = {p.pid for p in procs}
            used = 0
            try:
                for gp in self.nvml.nvmlDeviceGetComputeRunningProcesses(self._gpu._handle):
                    if gp.pid in pids and gp.usedGpuMemory is not None:
                        used += int(gp.usedGpuMemory)
            except Exception:
                used = 0
            self.gpu_peak = max(self.gpu_peak, used)
        return total

    def start(self) -> None:
        if self.nvml is not None and self.device_uuid:
            gpu = NvmlProcessMeter(self.nvml, self.device_uuid)
            try:
                self.nvml.nvmlInit()
                gpu._handle = gpu._find()
                self._gpu = gpu
            except Exception:
                self._gpu = None
        self._sampler = _Sampler(self._read, self.interval_s)
        self._sampler.start()

    def stop(self) -> float:
        """The larger of the resident and the GPU peak, in MiB."""
        peak = self._sampler.stop() if self._sampler is not None else 0
        if self._gpu is not None:
            with contextlib.suppress(Exception):
                self.nvml.nvmlShutdown()
        return max(peak, self.gpu_peak) / _MIB

    @property
    def rss_peak_mib(self) -> float:
        return (self._sampler.peak if self._sampler is not None else 0) / _MIB
