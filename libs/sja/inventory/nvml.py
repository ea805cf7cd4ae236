"""Slices from NVML: GPUs, their MIG mode and instances, as the same slice states a declared file gives.

``discover`` reads an injected ``nvml`` module (the real ``pynvml`` or ``FakeNvml``) and does no
other I/O. What becomes a slice:

- a GPU with MIG on: one slice per GPU instance (``source="nvml"``), named by its profile
  (``1g.10gb``), with the MIG device's UUID (``MIG-...``, what ``CUDA_VISIBLE_DEVICES`` takes), the
  instance's memory and its placement start. Profile ids and placements come from NVML's GPU
  instance queries; an unprivileged user cannot make those (``NoPermission``), and then placements
  are derived from the catalogue (``sja.core.mig.place_layout``) from the instances' profiles.
  A GPU instance cut into several compute instances shares its memory among them: it stays one
  slice, run through its first compute instance;
- a GPU with MIG off (or enabled but pending a reset): one whole-GPU slice (``source="whole"``),
  or, when ``soft_slices`` says so, several memory-capped soft slices (``source="soft"``) that share
  the GPU's compute and are held to their memory by the executor;
- a GPU that answers ``GpuIsLost`` (or any other error) is skipped and named in ``lost``: its
  slices vanish from the discovery, and the inventory marks them offline.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sja.core.mig import CATALOGUE, GpuModel, LayoutError, MigProfile, place_layout, validate_placements
from sja.core.mig import Placement as MigPlacement
from sja.inventory.declared import InventoryError, slice_id
from sja.protocol.messages import SliceState

log = logging.getLogger(__name__)

_MIB = 1024 * 1024
# ``MIG 1g.10gb``, ``MIG 1g.10gb+me``, ``MIG 1c.3g.40gb`` (a compute instance of a 3g.40gb): the profile
# is ``<g>g.<mem>gb`` with its suffix (``+me``, and the ``-me``, ``+gfx``, ``+me.all`` of newer GPUs),
# which names a different profile and so stays part of the name.
_MIG_NAME = re.compile(r"MIG\s+(?:\d+c\.)?(\d+g\.\d+gb(?:[+-][a-z]+(?:\.[a-z]+)?)?)", re.IGNORECASE)
_FAMILIES = ("A30", "A100", "H100", "H200")


class NvmlUnavailable(InventoryError):
    """NVML cannot be used at all: no driver library, or its initialization failed."""


@dataclass(frozen=True)
class SoftSlices:
    """How a GPU without MIG is cut: ``count`` equal slices, or explicit sizes in MiB; neither: whole."""

    count: int = 0
    sizes_mib: tuple[int, ...] = ()

    @property
    def whole(self) -> bool:
        return self.count <= 1 and not self.sizes_mib

    @classmethod
    def parse(cls, spec: str) -> SoftSlices:
        """``""`` or ``"1"``: whole; ``"4"``: four equal slices; ``"20000,20000,40000"``: sizes in MiB.

        A single number of at most 16 is a count; anything else is a list of sizes.
        """
        spec = spec.strip()
        if not spec:
            return cls()
        try:
            values = [int(v) for v in spec.split(",") if v.strip()]
        except ValueError:
            raise InventoryError(f"soft slices: expected a count or MiB sizes, got {spec!r}") from None
        if not values or any(v < 1 for v in values):
            raise InventoryError(f"soft slices: values must be positive, got {spec!r}")
        if len(values) == 1 and values[0] <= 16:
            return cls(count=values[0])
        return cls(sizes_mib=tuple(values))

    def sizes_for(self, total_mib: int) -> list[int]:
        if self.sizes_mib:
            if sum(self.sizes_mib) > total_mib:
                raise InventoryError(
                    f"soft slices of {sum(self.sizes_mib)} MiB exceed the GPU's {total_mib} MiB"
                )
            return list(self.sizes_mib)
        n = max(self.count, 1)
        return [total_mib // n] * n


@dataclass
class Discovery:
    """What one NVML read found."""

    slices: list[SliceState] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    """GPUs (``index: reason``) that did not answer and whose slices are therefore gone."""
    warnings: list[str] = field(default_factory=list)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def catalogue_model(name: str, total_mib: int) -> GpuModel | None:
    """The catalogue model of an NVML device name (``NVIDIA H100 80GB HBM3``), closest in memory."""
    upper = name.upper()
    family = next((f for f in _FAMILIES if re.search(rf"(?<![A-Z0-9]){f}(?![0-9])", upper)), None)
    if family is None:
        return None
    candidates = [m for m in CATALOGUE.values() if m.name.startswith(family + "-")]
    if not candidates:
        return None
    return min(candidates, key=lambda m: abs(m.total_mem_mib - total_mib))


def _model_name(name: str, model: GpuModel | None) -> str:
    if model is not None:
        return model.name
    short = re.sub(r"^NVIDIA\s+", "", name).strip()
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", short) or "unknown"


def _catalogue_profile(model: GpuModel | None, name: str) -> MigProfile | None:
    if model is None:
        return None
    return next((p for p in model.profiles if p.name == name), None)


@dataclass
class _Mig:
    uuid: str
    profile: str
    gi_id: int
    ci_id: int
    mem_mib: int
    start: int | None = None
    compute_slots: int = 1


def mig_profile(name: Any) -> str | None:
    """The GPU instance profile a MIG device or profile name names, or ``None``:
    ``NVIDIA H100 80GB HBM3 MIG 1g.10gb+me`` gives ``1g.10gb+me``, ``MIG 1c.3g.40gb`` gives ``3g.40gb``."""
    found = _MIG_NAME.search(_text(name))
    return found.group(1).lower() if found is not None else None


def mig_device_handles(nvml: Any, gpu: Any) -> Iterator[Any]:
    """The handle of each MIG device of a GPU (one per compute instance)."""
    for i in range(int(nvml.nvmlDeviceGetMaxMigDeviceCount(gpu))):
        try:
            yield nvml.nvmlDeviceGetMigDeviceHandleByIndex(gpu, i)
        except nvml.NVMLError_NotFound:
            continue  # an empty index: instances need not be contiguous


def _mig_devices(nvml: Any, gpu: Any) -> list[_Mig]:
    """Every MIG device of a GPU, one per GPU instance (the lowest compute instance)."""
    by_gi: dict[int, _Mig] = {}
    for mig in mig_device_handles(nvml, gpu):
        name = _text(nvml.nvmlDeviceGetName(mig))
        profile = mig_profile(name)
        if profile is None:
            raise InventoryError(f"MIG device name {name!r} names no profile")
        gi_id = int(nvml.nvmlDeviceGetGpuInstanceId(mig))
        ci_id = int(nvml.nvmlDeviceGetComputeInstanceId(mig))
        mem_mib = int(nvml.nvmlDeviceGetMemoryInfo(mig).total) // _MIB
        g = int(profile.split("g.")[0])
        entry = _Mig(
            uuid=_text(nvml.nvmlDeviceGetUUID(mig)),
            profile=profile,
            gi_id=gi_id,
            ci_id=ci_id,
            mem_mib=mem_mib,
            compute_slots=g,
        )
        if gi_id not in by_gi or ci_id < by_gi[gi_id].ci_id:
            by_gi[gi_id] = entry
    return sorted(by_gi.values(), key=lambda m: m.gi_id)


def _placements(nvml: Any, gpu: Any, model: GpuModel | None, migs: list[_Mig], warnings: list[str]) -> None:
    """Fill each instance's placement start: from NVML where allowed, else from the catalogue."""
    try:
        for m in migs:
            info = nvml.nvmlGpuInstanceGetInfo(nvml.nvmlDeviceGetGpuInstanceById(gpu, m.gi_id))
            m.start = int(info.placement.start)
        if model is not None:
            validate_placements(model, [MigPlacement(m.profile, m.start or 0) for m in migs])
        return
    except (nvml.NVMLError_NoPermission, nvml.NVMLError_NotSupported) as e:
        warnings.append(f"GPU instance placements not readable ({e}): derived from the catalogue")
    except (LayoutError, ValueError) as e:
        warnings.append(f"placements reported by NVML do not match the catalogue: {e}")
        return
    if model is None:
        for i, m in enumerate(migs):
            m.start = i
        return
    try:
        placed = list(place_layout(model, [m.profile for m in migs]))
    except (LayoutError, ValueError) as e:
        raise InventoryError(f"{model.name}: MIG layout not in the catalogue: {e}") from None
    # Assign starts to instances of each profile in GPU instance id order.
    for m in migs:
        i = next(i for i, pl in enumerate(placed) if pl.profile == m.profile)
        m.start = placed.pop(i).start


def _gpu_slices(
    nvml: Any, index: int, *, node: str, pool: str, soft: SoftSlices, warnings: list[str]
) -> list[SliceState]:
    gpu = nvml.nvmlDeviceGetHandleByIndex(index)
    name = _text(nvml.nvmlDeviceGetName(gpu))
    gpu_uuid = _text(nvml.nvmlDeviceGetUUID(gpu))
    total_mib = int(nvml.nvmlDeviceGetMemoryInfo(gpu).total) // _MIB
    model = catalogue_model(name, total_mib)
    model_name = _model_name(name, model)
    try:
        current, pending = (int(v) for v in nvml.nvmlDeviceGetMigMode(gpu))
    except nvml.NVMLError_NotSupported:
        current = pending = 0
    if pending != current:
        warnings.append(f"GPU {index} ({name}): MIG mode {current} pending {pending} until a GPU reset")

    if current == nvml.NVML_DEVICE_MIG_ENABLE:
        migs = _mig_devices(nvml, gpu)
        if not migs:
            warnings.append(f"GPU {index} ({name}): MIG on but no GPU instances: no slices")
            return []
        _placements(nvml, gpu, model, migs, warnings)
        out = []
        total_slots = model.compute_slots if model is not None else 7
        for m in migs:
            p = _catalogue_profile(model, m.profile)
            compute = p.compute_slots if p is not None else m.compute_slots
            start = m.start or 0
            out.append(
                SliceState(
                    slice_id=slice_id(node, index, m.profile, start),
                    node=node,
                    pool=pool,
                    gpu_index=index,
                    gpu_model=model_name,
                    gpu_uuid=m.uuid,
                    profile=m.profile,
                    mem_mib=m.mem_mib,
                    compute_slots=compute,
                    compute_share=min(compute / total_slots, 1.0),
                    placement_start=start,
                    source="nvml",
                )
            )
        return out

    slots = model.compute_slots if model is not None else 1
    if soft.whole:
        return [
            SliceState(
                slice_id=f"{node}-g{index}-whole",
                node=node,
                pool=pool,
                gpu_index=index,
                gpu_model=model_name,
                gpu_uuid=gpu_uuid,
                profile=f"whole.{round(total_mib / 1024)}gb",
                mem_mib=total_mib,
                compute_slots=slots,
                compute_share=1.0,
                source="whole",
            )
        ]
    out = []
    for k, mem in enumerate(soft.sizes_for(total_mib)):
        share = max(min(mem / total_mib, 1.0), 1e-6)
        out.append(
            SliceState(
                slice_id=f"{node}-g{index}-soft{k}",
                node=node,
                pool=pool,
                gpu_index=index,
                gpu_model=model_name,
                gpu_uuid=gpu_uuid,
                profile=f"soft.{max(round(mem / 1024), 1)}gb",
                mem_mib=mem,
                compute_slots=1,
                compute_share=share,
                placement_start=k,
                source="soft",
            )
        )
    return out


def discover(nvml: Any, *, node: str, pool: str = "", soft_slices: SoftSlices | str = "") -> Discovery:
    """Read every GPU through ``nvml`` and return its slices (all free, fence 0).

    Raises ``NvmlUnavailable`` when NVML cannot be initialized (no driver: ``LibraryNotFound``).
    A GPU that fails (``GpuIsLost`` and the like) is reported in ``lost``, not raised.
    """
    soft = SoftSlices.parse(soft_slices) if isinstance(soft_slices, str) else soft_slices
    pool = pool or node
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        raise NvmlUnavailable(f"NVML unavailable: {e} ({type(e).__name__})") from None
    found = Discovery()
    try:
        for index in range(int(nvml.nvmlDeviceGetCount())):
            try:
                found.slices.extend(
                    _gpu_slices(nvml, index, node=node, pool=pool, soft=soft, warnings=found.warnings)
                )
            except nvml.NVMLError as e:
                found.lost.append(f"{index}: {e} ({type(e).__name__})")
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError as e:
            log.debug("nvmlShutdown: %s", e)
    return found


def load_nvml() -> Any:
    """The real ``pynvml`` module (``nvidia-ml-py``)."""
    import pynvml

    return pynvml


def nvml_for(source: str) -> Any:
    """The NVML module a source names: ``nvml`` (real) or ``fake-nvml:SCENARIO``."""
    if source == "nvml":
        return load_nvml()
    if source.startswith("fake-nvml:"):
        from sja.inventory.fake_nvml import FakeNvml

        try:
            return FakeNvml(source.split(":", 1)[1])
        except ValueError as e:
            raise InventoryError(str(e)) from None
    raise InventoryError(f"not an NVML source: {source!r}")
