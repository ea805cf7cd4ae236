"""MIG catalogue: GPU models, their MIG profiles and valid placements; layout validation.

Figures follow NVIDIA's MIG user guide ("Supported MIG Profiles": which profiles a GPU has and how
many instances of each) and real ``nvidia-smi mig -lgip`` / ``-lgipp`` output (memory and
placements). Memory is the profile's size in MiB as NVML reports it (``memorySizeMB``;
``nvidia-smi mig -lgip`` prints it in GiB with two decimals; sizes come in 64 MiB units, which
those decimals tell apart, so 5.81 GiB is 5952 MiB and 19.62 GiB is 20096 MiB). Placements are
start positions in memory-slice units, as ``nvidia-smi mig -lgipp`` lists them (``{0,2,4,6}:2``:
starts 0, 2, 4, 6, two slices wide). The driver version can move a profile's memory by a fraction
of a GiB; where sources disagree, the comment beside the model says so and which figure is kept.
On a real GPU, NVML's answers are authoritative; this catalogue serves declared (emulated)
inventories, the simulator, and NVML discovery where placements cannot be read.

Media extensions: a ``+me`` profile (``1g.10gb+me``) has the memory, compute and placements of
its plain profile plus media engines the GPU has only one of (the optical-flow accelerator, and on
the A100 and A30 the JPEG decoder). NVIDIA lists one instance at most, and since the engines exist
once, a GPU holds at most one ``+me`` instance of any profile (the A30 has two ``+me`` profiles,
never together).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

MEDIA_EXTENSION = "+me"
"""Suffix of the profiles that take the GPU's media engines."""


@dataclass(frozen=True)
class MigProfile:
    name: str
    compute_slots: int
    """g in ``<g>g.<mem>gb``: compute slices out of the GPU's total."""
    mem_slots: int
    """How many memory slices the instance occupies (its placement width)."""
    mem_mib: int
    max_count: int
    starts: tuple[int, ...]
    """Valid placement start positions, in memory-slice units."""

    @property
    def media_extension(self) -> bool:
        """Whether the profile takes the GPU's media engines (``+me``): one such instance per GPU."""
        return self.name.endswith(MEDIA_EXTENSION)


@dataclass(frozen=True)
class GpuModel:
    name: str
    total_mem_mib: int
    compute_slots: int
    mem_slots: int
    profiles: tuple[MigProfile, ...]

    def profile(self, name: str) -> MigProfile:
        for p in self.profiles:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.profiles)
        raise ValueError(f"GPU {self.name} has no MIG profile {name!r} (known: {known})")


def id_token(profile: str) -> str:
    """A profile name as it may appear in ids (slice ids, KV keys, Ray resources), where ``+`` is
    not allowed: ``1g.10gb+me`` becomes ``1g.10gb_me``; plain names are unchanged."""
    return profile.replace("+", "_")


_ONE_SLICE_STARTS = (0, 1, 2, 3, 4, 5, 6)
"""Where a one-memory-slice instance of a seven-slice GPU may start (slot 7 holds none)."""

# A100-SXM4-40GB. Profiles and counts: MIG user guide, A100 table (1g.5gb+me from R470, 1g.10gb
# from R525). Memory: ``nvidia-smi mig -lgip`` on A100-SXM4-40GB, as four independent cluster and
# workstation guides print it: 1g.5gb 4.75, 1g.5gb+me 4.75, 1g.10gb 9.62, 2g.10gb 9.62, 3g.20gb
# 19.50, 4g.20gb 19.50, 7g.40gb 39.25 GiB (two other outputs print 9.75 / 19.62 for the two- and
# four-slice profiles; kept at the figures most sources show). Placements: the MIG user guide's A100
# diagram, {0..6}:1 (both 1g.5gb), {0,2,4,6}:2, {0,2,4}:2, {0,4}:4, {0}:4, {0}:8 in ``-lgipp``
# notation (the same geometry as the H100 NVL's ``-lgipp`` below).
A100_40GB = GpuModel(
    name="A100-40GB",
    total_mem_mib=40960,
    compute_slots=7,
    mem_slots=8,
    profiles=(
        MigProfile("1g.5gb", 1, 1, 4864, 7, _ONE_SLICE_STARTS),
        MigProfile("1g.5gb+me", 1, 1, 4864, 1, _ONE_SLICE_STARTS),
        MigProfile("1g.10gb", 1, 2, 9856, 4, (0, 2, 4, 6)),
        MigProfile("2g.10gb", 2, 2, 9856, 3, (0, 2, 4)),
        MigProfile("3g.20gb", 3, 4, 19968, 2, (0, 4)),
        MigProfile("4g.20gb", 4, 4, 19968, 1, (0,)),
        MigProfile("7g.40gb", 7, 8, 40192, 1, (0,)),
    ),
)

# A100-SXM4-80GB / A100 80GB PCIe. Profiles and counts: MIG user guide (the A100 table with the
# 80GB names). Memory: ``nvidia-smi mig -lgip`` on an A100 80GB PCIe, driver 515.86.01: 1g.10gb
# 9.50, 1g.10gb+me 9.50, 2g.20gb 19.50, 3g.40gb 39.25, 4g.40gb 39.25, 7g.80gb 79.00 GiB (the MIG
# devices show 9728 and 19968 MiB); other outputs print 79.12 or 79.25 for 7g.80gb. No ``-lgip``
# with 1g.20gb (R525+) was found: kept at 2g.20gb's memory, as on every GPU where both appear.
# Placements: as on the A100 40GB (same GA100 geometry).
A100_80GB = GpuModel(
    name="A100-80GB",
    total_mem_mib=81920,
    compute_slots=7,
    mem_slots=8,
    profiles=(
        MigProfile("1g.10gb", 1, 1, 9728, 7, _ONE_SLICE_STARTS),
        MigProfile("1g.10gb+me", 1, 1, 9728, 1, _ONE_SLICE_STARTS),
        MigProfile("1g.20gb", 1, 2, 19968, 4, (0, 2, 4, 6)),
        MigProfile("2g.20gb", 2, 2, 19968, 3, (0, 2, 4)),
        MigProfile("3g.40gb", 3, 4, 40192, 2, (0, 4)),
        MigProfile("4g.40gb", 4, 4, 40192, 1, (0,)),
        MigProfile("7g.80gb", 7, 8, 80896, 1, (0,)),
    ),
)

# H100 80GB HBM3 (SXM5) / H100 PCIe. Profiles and counts: MIG user guide, H100 80GB table. Memory:
# ``nvidia-smi mig -lgip`` on H100 SXM5 80GB nodes (StackHPC Slurm appliance MIG docs; several
# field notes, same figures): 1g.10gb 9.75, 1g.10gb+me 9.75, 1g.20gb 19.62, 2g.20gb 19.62,
# 3g.40gb 39.50, 4g.40gb 39.50, 7g.80gb 79.25 GiB (an older driver printed 9.62 / 19.50 / 39.25).
# Placements: ``-lgipp`` of the GH100 (listed with the H100 NVL below), the same on every Hopper.
H100_80GB = GpuModel(
    name="H100-80GB",
    total_mem_mib=81559,
    compute_slots=7,
    mem_slots=8,
    profiles=(
        MigProfile("1g.10gb", 1, 1, 9984, 7, _ONE_SLICE_STARTS),
        MigProfile("1g.10gb+me", 1, 1, 9984, 1, _ONE_SLICE_STARTS),
        MigProfile("1g.20gb", 1, 2, 20096, 4, (0, 2, 4, 6)),
        MigProfile("2g.20gb", 2, 2, 20096, 3, (0, 2, 4)),
        MigProfile("3g.40gb", 3, 4, 40448, 2, (0, 4)),
        MigProfile("4g.40gb", 4, 4, 40448, 1, (0,)),
        MigProfile("7g.80gb", 7, 8, 81152, 1, (0,)),
    ),
)

# H100 NVL / H100 94GB. Profiles and counts: MIG user guide, H100 94GB table. Memory and placements:
# ``nvidia-smi mig -lgip`` and ``-lgipp`` on an Azure NC40ads H100 v5 (H100 NVL, driver 560.35.03;
# the same ``-lgip`` is quoted in NVIDIA/gpu-operator#900 and NVIDIA/mig-parted#101): 1g.12gb
# 10.75, 1g.12gb+me 10.75, 1g.24gb 21.62, 2g.24gb 21.62, 3g.47gb 46.38, 4g.47gb 46.38, 7g.94gb
# 93.12 GiB (MIG devices 11008, 22144, 47488 MiB); placements {0..6}:1 (both 1g.12gb), {0,2,4,6}:2,
# {0,2,4}:2, {0,4}:4, {0}:4, {0}:8. Another driver printed 46.12 / 92.62 for 4g.47gb / 7g.94gb.
H100_94GB = GpuModel(
    name="H100-94GB",
    total_mem_mib=95830,
    compute_slots=7,
    mem_slots=8,
    profiles=(
        MigProfile("1g.12gb", 1, 1, 11008, 7, _ONE_SLICE_STARTS),
        MigProfile("1g.12gb+me", 1, 1, 11008, 1, _ONE_SLICE_STARTS),
        MigProfile("1g.24gb", 1, 2, 22144, 4, (0, 2, 4, 6)),
        MigProfile("2g.24gb", 2, 2, 22144, 3, (0, 2, 4)),
        MigProfile("3g.47gb", 3, 4, 47488, 2, (0, 4)),
        MigProfile("4g.47gb", 4, 4, 47488, 1, (0,)),
        MigProfile("7g.94gb", 7, 8, 95360, 1, (0,)),
    ),
)

# H200 141GB (SXM5 / NVL). Profiles and counts: MIG user guide, H200 table. Memory: ``nvidia-smi mig
# -lgip`` of an 8-GPU H200 node in NVIDIA/mig-parted#120: 1g.18gb 16.00, 1g.18gb+me 16.00, 1g.35gb
# 32.25, 2g.35gb 32.25, 3g.71gb 69.50, 4g.71gb 69.50, 7g.141gb 139.75 GiB (another driver printed
# 32.50 and 140.00). No ``-lgipp`` of an H200 was found: placements as on the H100 (same GH100).
H200_141GB = GpuModel(
    name="H200-141GB",
    total_mem_mib=143771,
    compute_slots=7,
    mem_slots=8,
    profiles=(
        MigProfile("1g.18gb", 1, 1, 16384, 7, _ONE_SLICE_STARTS),
        MigProfile("1g.18gb+me", 1, 1, 16384, 1, _ONE_SLICE_STARTS),
        MigProfile("1g.35gb", 1, 2, 33024, 4, (0, 2, 4, 6)),
        MigProfile("2g.35gb", 2, 2, 33024, 3, (0, 2, 4)),
        MigProfile("3g.71gb", 3, 4, 71168, 2, (0, 4)),
        MigProfile("4g.71gb", 4, 4, 71168, 1, (0,)),
        MigProfile("7g.141gb", 7, 8, 143104, 1, (0,)),
    ),
)

# A30 24GB. Profiles and counts: MIG user guide, A30 table (1g.6gb+me from R470, 2g.12gb+me from
# R525; four compute and four memory slices). Memory and placements: ``nvidia-smi mig -lgip`` and
# ``-lgipp`` on an A30, driver 535.183.01: 1g.6gb 5.81, 1g.6gb+me 5.81, 2g.12gb 11.69,
# 2g.12gb+me 11.69 GiB (MIG devices 5952 and 11968 MiB); {0,1,2,3}:1 (both 1g.6gb), {0,2}:2 (both
# 2g.12gb), {0}:4. 4g.24gb: 23.50 GiB in two other ``-lgip`` outputs, 23.44 on that driver; 23.50 kept.
A30_24GB = GpuModel(
    name="A30-24GB",
    total_mem_mib=24576,
    compute_slots=4,
    mem_slots=4,
    profiles=(
        MigProfile("1g.6gb", 1, 1, 5952, 4, (0, 1, 2, 3)),
        MigProfile("1g.6gb+me", 1, 1, 5952, 1, (0, 1, 2, 3)),
        MigProfile("2g.12gb", 2, 2, 11968, 2, (0, 2)),
        MigProfile("2g.12gb+me", 2, 2, 11968, 1, (0, 2)),
        MigProfile("4g.24gb", 4, 4, 24064, 1, (0,)),
    ),
)

CATALOGUE: dict[str, GpuModel] = {
    gpu.name: gpu for gpu in (A30_24GB, A100_40GB, A100_80GB, H100_80GB, H100_94GB, H200_141GB)
}


def gpu_model(name: str) -> GpuModel:
    try:
        return CATALOGUE[name]
    except KeyError:
        known = ", ".join(sorted(CATALOGUE))
        raise ValueError(f"unknown GPU model {name!r} (known: {known})") from None


@dataclass(frozen=True)
class Placement:
    profile: str
    start: int


class LayoutError(ValueError):
    """A MIG layout that the GPU cannot hold."""


def _check_media_extensions(gpu: GpuModel, profiles: Sequence[MigProfile]) -> None:
    """At most one ``+me`` instance per GPU: each takes the GPU's only optical-flow accelerator."""
    media = [p.name for p in profiles if p.media_extension]
    if len(media) > 1:
        raise LayoutError(
            f"{gpu.name}: at most one media-extension (+me) instance per GPU, got {' + '.join(media)}"
        )


def place_layout(gpu: GpuModel, profiles: Sequence[str]) -> tuple[Placement, ...]:
    """Find placements for a list of profile names, or raise ``LayoutError``.

    Larger instances are placed first; the search is exhaustive (layouts have at most 7 entries),
    and the first valid assignment in start order is returned, so the result is deterministic.
    """
    wanted = sorted((gpu.profile(name) for name in profiles), key=lambda p: (-p.mem_slots, -p.compute_slots))
    counts: dict[str, int] = {}
    for p in wanted:
        counts[p.name] = counts.get(p.name, 0) + 1
        if counts[p.name] > p.max_count:
            raise LayoutError(f"{gpu.name}: at most {p.max_count} x {p.name}")
    _check_media_extensions(gpu, wanted)
    if sum(p.compute_slots for p in wanted) > gpu.compute_slots:
        raise LayoutError(f"{gpu.name}: layout needs more than {gpu.compute_slots} compute slices")
    used = [False] * gpu.mem_slots
    chosen: list[Placement] = []

    def search(i: int) -> bool:
        if i == len(wanted):
            return True
        p = wanted[i]
        for start in p.starts:
            span = range(start, start + p.mem_slots)
            if span.stop > gpu.mem_slots or any(used[s] for s in span):
                continue
            for s in span:
                used[s] = True
            chosen.append(Placement(p.name, start))
            if search(i + 1):
                return True
            chosen.pop()
            for s in span:
                used[s] = False
        return False

    if not search(0):
        raise LayoutError(f"{gpu.name}: no valid placement for {' + '.join(profiles)}")
    return tuple(sorted(chosen, key=lambda pl: pl.start))


def validate_placements(gpu: GpuModel, placements: Sequence[Placement]) -> None:
    """Check explicit placements (as NVML reports them) against the catalogue."""
    used = [False] * gpu.mem_slots
    counts: dict[str, int] = {}
    compute = 0
    media = 0
    for pl in placements:
        p = gpu.profile(pl.profile)
        if pl.start not in p.starts:
            raise LayoutError(f"{gpu.name}: {p.name} cannot start at {pl.start}")
        counts[p.name] = counts.get(p.name, 0) + 1
        if counts[p.name] > p.max_count:
            raise LayoutError(f"{gpu.name}: at most {p.max_count} x {p.name}")
        compute += p.compute_slots
        if p.media_extension:
            media += 1
            if media > 1:
                raise LayoutError(f"{gpu.name}: at most one media-extension (+me) instance per GPU")
        for s in range(pl.start, pl.start + p.mem_slots):
            if used[s]:
                raise LayoutError(f"{gpu.name}: {p.name}@{pl.start} overlaps another instance")
            used[s] = True
    if compute > gpu.compute_slots:
        raise LayoutError(f"{gpu.name}: layout uses {compute} > {gpu.compute_slots} compute slices")


def enumerate_layouts(gpu: GpuModel, maximal_only: bool = True) -> Iterator[tuple[Placement, ...]]:
    """Every valid layout of a GPU (as sorted placements), deterministic order.

    With ``maximal_only`` only layouts to which no further instance can be added are yielded.
    """
    options = [Placement(p.name, s) for p in gpu.profiles for s in p.starts]
    options.sort(key=lambda pl: (pl.start, pl.profile))

    def fits(current: list[Placement], pl: Placement) -> bool:
        try:
            validate_placements(gpu, [*current, pl])
        except LayoutError:
            return False
        return True

    def rec(i: int, current: list[Placement]) -> Iterator[tuple[Placement, ...]]:
        if i == len(options):
            if current and (not maximal_only or not any(fits(current, o) for o in options)):
                yield tuple(current)
            return
        pl = options[i]
        if fits(current, pl):
            current.append(pl)
            yield from rec(i + 1, current)
            current.pop()
        yield from rec(i + 1, current)

    yield from rec(0, [])
