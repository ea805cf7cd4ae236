"""A fake NVML: the subset of ``pynvml`` that discovery and measurement call, answering as real GPUs do.

Scenarios reproduce the shape of real answers: device names such as ``NVIDIA H100 80GB HBM3`` and
``NVIDIA H100 80GB HBM3 MIG 1g.10gb``, ``GPU-<uuid>`` and ``MIG-<uuid>`` identifiers, memory in
bytes, ``nvmlDeviceGetMigMode`` as ``[current, pending]``, GPU instance profile ids as
``nvidia-smi mig -lgip`` lists them (19 for 1g, 20 for 1g+me, 14 for 2g, 9 for 3g, 5 for 4g, 0 for
7g, 15 for the two-memory-slice 1g; the A30's own: 14, 21, 5, 6, 0) and placements in memory-slice
units. Errors are the real ``pynvml.NVMLError``
subclasses with their codes: a missing driver raises ``NVMLError_LibraryNotFound`` from ``nvmlInit``,
a lost GPU raises ``NVMLError_GpuIsLost`` from every query on it.

| scenario | what it holds |
|---|---|
| ``h100-mig`` | one H100 80GB HBM3, MIG on: 2g.20gb@0, 1g.10gb@2, 1g.10gb@3, 3g.40gb@4 |
| ``h100-nomig`` | one H100 80GB HBM3, MIG off |
| ``a100-40gb`` | one A100-SXM4-40GB, MIG on: 2g.10gb@0, 1g.5gb@2, 1g.5gb@3, 3g.20gb@4 |
| ``a100-me`` | one A100-SXM4-40GB, MIG on: 1g.5gb+me@0, 1g.5gb@1, 2g.10gb@2, 3g.20gb@4 |
| ``node`` | the three above on one node (indices 0, 1, 2) |
| ``mig-pending`` | an H100 whose MIG mode is enabled but pending a GPU reset (still whole) |
| ``unprivileged`` | ``h100-mig`` as a non-root user sees it: GPU instance queries raise ``NoPermission`` |
| ``gpu-lost`` | ``node`` with GPU 1 fallen off the bus |
| ``no-driver`` | no NVML library at all |

Tests change a scenario while it runs: ``lose(index)`` makes a GPU lost, ``restore(index)`` brings
it back, ``add_process(...)`` places a process on a device.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pynvml

from sja.core.mig import GpuModel, MigProfile, gpu_model

_MIB = 1024 * 1024

NVML_DEVICE_MIG_DISABLE = pynvml.NVML_DEVICE_MIG_DISABLE
NVML_DEVICE_MIG_ENABLE = pynvml.NVML_DEVICE_MIG_ENABLE
NVML_GPU_INSTANCE_PROFILE_COUNT = pynvml.NVML_GPU_INSTANCE_PROFILE_COUNT
NVMLError = pynvml.NVMLError
NVMLError_LibraryNotFound = pynvml.NVMLError_LibraryNotFound
NVMLError_GpuIsLost = pynvml.NVMLError_GpuIsLost
NVMLError_NotFound = pynvml.NVMLError_NotFound
NVMLError_NotSupported = pynvml.NVMLError_NotSupported
NVMLError_NoPermission = pynvml.NVMLError_NoPermission
NVMLError_Uninitialized = pynvml.NVMLError_Uninitialized
NVMLError_InvalidArgument = pynvml.NVMLError_InvalidArgument

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


def _profile_ids(model: GpuModel, p: MigProfile) -> tuple[int, int]:
    table = _A30_PROFILE_IDS if model.name.startswith("A30") else _PROFILE_IDS
    return table[(p.compute_slots, p.mem_slots, p.media_extension)]


def _uuid(prefix: str, seed: str) -> str:
    return f"{prefix}-{uuid.UUID(bytes=hashlib.sha256(seed.encode()).digest()[:16])}"


@dataclass
class FakeMig:
    profile: str
    start: int
    gi_id: int
    ci_id: int = 0
    uuid: str = ""


@dataclass
class FakeGpu:
    name: str
    model: str
    """Catalogue model the figures come from."""
    total_bytes: int
    mig_current: int = 0
    mig_pending: int = 0
    instances: list[FakeMig] = field(default_factory=list)
    uuid: str = ""
    lost: bool = False
    processes: dict[str, list[tuple[int, int]]] = field(default_factory=dict)
    """Per device UUID: ``(pid, used bytes)`` of each compute process."""


@dataclass(frozen=True)
class _Handle:
    gpu: int
    mig: int = -1
    """Index among the GPU's MIG devices; -1: the GPU itself."""


@dataclass(frozen=True)
class _GpuInstance:
    gpu: int
    gi_id: int


def _h100(mig: bool, layout: list[tuple[str, int]] | None = None, pending: bool = False) -> FakeGpu:
    return FakeGpu(
        name="NVIDIA H100 80GB HBM3",
        model="H100-80GB",
        total_bytes=81559 * _MIB,
        mig_current=1 if mig else 0,
        mig_pending=1 if (mig or pending) else 0,
        instances=[FakeMig(p, s, gi_id=0) for p, s in (layout or [])],
    )


def _a100_40gb(layout: list[tuple[str, int]]) -> FakeGpu:
    return FakeGpu(
        name="NVIDIA A100-SXM4-40GB",
        model="A100-40GB",
        total_bytes=40960 * _MIB,
        mig_current=1,
        mig_pending=1,
        instances=[FakeMig(p, s, gi_id=0) for p, s in layout],
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

    NVML_DEVICE_MIG_DISABLE = NVML_DEVICE_MIG_DISABLE
    NVML_DEVICE_MIG_ENABLE = NVML_DEVICE_MIG_ENABLE
    NVML_GPU_INSTANCE_PROFILE_COUNT = NVML_GPU_INSTANCE_PROFILE_COUNT
    NVMLError = NVMLError
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_NotFound = NVMLError_NotFound
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_Uninitialized = NVMLError_Uninitialized

    def __init__(self, scenario: str = "h100-mig", *, host: str = "fake") -> None:
        self.scenario = scenario
        self.gpus, self.library = scenario_gpus(scenario)
        self.privileged = scenario != "unprivileged"
        self.initialized = 0
        for i, g in enumerate(self.gpus):
            g.uuid = _uuid("GPU", f"{host}/{i}/{g.name}")
            for j, m in enumerate(g.instances):
                # GPU instance ids as the driver hands them out: in creation order, from 1.
                m.gi_id = m.gi_id or (j + 1)
                m.uuid = _uuid("MIG", f"{g.uuid}/{m.gi_id}/{m.ci_id}")

    # --- test controls --------------------------------------------------------------------------

    def lose(self, index: int) -> None:
        self.gpus[index].lost = True

    def restore(self, index: int) -> None:
        self.gpus[index].lost = False

    def add_process(self, device_uuid: str, pid: int, used_bytes: int) -> None:
        for g in self.gpus:
            if device_uuid == g.uuid or any(m.uuid == device_uuid for m in g.instances):
                g.processes.setdefault(device_uuid, []).append((pid, used_bytes))
                return
        raise KeyError(device_uuid)

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

    def _mig(self, h: _Handle) -> FakeMig:
        g = self._gpu(h)
        if h.mig < 0 or h.mig >= len(g.instances):
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return g.instances[h.mig]

    def _model(self, g: FakeGpu) -> GpuModel:
        return gpu_model(g.model)

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
        if h.mig >= 0:
            return f"{g.name} MIG {self._mig(h).profile}"
        return g.name

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        g = self._gpu(h)
        return self._mig(h).uuid if h.mig >= 0 else g.uuid

    def nvmlDeviceGetMemoryInfo(self, h: _Handle, version: int | None = None) -> SimpleNamespace:
        g = self._gpu(h)
        if h.mig >= 0:
            m = self._mig(h)
            total = self._model(g).profile(m.profile).mem_mib * _MIB
            used = sum(b for _, b in g.processes.get(m.uuid, []))
        else:
            total = g.total_bytes
            used = sum(b for procs in g.processes.values() for _, b in procs)
        return SimpleNamespace(total=total, free=total - used, used=used)

    def nvmlDeviceGetMigMode(self, h: _Handle) -> list[int]:
        g = self._gpu(h)
        if h.mig >= 0:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if not g.model.startswith(("A30", "A100", "H100", "H200")):
            raise NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
        return [g.mig_current, g.mig_pending]

    def nvmlDeviceIsMigDeviceHandle(self, h: _Handle) -> int:
        self._gpu(h)
        return 1 if h.mig >= 0 else 0

    def nvmlDeviceGetMaxMigDeviceCount(self, h: _Handle) -> int:
        g = self._gpu(h)
        return self._model(g).compute_slots if g.mig_current else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h: _Handle, index: int) -> _Handle:
        g = self._gpu(h)
        if not g.mig_current:
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= self.nvmlDeviceGetMaxMigDeviceCount(h):
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        if index >= len(g.instances):
            raise NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return _Handle(h.gpu, index)

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, h: _Handle) -> _Handle:
        self._mig(h)
        return _Handle(h.gpu)

    def nvmlDeviceGetGpuInstanceId(self, h: _Handle) -> int:
        if h.mig < 0:
            self._gpu(h)
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._mig(h).gi_id

    def nvmlDeviceGetComputeInstanceId(self, h: _Handle) -> int:
        if h.mig < 0:
            self._gpu(h)
            raise NVMLError(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return self._mig(h).ci_id

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

    def nvmlDeviceGetGpuInstanceById(self, h: _Handle, gpu_instance_id: int) -> _GpuInstance:
        g = self._gpu(h)
        if not self.privileged:
            raise NVMLError(pynvml.NVML_ERROR_NO_PERMISSION)
        if not any(m.gi_id == gpu_instance_id for m in g.instances):
            raise NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return _GpuInstance(h.gpu, gpu_instance_id)

    def nvmlGpuInstanceGetInfo(self, gi: _GpuInstance) -> SimpleNamespace:
        g = self._gpu(_Handle(gi.gpu))
        model = self._model(g)
        m = next(m for m in g.instances if m.gi_id == gi.gi_id)
        p = model.profile(m.profile)
        return SimpleNamespace(
            device=_Handle(gi.gpu),
            id=gi.gi_id,
            profileId=_profile_ids(model, p)[1],
            placement=SimpleNamespace(start=m.start, size=p.mem_slots),
        )

    def nvmlDeviceGetComputeRunningProcesses(self, h: _Handle) -> list[SimpleNamespace]:
        g = self._gpu(h)
        if h.mig >= 0:
            m = self._mig(h)
            return [
                SimpleNamespace(pid=pid, usedGpuMemory=b, gpuInstanceId=m.gi_id, computeInstanceId=m.ci_id)
                for pid, b in g.processes.get(m.uuid, [])
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


def fake_nvml(scenario: str) -> Any:
    """The fake as a ``pynvml`` stand-in (typed ``Any`` like the real module)."""
    return FakeNvml(scenario)
