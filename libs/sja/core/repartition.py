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

**Draining a busy GPU** (``plan_drains``). Re-cutting only idle GPUs is not enough: while small
work keeps every GPU busy, a job that no instance of the layouts in place can hold (one that needs a
whole GPU's memory on GPUs cut 4g+3g) would wait for ever, and a rigid scheduler with MIG off would
have run it. For demand that nothing in place, nothing being re-cut and no idle GPU's new layout can
hold, the core picks GPUs to *drain*: no new work is granted on them, their holders yield at their
windows' ends (``core.continuation``), and once nothing runs they are re-cut. A drain is priced in
GPU-seconds of useful work it costs: each slice's compute from when it is free until the last
holder has yielded, the reconfiguration time at the GPU's current rate, and
the start-up each interrupted holder pays again. The cheapest GPUs are drained first, only as many
as the starving demand needs. A drain for demand that some layout in place could hold is taken only
where it pays within ``payoff_s``: the new layout's rate for the waiting demand, less what the GPU
does now, over that span, must exceed its cost (a whole GPU held by a job using a seventh of it,
while seven such jobs wait, is re-cut; a GPU whose slices are all well used is not).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache

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


def served_value(instance_share: float, wanted_share: float) -> float:
    """What serving an item that can use ``wanted_share`` of a GPU on an instance of
    ``instance_share`` is worth: the compute it uses, times the fraction of its full speed it runs at
    there. A job that can use a whole GPU counts 1 on a whole GPU and 9/49 on a 3g of 7; a job that
    uses a seventh counts a seventh on a 1g and on a whole GPU alike, so seven of them on seven 1g
    slices count 1."""
    want = max(wanted_share, 1e-9)
    used = min(instance_share, want)
    return used * used / want


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
                rate += served_value(slots / gpu.compute_slots, item.compute_share)
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


def demand_of(
    waiting: Iterable[tuple[str, float, int]],
    profiles_for: Callable[[str], Iterable[str]],
    *,
    limit: int = MAX_DEMAND_ITEMS,
    enough: Callable[[list[SliceDemand]], bool] | None = None,
) -> list[SliceDemand]:
    """What waiting jobs want, in the order given (the policy's queue order): for each
    ``(job id, compute share it can use, subjobs it could still start)``, one slice per subjob (at
    most 7: a GPU holds no more instances) of the profiles ``profiles_for(job id)`` names (those its
    planner would propose for; a job with none is left out). Stops at ``limit`` items, or once
    ``enough(items so far)`` holds."""
    out: list[SliceDemand] = []
    for job_id, share, room in waiting:
        if room <= 0:
            continue
        profiles = frozenset(profiles_for(job_id))
        if not profiles:
            continue
        out.extend([SliceDemand(0.0, share, job_id, profiles)] * min(room, 7))
        if len(out) >= limit or (enough is not None and enough(out)):
            break
    return out[:limit]


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


@dataclass(frozen=True)
class HeldSlice:
    """One instance of a busy GPU, as a drain would see it."""

    profile: str
    share: float
    """Its compute share of the GPU."""
    rate: float
    """What its holder gets from it now, valued as ``assign`` values an item served (0 if free)."""
    frees_in_s: float
    """Seconds until it is free if its holder is asked to yield at its window's end (0 if free)."""
    restart_s: float = 0.0
    """Seconds of start-up its holder pays again when it is interrupted (0 if it ends anyway)."""
    holder: SliceDemand | None = None
    """What its holder wants, if it would go on running after a yield (it then waits with the rest):
    ``held_demand``."""


def held_demand(job_id: str, mem_mib: float, compute_share: float) -> SliceDemand:
    """A holder as demand: it runs in ``mem_mib`` now, so any instance at least as large holds it
    (a job that holds a slice does not bid, so its planner is not asked)."""
    return SliceDemand(mem_mib, compute_share, job_id)


@dataclass(frozen=True)
class BusyGpu:
    """A repartitionable GPU with work running on it."""

    gpu_id: str
    model: GpuModel
    layout: tuple[str, ...]
    slices: tuple[HeldSlice, ...]
    since_recut_s: float = math.inf
    """Seconds since its layout was last changed: one younger than the payoff span is drained only
    for demand nothing in place can hold (its layout was chosen for the demand of then)."""

    @property
    def rate(self) -> float:
        return sum(s.rate for s in self.slices)

    def drain_cost(self, reconfig_s: float) -> float:
        """Useful GPU-seconds a drain and re-cut costs (see the module docstring)."""
        wait = max((s.frees_in_s for s in self.slices), default=0.0)
        idle = sum(s.share * (wait - s.frees_in_s) for s in self.slices)
        restart = sum(s.rate * s.restart_s for s in self.slices)
        return idle + restart + self.rate * reconfig_s


def unservable(
    gpu: GpuModel, layouts: Iterable[Sequence[str]], demand: Sequence[SliceDemand]
) -> list[SliceDemand]:
    """The items of ``demand`` that no instance of any of ``layouts`` could hold."""
    sizes = {(name, gpu.profile(name).mem_mib) for layout in layouts for name in layout}
    return [d for d in demand if not any(d.fits(name, mem) for name, mem in sizes)]


def plan_drains(
    busy: Sequence[BusyGpu],
    demand: Sequence[SliceDemand],
    *,
    in_place: Iterable[Sequence[str]],
    reconfig_s: float,
    payoff_s: float,
) -> list[Repartition]:
    """Busy GPUs to drain and re-cut for ``demand`` (what the idle GPUs' re-cuts left), cheapest first.

    ``in_place`` are the layouts that will hold work without a drain: every GPU's of the model that
    is not in ``busy`` (idle ones at their chosen layouts, those being re-cut or drained at their new
    ones) and the busy GPUs' own. First, demand no layout in place can hold: as many of the
    cheapest GPUs as it needs are drained, each to the layout that serves it best (with the rest of
    the demand after it). Then, any other GPU whose best layout for the remaining demand gains more
    over ``payoff_s`` than its drain costs (see the module docstring).
    """
    if not busy:
        return []
    gpu = busy[0].model
    layouts = [tuple(layout) for layout in in_place] + [b.layout for b in busy]
    cannot = {id(d) for d in unservable(gpu, layouts, demand)}
    starving = [d for d in demand if id(d) in cannot]
    rest = [d for d in demand if id(d) not in cannot]
    order = sorted(busy, key=lambda b: (b.drain_cost(reconfig_s), b.gpu_id))
    out: list[Repartition] = []
    for b in order:
        if not starving:
            break
        items = (starving + rest)[:MAX_DEMAND_ITEMS]
        first = min(len(starving), MAX_DEMAND_ITEMS)
        new = best_layout(b.model, items)
        _, _, served = assign(b.model, new, items)
        if new == b.layout or not any(i < first for i in served):
            continue
        out.append(Repartition(b.gpu_id, b.layout, new, tuple(items[i] for i in served)))
        gone = set(served)
        starving, rest = (
            [d for i, d in enumerate(starving) if i not in gone],
            [d for i, d in enumerate(rest) if i + len(starving) not in gone],
        )
    if payoff_s <= 0:
        return out
    # The GPUs that do least with what they hold first; one such drain per call (the demand is
    # looked at again after it, with the drained GPU's new layout in place).
    for b in sorted(busy, key=lambda b: (b.rate, b.gpu_id)):
        cost = b.drain_cost(reconfig_s)
        if b.since_recut_s < payoff_s or any(r.gpu_id == b.gpu_id for r in out):
            continue
        if (1.0 - b.rate) * payoff_s <= cost:
            continue  # no layout is worth more than 1: nothing can pay
        # Its own holders wait with the rest once they yield: the new layout serves them too.
        holders = [h.holder for h in b.slices if h.holder is not None]
        items = (holders + rest)[:MAX_DEMAND_ITEMS]
        if not items:
            continue
        new = best_layout(b.model, items)
        rate, _, served = assign(b.model, new, items)
        if new == b.layout or (rate - b.rate) * payoff_s <= cost:
            continue
        out.append(Repartition(b.gpu_id, b.layout, new, tuple(items[i] for i in served)))
        break
    return out


def best_layout(gpu: GpuModel, items: Sequence[SliceDemand]) -> tuple[str, ...]:
    """The maximal layout of the highest ``(rate, served)`` for ``items`` (first in order on ties)."""
    key = tuple((d.mem_mib, d.compute_share, d.profiles) for d in items)
    return _best_layout(gpu.name, key)


@lru_cache(maxsize=4096)
def _best_layout(
    model_name: str, key: tuple[tuple[float, float, frozenset[str] | None], ...]
) -> tuple[str, ...]:
    gpu = gpu_model(model_name)
    items = [SliceDemand(mem, share, "", profiles) for mem, share, profiles in key]
    best: tuple[str, ...] = maximal_layouts(gpu)[0]
    best_value = (-1.0, -1)
    for layout in maximal_layouts(gpu):
        value = layout_value(gpu, layout, items)
        if value > best_value:
            best_value, best = value, layout
    return best
