"""Rigid baselines: schedulers that run every job whole, for its whole duration, without preemption.

- ``fifo`` — whole GPUs, strict submission order: the queue's head blocks everyone behind it until
  enough GPUs are free for its whole request (gang).
- ``easy`` — EASY backfilling (Slurm-style), whole GPUs: when the head cannot start, it gets a
  reservation at the earliest time enough GPUs free up, computed from the running jobs' trace runtimes
  (exact estimates here); a later job may start now if it ends before the reservation or uses only GPUs
  the head will not need then.
- ``bestfit`` — static MIG: each single-GPU job goes to the smallest free slice of the fixed layout
  whose usable memory holds its declared memory, and runs slower on a slice with less compute than it
  asked for. A process sees one MIG instance, so only a GPU that is one slice (MIG off) or that may be
  re-cut (repartitionable) can give a job its whole memory: a job whose declaration no slice holds
  takes such an entirely free GPU, and a multi-GPU job takes that many entirely free such GPUs, or
  else one free slice holding its declaration on each of that many GPUs (a gang of MIG devices). A
  job no placement can ever hold is unschedulable. The queue is scanned in submission order and every
  job that fits is placed (no head-of-line blocking, no reservation), as a Kubernetes-style pod
  scheduler does.

**Repartitioning** (``bestfit`` only; ``fifo`` and ``easy`` give whole GPUs, whatever their layout):
a GPU marked repartitionable whose slices are all free may be re-cut before the queue is scanned.
The demand is the queue's single-GPU jobs, in order, less those that free slices of other GPUs can
hold (smallest fit, as placement does); ``core.repartition.plan_repartitions`` picks the GPUs to re-cut
and their layouts. A re-cut GPU offers nothing for its reconfiguration time, then its new slices.

A job whose real peak memory exceeds what it was given fails with an OOM once its peak is reached
(``SimConfig.oom_detect_s``) and is queued again with its declaration raised to what it really
needed, as a user would resubmit it. Rigid jobs pay no per-subjob start or checkpoint cost: the trace
durations already include their one start.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from sja.core.mig import gpu_model
from sja.core.repartition import MAX_DEMAND_ITEMS, SliceDemand, canonical_layout, plan_repartitions
from sja.sim.metrics import JobRecord, ScheduleRecorder
from sja.sim.model import (
    PROGRESS_EVERY,
    JobModel,
    Progress,
    SimCluster,
    SimConfig,
    SimResult,
    TraceJob,
    compute_capacity,
    job_model,
    mem_capacity,
    repartitionable,
    slice_speed,
)
from sja.sim.recut import Cut

BASELINES = ("fifo", "easy", "bestfit")


@dataclass
class _Unit:
    """A schedulable unit of a rigid scheduler: a whole GPU (fifo, easy) or a MIG slice (bestfit)."""

    idx: int
    gpu: int
    mem_mib: float
    share: float
    speed: float
    busy: bool = False
    retired: bool = False
    """Destroyed by a re-cut of its GPU (kept busy so no scan takes it)."""
    profile: str = ""


@dataclass
class _Waiting:
    idx: int
    model: JobModel
    need: int
    """Whole GPUs (fifo, easy, multi-GPU bestfit) the job takes at once."""
    decl_mem_mib: float
    """Declared per-GPU memory; raised after an OOM."""


@dataclass(order=True)
class _Finish:
    time: float
    seq: int
    job: _Waiting = field(compare=False)
    units: list[int] = field(compare=False)
    oom: bool = field(compare=False)
    started: float = field(compare=False)
    estimate_end: float = field(compare=False)
    """When the job would end by its trace runtime (what EASY reservations are computed from)."""


class RigidScheduler:
    """The event loop shared by the rigid baselines; subclasses decide placement."""

    name = "rigid"
    whole_gpus = True
    """Schedule whole GPUs (fifo, easy) rather than the slices of the static layout (bestfit)."""

    def __init__(self, cluster: SimCluster, jobs: Sequence[TraceJob], cfg: SimConfig) -> None:
        if not cluster.slices:
            raise ValueError("the cluster has no slices")
        self.cfg = cfg
        self.reserve = cfg.mem_reserve_mib
        gpu_index = {g.gpu_id: i for i, g in enumerate(cluster.gpus)}
        for s in cluster.slices:
            gpu_index.setdefault(s.gpu_id, len(gpu_index))
        self.gpu_units: dict[int, list[int]] = {}
        self.units: list[_Unit] = []
        if self.whole_gpus:
            per_gpu: dict[int, list[float]] = {}
            for s in cluster.slices:
                acc = per_gpu.setdefault(gpu_index[s.gpu_id], [0.0, 0.0, 0.0])
                acc[0] += s.mem_mib
                acc[1] += s.compute_share
                acc[2] += slice_speed(s, cfg)
            for g, (mem, share, speed) in sorted(per_gpu.items()):
                self.gpu_units[g] = [len(self.units)]
                self.units.append(_Unit(len(self.units), g, mem, share, min(speed, 1.0)))
        else:
            for s in cluster.slices:
                g = gpu_index[s.gpu_id]
                self.gpu_units.setdefault(g, []).append(len(self.units))
                self.units.append(
                    _Unit(
                        len(self.units),
                        g,
                        float(s.mem_mib),
                        s.compute_share,
                        slice_speed(s, cfg),
                        profile=s.profile,
                    )
                )
        self.units_live = len(self.units)
        """Units that exist now (re-cuts retire units and add others)."""
        self.cuts: dict[int, Cut] = {}
        """Repartitionable GPUs (``bestfit``), by GPU index, each in its canonical layout."""
        if not self.whole_gpus:
            for gpu in cluster.gpus:
                if repartitionable(gpu):
                    layout = canonical_layout(gpu_model(gpu.model), gpu.layout)
                    self.cuts[gpu_index[gpu.gpu_id]] = Cut.of(gpu, layout, cfg)
        self.recut_events: list[tuple[float, int, int, tuple[str, ...]]] = []
        """(end, seq, GPU, new layout) of re-cuts in progress."""
        self.repartitions: list[tuple[int, float, tuple[str, ...]]] = []
        """(GPU, start, new layout) of every re-cut, in order."""
        self.gpu_mem = {g: sum(self.units[u].mem_mib for u in us) for g, us in self.gpu_units.items()}
        self.gpu_busy = dict.fromkeys(self.gpu_units, 0)
        """Busy units per GPU (0: the whole GPU is free)."""
        self.busy_units = 0
        self.max_gpu_usable = max(self.gpu_mem.values()) - self.reserve
        for cut in self.cuts.values():
            whole = max(gpu_model(cut.gpu.model).profiles, key=lambda p: (p.compute_slots, p.mem_slots))
            self.max_gpu_usable = max(self.max_gpu_usable, whole.mem_mib - self.reserve)
        self.recorder = ScheduleRecorder(
            mem_capacity_mib=mem_capacity(cluster),
            compute_capacity=compute_capacity(cluster),
            bin_s=cfg.bin_s,
        )
        self.models = sorted(
            (job_model(tj, cfg) for tj in jobs), key=lambda m: (m.trace.submit_s, m.trace.job_id)
        )
        self.queue: list[_Waiting] = []
        self.running: list[_Finish] = []
        self.seq = 0
        self.now = 0.0
        self.free_mem = sum(u.mem_mib for u in self.units)
        for m in self.models:
            tj = m.trace
            self.recorder.add_job(
                JobRecord(
                    job_id=tj.job_id,
                    tenant=tj.tenant,
                    submit_s=tj.submit_s,
                    duration_s=tj.duration_s,
                    work_gpu_s=m.work_gpu_s,
                    critical_path_s=tj.duration_s,
                    unschedulable=not self.can_ever_run(m),
                    reason=""
                    if self.can_ever_run(m)
                    else (
                        f"needs {self.need_of(m)} GPU(s) of {m.true_mem_mib:,.0f} MiB; the cluster has "
                        f"{len(self.gpu_units)}, the largest holding {self.max_gpu_usable:,.0f} MiB usable"
                    ),
                )
            )

    # --- resources ------------------------------------------------------------------------------

    def need_of(self, m: JobModel) -> int:
        return max(m.trace.num_gpus, 1)

    def can_ever_run(self, m: JobModel) -> bool:
        """Whether some placement could hold the job's real memory and its GPU count."""
        return self.need_of(m) <= len(self.gpu_units) and m.true_mem_mib <= self.max_gpu_usable

    def free_gpus(self, min_mem_mib: float = 0.0) -> list[int]:
        """GPUs all of whose units are free and whose usable memory holds ``min_mem_mib``."""
        return [
            g
            for g in self.gpu_units
            if self.gpu_busy[g] == 0 and self.gpu_units[g] and self.gpu_mem[g] - self.reserve >= min_mem_mib
        ]

    def all_busy(self) -> bool:
        return self.busy_units == self.units_live

    # --- repartitioning (bestfit) ---------------------------------------------------------------

    def repartition(self) -> None:
        """Re-cut the free repartitionable GPUs the queue's single-GPU demand is better served by."""
        idle = sorted(g for g, cut in self.cuts.items() if not cut.reconfiguring and self.gpu_busy[g] == 0)
        if not idle or not self.queue:
            return
        idle_set = set(idle)
        others = sorted(
            (u.mem_mib, u.share, u.idx) for u in self.units if not u.busy and u.gpu not in idle_set
        )
        demand: list[SliceDemand] = []
        for w in self.queue:
            if w.need != 1:
                continue
            need = w.decl_mem_mib + self.reserve
            pos = next((i for i, (mem, _, _) in enumerate(others) if mem >= need), None)
            if pos is not None:
                del others[pos]  # placement will put it on a free slice elsewhere
                continue
            demand.append(SliceDemand(need, w.model.fraction, w.model.trace.job_id))
            if len(demand) >= MAX_DEMAND_ITEMS:
                break
        if not demand:
            return
        by_model: dict[str, list[int]] = {}
        for g in idle:
            by_model.setdefault(self.cuts[g].gpu.model, []).append(g)
        for model, gpus in sorted(by_model.items()):
            plan = plan_repartitions([(str(g), gpu_model(model), self.cuts[g].layout) for g in gpus], demand)
            for r in plan:
                self._start_recut(int(r.gpu_id), r.new)

    def _start_recut(self, g: int, layout: tuple[str, ...]) -> None:
        for i in self.gpu_units[g]:
            u = self.units[i]
            u.busy = True
            u.retired = True
            self.free_mem -= u.mem_mib
        self.units_live -= len(self.gpu_units[g])
        self.gpu_units[g] = []
        self.gpu_mem[g] = 0.0
        end = self.cuts[g].start(self.now, self.recorder)
        self.seq += 1
        heapq.heappush(self.recut_events, (end, self.seq, g, layout))
        self.repartitions.append((g, self.now, layout))
        self.units_changed()

    def _finish_recut(self, g: int, layout: tuple[str, ...]) -> None:
        for s in self.cuts[g].finish(layout):
            u = _Unit(len(self.units), g, float(s.mem_mib), s.compute_share, slice_speed(s, self.cfg))
            u.profile = s.profile
            self.units.append(u)
            self.gpu_units[g].append(u.idx)
            self.free_mem += u.mem_mib
        self.units_live += len(self.gpu_units[g])
        self.gpu_mem[g] = sum(self.units[i].mem_mib for i in self.gpu_units[g])
        self.units_changed()

    def units_changed(self) -> None:
        """The set of units changed (a re-cut); subclasses refresh their indices."""

    def start(self, w: _Waiting, unit_ids: list[int]) -> None:
        """Run a waiting job on units now, for its trace duration scaled by their speed."""
        m = w.model
        units = [self.units[i] for i in unit_ids]
        # Per GPU held: one slice, or whole GPUs (every slice of each, their layout set aside).
        gpus = len({u.gpu for u in units})
        speed = min(sum(u.speed for u in units) / gpus, 1.0)
        mem_per_gpu = sum(u.mem_mib for u in units) / gpus - self.reserve
        runtime = m.trace.duration_s / min(1.0, speed / m.fraction) if speed > 0 else math.inf
        oom = m.true_mem_mib > mem_per_gpu
        end = self.now + (min(runtime, self.cfg.oom_detect_s) if oom else runtime)
        for u in units:
            u.busy = True
            self.free_mem -= u.mem_mib
            self.gpu_busy[u.gpu] += 1
        self.busy_units += len(units)
        self.seq += 1
        fin = _Finish(end, self.seq, w, unit_ids, oom, self.now, self.now + runtime)
        heapq.heappush(self.running, fin)
        self.recorder.start_job(m.trace.job_id, self.now)

    def finish(self, fin: _Finish) -> None:
        m = fin.job.model
        share = sum(self.units[u].share for u in fin.units)
        mem = min(m.true_mem_mib, sum(self.units[u].mem_mib for u in fin.units)) * max(m.trace.num_gpus, 1)
        self.recorder.add_piece(
            fin.started,
            self.now,
            share=share,
            mem_mib=mem,
            useful_gpu_s=0.0 if fin.oom else m.work_gpu_s,
            status="oom" if fin.oom else "ok",
        )
        for u in fin.units:
            self.units[u].busy = False
            self.free_mem += self.units[u].mem_mib
            self.gpu_busy[self.units[u].gpu] -= 1
        self.busy_units -= len(fin.units)
        if fin.oom:
            w = fin.job
            w.decl_mem_mib = max(w.decl_mem_mib, m.true_mem_mib)
            self._enqueue(w)
        else:
            self.recorder.finish_job(m.trace.job_id, self.now)

    def _enqueue(self, w: _Waiting) -> None:
        # The queue stays in submission order (a resubmitted job keeps its place).
        i = len(self.queue)
        while i > 0 and self.queue[i - 1].idx > w.idx:
            i -= 1
        self.queue.insert(i, w)

    # --- policy -------------------------------------------------------------------------------------

    def schedule(self) -> None:
        """Start what the policy starts now from ``self.queue``."""
        raise NotImplementedError

    def stranded_mem(self) -> float:
        """Free memory that no waiting job can use now (see ``sja.sim.metrics``)."""
        raise NotImplementedError

    # --- loop ----------------------------------------------------------------------------------------

    def run(self, progress: Progress | None = None) -> SimResult:
        arrivals = self.models
        nxt = 0
        events = 0
        next_progress = PROGRESS_EVERY
        last_t = arrivals[0].trace.submit_s if arrivals else 0.0
        stranded = 0.0
        while nxt < len(arrivals) or self.running or self.recut_events:
            t_arr = arrivals[nxt].trace.submit_s if nxt < len(arrivals) else math.inf
            t_fin = self.running[0].time if self.running else math.inf
            t_cut = self.recut_events[0][0] if self.recut_events else math.inf
            t = min(t_arr, t_fin, t_cut)
            self.recorder.add_stranded(stranded, t - last_t)
            self.now = last_t = t
            while self.running and self.running[0].time <= t:
                self.finish(heapq.heappop(self.running))
                events += 1
            while self.recut_events and self.recut_events[0][0] <= t:
                _, _, g, layout = heapq.heappop(self.recut_events)
                self._finish_recut(g, layout)
                events += 1
            while nxt < len(arrivals) and arrivals[nxt].trace.submit_s <= t:
                m = arrivals[nxt]
                if not self.recorder.jobs[m.trace.job_id].unschedulable:
                    self._enqueue(_Waiting(nxt, m, self.need_of(m), m.decl_mem_mib))
                nxt += 1
                events += 1
            self.schedule()
            stranded = self.stranded_mem() if self.queue else 0.0
            if progress is not None and events >= next_progress:
                progress(events, sum(1 for j in self.recorder.jobs.values() if j.finish_s is not None))
                next_progress = events + PROGRESS_EVERY
        self.recorder.end_s = last_t
        if progress is not None:
            progress(events, sum(1 for j in self.recorder.jobs.values() if j.finish_s is not None))
        return SimResult(
            policy=self.name,
            recorder=self.recorder,
            counters={"events": events, "repartitions": len(self.repartitions)},
        )


class _WholeGpuScheduler(RigidScheduler):
    """fifo and easy: jobs take ``num_gpus`` whole GPUs that hold their declared memory."""

    whole_gpus = True

    def gpu_mem_need(self, w: _Waiting) -> float:
        # A job asking for whole GPUs is given whole GPUs; its declaration only picks which.
        return min(w.decl_mem_mib, self.max_gpu_usable)

    def try_start(self, w: _Waiting) -> bool:
        free = self.free_gpus(self.gpu_mem_need(w))
        if len(free) < w.need:
            return False
        self.start(w, [self.gpu_units[g][0] for g in free[: w.need]])
        return True

    def stranded_mem(self) -> float:
        free = self.units_live - self.busy_units
        if free == 0:
            return 0.0
        smallest = min(w.need for w in self.queue)
        return self.free_mem if free < smallest else 0.0


class FifoScheduler(_WholeGpuScheduler):
    name = "fifo"

    def schedule(self) -> None:
        while (
            self.queue
            and self.queue[0].need <= self.units_live - self.busy_units
            and self.try_start(self.queue[0])
        ):
            self.queue.pop(0)


class EasyBackfillScheduler(_WholeGpuScheduler):
    name = "easy"

    def schedule(self) -> None:
        while self.queue and self.try_start(self.queue[0]):
            self.queue.pop(0)
        if not self.queue:
            return
        head = self.queue[0]
        need_mem = self.gpu_mem_need(head)
        if self.all_busy():
            return
        free_now = self.free_gpus(need_mem)
        # The head's reservation: walk running jobs by estimated end until enough GPUs it can use free.
        avail = len(free_now)
        shadow = math.inf
        for fin in sorted(self.running, key=lambda f: (f.estimate_end, f.seq)):
            gained = sum(1 for u in fin.units if self.gpu_mem[self.units[u].gpu] - self.reserve >= need_mem)
            avail += gained
            if avail >= head.need:
                shadow = fin.estimate_end if not fin.oom else fin.time
                break
        extra = avail - head.need if math.isfinite(shadow) else 0
        started: list[int] = []
        free_count = self.units_live - self.busy_units
        for i in range(1, len(self.queue)):
            if free_count == 0:
                break
            w = self.queue[i]
            if w.need > free_count:
                continue
            ends = self.now + w.model.trace.duration_s
            fits_before = ends <= shadow
            if not fits_before and w.need > extra:
                continue
            if self.try_start(w):
                free_count -= w.need
                started.append(i)
                if not fits_before:
                    extra -= w.need
        for i in reversed(started):
            self.queue.pop(i)


class BestFitMigScheduler(RigidScheduler):
    name = "bestfit"
    whole_gpus = False

    def __init__(self, cluster: SimCluster, jobs: Sequence[TraceJob], cfg: SimConfig) -> None:
        super().__init__(cluster, jobs, cfg)
        self.by_fit: list[int] = []
        self.units_changed()
        self.max_slice_usable = max(u.mem_mib for u in self.units) - self.reserve
        poolable = [g for g in self.gpu_units if self.poolable(g)]
        self.max_pool_usable = max((self.pool_usable(g) for g in poolable), default=0.0)
        """Most memory an entirely free GPU gives one job (0: no GPU can be pooled)."""
        if self.cuts:  # a re-cut can make the largest profile out of any repartitionable GPU
            self.max_slice_usable = max(self.max_slice_usable, self.max_pool_usable)
        for m in self.models:
            rec = self.recorder.jobs[m.trace.job_id]
            if not rec.unschedulable and not self.can_place_ever(m):
                rec.unschedulable = True
                rec.reason = (
                    f"declares {m.decl_mem_mib:,.0f} MiB per GPU on {self.need_of(m)} GPU(s) (really "
                    f"{m.true_mem_mib:,.0f}); the largest slice holds {self.max_slice_usable:,.0f} MiB "
                    f"usable, a whole GPU {self.max_pool_usable:,.0f}, and MIG instances do not pool"
                )

    def poolable(self, g: int) -> bool:
        """Whether one job can have GPU ``g``'s whole memory: it is one slice, or it may be re-cut."""
        return len(self.gpu_units[g]) == 1 or g in self.cuts

    def pool_usable(self, g: int) -> float:
        if g in self.cuts:
            whole = max(gpu_model(self.cuts[g].gpu.model).profiles, key=lambda p: p.mem_mib)
            return whole.mem_mib - self.reserve
        return self.gpu_mem[g] - self.reserve

    def can_place_ever(self, m: JobModel) -> bool:
        """Whether some placement of this scheduler can hold the job's declaration, and its real
        peak (a job resubmitted after an OOM declares that)."""
        need, decl = self.need_of(m), m.decl_mem_mib
        if m.true_mem_mib > max(self.max_slice_usable, self.max_pool_usable):
            return False
        if need == 1:
            return decl <= max(self.max_slice_usable, self.max_pool_usable)
        hosts = sum(
            1
            for g, us in self.gpu_units.items()
            if (self.poolable(g) and self.pool_usable(g) >= decl)
            or any(self.units[u].mem_mib - self.reserve >= decl for u in us)
        )
        return hosts >= need

    def units_changed(self) -> None:
        self.by_fit = sorted(
            (i for i, u in enumerate(self.units) if not u.retired),
            key=lambda i: (self.units[i].mem_mib, self.units[i].share, i),
        )

    def place(self, w: _Waiting, free_by_fit: list[int]) -> bool:
        """Place one job if it fits now; ``free_by_fit`` (free units, smallest first) is kept current."""
        if w.need == 1:
            for pos, i in enumerate(free_by_fit):
                if self.units[i].mem_mib - self.reserve >= w.decl_mem_mib:
                    del free_by_fit[pos]
                    self.start(w, [i])
                    return True
            if w.decl_mem_mib <= self.max_slice_usable:
                return False  # a slice could hold it once one frees: wait for it
        # No slice holds it, or it wants several GPUs: that many entirely free GPUs that can be
        # pooled, or else (several GPUs) a free slice holding it on each of that many GPUs.
        free = [g for g in self.free_gpus(w.decl_mem_mib) if self.poolable(g)]
        taken: list[int] = []
        if len(free) >= w.need:
            taken = [u for g in free[: w.need] for u in self.gpu_units[g]]
        elif w.need > 1:
            per_gpu: dict[int, int] = {}
            for i in free_by_fit:
                u = self.units[i]
                if u.mem_mib - self.reserve >= w.decl_mem_mib:
                    per_gpu.setdefault(u.gpu, i)
            if len(per_gpu) >= w.need:
                taken = sorted(per_gpu.values(), key=free_by_fit.index)[: w.need]
        if not taken:
            return False
        self.start(w, taken)
        taken_set = set(taken)
        free_by_fit[:] = [i for i in free_by_fit if i not in taken_set]
        return True

    def schedule(self) -> None:
        if self.cuts:
            self.repartition()
        free_by_fit = [i for i in self.by_fit if not self.units[i].busy]
        placed: list[int] = []
        for i, w in enumerate(self.queue):
            if not free_by_fit:
                break
            if self.place(w, free_by_fit):
                placed.append(i)
        for i in reversed(placed):
            self.queue.pop(i)

    def stranded_mem(self) -> float:
        if self.busy_units == self.units_live:
            return 0.0
        smallest = min(w.decl_mem_mib for w in self.queue)
        return sum(u.mem_mib for u in self.units if not u.busy and u.mem_mib - self.reserve < smallest)


SCHEDULERS: dict[str, type[RigidScheduler]] = {
    "fifo": FifoScheduler,
    "easy": EasyBackfillScheduler,
    "bestfit": BestFitMigScheduler,
}


def run_baseline(
    name: str,
    cluster: SimCluster,
    jobs: Sequence[TraceJob],
    cfg: SimConfig,
    progress: Progress | None = None,
) -> SimResult:
    """Simulate one rigid baseline (``fifo``, ``easy`` or ``bestfit``)."""
    try:
        cls = SCHEDULERS[name]
    except KeyError:
        raise ValueError(f"unknown baseline {name!r} (known: {', '.join(BASELINES)})") from None
    return cls(cluster, jobs, cfg).run(progress)
