"""Metrics of one simulated schedule, the same for SJA and the rigid baselines.

A scheduler under simulation feeds a ``ScheduleRecorder``: every *piece* it ran (a subjob, or a whole
rigid job on its slice or GPUs) with the slice share and memory it held, the work it completed and the
overhead it paid; every job's submit, first start and finish; and the time free memory sat stranded.
``summarize`` turns that into the numbers the reports compare.

Definitions (also in ``docs/evaluation.md``):

- **makespan** — last job finish minus first submission.
- **makespan lower bound** — ``max(total work / compute capacity, max_j (submit_j - t0 + cp_j))`` where
  ``cp_j`` is job ``j``'s critical path: its trace duration divided by the parallelism the scheduler may
  give it beyond its request (1 for the rigid baselines). Neither term can be beaten by any schedule.
- **utilization** — the share of the cluster's compute, from the first submission to the end of the
  run, that did work which completed (GPU-seconds at full-GPU speed over capacity times that span):
  the same for every policy, and when every job finishes, the inverse of the makespan.
  ``alloc_utilization`` (slice compute share held, overheads and lost work included) and
  ``mem_utilization`` (real peak memory held over memory capacity) show how the capacity was spent.
- **completion** — ``jobs_finished``, ``jobs_failed`` (given up, with a reason), ``jobs_unfinished``
  (still waiting or running when the run ended) and ``jobs_unschedulable`` (no placement of the
  scheduler can ever hold them, with a reason). ``makespan_s`` is ``None`` while a job is unfinished.
- **wait** — first start minus submission; **JCT** — finish minus submission, over finished jobs;
  ``sja.sim.runner.run_comparison`` adds ``*_common`` figures over the jobs every compared policy
  finished, the only JCTs that compare runs whose finished sets differ.
- **slowdown** — JCT over the job's trace duration.
- **fragmentation** — time-averaged fraction of the cluster's memory (over the whole simulated span)
  that was free while jobs were waiting, but in slices no waiting job could use (for SJA: free slices
  that were offered and drew no proposal; for rigid baselines: free capacity too small for every
  waiting request).
- **repartitions** — re-cuts of repartitionable GPUs; **reconfig_s** the GPU-seconds they offered
  nothing while being re-cut (also counted in ``alloc_utilization``).
- **Jain's fairness** — ``(sum x)^2 / (n sum x^2)`` over tenants, with ``x`` the tenant's mean of
  ``duration / JCT`` over its finished jobs (1 = every tenant got the same relative service).
- **finish-time fairness rho** (after Themis, NSDI'20, with the rigid scheduler as the reference each job
  is measured against) — per job, ``rho_j = JCT_j under the policy / JCT_j under best-fit`` on the same
  trace and cluster, over the jobs both finished (``rho_jobs``); both JCTs are floored at
  ``RHO_FLOOR_S`` (1 s) so a job that took no time under best-fit has a finite rho (1 when it took no
  time under both). ``rho_p50``/``rho_p90``/``rho_p99`` (numpy's ``higher`` method: each is a rho some
  job got), ``rho_max``, ``rho_mean``, ``rho_over_1_5`` (the share of those jobs with rho > 1.5) and
  ``rho_worst`` (the jobs of largest rho, with both JCTs). Best-fit's own rho is 1 for every job.
  ``sja.sim.runner.compare`` adds them when best-fit is among the compared policies, ``None`` otherwise.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

RHO_REFERENCE = "bestfit"
"""The policy finish-time fairness measures every job against: the rigid best-fit scheduler."""
RHO_FLOOR_S = 1.0
"""Both JCTs of a job's rho are floored at this (s): a job that took no time has a finite rho."""
RHO_LIMIT = 1.5
"""``rho_over_1_5`` counts jobs above this rho; the evaluation's goal asks p99 rho at most this."""
RHO_WORST = 5
"""How many jobs ``rho_worst`` names."""
RHO_FIELDS: tuple[str, ...] = (
    "rho_jobs",
    "rho_p50",
    "rho_p90",
    "rho_p99",
    "rho_max",
    "rho_mean",
    "rho_over_1_5",
    "rho_worst",
)


@dataclass
class JobRecord:
    """What a scheduler did with one trace job."""

    job_id: str
    tenant: str
    submit_s: float
    duration_s: float
    """Trace duration (its runtime on what it asked for)."""
    work_gpu_s: float
    """Work in full-GPU seconds (duration x GPUs x fraction)."""
    critical_path_s: float
    """Shortest time the job could take on this scheduler with the whole cluster to itself."""
    first_start_s: float | None = None
    finish_s: float | None = None
    unschedulable: bool = False
    """No resource of the cluster can ever hold it under this scheduler."""
    failed: bool = False
    """The scheduler gave up on it (``reason`` says why)."""
    reason: str = ""
    """Why it is unschedulable, failed, or was left unfinished when the simulation ended."""


@dataclass
class ScheduleRecorder:
    """Accumulates what a schedule used, piece by piece, in fixed time bins for the plots."""

    mem_capacity_mib: float
    compute_capacity: float
    """Sum of the slices' compute shares (GPU equivalents)."""
    bin_s: float = 3600.0
    mem_time: float = 0.0
    """Real peak memory held x time (MiB-s)."""
    alloc_time: float = 0.0
    """Compute share held x time (GPU-s)."""
    useful_gpu_s: float = 0.0
    overhead_s: float = 0.0
    """Slice-seconds spent on per-subjob start and checkpoint."""
    wasted_s: float = 0.0
    """Slice-seconds of pieces whose work was lost (OOM, timeout)."""
    stranded_mem_time: float = 0.0
    end_s: float = 0.0
    """Time of the simulation's last event (later than the last finish when some job never ends)."""
    pieces: int = 0
    oom_count: int = 0
    timeout_count: int = 0
    mem_violations: int = 0
    """Completed or failed pieces whose real peak exceeded the planned memory quantile."""
    time_violations: int = 0
    """Pieces whose real duration exceeded the planned duration quantile."""
    planned_pieces: int = 0
    """Pieces that carried a planned quantile (SJA subjobs)."""
    repartitions: int = 0
    """Re-cuts of a repartitionable GPU's MIG layout."""
    reconfig_s: float = 0.0
    """GPU-seconds during which re-cut GPUs offered nothing."""
    jobs: dict[str, JobRecord] = field(default_factory=dict)
    compute_bins: dict[int, float] = field(default_factory=dict)
    mem_bins: dict[int, float] = field(default_factory=dict)

    def add_job(self, record: JobRecord) -> None:
        self.jobs[record.job_id] = record

    def start_job(self, job_id: str, now: float) -> None:
        rec = self.jobs[job_id]
        if rec.first_start_s is None:
            rec.first_start_s = now

    def finish_job(self, job_id: str, now: float) -> None:
        self.jobs[job_id].finish_s = now

    def add_piece(
        self,
        start_s: float,
        end_s: float,
        *,
        share: float,
        mem_mib: float,
        useful_gpu_s: float,
        overhead_s: float = 0.0,
        status: str = "ok",
    ) -> None:
        """One piece held ``share`` of compute and ``mem_mib`` of real memory over ``[start, end)``."""
        length = max(end_s - start_s, 0.0)
        self.pieces += 1
        self.mem_time += mem_mib * length
        self.alloc_time += share * length
        self.useful_gpu_s += useful_gpu_s
        self.overhead_s += overhead_s
        if status == "oom":
            self.oom_count += 1
        elif status == "timeout":
            self.timeout_count += 1
        if status != "ok":
            self.wasted_s += max(length - overhead_s, 0.0)
        if length <= 0.0:
            return
        # Spread the piece's compute (useful rate over its whole occupancy) and memory over the bins.
        rate = useful_gpu_s / length
        first, last = int(start_s // self.bin_s), int(end_s // self.bin_s)
        for b in range(first, last + 1):
            lo, hi = max(start_s, b * self.bin_s), min(end_s, (b + 1) * self.bin_s)
            if hi > lo:
                self.compute_bins[b] = self.compute_bins.get(b, 0.0) + rate * (hi - lo)
                self.mem_bins[b] = self.mem_bins.get(b, 0.0) + mem_mib * (hi - lo)

    def add_reconfig(self, start_s: float, end_s: float, *, share: float = 1.0) -> None:
        """A GPU of compute ``share`` was being re-cut over ``[start, end)``: held, and useless.

        Counted in ``alloc_time`` (capacity spent, like per-subjob overhead) and in ``reconfig_s``."""
        length = max(end_s - start_s, 0.0)
        self.repartitions += 1
        self.reconfig_s += share * length
        self.alloc_time += share * length

    def add_plan_check(self, *, mem_violated: bool, time_violated: bool) -> None:
        self.planned_pieces += 1
        self.mem_violations += int(mem_violated)
        self.time_violations += int(time_violated)

    def add_stranded(self, mem_mib: float, dt: float) -> None:
        if mem_mib > 0 and dt > 0:
            self.stranded_mem_time += mem_mib * dt

    def utilization_series(self) -> tuple[list[float], list[float], list[float]]:
        """(bin start times, compute utilization, memory utilization) per bin."""
        if not self.compute_bins:
            return [], [], []
        lo, hi = min(self.compute_bins), max(self.compute_bins)
        times = [b * self.bin_s for b in range(lo, hi + 1)]
        comp = [
            self.compute_bins.get(b, 0.0) / (self.compute_capacity * self.bin_s) for b in range(lo, hi + 1)
        ]
        mem = [self.mem_bins.get(b, 0.0) / (self.mem_capacity_mib * self.bin_s) for b in range(lo, hi + 1)]
        return times, comp, mem


def percentile(values: Sequence[float], q: float, method: Literal["linear", "higher"] = "linear") -> float:
    """The ``q`` percentile (numpy's ``method``: linear interpolation by default), NaN for no values."""
    if not values:
        return math.nan
    return float(np.percentile(np.asarray(values, dtype=float), q, method=method))


def jain_index(values: Iterable[float]) -> float:
    """Jain's fairness index of non-negative values: 1 when all are equal, 1/n at worst."""
    xs = [v for v in values if math.isfinite(v)]
    if not xs:
        return math.nan
    sq = sum(x * x for x in xs)
    return (sum(xs) ** 2) / (len(xs) * sq) if sq > 0 else 1.0


def makespan_lower_bound(jobs: Iterable[JobRecord], compute_capacity: float) -> float:
    """``max(total work / capacity, max_j (submit_j - t0 + critical_path_j))`` over schedulable jobs."""
    todo = [j for j in jobs if not j.unschedulable]
    if not todo:
        return 0.0
    t0 = min(j.submit_s for j in todo)
    work = sum(j.work_gpu_s for j in todo) / compute_capacity if compute_capacity > 0 else math.inf
    path = max(j.submit_s - t0 + j.critical_path_s for j in todo)
    return max(work, path)


def summarize(rec: ScheduleRecorder, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """The metrics of one schedule (see the module docstring for definitions)."""
    jobs = list(rec.jobs.values())
    finished = [j for j in jobs if j.finish_s is not None]
    started = [j for j in jobs if j.first_start_s is not None]
    jct = [j.finish_s - j.submit_s for j in finished if j.finish_s is not None]
    wait = [j.first_start_s - j.submit_s for j in started if j.first_start_s is not None]
    slowdown = [
        (j.finish_s - j.submit_s) / j.duration_s
        for j in finished
        if j.finish_s is not None and j.duration_s > 0
    ]
    if finished:
        t0 = min(j.submit_s for j in jobs if not j.unschedulable)
        makespan = max(j.finish_s for j in finished if j.finish_s is not None) - t0
    else:
        makespan = 0.0
    # Every ratio is over the whole simulated span (first submission to the last event), which
    # outlasts the makespan when some job never finishes: the same denominator for every policy.
    t_first = min((j.submit_s for j in jobs if not j.unschedulable), default=0.0)
    span = max(makespan, rec.end_s - t_first)
    span_compute = rec.compute_capacity * span
    span_mem = rec.mem_capacity_mib * span
    simulated_mem = span_mem
    unfinished = sum(1 for j in jobs if j.finish_s is None and not j.unschedulable and not j.failed)
    by_tenant: dict[str, list[float]] = {}
    for j in finished:
        if j.finish_s is not None and j.finish_s > j.submit_s:
            by_tenant.setdefault(j.tenant, []).append(min(j.duration_s / (j.finish_s - j.submit_s), 1.0))
    tenant_service = {t: sum(v) / len(v) for t, v in sorted(by_tenant.items())}
    out: dict[str, Any] = {
        "jobs": len(jobs),
        "jobs_finished": len(finished),
        "jobs_failed": sum(1 for j in jobs if j.failed),
        "jobs_unfinished": unfinished,
        "jobs_unschedulable": sum(1 for j in jobs if j.unschedulable),
        "utilization": rec.useful_gpu_s / span_compute if span_compute > 0 else 0.0,
        "alloc_utilization": rec.alloc_time / span_compute if span_compute > 0 else 0.0,
        "mem_utilization": rec.mem_time / span_mem if span_mem > 0 else 0.0,
        "mean_jct_s": float(np.mean(jct)) if jct else math.nan,
        "p50_jct_s": percentile(jct, 50),
        "p95_jct_s": percentile(jct, 95),
        "p99_jct_s": percentile(jct, 99),
        "mean_wait_s": float(np.mean(wait)) if wait else math.nan,
        "p50_wait_s": percentile(wait, 50),
        "p95_wait_s": percentile(wait, 95),
        "p99_wait_s": percentile(wait, 99),
        "mean_slowdown": float(np.mean(slowdown)) if slowdown else math.nan,
        "p95_slowdown": percentile(slowdown, 95),
        "makespan_s": makespan if unfinished == 0 else math.nan,
        "makespan_lower_bound_s": makespan_lower_bound(jobs, rec.compute_capacity),
        "fragmentation": rec.stranded_mem_time / simulated_mem if simulated_mem > 0 else 0.0,
        "oom_count": rec.oom_count,
        "timeout_count": rec.timeout_count,
        "replans": rec.oom_count + rec.timeout_count,
        "subjobs": rec.pieces,
        "overhead_s": rec.overhead_s,
        "wasted_s": rec.wasted_s,
        "repartitions": rec.repartitions,
        "reconfig_s": rec.reconfig_s,
        "mem_violation_rate": rec.mem_violations / rec.planned_pieces if rec.planned_pieces else 0.0,
        "time_violation_rate": rec.time_violations / rec.planned_pieces if rec.planned_pieces else 0.0,
        "jain_fairness": jain_index(tenant_service.values()),
        "tenant_service": tenant_service,
    }
    if extra:
        out.update(extra)
    return out


def reasons(rec: ScheduleRecorder, limit: int = 5) -> dict[str, dict[str, int]]:
    """The most common reasons, with their counts, for unschedulable, failed and unfinished jobs."""
    out: dict[str, dict[str, int]] = {}
    for j in rec.jobs.values():
        if j.unschedulable:
            kind = "unschedulable"
        elif j.failed:
            kind = "failed"
        elif j.finish_s is None:
            kind = "unfinished"
        else:
            continue
        bucket = out.setdefault(kind, {})
        why = j.reason or "no reason recorded"
        bucket[why] = bucket.get(why, 0) + 1
    return {k: dict(sorted(v.items(), key=lambda kv: -kv[1])[:limit]) for k, v in out.items()}


def finished_ids(rec: ScheduleRecorder) -> set[str]:
    return {j.job_id for j in rec.jobs.values() if j.finish_s is not None}


def common_jct(rec: ScheduleRecorder, common: set[str]) -> dict[str, float]:
    """Mean and p95 JCT and wait over the jobs of ``common`` (finished under every compared policy)."""
    jobs = [j for j in rec.jobs.values() if j.job_id in common and j.finish_s is not None]
    jct = [j.finish_s - j.submit_s for j in jobs if j.finish_s is not None]
    wait = [j.first_start_s - j.submit_s for j in jobs if j.first_start_s is not None]
    return {
        "jobs_common": len(jobs),
        "mean_jct_common_s": float(np.mean(jct)) if jct else math.nan,
        "p95_jct_common_s": percentile(jct, 95),
        "mean_wait_common_s": float(np.mean(wait)) if wait else math.nan,
    }


def jct_values(rec: ScheduleRecorder) -> list[float]:
    """Completion times of the finished jobs (for CDF plots)."""
    return sorted(j.finish_s - j.submit_s for j in rec.jobs.values() if j.finish_s is not None)


def job_jcts(rec: ScheduleRecorder) -> dict[str, float]:
    """Each finished job's JCT (finish minus submission), by job id."""
    return {j.job_id: j.finish_s - j.submit_s for j in rec.jobs.values() if j.finish_s is not None}


def finish_time_fairness(
    rec: ScheduleRecorder, reference: ScheduleRecorder, worst: int = RHO_WORST
) -> dict[str, Any]:
    """Finish-time fairness of ``rec`` against ``reference`` (best-fit's run of the same trace).

    Over the jobs both finished, ``rho_j = max(JCT_j, RHO_FLOOR_S) / max(reference JCT_j, RHO_FLOOR_S)``.
    Percentiles use numpy's ``higher`` method: each is a rho some job got, with at least that share of
    the jobs at or below it, so ``rho_p99 <= 1.5`` means at least 99 % of the jobs had rho ≤ 1.5
    (over at most 100 jobs, ``rho_p99`` is ``rho_max``).
    With no job in common the figures are NaN, ``rho_worst`` empty. ``rho_worst`` lists the
    ``worst`` jobs of largest rho (ties by job id): ``job_id``, ``rho``, ``jct_s``, ``reference_jct_s``.
    """
    mine, ref = job_jcts(rec), job_jcts(reference)
    rows = sorted(
        (
            (max(jct, RHO_FLOOR_S) / max(ref[job_id], RHO_FLOOR_S), job_id, jct, ref[job_id])
            for job_id, jct in mine.items()
            if job_id in ref
        ),
        key=lambda r: (-r[0], r[1]),
    )
    rho = [r[0] for r in rows]
    return {
        "rho_jobs": len(rho),
        "rho_p50": percentile(rho, 50, method="higher"),
        "rho_p90": percentile(rho, 90, method="higher"),
        "rho_p99": percentile(rho, 99, method="higher"),
        "rho_max": max(rho) if rho else math.nan,
        "rho_mean": float(np.mean(rho)) if rho else math.nan,
        "rho_over_1_5": sum(1 for x in rho if x > RHO_LIMIT) / len(rho) if rho else math.nan,
        "rho_worst": [
            {"job_id": job_id, "rho": r, "jct_s": jct, "reference_jct_s": ref_jct}
            for r, job_id, jct, ref_jct in rows[:worst]
        ],
    }
