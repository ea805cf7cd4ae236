"""Re-cutting idle GPUs: which MIG layout best serves the work waiting for slices.

A MIG GPU's layout can change only while none of its instances runs anything (NVIDIA's MIG user
guide: instances are destroyed and created again; the GPU offers nothing meanwhile). The decision
is pure: given the GPUs that are entirely idle, their current layouts and the demand that nothing
free could serve, pick for each GPU the maximal layout (``mig.enumerate_layouts``) that serves the
most of that demand, and keep the current layout unless another is strictly better.

Demand is a list of slices wanted, in priority order (the scheduler's queue order): each wants an
instance with at least ``mem_mib`` of memory (and, when ``profiles`` is given, of one of those
profiles: what the job's own planner accepts) and can use up to ``compute_share`` of a full GPU. A
layout's value for a demand list is computed greedily, in that order: each item takes the smallest
unused instance (by memory, then compute) that holds it. The value is ``(rate, served)``: the total
compute the served items can use (``min(instance share, item share)``), then how many were served.
A GPU is re-cut only when another layout's *rate* is strictly higher: cutting a GPU into seven
slices for seven whole-GPU jobs serves more jobs at no gain in throughput and costs a
reconfiguration; cutting it for seven jobs that each use a seventh gives seven times the throughput.
Among the layouts of the highest rate, the one serving the most items wins, then the first in
``maximal_layouts`` order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from sja.core.mig import GpuModel, enumerate_layouts, gpu_model, place_layout

MAX_DEMAND_ITEMS = 64
"""Demand items considered per GPU: enough for any layout (at most 7 instances) to pick from."""


@dataclass(frozen=True)
class SliceDemand:
    """One slice wanted by waiting work."""

    mem_mib: float
    """Smallest instance memory (MiB, as the catalogue lists it) the work can run in."""
    compute_share: float = 1.0
    """Largest compute share of a full GPU the work can use (a faster instance does not help)."""
    key: str = ""
    """Who wants it (a job id): opaque to the decision, returned to the caller."""
    profiles: frozenset[str] | None = None
    """The only profiles it can run on (``None``: any holding ``mem_mib``)."""

    def fits(self, profile: str, mem_mib: float) -> bool:
        return mem_mib >= self.mem_mib and (self.profiles is None or profile in self.profiles)


@dataclass(frozen=True)
class Repartition:
    """Re-cut ``gpu_id`` from ``old`` to ``new``; ``serves`` are the demand items the new layout holds."""

    gpu_id: str
    old: tuple[str, ...]
    new: tuple[str, ...]
    serves: tuple[SliceDemand, ...]


@cache
def _maximal_layouts(model_name: str) -> tuple[tuple[str, ...], ...]:
    gpu = gpu_model(model_name)
    seen: set[tuple[str, ...]] = set()
    out: list[tuple[str, ...]] = []
    for placements in enumerate_layouts(gpu, maximal_only=True):
        key = tuple(sorted(pl.profile for pl in placements))
        if key in seen:
            continue
        seen.add(key)
        out.append(tuple(pl.profile for pl in placements))
    return tuple(out)


def maximal_layouts(gpu: GpuModel) -> tuple[tuple[str, ...], ...]:
    """Every maximal layout of a catalogue GPU, one per multiset of profiles, in placement order,
    deterministic."""
    return _maximal_layouts(gpu.name)


def canonical_layout(gpu: GpuModel, layout: Sequence[str] | None) -> tuple[str, ...]:
    """A layout as its profiles in placement order; ``None`` (a whole GPU) is the largest profile."""
    if layout is None:
        whole = max(gpu.profiles, key=lambda p: (p.compute_slots, p.mem_slots))
        return (whole.name,)
    return tuple(pl.profile for pl in place_layout(gpu, layout))


def assign(
    gpu: GpuModel, layout: Sequence[str], demand: Sequence[SliceDemand]
) -> tuple[float, int, tuple[int, ...]]:
    """Greedy assignment of ``demand`` (in order) to the instances of ``layout``.

    Returns ``(rate, served, indices of the served items)``.
    """
    free = sorted((gpu.profile(name).mem_mib, gpu.profile(name).compute_slots, name) for name in layout)
    rate = 0.0
    served: list[int] = []
    for i, item in enumerate(demand):
        if not free:
            break
        for pos, (mem, slots, name) in enumerate(free):
            if item.fits(name, mem):
                del free[pos]
                served.append(i)
                rate += min(slots / gpu.compute_slots, max(item.compute_share, 0.0))
                break
    return rate, len(served), tuple(served)


def layout_value(gpu: GpuModel, layout: Sequence[str], demand: Sequence[SliceDemand]) -> tuple[float, int]:
    """``(rate, served)`` of a layout for a demand list (see the module docstring)."""
    rate, served, _ = assign(gpu, layout, demand)
    return round(rate, 9), served


def choose_layout(
    gpu: GpuModel, current: Sequence[str] | None, demand: Sequence[SliceDemand]
) -> tuple[str, ...] | None:
    """The layout an idle GPU should be re-cut to for ``demand``, or ``None`` to keep ``current``.

    Only a layout of strictly higher rate than the current one is returned (see the module
    docstring); the choice is deterministic.
    """
    items = list(demand[:MAX_DEMAND_ITEMS])
    if not items:
        return None
    cur_rate, _ = layout_value(gpu, canonical_layout(gpu, current), items)
    best_value = (cur_rate, -1)
    best: tuple[str, ...] | None = None
    for layout in maximal_layouts(gpu):
        value = layout_value(gpu, layout, items)
        if value[0] > cur_rate and value > best_value:
            best_value, best = value, layout
    return best


def plan_repartitions(
    gpus: Sequence[tuple[str, GpuModel, Sequence[str] | None]], demand: Sequence[SliceDemand]
) -> list[Repartition]:
    """Re-cuts for idle GPUs ``(gpu_id, model, current layout)``, taken in the given order.

    Each GPU is chosen for the demand the GPUs before it (re-cut or kept) did not serve, so several
    idle GPUs do not all re-cut for the same few jobs.
    """
    remaining = list(demand)
    out: list[Repartition] = []
    for gpu_id, gpu, current in gpus:
        if not remaining:
            break
        cur = canonical_layout(gpu, current)
        new = choose_layout(gpu, cur, remaining)
        layout = new if new is not None else cur
        window = remaining[:MAX_DEMAND_ITEMS]
        _, _, served = assign(gpu, layout, window)
        if new is not None:
            out.append(Repartition(gpu_id, cur, new, tuple(window[i] for i in served)))
        taken = set(served)
        remaining = [d for i, d in enumerate(window) if i not in taken] + remaining[MAX_DEMAND_ITEMS:]
    return out
