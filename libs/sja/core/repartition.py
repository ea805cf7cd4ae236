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
unused instance (by memory, then compute) that holds it. Its *rate* is the total compute the served
items can use (``min(instance share, item share)``).

Layouts are ranked by ``(rate, fewer instances)`` and a GPU is re-cut only to a layout that serves
some of the demand and is ranked strictly above its current one; among equals the first in
``maximal_layouts`` order wins. Rate first: cutting a GPU into seven slices for seven jobs that each
use a seventh gives seven times the throughput. Fewer instances second: seven whole-GPU jobs on
seven 1g slices have the rate of one on the whole GPU, but each runs at a seventh of its speed, a
job limited to a few subjobs at once cannot make up for it, and small slices hold less memory; so a
GPU is not cut for them, and a GPU cut for small jobs is made whole again once it is idle and
whole-GPU jobs wait.
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

    Only a layout ranked strictly above the current one (see ``layout_rank``) is returned; the
    choice is deterministic.
    """
    items = list(demand[:MAX_DEMAND_ITEMS])
    if not items:
        return None
    best_rank = layout_rank(gpu, canonical_layout(gpu, current), items)
    best: tuple[str, ...] | None = None
    for layout in maximal_layouts(gpu):
        rank = layout_rank(gpu, layout, items)
        if rank[0] > 0.0 and rank > best_rank:  # never re-cut for demand nothing can serve
            best_rank, best = rank, layout
    return best


def layout_rank(gpu: GpuModel, layout: Sequence[str], demand: Sequence[SliceDemand]) -> tuple[float, int]:
    """``(rate, -instances)``: how layouts are compared for a demand list (higher is better)."""
    return layout_value(gpu, layout, demand)[0], -len(layout)


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
