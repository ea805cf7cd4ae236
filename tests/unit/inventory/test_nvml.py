"""NVML discovery over the fake NVML: every scenario's slices, and NVML's errors."""

from __future__ import annotations

import re

import pynvml
import pytest

from sja.core.mig import Placement, gpu_model, validate_placements
from sja.inventory.declared import InventoryError, load_declared
from sja.inventory.fake_nvml import SCENARIOS, FakeNvml
from sja.inventory.nvml import NvmlUnavailable, SoftSlices, catalogue_model, discover
from sja.inventory.sources import check_source, read_source

_MIB = 1024 * 1024


def layout(found) -> list[tuple[str, str, int, int]]:
    return [(s.gpu_model, s.profile, s.placement_start, s.mem_mib) for s in found.slices]


def test_h100_with_mig_gives_one_slice_per_gpu_instance() -> None:
    found = discover(FakeNvml("h100-mig"), node="n1")
    assert not found.lost and not found.warnings
    assert layout(found) == [
        ("H100-80GB", "2g.20gb", 0, 20096),
        ("H100-80GB", "1g.10gb", 2, 9984),
        ("H100-80GB", "1g.10gb", 3, 9984),
        ("H100-80GB", "3g.40gb", 4, 40448),
    ]
    s = found.slices[0]
    assert s.slice_id == "n1-g0-2g.20gb-0" and s.node == "n1" and s.pool == "n1"
    assert s.source == "nvml" and s.status == "free" and s.fence == 0
    assert s.compute_slots == 2 and s.compute_share == pytest.approx(2 / 7)
    assert all(re.fullmatch(r"MIG-[0-9a-f-]{36}", x.gpu_uuid) for x in found.slices)
    assert len({x.gpu_uuid for x in found.slices}) == 4
    validate_placements(
        gpu_model("H100-80GB"), [Placement(x.profile, x.placement_start) for x in found.slices]
    )


def test_a100_slice_ids_match_the_declared_inventory_of_the_same_layout() -> None:
    found = discover(FakeNvml("a100-40gb"), node="local")
    assert [s.profile for s in found.slices] == ["2g.10gb", "1g.5gb", "1g.5gb", "3g.20gb"]
    declared = {s.slice_id for s in load_declared(None) if s.gpu_index == 0}
    assert {s.slice_id for s in found.slices} == declared


def test_media_extension_instance_keeps_its_profile_name() -> None:
    """``MIG 1g.5gb+me`` is its own profile: not a plain 1g.5gb, and its slice id stays a valid key."""
    nvml = FakeNvml("a100-me")
    nvml.nvmlInit()
    try:
        gpu = nvml.nvmlDeviceGetHandleByIndex(0)
        mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 0)
        assert nvml.nvmlDeviceGetName(mig) == "NVIDIA A100-SXM4-40GB MIG 1g.5gb+me"
        info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1)
        assert (info.id, info.instanceCount, info.memorySizeMB, info.name) == (20, 1, 4864, b"MIG 1g.5gb+me")
    finally:
        nvml.nvmlShutdown()

    found = discover(FakeNvml("a100-me"), node="n1")
    assert not found.warnings
    assert [(s.profile, s.placement_start, s.mem_mib, s.compute_slots) for s in found.slices] == [
        ("1g.5gb+me", 0, 4864, 1),
        ("1g.5gb", 1, 4864, 1),
        ("2g.10gb", 2, 9856, 2),
        ("3g.20gb", 4, 19968, 3),
    ]
    assert found.slices[0].slice_id == "n1-g0-1g.5gb_me-0"
    assert all(re.fullmatch(r"[-/_=.a-zA-Z0-9]+", s.slice_id) for s in found.slices), "NATS KV keys"

    # Without the right to read placements, the catalogue places the same profiles, +me included.
    unprivileged = FakeNvml("a100-me")
    unprivileged.privileged = False
    derived = discover(unprivileged, node="n1")
    assert any("not readable" in w for w in derived.warnings)
    assert sorted(s.profile for s in derived.slices) == sorted(s.profile for s in found.slices)
    validate_placements(
        gpu_model("A100-40GB"), [Placement(x.profile, x.placement_start) for x in derived.slices]
    )


@pytest.mark.parametrize(
    ("device_name", "profile"),
    [
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb+me", "1g.10gb+me"),
        ("NVIDIA H100 80GB HBM3 MIG 1g.10gb", "1g.10gb"),
        ("NVIDIA A100-SXM4-40GB MIG 1c.3g.20gb", "3g.20gb"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition MIG 1g.24gb+me.all", "1g.24gb+me.all"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition MIG 2g.48gb-me", "2g.48gb-me"),
    ],
)
def test_mig_device_names_keep_their_suffix(device_name: str, profile: str) -> None:
    from sja.inventory.nvml import _MIG_NAME

    found = _MIG_NAME.search(device_name)
    assert found is not None and found.group(1) == profile


def test_gpu_without_mig_is_one_whole_slice_or_soft_slices() -> None:
    whole = discover(FakeNvml("h100-nomig"), node="n1")
    assert [(s.slice_id, s.source, s.profile, s.mem_mib) for s in whole.slices] == [
        ("n1-g0-whole", "whole", "whole.80gb", 81559)
    ]
    assert whole.slices[0].gpu_uuid.startswith("GPU-") and whole.slices[0].compute_share == 1.0

    soft = discover(FakeNvml("h100-nomig"), node="n1", soft_slices="4")
    assert [s.slice_id for s in soft.slices] == [f"n1-g0-soft{k}" for k in range(4)]
    assert {s.mem_mib for s in soft.slices} == {81559 // 4}
    assert {s.source for s in soft.slices} == {"soft"}
    assert {s.gpu_uuid for s in soft.slices} == {whole.slices[0].gpu_uuid}, "soft slices share the GPU"

    sized = discover(FakeNvml("h100-nomig"), node="n1", soft_slices="20000,20000,40000")
    assert [s.mem_mib for s in sized.slices] == [20000, 20000, 40000]
    assert sized.slices[2].compute_share == pytest.approx(40000 / 81559)
    with pytest.raises(InventoryError, match="exceed"):
        discover(FakeNvml("h100-nomig"), node="n1", soft_slices="60000,60000")


def test_soft_slice_spec_parsing() -> None:
    assert SoftSlices.parse("").whole and SoftSlices.parse("1").whole
    assert SoftSlices.parse("3") == SoftSlices(count=3)
    assert SoftSlices.parse("1000,2000") == SoftSlices(sizes_mib=(1000, 2000))
    assert SoftSlices.parse("30000") == SoftSlices(sizes_mib=(30000,))
    for bad in ("x", "0", "-1,2", "4,,a"):
        with pytest.raises(InventoryError):
            SoftSlices.parse(bad)


def test_soft_slices_leave_mig_gpus_alone() -> None:
    found = discover(FakeNvml("node"), node="n1", soft_slices="2")
    by_gpu: dict[int, list[str]] = {}
    for s in found.slices:
        by_gpu.setdefault(s.gpu_index, []).append(s.source)
    assert by_gpu == {0: ["nvml"] * 4, 1: ["soft", "soft"], 2: ["nvml"] * 4}


def test_mig_pending_a_reset_is_still_a_whole_gpu_with_a_warning() -> None:
    found = discover(FakeNvml("mig-pending"), node="n1")
    assert [s.source for s in found.slices] == ["whole"]
    assert found.warnings and "pending" in found.warnings[0]


def test_unprivileged_user_gets_placements_from_the_catalogue() -> None:
    privileged = discover(FakeNvml("h100-mig"), node="n1")
    found = discover(FakeNvml("unprivileged"), node="n1")
    assert layout(found) == layout(privileged)
    assert any("not readable" in w for w in found.warnings)


def test_lost_gpu_is_reported_and_its_slices_are_gone() -> None:
    found = discover(FakeNvml("gpu-lost"), node="n1")
    assert len(found.lost) == 1 and found.lost[0].startswith("1:") and "GpuIsLost" in found.lost[0]
    assert {s.gpu_index for s in found.slices} == {0, 2}

    nvml = FakeNvml("node")
    before = {s.slice_id for s in discover(nvml, node="n1").slices}
    nvml.lose(2)
    after = discover(nvml, node="n1")
    assert {s.slice_id for s in after.slices} == {x for x in before if "-g2-" not in x}
    nvml.restore(2)
    assert {s.slice_id for s in discover(nvml, node="n1").slices} == before
    assert nvml.initialized == 0, "every discovery shuts NVML down again"


def test_no_driver_raises_library_not_found_as_unavailable() -> None:
    nvml = FakeNvml("no-driver")
    with pytest.raises(pynvml.NVMLError_LibraryNotFound):
        nvml.nvmlInit()
    with pytest.raises(NvmlUnavailable, match="LibraryNotFound"):
        discover(nvml, node="n1")


def test_fake_answers_like_pynvml() -> None:
    """Return shapes and error classes as the real bindings have them."""
    nvml = FakeNvml("h100-mig")
    with pytest.raises(pynvml.NVMLError_Uninitialized):
        nvml.nvmlDeviceGetCount()
    nvml.nvmlInit()
    try:
        gpu = nvml.nvmlDeviceGetHandleByIndex(0)
        assert nvml.nvmlDeviceGetName(gpu) == "NVIDIA H100 80GB HBM3"
        assert nvml.nvmlDeviceGetMigMode(gpu) == [1, 1]
        assert nvml.nvmlDeviceGetMaxMigDeviceCount(gpu) == 7
        mig = nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 1)
        assert nvml.nvmlDeviceGetName(mig) == "NVIDIA H100 80GB HBM3 MIG 1g.10gb"
        assert nvml.nvmlDeviceGetUUID(mig).startswith("MIG-")
        assert nvml.nvmlDeviceGetMemoryInfo(mig).total == 9984 * _MIB
        assert nvml.nvmlDeviceGetDeviceHandleFromMigDeviceHandle(mig) == gpu
        with pytest.raises(pynvml.NVMLError_NotFound):
            nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 5)
        with pytest.raises(pynvml.NVMLError_InvalidArgument):
            nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, 7)
        info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE)
        assert (info.id, info.sliceCount, info.memorySizeMB) == (19, 1, 9984)
        with pytest.raises(pynvml.NVMLError_NotSupported):
            nvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, pynvml.NVML_GPU_INSTANCE_PROFILE_6_SLICE)
        gi = nvml.nvmlDeviceGetGpuInstanceById(gpu, nvml.nvmlDeviceGetGpuInstanceId(mig))
        gi_info = nvml.nvmlGpuInstanceGetInfo(gi)
        assert (gi_info.profileId, gi_info.placement.start, gi_info.placement.size) == (19, 2, 1)

        uuid = nvml.nvmlDeviceGetUUID(mig)
        nvml.add_process(uuid, pid=4242, used_bytes=512 * _MIB)
        procs = nvml.nvmlDeviceGetComputeRunningProcesses(mig)
        assert [(p.pid, p.usedGpuMemory) for p in procs] == [(4242, 512 * _MIB)]
        assert nvml.nvmlDeviceGetMemoryInfo(mig).used == 512 * _MIB

        nvml.lose(0)
        with pytest.raises(pynvml.NVMLError_GpuIsLost) as lost:
            nvml.nvmlDeviceGetName(gpu)
        assert lost.value.value == pynvml.NVML_ERROR_GPU_IS_LOST
    finally:
        nvml.nvmlShutdown()


@pytest.mark.parametrize("scenario", [s for s in SCENARIOS if s != "no-driver"])
def test_every_scenario_discovers_valid_slices(scenario: str) -> None:
    found = discover(FakeNvml(scenario), node="n1")
    assert found.slices
    ids = [s.slice_id for s in found.slices]
    assert len(ids) == len(set(ids))
    for s in found.slices:
        assert s.mem_mib > 0 and 0 < s.compute_share <= 1
        assert s.gpu_uuid.startswith("MIG-" if s.source == "nvml" else "GPU-")


def test_catalogue_model_from_nvml_names() -> None:
    def name(n: str, mib: int) -> str | None:
        m = catalogue_model(n, mib)
        return m.name if m else None

    assert name("NVIDIA H100 80GB HBM3", 81559) == "H100-80GB"
    assert name("NVIDIA H100 NVL", 95830) == "H100-94GB"
    assert name("NVIDIA A100-SXM4-40GB", 40960) == "A100-40GB"
    assert name("NVIDIA A100 80GB PCIe", 81920) == "A100-80GB"
    assert name("NVIDIA H200", 143771) == "H200-141GB"
    assert name("NVIDIA A30", 24576) == "A30-24GB"
    assert name("NVIDIA GeForce RTX 4090", 24564) is None
    assert name("NVIDIA GH200 480GB", 97871) is None


def test_sources_by_name() -> None:
    assert check_source("") == "declared"
    with pytest.raises(InventoryError, match="unknown inventory source"):
        check_source("nvidia")
    with pytest.raises(InventoryError, match="unknown fake NVML scenario"):
        read_source("fake-nvml:nope")
    assert len(read_source("declared").slices) == 6
    assert [s.node for s in read_source("fake-nvml:h100-mig", node="gpu7").slices] == ["gpu7"] * 4
