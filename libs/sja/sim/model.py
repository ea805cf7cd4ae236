"""The simulator's model, shared by the SJA engine (``sja.sim.engine``) and the rigid baselines
(``sja.sim.baselines``): trace jobs, simulated GPUs and slices, the settings of a run (``SimConfig``),
what a trace job is as work (``JobModel``), the capacity of a cluster, and what a run produces."""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sja.core import defaults
from sja.core.mig import CATALOGUE, gpu_model
from sja.core.planner import PlanLimits
from sja.protocol.messages import MemoryDecl
from sja.sim.metrics import ScheduleRecorder


@dataclass(frozen=True)
class TraceJob:
    """One job of a replayed trace, in the trace's own terms plus what the mapping adds.

    Every field a trace does not carry and a seeded model filled in is named in ``synthetic``; reports
    label such results as synthetic.
    """

    job_id: str
    submit_s: float
    """Seconds since the start of the trace (after any time compression)."""
    duration_s: float
    """Runtime on the resources it asked for, as recorded (or modeled)."""
    num_gpus: int
    """Whole GPUs asked for; 1 when ``gpu_fraction`` < 1."""
    gpu_fraction: float = 1.0
    """Fraction of one GPU (openb ``gpu_milli`` / 1000) when below 1."""
    mem_mib: float | None = None
    """Declared peak GPU memory per GPU (what a rigid scheduler sizes the slice by)."""
    true_mem_mib: float | None = None
    """Real peak GPU memory per GPU (the modeled gap between declaration and use)."""
    tenant: str = "default"
    deadline_s: float | None = None
    """Absolute deadline, seconds since the start of the trace."""
    synthetic: tuple[str, ...] = ()


@dataclass(frozen=True)
class SimGpu:
    gpu_id: str
    node: str
    model: str
    """A catalogue model name (``sja.core.mig.CATALOGUE``) or a non-MIG model from a trace."""
    layout: tuple[str, ...] | None = None
    """MIG profiles; ``None``: the GPU is one whole slice."""
    repartitionable: bool = False
    """The simulator may re-cut the GPU's MIG layout while nothing runs on it."""
    reconfig_s: float | None = None
    """Seconds a re-cut takes (the GPU offers nothing meanwhile); ``None``: ``SimConfig.reconfig_s``."""


@dataclass(frozen=True)
class SimSlice:
    slice_id: str
    gpu_id: str
    node: str
    gpu_model: str
    profile: str
    mem_mib: int
    compute_share: float


@dataclass
class SimCluster:
    gpus: list[SimGpu] = field(default_factory=list)
    slices: list[SimSlice] = field(default_factory=list)


# --- configuration ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimConfig:
    """Everything a simulated run depends on besides the trace and the cluster.

    The settings the live stack also has (window length, the planner's start overhead, the clearing
    policy, the jobs' default ``eps``) default to ``sja.core.defaults``, what ``sja up`` and the
    services run; the rest models the trace's jobs."""

    seed: int = 0
    policy: str = defaults.POLICY
    """SJA clearing policy (``core.policies.POLICIES``)."""
    mode: str = "sja"
    """Reply mode of the simulated jobs: ``sja`` (one candidate) or ``jasda`` (several)."""
    unit_s: float = 60.0
    """Seconds of a job's own runtime (on the resources it asked for) in one unit of work: a tenth
    of the window, so that a window holds several units after a subjob's start-up and a holder
    asked to yield stops within a minute of its own work."""
    start_s: float = 10.0
    """Per-subjob start cost of a trace job's program (container, process, loading a checkpoint)."""
    checkpoint_s: float = 5.0
    """Per-subjob checkpoint cost at its end. The job declares both as its start-up
    (``TimeDecl.warmup_s``), as a user declares a program's."""
    horizon_s: float = defaults.HORIZON_S
    """Length of an offered window (``defaults.HORIZON_S``); a free slice's window stretches for a
    longer smallest subjob, and an open subjob goes on past it while no other job wins the slice."""
    start_overhead_s: float = defaults.START_OVERHEAD_S
    """What the planner takes off every window for the stack's own part of a subjob
    (``PlanLimits.start_overhead_s``); the simulator charges no time for it (``start_s`` and
    ``checkpoint_s`` are all a modeled subjob costs)."""
    eps_mem: float = defaults.EPS_MEM
    eps_time: float = defaults.EPS_TIME
    mem_reserve_mib: float = 256.0
    """Driver/context memory of every slice, unavailable to work (all policies)."""
    mem_noise_sd: float = 0.05
    """Log-normal spread of a piece's real peak memory around the job's true profile."""
    time_noise_sd: float = 0.10
    """Log-normal spread of a subjob's compute time around its modeled mean."""
    mem_per_unit_frac: float = 0.0
    """Share of a job's peak memory that grows with the subjob size (the rest is a fixed base); the
    trace's per-GPU memory is the peak of a subjob as long as one window on a full GPU."""
    decl_mem_rel_sd: float = 0.25
    decl_time_rel_sd: float = 0.3
    slices_per_gpu: int = 7
    """SJA: slices a one-GPU job that uses its whole GPU may run on at once (``max_parallel``),
    together holding no more than one GPU's compute (``JobSpec.gpus``, ``job_gpus``): where GPUs
    are cut, a ``4g`` and a ``3g`` slice at once; on whole GPUs, one. 7: the most compute instances
    a GPU is cut into. Other jobs run one slice per GPU they asked for."""
    negotiation_latency_s: float = 0.0
    """Virtual time between an offer and the start of the subjob it grants (the slice is held)."""
    oom_detect_s: float = 30.0
    """An OOM surfaces after this much of a piece's compute (or at its end if shorter)."""
    default_mem_mib: float = 8192.0
    """Declared memory of a trace job that carries none."""
    speed_table: Mapping[str, float] | None = None
    """Speed relative to the full GPU per MIG profile (MISO measurements); default: compute share."""
    bin_s: float = 3600.0
    """Width of the time bins of the utilization-over-time series."""
    lease_s: float = 30.0
    reconfig_s: float = defaults.RECONFIG_S
    """Seconds a repartitionable GPU offers nothing while it is re-cut into another MIG layout
    (destroying and creating MIG instances, which needs the GPU idle, takes seconds; a cluster
    group's ``~repart=<seconds>`` overrides it)."""

    def limits(self) -> PlanLimits:
        return PlanLimits(
            mem_reserve_mib=self.mem_reserve_mib,
            start_overhead_s=self.start_overhead_s,
            horizon_s=self.horizon_s,
        )


def load_speed_table(path: str | Path) -> dict[str, float]:
    """Median ``speed_rel_7g`` per MIG profile over the models MISO measured (A100-40GB)."""
    by_slice: dict[str, list[float]] = {}
    with open(path, newline="", encoding="utf-8") as f:
        for row in csv.DictReader(f):
            by_slice.setdefault(row["mig_slice"], []).append(float(row["speed_rel_7g"]))
    out = {}
    for name, values in sorted(by_slice.items()):
        values.sort()
        n = len(values)
        out[name] = values[n // 2] if n % 2 else 0.5 * (values[n // 2 - 1] + values[n // 2])
    return out


def slice_speed(s: SimSlice, cfg: SimConfig) -> float:
    """Speed of a slice relative to the full GPU."""
    if cfg.speed_table is not None and s.profile in cfg.speed_table:
        return cfg.speed_table[s.profile]
    return s.compute_share


# --- how a trace job becomes work -----------------------------------------------------------------


@dataclass(frozen=True)
class JobModel:
    """The modeled truth about one trace job, shared by SJA and the baselines."""

    trace: TraceJob
    fraction: float
    """Largest rate (GPU equivalents) one piece of the job can use."""
    work_gpu_s: float
    units: int
    decl_mem_mib: float
    """Declared per-GPU peak memory (what rigid schedulers size by)."""
    true_mem_mib: float
    """Real per-GPU peak memory of the whole job (one window-sized piece for SJA)."""
    k_ref: int
    """Units of one window-long piece at full speed: the size at which the trace memory applies."""
    unit_run_s: float
    """Seconds of the job's own runtime in one unit: its runtime over its units (at most ``unit_s``,
    so that cutting a job into whole units adds no work to it)."""

    def decl_memory(self, cfg: SimConfig) -> MemoryDecl:
        return MemoryDecl(
            base_mib=self.decl_mem_mib * (1.0 - self.beta),
            per_unit_mib=self.decl_mem_mib * self.beta / self.k_ref,
            rel_sd=cfg.decl_mem_rel_sd,
        )

    beta: float
    """Share of the peak that grows with the piece's size (``SimConfig.mem_per_unit_frac``)."""
    start_s: float = 0.0
    """Start-up of one run of the job's program (``SimConfig.start_s``, less for a job too short to
    hold it): the trace's duration includes one, so its work is the duration less it."""
    checkpoint_s: float = 0.0
    """What one run of its program spends saving its state at the end (``SimConfig.checkpoint_s``,
    scaled as ``start_s``): the trace's run saved its result once too."""

    def true_peak(self, units: int) -> float:
        """Mean real peak memory of a piece of ``units`` units (before noise)."""
        return self.true_mem_mib * ((1.0 - self.beta) + self.beta * units / self.k_ref)

    def decl_peak(self, units: int) -> float:
        """Declared peak memory of a piece of ``units`` units (the bound the job vouches for)."""
        return self.decl_mem_mib * ((1.0 - self.beta) + self.beta * units / self.k_ref)


def job_gpus(m: JobModel) -> float | None:
    """The compute a trace job's subjobs may hold at once (``JobSpec.gpus``), for a one-GPU job that
    uses its whole GPU: one GPU, on as many slices as add up to it. None (one slice per GPU it asked
    for, of any size) for a job that uses a fraction of a GPU (more slices would give it more than
    it asked for) and for a multi-GPU job (its pieces are its GPUs' workers, each on a slice of its
    own; spread over the slices of cut GPUs, it fragments the GPUs a re-cut would give it whole)."""
    return 1.0 if m.fraction >= 1.0 and m.trace.num_gpus <= 1 else None


def job_model(tj: TraceJob, cfg: SimConfig) -> JobModel:
    """The work of a trace job. Its recorded duration is one run of its program: one start-up, its
    work, one save of its result. So its work is the duration less ``start_s`` and
    ``checkpoint_s``, which every subjob pays again (a rigid scheduler runs the job once and pays
    them once, inside the duration). A job shorter than twice that has them scaled down to half its
    duration."""
    fraction = min(max(tj.gpu_fraction, 1e-3), 1.0)
    duration = max(tj.duration_s, 0.0)
    fixed = cfg.start_s + cfg.checkpoint_s
    scale = min(1.0, 0.5 * duration / fixed) if fixed > 0 else 0.0
    start_s, checkpoint_s = cfg.start_s * scale, cfg.checkpoint_s * scale
    runtime = (duration - start_s - checkpoint_s) * max(tj.num_gpus, 1)
    units = max(1, math.ceil(runtime / cfg.unit_s))
    decl = tj.mem_mib if tj.mem_mib is not None else cfg.default_mem_mib
    true = tj.true_mem_mib if tj.true_mem_mib is not None else decl
    k_ref = max(1, int((cfg.horizon_s - cfg.start_s - cfg.checkpoint_s) / cfg.unit_s))
    return JobModel(
        trace=tj,
        fraction=fraction,
        work_gpu_s=runtime * fraction,
        units=units,
        decl_mem_mib=float(decl),
        true_mem_mib=float(true),
        k_ref=k_ref,
        unit_run_s=runtime / units,
        beta=min(max(cfg.mem_per_unit_frac, 0.0), 1.0),
        start_s=start_s,
        checkpoint_s=checkpoint_s,
    )


# --- the capacity of a cluster --------------------------------------------------------------------


def repartitionable(gpu: SimGpu) -> bool:
    """Whether the simulator may re-cut this GPU (marked so, and a MIG model)."""
    return gpu.repartitionable and gpu.model in CATALOGUE


def _whole_gpu_capacity(gpu: SimGpu) -> tuple[float, float]:
    whole = max(gpu_model(gpu.model).profiles, key=lambda p: (p.compute_slots, p.mem_slots))
    return 1.0, float(whole.mem_mib)


def compute_capacity(cluster: SimCluster) -> float:
    """Sum of the slices' compute shares; a repartitionable GPU counts as a whole GPU (what any of
    its layouts could offer at most)."""
    repart = {g.gpu_id: g for g in cluster.gpus if repartitionable(g)}
    fixed = sum(s.compute_share for s in cluster.slices if s.gpu_id not in repart)
    return fixed + sum(_whole_gpu_capacity(g)[0] for g in repart.values())


def mem_capacity(cluster: SimCluster) -> float:
    """Sum of the slices' memory; a repartitionable GPU counts with its largest profile's memory."""
    repart = {g.gpu_id: g for g in cluster.gpus if repartitionable(g)}
    fixed = float(sum(s.mem_mib for s in cluster.slices if s.gpu_id not in repart))
    return fixed + sum(_whole_gpu_capacity(g)[1] for g in repart.values())


# --- results ----------------------------------------------------------------------------------------


@dataclass
class SimResult:
    """What one simulated policy produced: the recorder (for metrics and plots) and counters."""

    policy: str
    recorder: ScheduleRecorder
    counters: dict[str, float] = field(default_factory=dict)


Progress = Callable[[int, int], None]
"""Called as ``progress(events_done, jobs_done)`` every few thousand events."""

PROGRESS_EVERY = 2000
