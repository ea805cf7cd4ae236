"""A fake NVML: the subset of ``pynvml`` that discovery, measurement and re-cutting call, answering as
real GPUs do.

Scenarios reproduce the shape of real answers: device names such as ``NVIDIA H100 80GB HBM3`` and
``NVIDIA H100 80GB HBM3 MIG 1g.10gb``, ``GPU-<uuid>`` and ``MIG-<uuid>`` identifiers, memory in
bytes, ``nvmlDeviceGetMigMode`` as ``[current, pending]``, GPU instance profile ids as
``nvidia-smi mig -lgip`` lists them (19 for 1g, 20 for 1g+me, 14 for 2g, 9 for 3g, 5 for 4g, 0 for
7g, 15 for the two-memory-slice 1g; the A30's own: 14, 21, 5, 6, 0), compute instance profile ids
as ``-lcip`` does (0 for 1c, 1 for 2c, 2 for 3c, 3 for 4c, 4 for 7c) and placements in memory-slice
units. Errors are the real ``pynvml.NVMLError`` subclasses with their codes: a missing driver raises
``NVMLError_LibraryNotFound`` from ``nvmlInit``, a lost GPU raises ``NVMLError_GpuIsLost`` from
every query on it.

Instances change as the driver changes them. ``nvmlDeviceGetGpuInstances`` and
``nvmlGpuInstanceGetComputeInstances`` fill a ctypes array of handles through a pointer to its
count, as the C functions do (the fake's handle types are ``ctypes.py_object``, so the same array
code runs on both); ``nvmlDeviceCreateGpuInstanceWithPlacement`` takes a pointer to a real
``c_nvmlGpuInstancePlacement_t`` (a structure passed by value is refused, as it would crash the
driver); each compute instance is a MIG device (``MIG 3g.40gb``, or ``MIG 1c.3g.40gb`` for one of
several in a 3g.40gb) that ``nvmlDeviceGetMigDeviceHandleByIndex`` lists, with a new ``MIG-`` UUID
each time one is created. The driver's refusals: ``InsufficientResources`` for a GPU instance that
overlaps another (or exceeds its profile's count, the GPU's compute slices or its one set of media
engines), ``InvalidArgument`` for a start the profile does not offer, ``InUse`` destroying a
compute instance a process runs on or a GPU instance that still holds compute instances.

| scenario | what it holds | re-cutting (instance changes) |
|---|---|---|
| ``h100-mig`` | one H100 80GB HBM3, MIG on: 2g.20gb@0, 1g.10gb@2, 1g.10gb@3, 3g.40gb@4 | allowed |
| ``h100-nomig`` | one H100 80GB HBM3, MIG off | ``NotSupported`` |
| ``a100-40gb`` | one A100-SXM4-40GB, MIG on: 2g.10gb@0, 1g.5gb@2, 1g.5gb@3, 3g.20gb@4 | allowed |
| ``a100-me`` | one A100-SXM4-40GB, MIG on: 1g.5gb+me@0, 1g.5gb@1, 2g.10gb@2, 3g.20gb@4 | allowed |
| ``node`` | the three above on one node (indices 0, 1, 2) | as above |
| ``mig-pending`` | an H100 whose MIG mode is on after a GPU reset (whole until then) | ``NotSupported`` |
| ``unprivileged`` | ``h100-mig`` as a non-root user sees it | ``NoPermission`` (and instance queries) |
| ``gpu-lost`` | ``node`` with GPU 1 fallen off the bus | ``GpuIsLost`` on GPU 1 |
| ``no-driver`` | no NVML library at all | |

Tests change a scenario while it runs: ``lose(index)`` makes a GPU lost, ``restore(index)`` brings
it back, ``add_process(...)`` places a process on a device, ``fail_create(n)`` and
``fail_destroy(n)`` make the n-th create (of a GPU or compute instance) or destroy call from now
fail. ``changes`` lists every instance created or destroyed, in order.
"""

from __future__ import annotations

import ctypes
import hashlib
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

from sja.core.mig import GpuModel, MigProfile, gpu_model

_MIB = 1024 * 1024

NVML_SUCCESS: int = pynvml.NVML_SUCCESS
NVML_DEVICE_MIG_DISABLE = pynvml.NVML_DEVICE_MIG_DISABLE
NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
NVML_GPU_INSTANCE_PROFILE_COUNT = pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
NVML_COMPUTE_INSTANCE_PROFILE_COUNT = pynvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT
NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
NVMLError = pynvml.NVMLError
NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
NVMLError_NotFound = pynvml.NVMLError_NotFound
NVMLError_NotSupported = pynvml.NVMLError_NotSupported
NVMLError_NoPermission = pynvml.NVMLError_NoPermission
NVMLError_Uninitialized = pynvml.NVMLError_Uninitialized
NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument
NVMLError_InUse = pynvml.NVMLError_InUse
NVMLError_InsufficientResources = pynvml.NVMLError_InsufficientResources
NVMLError_InsufficientSize = pynvml.NVMLError_InsufficientSize

# (compute slots, memory slots, media extensions) -> (profile index as in
# NVML_GPU_INSTANCE_PROFILE_*, profile id as ``nvidia-smi mig -lgip`` lists it)
_PROFILE_IDS: dict[tuple[int, int, bool], tuple[int, int]] = {
    (1, 1, False): (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19),
    (1, 1, True): (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20),
    (2, 2, False): (pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14),
    (3, 4, False): (pynvml.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9),
    (4, 4, False): (pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5),
    (7, 8, False): (pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0),
    (1, 2, False): (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15),
}
# The A30 numbers its profiles differently (four compute and four memory slices).
_A30_PROFILE_IDS: dict[tuple[int, int, bool], tuple[int, int]] = {
    (1, 1, False): (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 14),
    (1, 1, True): (pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 21),
    (2, 2, False): (pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 5),
    (2, 2, True): (pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1, 6),
    (4, 4, False): (pynvml.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 0),
}
# Compute instance profiles: index (NVML_COMPUTE_INSTANCE_PROFILE_*, which ``-lcip`` also lists as the
# profile id) -> compute slices; and which sizes a GPU instance of each compute size can be cut into.
_CI_SLICES: dict[int, int] = {
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE: 1,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_2_SLICE: 2,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE: 3,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE: 4,
    pynvml.NVML_COMPUTE_INSTANCE_PROFILE_7_SLICE: 7,
}
_CI_SIZES: dict[int, frozenset[int]] = {
    1: frozenset({1}),
    2: frozenset({1, 2}),
    3: frozenset({1, 2, 3}),
    4: frozenset({1, 2, 4}),
    7: frozenset({1, 2, 3, 4, 7}),
}


def _profile_ids(model: GpuModel, p: MigProfile) -> tuple[int, int]:
    table = _A30_PROFILE_IDS if model.name.startswith("A30") else _PROFILE_IDS
    return table[(p.compute_slots, p.mem_slots, p.media_extension)]


def _uuid(prefix: str, seed: str) -> str:
    return f"{prefix}-{uuid.UUID(bytes=hashlib.sha256(seed.encode()).digest()[:16])}"


def _error(code: int) -> pynvml.NVMLError:
    return pynvml.NVMLError(code)


def _deref(ref: Any) -> Any:
    """What a ``ctypes.pointer`` or ``ctypes.byref`` argument points to; anything else is refused, as
    passing a value where the C function takes a pointer would crash the real driver."""
    if isinstance(ref, ctypes._Pointer):
        return ref.contents
    obj = getattr(ref, "_obj", None)  # ctypes.byref(...)
    if obj is None:
        raise TypeError(f"expected ctypes.pointer(...) or ctypes.byref(...), got {type(ref).__name__}")
    return obj


@dataclass
class FakeCi:
    """A compute instance: one MIG device."""

    ci_id: int
    slices: int
    """Its compute slices: the GPU instance's own count when one compute instance spans it."""
    uuid: str = ""


@dataclass
class FakeGi:
    """A GPU instance at its placement, and the compute instances cut in it."""

    profile: str
    start: int
    gi_id: int = 0
    cis: list[FakeCi] = field(default_factory=list)


@dataclass
class FakeGpu:
    name: str
    model: str
    """Catalogue model the figures come from."""
    total_bytes: int
    mig_current: int = 0
    mig_pending: int = 0
    instances: list[FakeGi] = field(default_factory=list)
    uuid: str = ""
    lost: bool = False
    processes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Per device UUID: ``(pid, used bytes)`` of each compute process."""


@dataclass(frozen=True)
class _Handle:
    gpu: int
    gi: int = -1
    """The GPU instance of a MIG device; -1: the GPU itself."""
    ci: int = -1
    """The compute instance of a MIG device."""


@dataclass(frozen=True)
class _GpuInstance:
    gpu: int
    gi_id: int


@dataclass(frozen=True)
class _ComputeInstance:
    gpu: int
    gi_id: int
    ci_id: int


@dataclass
class _Fault:
    calls_left: int
    """Calls still to pass before the failing one."""
    times: int
    code: int


def _h100(mig: bool, layout: list[tuple[str, int]] | None = None, pending: bool = False) -> FakeGpu:
    return FakeGpu(
        name="NVIDIA H100 80GB HBM3",
        model="H100-80GB",
        total_bytes=81559 * _MIB,
        mig_current=1 if mig else 0,
        mig_pending=1 if (mig or pending) else 0,
        instances=[FakeGi(p, s) for p, s in (layout or [])],
    )


def _a100_40gb(layout: list[tuple[str, int]]) -> FakeGpu:
    return FakeGpu(
        name="NVIDIA A100-SXM4-40GB",
        model="A100-40GB",
        total_bytes=40960 * _MIB,
        mig_current=1,
        mig_pending=1,
        instances=[FakeGi(p, s) for p, s in layout],
    )


_H100_LAYOUT = [("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)]
_A100_LAYOUT = [("2g.10gb", 0), ("1g.5gb", 2), ("1g.5gb", 3), ("3g.20gb", 4)]
_A100_ME_LAYOUT = [("1g.5gb+me", 0), ("1g.5gb", 1), ("2g.10gb", 2), ("3g.20gb", 4)]


def scenario_gpus(name: str) -> tuple[list[FakeGpu], bool]:
    """The GPUs of a scenario, and whether the NVML library is there at all."""
    if name == "h100-mig":
        return [_h100(True, _H100_LAYOUT)], True
    if name == "h100-nomig":
        return [_h100(False)], True
    if name == "a100-40gb":
        return [_a100_40gb(_A100_LAYOUT)], True
    if name == "a100-me":
        return [_a100_40gb(_A100_ME_LAYOUT)], True
    if name == "node":
        return [_h100(True, _H100_LAYOUT), _h100(False), _a100_40gb(_A100_LAYOUT)], True
    if name == "mig-pending":
        return [_h100(False, pending=True)], True
    if name == "unprivileged":
        return [_h100(True, _H100_LAYOUT)], True
    if name == "gpu-lost":
        gpus = [_h100(True, _H100_LAYOUT), _h100(False), _a100_40gb(_A100_LAYOUT)]
        gpus[1].lost = True
        return gpus, True
    if name == "no-driver":
        return [], False
    raise ValueError(f"unknown fake NVML scenario {name!r} (known: {', '.join(SCENARIOS)})")


SCENARIOS = (
    "h100-mig",
    "h100-nomig",
    "a100-40gb",
    "a100-me",
    "node",
    "mig-pending",
    "unprivileged",
    "gpu-lost",
    "no-driver",
)


class FakeNvml:
    """Module-like: ``discover(FakeNvml("h100-mig"), ...)`` reads it as it would read ``pynvml``."""

    NVML_SUCCESS = NVML_SUCCESS
    NVML_DEVICE_MIG_DISABLE = NVML_DEVICE_MIG_DISABLE
    NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE
    NVML_GPU_INSTANCE_PROFILE_COUNT = NVML_GPU_INSTANCE_PROFILE_COUNT
    NVML_COMPUTE_INSTANCE_PROFILE_COUNT = NVML_COMPUTE_INSTANCE_PROFILE_COUNT
    NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED = NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
    NVMLError = NVMLError
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_InUse = NVMLError_InUse
    NVMLError_InsufficientResources = NVMLError_InsufficientResources
    NVMLError_InsufficientSize = NVMLError_InsufficientSize
    # Handle types as ctypes arrays hold them (the real ones are pointers to opaque structures).
    c_nvmlGpuInstance_t = ctypes.py_object
    c_nvmlComputeInstance_t = ctypes.py_object
    c_nvmlGpuInstancePlacement_t = pynvml.c_nvmlGpuInstancePlacement_t

    def __init__(self, scenario: str = "h100-mig", *, host: str = "fake") -> None:
        self.scenario = scenario
        self.gpus, self.library = scenario_gpus(scenario)
        self.privileged = scenario != "unprivileged"
        self.initialized = 0
        self.changes: list[str] = []
        """Every instance created or destroyed, in order (``"gpu 0: create gpu instance 1 ..."``)."""
        self._created = 0
        self._faults: dict[str, _Fault] = {}
        for i, g in enumerate(self.gpus):
            g.uuid = _uuid("GPU", f"{host}/{i}/{g.name}")
            model = self._model(g)
            for j, gi in enumerate(g.instances):
                # GPU instance ids as the driver hands them out: in creation order, from 1.
                gi.gi_id = gi.gi_id or (j + 1)
                slices = model.profile(gi.profile).compute_slots
                gi.cis = [FakeCi(0, slices, _uuid("MIG", f"{g.uuid}/{gi.gi_id}/0"))]

    # --- test controls --------------------------------------------------------------------------

    def lose(self, index: int) -> None:
        self.gpus[index].lost = True

    def restore(self, index: int) -> None:
        self.gpus[index].lost = False

    def add_process(self, device_uuid: str, pid: int, used_bytes: int) -> None:
        for g in self.gpus:
            if device_uuid == g.uuid or any(ci.uuid == device_uuid for _, ci in self._devices(g)):
                g.processes.setdefault(device_uuid, []).append((pid, used_bytes))
                return
        raise KeyError(device_uuid)

    def fail_create(self, nth: int = 1, *, times: int = 1, code: int = pynvml.NVML_ERROR_UNKNOWN) -> None:
        """Make the ``nth`` create call from now (of a GPU or a compute instance) fail with ``code``,
        and the ``times - 1`` create calls after it."""
        self._faults["create"] = _Fault(nth - 1, times, code)

    def fail_destroy(self, nth: int = 1, *, times: int = 1, code: int = pynvml.NVML_ERROR_UNKNOWN) -> None:
        """Make the ``nth`` destroy call from now (of a GPU or a compute instance) fail with ``code``,
        and the ``times - 1`` destroy calls after it."""
        self._faults["destroy"] = _Fault(nth - 1, times, code)

    def _maybe_fail(self, kind: str) -> None:
        fault = self._faults.get(kind)
        if fault is None:
            return
        if fault.calls_left > 0:
            fault.calls_left -= 1
            return
        fault.times -= 1
        if fault.times <= 0:
            del self._faults[kind]
        raise _error(fault.code)

    # --- library --------------------------------------------------------------------------------

    def nvmlInit(self) -> None:
        if not self.library:
            raise NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
        self.initialized += 1

    def nvmlShutdown(self) -> None:
        if self.initialized <= 0:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
        self.initialized -= 1

    def _check_init(self) -> None:
        if self.initialized <= 0:
            raise NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)

    def _gpu(self, h: _Handle) -> FakeGpu:
        self._check_init()
        if not isinstance(h, _Handle) or not 0 <= h.gpu < len(self.gpus):
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        g = self.gpus[h.gpu]
        if g.lost:
            raise NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
        return g

    def _devices(self, g: FakeGpu) -> list[tuple[FakeGi, FakeCi]]:
        """The GPU's MIG devices (one per compute instance), in the order NVML indexes them."""
        return [
            (gi, ci)
            for gi in sorted(g.instances, key=lambda gi: gi.gi_id)
            for ci in sorted(gi.cis, key=lambda ci: ci.ci_id)
        ]

    def _mig(self, h: _Handle) -> tuple[FakeGi, FakeCi]:
        g = self._gpu(h)
        for gi, ci in self._devices(g):
            if (gi.gi_id, ci.ci_id) == (h.gi, h.ci):
                return gi, ci
        raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _model(self, g: FakeGpu) -> GpuModel:
        return gpu_model(g.model)

    def _mig_gpu(self, h: _Handle) -> FakeGpu:
        """A GPU (not a MIG device) whose instances a privileged user may query and change."""
        g = self._gpu(h)
        if h.gi >= 0:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not g.mig_current:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        if not self.privileged:
            raise NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        return g

    def _gi(self, handle: _GpuInstance) -> tuple[FakeGpu, FakeGi]:
        if not isinstance(handle, _GpuInstance):
            self._check_init()
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        g = self._mig_gpu(_Handle(handle.gpu))
        for gi in g.instances:
            if gi.gi_id == handle.gi_id:
                return g, gi
        raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)  # destroyed since

    def _ci(self, handle: _ComputeInstance) -> tuple[FakeGpu, FakeGi, FakeCi]:
        if not isinstance(handle, _ComputeInstance):
            self._check_init()
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        g, gi = self._gi(_GpuInstance(handle.gpu, handle.gi_id))
        for ci in gi.cis:
            if ci.ci_id == handle.ci_id:
                return g, gi, ci
        raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _gi_profile(self, g: FakeGpu, profile_id: int) -> MigProfile:
        model = self._model(g)
        for p in model.profiles:
            if _profile_ids(model, p)[1] == profile_id:
                return p
        raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)

    def _ci_slices(self, g: FakeGpu, gi: FakeGi, profile: int) -> int:
        """Compute slices of a compute instance profile (index or id: the same numbers) in ``gi``."""
        slices = _CI_SLICES.get(profile)
        gi_slots = self._model(g).profile(gi.profile).compute_slots
        if slices is None or slices not in _CI_SIZES.get(gi_slots, frozenset()):
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return slices

    def _mig_name(self, g: FakeGpu, gi: FakeGi, ci: FakeCi) -> str:
        if ci.slices == self._model(g).profile(gi.profile).compute_slots:
            return gi.profile
        return f"{ci.slices}c.{gi.profile}"

    @staticmethod
    def _fill(array: Any, count_ref: Any, items: list[Any]) -> int:
        count = _deref(count_ref)
        if len(array) < len(items):
            count.value = len(items)
            raise NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, item in enumerate(items):
            array[i] = item
        count.value = len(items)
        return NVML_SUCCESS

    # --- devices --------------------------------------------------------------------------------

    def nvmlDeviceGetCount(self) -> int:
        self._check_init()
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._check_init()
        if not 0 <= index < len(self.gpus):
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        # A lost GPU still has a handle; its queries fail (as after an Xid 79).
        return _Handle(index)

    def nvmlDeviceGetName(self, h: _Handle) -> str:
        g = self._gpu(h)
        if h.gi >= 0:
            gi, ci = self._mig(h)
            return f"{g.name} MIG {self._mig_name(g, gi, ci)}"
        return g.name

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        g = self._gpu(h)
        return self._mig(h)[1].uuid if h.gi >= 0 else g.uuid

    def nvmlDeviceGetMemoryInfo(self, h: _Handle, version: int | None = None) -> SimpleNamespace:
        g = self._gpu(h)
        if h.gi >= 0:
            gi, ci = self._mig(h)
            total = self._model(g).profile(gi.profile).mem_mib * _MIB
            used = sum(b for _, b in g.processes.get(ci.uuid, []))
        else:
            total = g.total_bytes
            used = sum(b for procs in g.processes.values() for _, b in procs)
        return SimpleNamespace(total=total, free=total - used, used=used)

    def nvmlDeviceGetMigMode(self, h: _Handle) -> list[int]:
        g = self._gpu(h)
        if h.gi >= 0:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not g.model.startswith(("A30", "A100", "H100", "H200")):
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [g.mig_current, g.mig_pending]

    def nvmlDeviceIsMigDeviceHandle(self, h: _Handle) -> int:
        self._gpu(h)
        return 1 if h.gi >= 0 else 0

    def nvmlDeviceGetMaxMigDeviceCount(self, h: _Handle) -> int:
        g = self._gpu(h)
        return self._model(g).compute_slots if g.mig_current else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: _Handle, index: int) -> _Handle:
        g = self._gpu(h)
        if not g.mig_current:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= self.nvmlDeviceGetMaxMigDeviceCount(h):
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        devices = self._devices(g)
        if index >= len(devices):
            raise NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        gi, ci = devices[index]
        return _Handle(h.gpu, gi.gi_id, ci.ci_id)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: _Handle) -> _Handle:
        self._mig(h)
        return _Handle(h.gpu)

    def nvmlDeviceGetGpuInstanceId(self, h: _Handle) -> int:
        if h.gi < 0:
            self._gpu(h)
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._mig(h)[0].gi_id

    def nvmlDeviceGetComputeInstanceId(self, h: _Handle) -> int:
        if h.gi < 0:
            self._gpu(h)
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._mig(h)[1].ci_id

    def nvmlDeviceGetComputeRunningProcesses(self, h: _Handle) -> list[SimpleNamespace]:
        g = self._gpu(h)
        if h.gi >= 0:
            gi, ci = self._mig(h)
            return [
                SimpleNamespace(pid=pid, usedGpuMemory=b, gpuInstanceId=gi.gi_id, computeInstanceId=ci.ci_id)
                for pid, b in g.processes.get(ci.uuid, [])
            ]
        if g.mig_current:
            # On a MIG-enabled GPU the parent handle sees every instance's processes, without
            # their memory (NVML reports it only per MIG device).
            return [
                SimpleNamespace(pid=pid, usedGpuMemory=None, gpuInstanceId=0, computeInstanceId=0)
                for procs in g.processes.values()
                for pid, _ in procs
            ]
        return [
            SimpleNamespace(pid=pid, usedGpuMemory=b, gpuInstanceId=0xFFFFFFFF, computeInstanceId=0xFFFFFFFF)
            for pid, b in g.processes.get(g.uuid, [])
        ]

    # --- GPU instances --------------------------------------------------------------------------

    def nvmlDeviceGetGpuInstanceProfileInfo(
        self, h: _Handle, profile: int, version: int = 2
    ) -> SimpleNamespace:
        g = self._gpu(h)
        model = self._model(g)
        for p in model.profiles:
            index, profile_id = _profile_ids(model, p)
            if index == profile:
                return SimpleNamespace(
                    id=profile_id,
                    isP2pSupported=0,
                    sliceCount=p.compute_slots,
                    instanceCount=p.max_count,
                    multiprocessorCount=0,
                    memorySizeMB=p.mem_mib,
                    name=f"MIG {p.name}".encode(),
                )
        raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetGpuInstancePossiblePlacements(
        self, h: _Handle, profile_id: int, placements: Any, count_ref: Any
    ) -> int:
        """Every placement the profile may take (``-lgipp``), whatever the GPU holds now. With
        ``placements`` ``None``, only their number; else ``count_ref`` holds the array's size."""
        g = self._gpu(h)
        if not g.mig_current:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        p = self._gi_profile(g, profile_id)
        count = _deref(count_ref)
        if placements is None:
            count.value = len(p.starts)
            return NVML_SUCCESS
        if count.value < len(p.starts) or len(placements) < len(p.starts):
            count.value = len(p.starts)
            raise NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
        for i, start in enumerate(p.starts):
            placements[i].start = start
            placements[i].size = p.mem_slots
        count.value = len(p.starts)
        return NVML_SUCCESS

    def nvmlDeviceGetGpuInstances(self, h: _Handle, profile_id: int, instances: Any, count_ref: Any) -> int:
        g = self._mig_gpu(h)
        p = self._gi_profile(g, profile_id)
        found = sorted((gi for gi in g.instances if gi.profile == p.name), key=lambda gi: gi.gi_id)
        return self._fill(instances, count_ref, [_GpuInstance(h.gpu, gi.gi_id) for gi in found])

    def nvmlDeviceGetGpuInstanceById(self, h: _Handle, gpu_instance_id: int) -> _GpuInstance:
        g = self._mig_gpu(h)
        if not any(gi.gi_id == gpu_instance_id for gi in g.instances):
            raise NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return _GpuInstance(h.gpu, gpu_instance_id)

    def nvmlGpuInstanceGetInfo(self, handle: _GpuInstance) -> SimpleNamespace:
        g, gi = self._gi(handle)
        model = self._model(g)
        p = model.profile(gi.profile)
        return SimpleNamespace(
            device=_Handle(handle.gpu),
            id=gi.gi_id,
            profileId=_profile_ids(model, p)[1],
            placement=SimpleNamespace(start=gi.start, size=p.mem_slots),
        )

    def nvmlDeviceCreateGpuInstanceWithPlacement(
        self, h: _Handle, profile_id: int, placement_ref: Any
    ) -> _GpuInstance:
        g = self._mig_gpu(h)
        self._maybe_fail("create")
        p = self._gi_profile(g, profile_id)
        placement = _deref(placement_ref)
        start, size = int(placement.start), int(placement.size)
        if start not in p.starts or size != p.mem_slots:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        model = self._model(g)
        held = [model.profile(gi.profile) for gi in g.instances]
        taken = {
            s
            for gi, q in zip(g.instances, held, strict=True)
            for s in range(gi.start, gi.start + q.mem_slots)
        }
        if (
            taken & set(range(start, start + size))
            or sum(q.name == p.name for q in held) >= p.max_count
            or sum(q.compute_slots for q in held) + p.compute_slots > model.compute_slots
            or (p.media_extension and any(q.media_extension for q in held))
        ):
            raise NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        used = {gi.gi_id for gi in g.instances}
        gi_id = next(i for i in range(1, len(used) + 2) if i not in used)
        g.instances.append(FakeGi(p.name, start, gi_id))
        self.changes.append(f"gpu {h.gpu}: create gpu instance {gi_id} {p.name}@{start}")
        return _GpuInstance(h.gpu, gi_id)

    def nvmlGpuInstanceDestroy(self, handle: _GpuInstance) -> int:
        g, gi = self._gi(handle)
        self._maybe_fail("destroy")
        if gi.cis:
            raise NVMLError(pynvml.NVML_ERROR_IN_USE)
        g.instances.remove(gi)
        self.changes.append(f"gpu {handle.gpu}: destroy gpu instance {gi.gi_id} {gi.profile}@{gi.start}")
        return NVML_SUCCESS

    # --- compute instances ----------------------------------------------------------------------

    def nvmlGpuInstanceGetComputeInstanceProfileInfo(
        self, handle: _GpuInstance, profile: int, eng_profile: int, version: int = 2
    ) -> SimpleNamespace:
        g, gi = self._gi(handle)
        if eng_profile != NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED:
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        slices = self._ci_slices(g, gi, profile)
        gi_slots = self._model(g).profile(gi.profile).compute_slots
        name = gi.profile if slices == gi_slots else f"{slices}c.{gi.profile}"
        return SimpleNamespace(
            id=profile,
            sliceCount=slices,
            instanceCount=gi_slots // slices,
            multiprocessorCount=0,
            name=f"MIG {name}".encode(),
        )

    def nvmlGpuInstanceCreateComputeInstance(self, handle: _GpuInstance, profile_id: int) -> _ComputeInstance:
        g, gi = self._gi(handle)
        self._maybe_fail("create")
        slices = self._ci_slices(g, gi, profile_id)
        if sum(ci.slices for ci in gi.cis) + slices > self._model(g).profile(gi.profile).compute_slots:
            raise NVMLError(pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
        used = {ci.ci_id for ci in gi.cis}
        ci_id = next(i for i in range(len(used) + 1) if i not in used)
        self._created += 1
        ci = FakeCi(ci_id, slices, _uuid("MIG", f"{g.uuid}/{gi.gi_id}/{ci_id}/{self._created}"))
        gi.cis.append(ci)
        self.changes.append(f"gpu {handle.gpu}: create compute instance {ci_id} ({slices}c) in {gi.gi_id}")
        return _ComputeInstance(handle.gpu, gi.gi_id, ci_id)

    def nvmlGpuInstanceGetComputeInstances(
        self, handle: _GpuInstance, profile_id: int, instances: Any, count_ref: Any
    ) -> int:
        _, gi = self._gi(handle)
        slices = _CI_SLICES.get(profile_id)
        if slices is None:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        found = sorted((ci for ci in gi.cis if ci.slices == slices), key=lambda ci: ci.ci_id)
        return self._fill(
            instances, count_ref, [_ComputeInstance(handle.gpu, gi.gi_id, ci.ci_id) for ci in found]
        )

    def nvmlGpuInstanceGetComputeInstanceById(self, handle: _GpuInstance, ci_id: int) -> _ComputeInstance:
        _, gi = self._gi(handle)
        if not any(ci.ci_id == ci_id for ci in gi.cis):
            raise NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return _ComputeInstance(handle.gpu, gi.gi_id, ci_id)

    def nvmlComputeInstanceGetInfo(self, handle: _ComputeInstance) -> SimpleNamespace:
        _, gi, ci = self._ci(handle)
        profile = next(k for k, v in _CI_SLICES.items() if v == ci.slices)
        return SimpleNamespace(
            device=_Handle(handle.gpu),
            gpuInstance=_GpuInstance(handle.gpu, gi.gi_id),
            id=ci.ci_id,
            profileId=profile,
            placement=SimpleNamespace(start=0, size=ci.slices),
        )

    nvmlComputeInstanceGetInfo_v2 = nvmlComputeInstanceGetInfo

    def nvmlComputeInstanceDestroy(self, handle: _ComputeInstance) -> int:
        g, gi, ci = self._ci(handle)
        self._maybe_fail("destroy")
        if g.processes.get(ci.uuid):
            raise NVMLError(pynvml.NVML_ERROR_IN_USE)
        gi.cis.remove(ci)
        g.processes.pop(ci.uuid, None)
        self.changes.append(f"gpu {handle.gpu}: destroy compute instance {ci.ci_id} in {gi.gi_id}")
        return NVML_SUCCESS


def fake_nvml(scenario: str) -> Any:
    """The fake as a ``pynvml`` stand-in (typed ``Any`` like the real module)."""
    return FakeNvml(scenario)
