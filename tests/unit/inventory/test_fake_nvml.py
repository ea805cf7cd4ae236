"""The fake NVML's GPU and compute instances: created and destroyed through the same ctypes calls as
the real bindings take, with the driver's refusals, and seen by discovery afterwards."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pynvml
import pytest

from sja.inventory.fake_nvml import FakeNvml
from sja.inventory.nvml import discover


@contextmanager
def gpu0(nvml: FakeNvml) -> Iterator[Any]:
    nvml.nvmlInit()
    try:
        yield nvml.nvmlDeviceGetHandleByIndex(0)
    finally:
        nvml.nvmlShutdown()


def gpu_instances(nvml: FakeNvml, gpu: Any, profile_id: int) -> list[Any]:
    array = (nvml.c_nvmlGpuInstance_t * 8)()
    count = ctypes.c_uint(0)
    assert nvml.nvmlDeviceGetGpuInstances(gpu, profile_id, array, ctypes.pointer(count)) == 0
    return [array[i] for i in range(count.value)]


def compute_instances(nvml: FakeNvml, gi: Any, profile_id: int) -> list[Any]:
    array = (nvml.c_nvmlComputeInstance_t * 8)()
    count = ctypes.c_uint(0)
    nvml.nvmlGpuInstanceGetComputeInstances(gi, profile_id, array, ctypes.byref(count))
    return [array[i] for i in range(count.value)]


def placement(start: int, size: int) -> Any:
    p = pynvml.c_nvmlGpuInstancePlacement_t()
    p.start, p.size = start, size
    return ctypes.pointer(p)


def test_instances_are_listed_through_ctypes_arrays_as_the_driver_fills_them() -> None:
    nvml = FakeNvml("h100-mig")
    with gpu0(nvml) as gpu:
        ones = gpu_instances(nvml, gpu, 19)  # 1g.10gb
        assert [nvml.nvmlGpuInstanceGetInfo(gi).placement.start for gi in ones] == [2, 3]
        (three,) = gpu_instances(nvml, gpu, 9)
        info = nvml.nvmlGpuInstanceGetInfo(three)
        assert (info.id, info.profileId, info.placement.start, info.placement.size) == (4, 9, 4, 4)

        shared = pynvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
        full = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
            three, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE, shared
        )
        assert (full.id, full.sliceCount, full.instanceCount, full.name) == (2, 3, 1, b"MIG 3g.40gb")
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                three, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_4_SLICE, shared
            )
        (ci,) = compute_instances(nvml, three, full.id)
        assert nvml.nvmlComputeInstanceGetInfo(ci).id == 0
        assert compute_instances(nvml, three, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE) == []

        array = (nvml.c_nvmlGpuInstancePlacement_t * 8)()
        count = ctypes.c_uint(8)
        nvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu, 14, array, ctypes.pointer(count))
        assert [(array[i].start, array[i].size) for i in range(count.value)] == [(0, 2), (2, 2), (4, 2)]
        small = (nvml.c_nvmlGpuInstancePlacement_t * 2)()
        with pytest.raises(pynvml.NVMLError_InsufficientSize):
            nvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu, 19, small, ctypes.pointer(ctypes.c_uint(2)))


def test_creating_and_destroying_instances_changes_the_mig_devices() -> None:
    nvml = FakeNvml("h100-mig")
    before = {s.gpu_uuid for s in discover(nvml, node="n").slices}
    with gpu0(nvml) as gpu:
        (three,) = gpu_instances(nvml, gpu, 9)
        (ci,) = compute_instances(nvml, three, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
        with pytest.raises(pynvml.NVMLError_InUse):
            nvml.nvmlGpuInstanceDestroy(three)  # it still holds a compute instance
        nvml.nvmlComputeInstanceDestroy(ci)
        nvml.nvmlGpuInstanceDestroy(three)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nvml.nvmlGpuInstanceGetInfo(three)  # a stale handle

        # Slices 4-7 are free: three 1g.10gb and a 1g.10gb that would overlap the second.
        new = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 9, placement(4, 4))
        for _ in range(3):
            nvml.nvmlGpuInstanceCreateComputeInstance(new, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            nvml.nvmlGpuInstanceCreateComputeInstance(new, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
        names = [
            nvml.nvmlDeviceGetName(nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, i)) for i in range(2, 6)
        ]
        assert names[-3:] == ["NVIDIA H100 80GB HBM3 MIG 1c.3g.40gb"] * 3
    assert nvml.changes == [
        "gpu 0: destroy compute instance 0 in 4",
        "gpu 0: destroy gpu instance 4 3g.40gb@4",
        "gpu 0: create gpu instance 4 3g.40gb@4",
        "gpu 0: create compute instance 0 (1c) in 4",
        "gpu 0: create compute instance 1 (1c) in 4",
        "gpu 0: create compute instance 2 (1c) in 4",
    ]
    after = discover(nvml, node="n").slices
    # A GPU instance cut into compute instances stays one slice, run through its first one.
    assert [(s.profile, s.placement_start) for s in after] == [
        ("2g.20gb", 0),
        ("1g.10gb", 2),
        ("1g.10gb", 3),
        ("3g.40gb", 4),
    ]
    assert after[3].gpu_uuid not in before, "a compute instance created again is a new MIG device"
    assert {s.gpu_uuid for s in after[:3]} <= before


def test_the_driver_refuses_what_it_would_refuse() -> None:
    nvml = FakeNvml("h100-mig")
    with gpu0(nvml) as gpu:
        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            nvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 19, placement(3, 1))  # 1g.10gb@3 is there
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 9, placement(2, 4))  # 3g starts at 0 or 4
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 77, placement(0, 1))  # no such profile
        with pytest.raises(TypeError, match="pointer"):
            nvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 19, placement(7, 1).contents)  # by value

        mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 1)
        nvml.add_process(nvml.nvmlDeviceGetUUID(mig), pid=77, used_bytes=1 << 20)
        (gi, _) = gpu_instances(nvml, gpu, 19)
        (ci,) = compute_instances(nvml, gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_1_SLICE)
        with pytest.raises(pynvml.NVMLError_InUse):
            nvml.nvmlComputeInstanceDestroy(ci)
    assert nvml.changes == []

    for scenario, error in (
        ("unprivileged", pynvml.NVMLError_NoPermission),
        ("h100-nomig", pynvml.NVMLError_NotSupported),
        ("mig-pending", pynvml.NVMLError_NotSupported),
    ):
        other = FakeNvml(scenario)
        with gpu0(other) as gpu:
            with pytest.raises(error):
                gpu_instances(other, gpu, 19)
            with pytest.raises(error):
                other.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 19, placement(0, 1))


def test_failures_can_be_injected_into_the_nth_create_or_destroy() -> None:
    nvml = FakeNvml("h100-mig")
    nvml.fail_create(2, code=pynvml.NVML_ERROR_INSUFFICIENT_RESOURCES)
    nvml.fail_destroy(1, times=2)
    with gpu0(nvml) as gpu:
        (three,) = gpu_instances(nvml, gpu, 9)
        (ci,) = compute_instances(nvml, three, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
        for _ in range(2):
            with pytest.raises(pynvml.NVMLError_Unknown):
                nvml.nvmlComputeInstanceDestroy(ci)
        nvml.nvmlComputeInstanceDestroy(ci)
        nvml.nvmlGpuInstanceDestroy(three)
        gi = nvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, 9, placement(4, 4))  # the first create
        with pytest.raises(pynvml.NVMLError_InsufficientResources):
            nvml.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
        nvml.nvmlGpuInstanceCreateComputeInstance(gi, pynvml.NVML_COMPUTE_INSTANCE_PROFILE_3_SLICE)
    assert len(nvml.changes) == 4
