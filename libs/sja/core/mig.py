"""MIG catalogue: GPU models, their MIG profiles and valid placements; layout validation.

Figures follow NVIDIA's MIG user guide (supported profiles per GPU, placements given as start
positions in memory-slice units). Memory is the usable size in MiB as ``nvidia-smi mig -lgip``
reports it, rounded to what the driver advertises for the profile. On a real GPU, NVML's placement
queries are authoritative; this catalogue serves declared (emulated) inventories and the simulator.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass


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


A100_40GB = GpuModel(
    name="A100-40GB",
    total_mem_mib=40960,
    compute_slots=7,
    mem_slots=8,
    profiles=(
        MigProfile("1g.5gb", 1, 1, 4864, 7, (0, 1, 2, 3, 4, 5, 6)),
        MigProfile("1g.10gb", 1, 2, 9856, 4, (0, 2, 4, 6)),
        MigProfile("2g.10gb", 2, 2, 9856, 3, (0, 2, 4)),
        MigProfile("3g.20gb", 3, 4, 19968, 2, (0, 4)),
        MigProfile("4g.20gb", 4, 4, 19968, 1, (0,)),
        MigProfile("7g.40gb", 7, 8, 40192, 1, (0,)),
    ),
)

A100_80GB = GpuModel(
    name="A100-80GB",
    total_mem_mib=81920,
    compute_slots=7,
    mem_slots=8,
    profiles=(
        MigProfile("1g.10gb", 1, 1, 9728, 7, (0, 1, 2, 3, 4, 5, 6)),
        MigProfile("1g.20gb", 1, 2, 19968, 4, (0, 2, 4, 6)),
        MigProfile("2g.20gb", 2, 2, 19968, 3, (0, 2, 4)),
        MigProfile("3g.40gb", 3, 4, 40192, 2, (0, 4)),
        MigProfile("4g.40gb", 4, 4, 40192, 1, (0,)),
        MigProfile("7g.80gb", 7, 8, 80384, 1, (0,)),
    ),
)

H100_80GB = GpuModel(
    name="H100-80GB",
    total_mem_mib=81559,
    compute_slots=7,
    mem_slots=8,
    profiles=(
        MigProfile("1g.10gb", 1, 1, 9984, 7, (0, 1, 2, 3, 4, 5, 6)),
        MigProfile("1g.20gb", 1, 2, 20096, 4, (0, 2, 4, 6)),
        MigProfile("2g.20gb", 2, 2, 20096, 3, (0, 2, 4)),
        MigProfile("3g.40gb", 3, 4, 40320, 2, (0, 4)),
        MigProfile("4g.40gb", 4, 4, 40320, 1, (0,)),
        MigProfile("7g.80gb", 7, 8, 80896, 1, (0,)),
    ),
)

H100_94GB = GpuModel(
    name="H100-94GB",
    total_mem_mib=95830,
    compute_slots=7,
    mem_slots=8,
    profiles=(
        MigProfile("1g.12gb", 1, 1, 11776, 7, (0, 1, 2, 3, 4, 5, 6)),
        MigProfile("1g.24gb", 1, 2, 23936, 4, (0, 2, 4, 6)),
        MigProfile("2g.24gb", 2, 2, 23936, 3, (0, 2, 4)),
        MigProfile("3g.47gb", 3, 4, 47488, 2, (0, 4)),
        MigProfile("4g.47gb", 4, 4, 47488, 1, (0,)),
        MigProfile("7g.94gb", 7, 8, 95232, 1, (0,)),
    ),
)

H200_141GB = GpuModel(
    name="H200-141GB",
    total_mem_mib=143771,
    compute_slots=7,
    mem_slots=8,
    profiles=(
        MigProfile("1g.18gb", 1, 1, 16384, 7, (0, 1, 2, 3, 4, 5, 6)),
        MigProfile("1g.35gb", 1, 2, 32768, 4, (0, 2, 4, 6)),
        MigProfile("2g.35gb", 2, 2, 32768, 3, (0, 2, 4)),
        MigProfile("3g.71gb", 3, 4, 71424, 2, (0, 4)),
        MigProfile("4g.71gb", 4, 4, 71424, 1, (0,)),
        MigProfile("7g.141gb", 7, 8, 143360, 1, (0,)),
    ),
)

A30_24GB = GpuModel(
    name="A30-24GB",
    total_mem_mib=24576,
    compute_slots=4,
    mem_slots=4,
    profiles=(
        MigProfile("1g.6gb", 1, 1, 5836, 4, (0, 1, 2, 3)),
        MigProfile("2g.12gb", 2, 2, 11904, 2, (0, 2)),
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
    for pl in placements:
        p = gpu.profile(pl.profile)
        if pl.start not in p.starts:
            raise LayoutError(f"{gpu.name}: {p.name} cannot start at {pl.start}")
        counts[p.name] = counts.get(p.name, 0) + 1
        if counts[p.name] > p.max_count:
            raise LayoutError(f"{gpu.name}: at most {p.max_count} x {p.name}")
        compute += p.compute_slots
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
