"""Data shared by the simulator's parts: trace jobs, simulated GPUs and slices."""

from __future__ import annotations

from dataclasses import dataclass, field


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
