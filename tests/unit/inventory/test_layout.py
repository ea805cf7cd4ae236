"""Re-cutting MIG GPUs over the fake NVML: plans (the dry run), each refusal, the re-cut itself as
discovery then sees it, and the old layout put back when a step fails midway. One test makes a dry
run on a real GPU with MIG on, where asked to (it never changes a real GPU)."""

from __future__ import annotations

import copy
import os
import pickle
from typing import Any

import pynvml
import pytest

from sja.core.mig import GpuModel, place_layout
from sja.inventory.declared import InventoryError
from sja.inventory.fake_nvml import FakeCi, FakeNvml
from sja.inventory.layout import (
    REASONS,
    CreateStep,
    DestroyStep,
    LayoutPlan,
    LayoutRefused,
    apply_layout,
    current_layout,
    plan_layout,
)
from sja.inventory.nvml import NvmlUnavailable, catalogue_model, discover

H100_OLD = ("2g.20gb", "1g.10gb", "1g.10gb", "3g.40gb")


def slices(nvml: Any, node: str = "n1") -> list[tuple[str, int]]:
    found = discover(nvml, node=node)
    assert not found.warnings and not found.lost
    return [(s.profile, s.placement_start) for s in found.slices]


def uuids(nvml: Any) -> list[str]:
    return [s.gpu_uuid for s in discover(nvml, node="n1").slices]


def refused(reason: str, call: Any, *args: Any, **kw: Any) -> LayoutRefused:
    with pytest.raises(LayoutRefused) as e:
        call(*args, **kw)
    assert e.value.reason == reason, str(e.value)
    return e.value


# --- re-cutting -------------------------------------------------------------------------------------


def test_recut_h100_to_seven_1g_slices_and_discovery_sees_them() -> None:
    nvml = FakeNvml("h100-mig")
    old_uuids = set(uuids(nvml))
    plan = apply_layout(nvml, 0, ["1g.10gb"] * 7)
    assert (plan.old, plan.new) == (H100_OLD, ("1g.10gb",) * 7)
    assert slices(nvml) == [("1g.10gb", start) for start in range(7)]
    assert not old_uuids & set(uuids(nvml)), "every MIG device is new"
    assert current_layout(nvml, 0) == ("1g.10gb",) * 7
    assert nvml.initialized == 0, "every call shuts NVML down again"

    # Compute instances go before any GPU instance, and every GPU instance before the first create.
    kinds = [c.split(": ")[1].rsplit(" instance", 1)[0] for c in nvml.changes]
    assert kinds == ["destroy compute"] * 4 + ["destroy gpu"] * 4 + ["create gpu", "create compute"] * 7


def test_recut_h100_to_one_whole_instance_and_back() -> None:
    nvml = FakeNvml("h100-mig")
    plan = apply_layout(nvml, 0, ("7g.80gb",))
    assert plan.create == (CreateStep("7g.80gb", 0, 0, 8, 7),)
    found = discover(nvml, node="n1").slices
    assert [(s.profile, s.placement_start, s.mem_mib, s.compute_slots, s.compute_share) for s in found] == [
        ("7g.80gb", 0, 81152, 7, 1.0)
    ]

    # Back, in the order the repartition decision names a layout (any order places the same).
    back = apply_layout(nvml, 0, ("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb"))
    assert back.old == ("7g.80gb",) and back.new == H100_OLD
    assert slices(nvml) == [("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)]


def test_a100_40gb_profiles() -> None:
    nvml = FakeNvml("a100-40gb")
    plan = plan_layout(nvml, 0, ["3g.20gb", "1g.10gb", "1g.10gb"])
    assert plan.gpu_model == "A100-40GB"
    assert plan.create == (
        CreateStep("3g.20gb", 9, 0, 4, 3),
        CreateStep("1g.10gb", 15, 4, 2, 1),  # the two-memory-slice 1g
        CreateStep("1g.10gb", 15, 6, 2, 1),
    )
    apply_layout(nvml, 0, ["3g.20gb", "1g.10gb", "1g.10gb"])
    found = discover(nvml, node="n1").slices
    assert [(s.profile, s.placement_start, s.mem_mib) for s in found] == [
        ("3g.20gb", 0, 19968),
        ("1g.10gb", 4, 9856),
        ("1g.10gb", 6, 9856),
    ]

    apply_layout(nvml, 0, ["1g.5gb+me"] + ["1g.5gb"] * 6)
    assert slices(nvml) == [("1g.5gb+me", 0)] + [("1g.5gb", start) for start in range(1, 7)]
    refused("invalid_layout", plan_layout, nvml, 0, ["1g.5gb+me", "1g.5gb+me"])
    refused("invalid_layout", plan_layout, nvml, 0, ["7g.80gb"])  # an H100 profile


def test_only_the_gpu_named_is_recut() -> None:
    nvml = FakeNvml("node")
    before = discover(nvml, node="n1").slices
    apply_layout(nvml, 2, ["7g.40gb"])
    after = discover(nvml, node="n1").slices
    assert [s for s in after if s.gpu_index != 2] == [s for s in before if s.gpu_index != 2]
    assert [(s.profile, s.placement_start) for s in after if s.gpu_index == 2] == [("7g.40gb", 0)]


def test_a_gpu_with_no_instances_or_a_split_one_is_cut_as_sja_cuts() -> None:
    """MIG on with no GPU instance yet; and the same profiles with one cut into compute instances,
    which is not the layout SJA holds (one MIG device, one slice, per GPU instance)."""
    empty = FakeNvml("h100-mig")
    empty.gpus[0].instances = []
    assert current_layout(empty, 0) == ()
    plan = apply_layout(empty, 0, ["4g.40gb", "3g.40gb"])
    assert (plan.old, plan.destroy) == ((), ())
    assert slices(empty) == [("4g.40gb", 0), ("3g.40gb", 4)]

    split = FakeNvml("h100-mig")
    three = split.gpus[0].instances[3]
    three.cis = [FakeCi(0, 1, "MIG-a"), FakeCi(1, 2, "MIG-b")]
    plan = apply_layout(split, 0, H100_OLD)
    assert plan.old == plan.new == H100_OLD and plan.destroy[3].compute_instances == (0, 1)
    assert [len(gi.cis) for gi in split.gpus[0].instances] == [1, 1, 1, 1]
    refused("unchanged", plan_layout, split, 0, H100_OLD)


# --- the dry run ------------------------------------------------------------------------------------


def test_the_dry_run_says_every_step_and_changes_nothing() -> None:
    nvml = FakeNvml("h100-mig")
    gpus = copy.deepcopy(nvml.gpus)
    plan = plan_layout(nvml, 0, ["4g.40gb", "3g.40gb"])
    assert nvml.gpus == gpus and nvml.changes == [] and nvml.initialized == 0
    assert plan == LayoutPlan(
        gpu_index=0,
        gpu_uuid=nvml.gpus[0].uuid,
        gpu_model="H100-80GB",
        old=H100_OLD,
        new=("4g.40gb", "3g.40gb"),
        destroy=(
            DestroyStep(gi_id=1, profile="2g.20gb", profile_id=14, start=0, compute_instances=(0,)),
            DestroyStep(gi_id=2, profile="1g.10gb", profile_id=19, start=2, compute_instances=(0,)),
            DestroyStep(gi_id=3, profile="1g.10gb", profile_id=19, start=3, compute_instances=(0,)),
            DestroyStep(gi_id=4, profile="3g.40gb", profile_id=9, start=4, compute_instances=(0,)),
        ),
        create=(CreateStep("4g.40gb", 5, 0, 4, 4), CreateStep("3g.40gb", 9, 4, 4, 3)),
    )
    lines = plan.describe()
    assert lines[0].startswith("GPU 0 (H100-80GB, GPU-") and lines[0].endswith(
        "2g.20gb + 1g.10gb + 1g.10gb + 3g.40gb -> 4g.40gb + 3g.40gb"
    )
    assert lines[1] == "destroy compute instance 0 of GPU instance 1 (2g.20gb@0)"
    assert lines[5] == "destroy GPU instance 1 (2g.20gb@0, profile id 14)"
    assert lines[-1].startswith("create GPU instance 3g.40gb@4 (profile id 9, 4 memory slices)")
    assert len(lines) == 1 + 4 + 4 + 2
    assert apply_layout(nvml, 0, ["3g.40gb", "4g.40gb"]) == plan


def test_current_layout_as_root_and_as_a_user() -> None:
    assert current_layout(FakeNvml("h100-mig"), 0) == H100_OLD
    assert current_layout(FakeNvml("unprivileged"), 0) == H100_OLD, "placed from the catalogue"
    assert current_layout(FakeNvml("a100-me"), 0) == ("1g.5gb+me", "1g.5gb", "2g.10gb", "3g.20gb")
    assert current_layout(FakeNvml("h100-nomig"), 0) == ()
    assert current_layout(FakeNvml("mig-pending"), 0) == ()
    refused("nvml_error", current_layout, FakeNvml("gpu-lost"), 1)
    with pytest.raises(NvmlUnavailable):
        current_layout(FakeNvml("no-driver"), 0)


# --- refusals ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("scenario", "index", "layout", "reason", "words"),
    [
        ("h100-nomig", 0, ["7g.80gb"], "mig_off", "MIG mode is off on GPU 0: SJA never changes the MIG mode"),
        ("node", 1, ["7g.80gb"], "mig_off", "MIG mode is off on GPU 1"),
        ("mig-pending", 0, ["7g.80gb"], "mig_pending", "off, on after the next GPU reset"),
        ("h100-mig", 0, ["4g.40gb", "4g.40gb"], "invalid_layout", "at most 1 x 4g.40gb"),
        ("h100-mig", 0, ["7g.80gb", "1g.10gb"], "invalid_layout", "more than 7 compute slices"),
        ("h100-mig", 0, ["2g.10gb"], "invalid_layout", "no MIG profile '2g.10gb'"),
        ("h100-mig", 0, [], "invalid_layout", "empty layout"),
        ("unprivileged", 0, ["7g.80gb"], "no_permission", "needs root"),
        ("h100-mig", 0, ["3g.40gb", "1g.10gb", "2g.20gb", "1g.10gb"], "unchanged", "holds 2g.20gb + 1g"),
        ("gpu-lost", 1, ["7g.80gb"], "nvml_error", "GpuIsLost"),
        ("h100-mig", 3, ["7g.80gb"], "nvml_error", "InvalidArgument"),
    ],
)
def test_refusals(scenario: str, index: int, layout: list[str], reason: str, words: str) -> None:
    nvml = FakeNvml(scenario)
    gpus = copy.deepcopy(nvml.gpus)
    for call in (plan_layout, apply_layout):
        e = refused(reason, call, nvml, index, layout)
        assert words in str(e) and words in e.message
        assert isinstance(e, InventoryError)
    assert nvml.gpus == gpus and nvml.changes == [] and nvml.initialized == 0


def test_a_gpu_outside_the_catalogue_is_refused() -> None:
    nvml = FakeNvml("h100-mig")
    nvml.gpus[0].name = "NVIDIA GH200 480GB"
    e = refused("invalid_layout", plan_layout, nvml, 0, ["7g.80gb"])
    assert "NVIDIA GH200 480GB" in str(e) and "not in the MIG catalogue" in str(e)


class _OffersLess(FakeNvml):
    """A driver that does not offer 1g.10gb at start 6 (where the catalogue places the seventh)."""

    def nvmlDeviceGetGpuInstancePossiblePlacements(self, h: Any, profile_id: int, arr: Any, ref: Any) -> int:
        super().nvmlDeviceGetGpuInstancePossiblePlacements(h, profile_id, arr, ref)
        if profile_id == 19:
            ref.contents.value -= 1
        return 0


def test_a_placement_nvml_does_not_offer_is_refused() -> None:
    nvml = _OffersLess("h100-mig")
    e = refused("invalid_layout", plan_layout, nvml, 0, ["1g.10gb"] * 7)
    assert "NVML offers 1g.10gb at 0, 1, 2, 3, 4, 5, not at 6" in str(e)
    assert plan_layout(nvml, 0, ["1g.10gb"] * 6).new == ("1g.10gb",) * 6


def test_no_permission_to_change_instances_changes_nothing() -> None:
    """Reading instances may be allowed where changing them is not (the MIG ``config`` capability)."""
    nvml = FakeNvml("h100-mig")
    nvml.fail_destroy(1, code=pynvml.NVML_ERROR_NO_PERMISSION)
    e = refused("no_permission", apply_layout, nvml, 0, ["7g.80gb"])
    assert "nothing changed" in str(e)
    assert nvml.changes == [] and current_layout(nvml, 0) == H100_OLD


def test_refusal_is_an_inventory_error_that_survives_pickling() -> None:
    e = LayoutRefused("busy", "GPU 0 is busy")
    copied = pickle.loads(pickle.dumps(e))
    assert (copied.reason, copied.message, str(copied)) == ("busy", "GPU 0 is busy", "GPU 0 is busy")
    assert set(REASONS) == {
        "mig_off",
        "mig_pending",
        "invalid_layout",
        "no_permission",
        "unchanged",
        "busy",
        "nvml_error",
    }


# --- busy GPUs ----------------------------------------------------------------------------------------


def test_a_process_on_a_mig_device_or_the_gpu_makes_it_busy() -> None:
    nvml = FakeNvml("h100-mig")
    target = uuids(nvml)[1]
    nvml.add_process(target, pid=4242, used_bytes=1 << 30)
    for call in (plan_layout, apply_layout):
        e = refused("busy", call, nvml, 0, ["7g.80gb"])
        assert f"pid 4242 on {target}" in str(e) and "on the GPU" not in str(e)
    assert nvml.changes == [] and current_layout(nvml, 0) == H100_OLD

    whole = FakeNvml("h100-mig")
    whole.add_process(whole.gpus[0].uuid, pid=7, used_bytes=1 << 20)
    assert "pid 7 on the GPU" in str(refused("busy", plan_layout, whole, 0, ["7g.80gb"]))


def test_a_held_or_leased_slice_makes_the_gpu_busy() -> None:
    nvml = FakeNvml("node")
    held = next(s.gpu_uuid for s in discover(nvml, node="n1").slices if s.gpu_index == 2)
    e = refused("busy", apply_layout, nvml, 2, ["7g.40gb"], busy={held})
    assert f"{held} is held or leased" in str(e) and nvml.changes == []
    # A slice held on another GPU does not keep this one.
    other = next(s.gpu_uuid for s in discover(nvml, node="n1").slices if s.gpu_index == 0)
    assert apply_layout(nvml, 2, ["7g.40gb"], busy=frozenset({other})).new == ("7g.40gb",)


class _StartsAJob(FakeNvml):
    """A process starts on a MIG device right after the plan's check of the GPU's processes."""

    parent_checks = 0

    def nvmlDeviceGetComputeRunningProcesses(self, h: Any) -> list[Any]:
        found = super().nvmlDeviceGetComputeRunningProcesses(h)
        if h.gi < 0:
            self.parent_checks += 1
            if self.parent_checks == 1:
                mig = self.nvmlDeviceGetMigDeviceHandleByIndex(h, 0)
                self.add_process(self.nvmlDeviceGetUUID(mig), pid=99, used_bytes=1 << 20)
        return found


def test_apply_checks_busy_again_before_the_first_change() -> None:
    nvml = _StartsAJob("h100-mig")
    e = refused("busy", apply_layout, nvml, 0, ["7g.80gb"])
    assert "pid 99" in str(e) and nvml.parent_checks == 2 and nvml.changes == []


def test_a_compute_instance_in_use_at_the_first_destroy_changes_nothing() -> None:
    nvml = FakeNvml("h100-mig")
    nvml.fail_destroy(1, code=pynvml.NVML_ERROR_IN_USE)
    e = refused("busy", apply_layout, nvml, 0, ["7g.80gb"])
    assert "nothing changed" in str(e) and nvml.changes == []


# --- a step failing midway --------------------------------------------------------------------------


def test_a_failed_create_puts_the_old_layout_back() -> None:
    nvml = FakeNvml("h100-mig")
    nvml.fail_create(3)  # the second GPU instance, after one 1g.10gb and its compute instance
    e = refused("nvml_error", apply_layout, nvml, 0, ["1g.10gb"] * 7)
    step = "GPU 0: creating GPU instance 1g.10gb@1 failed (Unknown Error, NVMLError_Unknown)"
    assert str(e).startswith(step)
    assert "the old layout 2g.20gb@0 + 1g.10gb@2 + 1g.10gb@3 + 3g.40gb@4 was put back" in str(e)
    assert slices(nvml) == [("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)]
    assert current_layout(nvml, 0) == H100_OLD and nvml.initialized == 0
    # The GPU is whole again: the next re-cut goes through.
    assert apply_layout(nvml, 0, ["1g.10gb"] * 7).new == ("1g.10gb",) * 7


def test_a_failed_destroy_keeps_the_instances_still_there() -> None:
    nvml = FakeNvml("h100-mig")
    before = uuids(nvml)
    nvml.fail_destroy(3)  # the third compute instance: the first two GPU instances lost theirs
    e = refused("nvml_error", apply_layout, nvml, 0, ["7g.80gb"])
    assert "destroying compute instance 0 of GPU instance 3 (1g.10gb@3) failed" in str(e)
    assert "was put back" in str(e)
    assert slices(nvml) == [("2g.20gb", 0), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)]
    after = uuids(nvml)
    assert after[2:] == before[2:], "untouched MIG devices keep their UUIDs"
    assert not set(after[:2]) & set(before), "the compute instances made again are new MIG devices"


def test_a_failed_restore_says_what_the_gpu_holds() -> None:
    nvml = FakeNvml("h100-mig")
    nvml.fail_create(3, times=100)
    e = refused("nvml_error", apply_layout, nvml, 0, ["1g.10gb"] * 7)
    assert "putting the old layout 2g.20gb@0 + 1g.10gb@2 + 1g.10gb@3 + 3g.40gb@4 back failed" in str(e)
    assert str(e).endswith("the GPU holds no GPU instances")
    assert current_layout(nvml, 0) == () and discover(nvml, node="n1").slices == []
    assert nvml.initialized == 0


# --- a real GPU -------------------------------------------------------------------------------------


def _real_mig_gpu() -> tuple[int, GpuModel | None] | None:
    """The index of a real GPU with MIG on and its catalogue model, or ``None``."""
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return None
    try:
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                gpu = pynvml.nvmlDeviceGetHandleByIndex(i)
                if pynvml.nvmlDeviceGetMigMode(gpu)[0] != pynvml.NVML_DEVICE_MIG_ENABLE:
                    continue
                name = pynvml.nvmlDeviceGetName(gpu)
                total_mib = int(pynvml.nvmlDeviceGetMemoryInfo(gpu).total) // (1024 * 1024)
            except pynvml.NVMLError:
                continue
            return i, catalogue_model(name.decode() if isinstance(name, bytes) else name, total_mib)
        return None
    finally:
        pynvml.nvmlShutdown()


@pytest.mark.gpu
@pytest.mark.skipif(
    os.environ.get("SJA_TEST_REAL_MIG_RECUT") != "1", reason="set SJA_TEST_REAL_MIG_RECUT=1 on a MIG GPU"
)
def test_dry_run_on_a_real_mig_gpu() -> None:
    """A plan for a real GPU with MIG on (one whole instance, or all the smallest if it holds that
    already): the dry run only, never applied, and the GPU is as it was after it."""
    found = _real_mig_gpu()
    if found is None:
        pytest.skip("no GPU with MIG on")
    index, model = found
    if model is None:
        pytest.skip("the GPU with MIG on is not in the MIG catalogue")
    before = current_layout(pynvml, index)
    whole = max(model.profiles, key=lambda p: (p.compute_slots, p.mem_slots)).name
    target = [whole] if before != (whole,) else [model.profiles[0].name] * model.compute_slots
    try:
        plan = plan_layout(pynvml, index, target)
    except LayoutRefused as e:
        if e.reason in ("no_permission", "busy"):
            pytest.skip(f"{e.reason}: {e}")
        raise
    assert (plan.gpu_index, plan.gpu_model, plan.old) == (index, model.name, before)
    placed = place_layout(model, target)
    assert [(c.profile, c.start) for c in plan.create] == [(pl.profile, pl.start) for pl in placed]
    assert [d.profile for d in plan.destroy] == list(before)
    assert current_layout(pynvml, index) == before, "the dry run changed nothing"
