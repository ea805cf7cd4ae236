"""Re-cutting one MIG GPU through NVML: the GPU instances it holds, the steps to another layout, and
those steps carried out.

``plan_layout`` reads a GPU and returns what a re-cut would do without changing anything (the dry
run an operator sees); ``apply_layout`` does it. Both read and change the GPU through an injected
``nvml`` module (the real ``pynvml`` or ``FakeNvml``) and do no other I/O. A re-cut destroys every
compute instance and then every GPU instance of the GPU, then creates each GPU instance of the new
layout at its placement (the catalogue's, ``sja.core.mig.place_layout``, which NVML must offer:
``nvmlDeviceGetGpuInstancePossiblePlacements``) with one compute instance spanning it, so that each
GPU instance is one MIG device, one slice, as ``sja.inventory.nvml.discover`` then reads it. Every
MIG device the re-cut creates has a new UUID. SJA never changes a GPU's MIG mode.

A layout is a sequence of profile names (``("3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb")``), in any
order; plans give them in placement order, as ``sja.core.repartition`` does.

Refusals raise ``LayoutRefused``; its ``reason`` is one of:

| reason | when |
|---|---|
| ``mig_off`` | MIG mode is off on the GPU (or the GPU has none) |
| ``mig_pending`` | the GPU's MIG mode changes at its next reset |
| ``invalid_layout`` | the GPU is not in the catalogue, the layout does not place on it, or NVML |
| | does not offer a profile or placement it needs |
| ``no_permission`` | NVML denies GPU instance management (``NoPermission``): it needs root |
| ``unchanged`` | the GPU holds the layout already: the same profiles, each one compute instance |
| ``busy`` | a compute process runs on the GPU or one of its MIG devices, or one of its MIG |
| | device UUIDs is in ``busy`` (the slices held or leased) |
| ``nvml_error`` | any other NVML error (a lost GPU); from ``apply_layout``, a step that failed midway |

Nothing has changed on the GPU after any refusal but ``nvml_error`` from ``apply_layout`` after its
first change: it then puts the old layout back as far as it can (keeping the old GPU instances still
there, creating those destroyed, each with one compute instance), and its message says what the GPU
holds after that. When NVML cannot be initialized at all, ``NvmlUnavailable`` is raised, as by
``discover``.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from sja.core.mig import LayoutError, Placement, place_layout
from sja.inventory.declared import InventoryError
from sja.inventory.nvml import (
    NvmlUnavailable,
    _mig_devices,
    _placements,
    _text,
    catalogue_model,
    mig_device_handles,
    mig_profile,
)

log = logging.getLogger(__name__)

_MIB = 1024 * 1024
_MIN_HANDLES = 8
"""Room for instance handles beyond a profile's ``instanceCount``: NVML writes as many as exist."""
_MAX_PLACEMENTS = 32
"""Room for a profile's possible placements (at most one per memory slice: 8 on today's GPUs)."""

REASONS = ("mig_off", "mig_pending", "invalid_layout", "no_permission", "unchanged", "busy", "nvml_error")
"""Every ``LayoutRefused.reason``."""


class LayoutRefused(InventoryError):
    """A layout that is not applied to a GPU: ``reason`` (one of ``REASONS``) and why, in words."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (type(self), (self.reason, self.message))


@dataclass(frozen=True)
class DestroyStep:
    """A GPU instance the re-cut destroys, after its compute instances."""

    gi_id: int
    """The GPU instance's id (``nvidia-smi mig -lgi``'s ``GI ID``)."""
    profile: str
    profile_id: int
    """Its GPU instance profile id (``-lgip``'s ``ID``)."""
    start: int
    """Its placement start, in memory slices."""
    compute_instances: tuple[int, ...]
    """Ids of its compute instances, destroyed first."""


@dataclass(frozen=True)
class CreateStep:
    """A GPU instance the re-cut creates at its placement, with one compute instance spanning it."""

    profile: str
    profile_id: int
    """The GPU instance profile id passed to ``nvmlDeviceCreateGpuInstanceWithPlacement``."""
    start: int
    size: int
    """Its placement: start and width in memory slices."""
    compute_slices: int
    """Compute slices of the one compute instance made in it: all of the GPU instance's."""


@dataclass(frozen=True)
class LayoutPlan:
    """What re-cutting GPU ``gpu_index`` from ``old`` to ``new`` does, step by step."""

    gpu_index: int
    gpu_uuid: str
    gpu_model: str
    """The catalogue model (``H100-80GB``)."""
    old: tuple[str, ...]
    """The GPU instances' profiles now, in placement order."""
    new: tuple[str, ...]
    """The profiles after the re-cut, in placement order."""
    destroy: tuple[DestroyStep, ...]
    """Every GPU instance of the GPU, in placement order: all compute instances go first, then these."""
    create: tuple[CreateStep, ...]
    """The new GPU instances in placement order, each created with its compute instance."""

    def describe(self) -> list[str]:
        """The plan as lines an operator reads, one per NVML call that changes the GPU."""
        old = " + ".join(self.old) or "no GPU instances"
        lines = [f"GPU {self.gpu_index} ({self.gpu_model}, {self.gpu_uuid}): {old} -> {' + '.join(self.new)}"]
        for d in self.destroy:
            for ci in d.compute_instances:
                lines.append(
                    f"destroy compute instance {ci} of GPU instance {d.gi_id} ({d.profile}@{d.start})"
                )
        for d in self.destroy:
            lines.append(f"destroy GPU instance {d.gi_id} ({d.profile}@{d.start}, profile id {d.profile_id})")
        for c in self.create:
            lines.append(
                f"create GPU instance {c.profile}@{c.start} (profile id {c.profile_id}, {c.size} memory"
                f" slices) and in it one compute instance of {c.compute_slices} compute slices"
            )
        return lines


# --- reading the GPU --------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Profile:
    """A GPU instance profile as this GPU's NVML lists it."""

    name: str
    id: int
    slices: int
    instance_count: int


@dataclass
class _Ci:
    handle: Any
    ci_id: int
    slices: int


@dataclass
class _Gi:
    handle: Any
    gi_id: int
    profile: _Profile
    start: int
    size: int
    cis: list[_Ci]

    @property
    def whole(self) -> bool:
        """One compute instance spans it: one MIG device, as SJA cuts."""
        return len(self.cis) == 1 and self.cis[0].slices == self.profile.slices

    def __str__(self) -> str:
        return f"{self.profile.name}@{self.start}"


class _StepFailed(Exception):
    """A step NVML could not be asked to do (no compute instance profile fits)."""


def _not_offered(nvml: Any) -> tuple[type[BaseException], ...]:
    """What NVML answers for a profile index the GPU or GPU instance does not have."""
    return (nvml.NVMLError_NotSupported, nvml.NVMLError_InvalidArgument, nvml.NVMLError_NotFound)


def _gpu_profiles(nvml: Any, gpu: Any) -> dict[str, _Profile]:
    """The GPU instance profiles the GPU offers, by name (``1g.10gb``), from NVML."""
    out: dict[str, _Profile] = {}
    for index in range(int(nvml.NVML_GPU_INSTANCE_PROFILE_COUNT)):
        try:
            info = nvml.nvmlDeviceGetGpuInstanceProfileInfo(gpu, index)
        except _not_offered(nvml):
            continue
        name = mig_profile(info.name)
        if name is not None and name not in out:
            out[name] = _Profile(name, int(info.id), int(info.sliceCount), int(info.instanceCount))
    return out


def _handles(kind: Any, capacity: int) -> tuple[Any, ctypes.c_uint]:
    """An array of ``capacity`` handles of ``kind`` and a count, as NVML's instance lists fill them."""
    return (kind * capacity)(), ctypes.c_uint(0)


def _compute_instances(nvml: Any, gi: Any) -> list[_Ci]:
    out: list[_Ci] = []
    seen: set[int] = set()
    for index in range(int(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)):
        try:
            info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, index, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
        except _not_offered(nvml):
            continue
        if int(info.id) in seen:
            continue
        seen.add(int(info.id))
        array, count = _handles(nvml.c_nvmlComputeInstance_t, max(int(info.instanceCount), _MIN_HANDLES))
        nvml.nvmlGpuInstanceGetComputeInstances(gi, int(info.id), array, ctypes.pointer(count))
        for k in range(count.value):
            ci = array[k]
            out.append(_Ci(ci, int(nvml.nvmlComputeInstanceGetInfo(ci).id), int(info.sliceCount)))
    return sorted(out, key=lambda c: c.ci_id)


def _gpu_instances(nvml: Any, gpu: Any, profiles: dict[str, _Profile]) -> list[_Gi]:
    """Every GPU instance of the GPU with its compute instances, in placement order. Needs root."""
    out: list[_Gi] = []
    for p in profiles.values():
        array, count = _handles(nvml.c_nvmlGpuInstance_t, max(p.instance_count, _MIN_HANDLES))
        nvml.nvmlDeviceGetGpuInstances(gpu, p.id, array, ctypes.pointer(count))
        for k in range(count.value):
            gi = array[k]
            info = nvml.nvmlGpuInstanceGetInfo(gi)
            start, size = int(info.placement.start), int(info.placement.size)
            out.append(_Gi(gi, int(info.id), p, start, size, _compute_instances(nvml, gi)))
    return sorted(out, key=lambda g: (g.start, g.gi_id))


def _possible_placements(nvml: Any, gpu: Any, profile_id: int) -> list[tuple[int, int]]:
    """``(start, size)`` of every placement NVML offers a GPU instance profile (``-lgipp``)."""
    array = (nvml.c_nvmlGpuInstancePlacement_t * _MAX_PLACEMENTS)()
    count = ctypes.c_uint(_MAX_PLACEMENTS)
    nvml.nvmlDeviceGetGpuInstancePossiblePlacements(gpu, profile_id, array, ctypes.pointer(count))
    return [(int(array[k].start), int(array[k].size)) for k in range(count.value)]


def _busy(nvml: Any, gpu: Any, gpu_uuid: str, busy: Collection[str]) -> list[str]:
    """What keeps the GPU busy: compute processes on it or its MIG devices, MIG devices in ``busy``."""
    found: list[str] = []
    if gpu_uuid in busy:
        found.append(f"{gpu_uuid} is held")
    on_migs: set[int] = set()
    for mig in mig_device_handles(nvml, gpu):
        uuid = _text(nvml.nvmlDeviceGetUUID(mig))
        if uuid in busy:
            found.append(f"{uuid} is held or leased")
        pids = sorted({int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(mig)})
        if pids:
            on_migs.update(pids)
            found.append(f"pid {', '.join(map(str, pids))} on {uuid}")
    try:
        parent = {int(p.pid) for p in nvml.nvmlDeviceGetComputeRunningProcesses(gpu)}
    except (nvml.NVMLError_NotSupported, nvml.NVMLError_NoPermission):
        parent = set()  # what runs on its MIG devices was asked of them
    if parent - on_migs:
        found.append(f"pid {', '.join(map(str, sorted(parent - on_migs)))} on the GPU")
    return found


def _check_mig_mode(nvml: Any, gpu: Any, index: int) -> None:
    try:
        current, pending = (int(v) for v in nvml.nvmlDeviceGetMigMode(gpu))
    except nvml.NVMLError_NotSupported:
        raise LayoutRefused(
            "mig_off", f"MIG mode is off on GPU {index} (it has none): SJA never changes the MIG mode"
        ) from None
    on = int(nvml.NVML_DEVICE_MIG_ENABLE)
    if current != pending:
        now, then = ("on", "off") if current == on else ("off", "on")
        raise LayoutRefused(
            "mig_pending",
            f"MIG mode on GPU {index} is {now}, {then} after the next GPU reset: SJA never changes the"
            " MIG mode and re-cuts only a GPU whose MIG mode is on and settled",
        )
    if current != on:
        raise LayoutRefused("mig_off", f"MIG mode is off on GPU {index}: SJA never changes the MIG mode")


@dataclass
class _Planned:
    plan: LayoutPlan
    gpu: Any
    instances: list[_Gi]
    profiles: dict[str, _Profile]


def _create_steps(
    nvml: Any, gpu: Any, index: int, placements: Sequence[Placement], profiles: dict[str, _Profile]
) -> tuple[CreateStep, ...]:
    steps = []
    offered: dict[str, list[tuple[int, int]]] = {}
    for pl in placements:
        p = profiles.get(pl.profile)
        if p is None:
            raise LayoutRefused(
                "invalid_layout",
                f"GPU {index}: NVML offers no {pl.profile} GPU instance profile"
                f" (it offers {', '.join(sorted(profiles)) or 'none'})",
            )
        if p.name not in offered:
            offered[p.name] = _possible_placements(nvml, gpu, p.id)
        size = next((size for start, size in offered[p.name] if start == pl.start), None)
        if size is None:
            starts = ", ".join(str(start) for start, _ in offered[p.name])
            raise LayoutRefused(
                "invalid_layout",
                f"GPU {index}: NVML offers {p.name} at {starts or 'no placement'}, not at {pl.start}"
                " where the catalogue places it",
            )
        steps.append(CreateStep(p.name, p.id, pl.start, size, p.slices))
    return tuple(steps)


def _plan(nvml: Any, index: int, layout: Sequence[str], busy: Collection[str]) -> _Planned:
    """The plan (raising ``LayoutRefused``), within an NVML session."""
    try:
        gpu = nvml.nvmlDeviceGetHandleByIndex(index)
        name = _text(nvml.nvmlDeviceGetName(gpu))
        gpu_uuid = _text(nvml.nvmlDeviceGetUUID(gpu))
        total_mib = int(nvml.nvmlDeviceGetMemoryInfo(gpu).total) // _MIB
        _check_mig_mode(nvml, gpu, index)
        model = catalogue_model(name, total_mib)
        if model is None:
            raise LayoutRefused("invalid_layout", f"GPU {index} ({name}) is not in the MIG catalogue")
        try:
            placements = place_layout(model, list(layout))
        except (LayoutError, ValueError) as e:
            raise LayoutRefused("invalid_layout", f"GPU {index}: {e}") from None
        if not placements:
            raise LayoutRefused("invalid_layout", f"GPU {index}: an empty layout leaves no slice")
        profiles = _gpu_profiles(nvml, gpu)
        create = _create_steps(nvml, gpu, index, placements, profiles)
        instances = _gpu_instances(nvml, gpu, profiles)
        old = tuple(g.profile.name for g in instances)
        new = tuple(pl.profile for pl in placements)
        if sorted(old) == sorted(new) and all(g.whole for g in instances):
            raise LayoutRefused("unchanged", f"GPU {index} holds {' + '.join(old)} already")
        found = _busy(nvml, gpu, gpu_uuid, busy)
        if found:
            raise LayoutRefused("busy", f"GPU {index} is busy: {'; '.join(found)}")
    except nvml.NVMLError_NoPermission as e:
        raise LayoutRefused(
            "no_permission", f"GPU {index}: NVML denies managing MIG instances ({e}): it needs root"
        ) from None
    except nvml.NVMLError as e:
        raise LayoutRefused("nvml_error", f"GPU {index}: {e} ({type(e).__name__})") from None
    destroy = tuple(
        DestroyStep(g.gi_id, g.profile.name, g.profile.id, g.start, tuple(c.ci_id for c in g.cis))
        for g in instances
    )
    plan = LayoutPlan(index, gpu_uuid, model.name, old, new, destroy, create)
    return _Planned(plan, gpu, instances, profiles)


@contextmanager
def _session(nvml: Any) -> Iterator[None]:
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        raise NvmlUnavailable(f"NVML unavailable: {e} ({type(e).__name__})") from None
    try:
        yield
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as e:
            log.debug("nvmlShutdown: %s", e)


# --- the public calls -------------------------------------------------------------------------------


def current_layout(nvml: Any, index: int) -> tuple[str, ...]:
    """The profiles of GPU ``index``'s GPU instances, in placement order; ``()`` with MIG off.

    As root every GPU instance counts, one without a compute instance too; otherwise NVML lists only
    MIG devices (GPU instances with a compute instance), placed as ``discover`` places them.
    Raises ``LayoutRefused("nvml_error")`` when the GPU does not answer.
    """
    with _session(nvml):
        try:
            gpu = nvml.nvmlDeviceGetHandleByIndex(index)
            try:
                current = int(nvml.nvmlDeviceGetMigMode(gpu)[0])
            except nvml.NVMLError_NotSupported:
                return ()
            if current != int(nvml.NVML_DEVICE_MIG_ENABLE):
                return ()
            try:
                return tuple(g.profile.name for g in _gpu_instances(nvml, gpu, _gpu_profiles(nvml, gpu)))
            except nvml.NVMLError_NoPermission:
                pass
            name = _text(nvml.nvmlDeviceGetName(gpu))
            model = catalogue_model(name, int(nvml.nvmlDeviceGetMemoryInfo(gpu).total) // _MIB)
            migs = _mig_devices(nvml, gpu)
            _placements(nvml, gpu, model, migs, [])
            return tuple(m.profile for m in sorted(migs, key=lambda m: (m.start or 0, m.gi_id)))
        except nvml.NVMLError as e:
            raise LayoutRefused("nvml_error", f"GPU {index}: {e} ({type(e).__name__})") from None


def plan_layout(
    nvml: Any, index: int, layout: Sequence[str], *, busy: Collection[str] = frozenset()
) -> LayoutPlan:
    """What re-cutting GPU ``index`` to ``layout`` would do: a dry run, which changes nothing.

    ``busy``: UUIDs of the slices held or leased (a GPU with one of them among its MIG devices is
    refused). Raises ``LayoutRefused`` (see the module docstring) or ``NvmlUnavailable``.
    """
    with _session(nvml):
        return _plan(nvml, index, layout, busy).plan


def apply_layout(
    nvml: Any, index: int, layout: Sequence[str], *, busy: Collection[str] = frozenset()
) -> LayoutPlan:
    """Re-cut GPU ``index`` to ``layout`` and return the plan carried out.

    Refuses as ``plan_layout`` does, checks ``busy`` and the GPU's processes again right before the
    first change, then destroys every compute instance and GPU instance and creates the new ones.
    When a step fails midway, puts the old layout back as far as it can and raises
    ``LayoutRefused("nvml_error")`` saying what the GPU holds now.
    """
    with _session(nvml):
        planned = _plan(nvml, index, layout, busy)
        plan = planned.plan
        try:
            found = _busy(nvml, planned.gpu, plan.gpu_uuid, busy)
        except nvml.NVMLError as e:
            raise LayoutRefused("nvml_error", f"GPU {index}: {e} ({type(e).__name__})") from None
        if found:
            raise LayoutRefused("busy", f"GPU {index} is busy: {'; '.join(found)}")
        _carry_out(nvml, planned)
        log.info("GPU %d re-cut: %s -> %s", index, " + ".join(plan.old), " + ".join(plan.new))
        return plan


# --- changing the GPU -------------------------------------------------------------------------------


def _create_gpu_instance(nvml: Any, gpu: Any, profile_id: int, start: int, size: int) -> Any:
    placement = nvml.c_nvmlGpuInstancePlacement_t()
    placement.start = start
    placement.size = size
    return nvml.nvmlDeviceCreateGpuInstanceWithPlacement(gpu, profile_id, ctypes.pointer(placement))


def _create_compute_instance(nvml: Any, gi: Any, slices: int) -> Any:
    """One compute instance of ``slices`` compute slices (all of the GPU instance's) in ``gi``."""
    for index in range(int(nvml.NVML_COMPUTE_INSTANCE_PROFILE_COUNT)):
        try:
            info = nvml.nvmlGpuInstanceGetComputeInstanceProfileInfo(
                gi, index, nvml.NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED
            )
        except _not_offered(nvml):
            continue
        if int(info.sliceCount) == slices:
            return nvml.nvmlGpuInstanceCreateComputeInstance(gi, int(info.id))
    raise _StepFailed(f"no compute instance profile of {slices} slices")


def _destroy(nvml: Any, instances: Sequence[_Gi], done: list[str]) -> None:
    """Every compute instance of ``instances``, then the GPU instances; ``done`` lists what went."""
    for g in instances:
        for c in list(g.cis):
            done.append(f"destroying compute instance {c.ci_id} of GPU instance {g.gi_id} ({g})")
            nvml.nvmlComputeInstanceDestroy(c.handle)
            g.cis.remove(c)
    for g in instances:
        done.append(f"destroying GPU instance {g.gi_id} ({g})")
        nvml.nvmlGpuInstanceDestroy(g.handle)


def _create(nvml: Any, gpu: Any, steps: Sequence[CreateStep], done: list[str]) -> None:
    for c in steps:
        done.append(f"creating GPU instance {c.profile}@{c.start}")
        gi = _create_gpu_instance(nvml, gpu, c.profile_id, c.start, c.size)
        done.append(f"creating the compute instance of {c.profile}@{c.start}")
        _create_compute_instance(nvml, gi, c.compute_slices)


def _carry_out(nvml: Any, planned: _Planned) -> None:
    plan = planned.plan
    index = plan.gpu_index
    done: list[str] = []
    try:
        _destroy(nvml, planned.instances, done)
        _create(nvml, planned.gpu, plan.create, done)
        return
    except (nvml.NVMLError, _StepFailed) as e:
        error, step = e, done[-1]
    why = f"{error}, {type(error).__name__}"
    if len(done) == 1:  # the first change failed: nothing changed
        if isinstance(error, nvml.NVMLError_NoPermission):
            raise LayoutRefused(
                "no_permission", f"GPU {index}: NVML denies {step} ({why}): it needs root; nothing changed"
            ) from None
        if isinstance(error, nvml.NVMLError_InUse):
            raise LayoutRefused("busy", f"GPU {index}: {step}: in use ({why}); nothing changed") from None
        raise LayoutRefused("nvml_error", f"GPU {index}: {step} failed ({why}); nothing changed") from None
    old = [
        CreateStep(g.profile.name, g.profile.id, g.start, g.size, g.profile.slices) for g in planned.instances
    ]
    outcome = _restore(nvml, planned.gpu, old, planned.profiles)
    raise LayoutRefused("nvml_error", f"GPU {index}: {step} failed ({why}); {outcome}") from None


def _restore(nvml: Any, gpu: Any, old: Sequence[CreateStep], profiles: dict[str, _Profile]) -> str:
    """Put the old layout back: keep its GPU instances still there (with a compute instance added
    where theirs went), destroy any other, create those missing. Says what the GPU holds after."""
    old_text = " + ".join(f"{c.profile}@{c.start}" for c in old) or "no GPU instances"
    try:
        now = _gpu_instances(nvml, gpu, profiles)
        missing = list(old)
        stray = []
        for g in now:
            match = next((c for c in missing if (c.profile, c.start) == (g.profile.name, g.start)), None)
            if match is None:
                stray.append(g)
                continue
            missing.remove(match)
            if not g.cis:
                _create_compute_instance(nvml, g.handle, g.profile.slices)
        _destroy(nvml, stray, [])
        _create(nvml, gpu, missing, [])
    except (nvml.NVMLError, _StepFailed) as e:
        restore_error: str | None = f"{e}, {type(e).__name__}"
    else:
        restore_error = None
    try:
        after = _gpu_instances(nvml, gpu, profiles)
    except nvml.NVMLError as e:
        held = f"what the GPU holds could not be read ({e}, {type(e).__name__})"
        if restore_error is None:
            return f"the old layout {old_text} was put back, but {held}"
        return f"putting the old layout {old_text} back failed ({restore_error}) and {held}"
    held_text = (
        " + ".join(str(g) if g.whole else f"{g} ({len(g.cis)} compute instances)" for g in after)
        or "no GPU instances"
    )
    restored = sorted((g.profile.name, g.start) for g in after) == sorted((c.profile, c.start) for c in old)
    if restored and all(g.cis for g in after):
        return f"the old layout {old_text} was put back (MIG devices created again have new UUIDs)"
    if restore_error is None:
        restore_error = "the GPU holds another layout"
    return f"putting the old layout {old_text} back failed ({restore_error}): the GPU holds {held_text}"
