"""The simulator's jobs and cluster as the decision core sees them: a trace job as the ``JobSpec`` a
user would submit and the ``JobState`` the gateway would make of it, a simulated slice as the
``SliceState`` the inventory would publish, and the simulator's own workload (opaque units, no
data), registered so that the core's job transitions can count and merge its units."""

from __future__ import annotations

import dataclasses
import math
import random
import re
from typing import Any, ClassVar

from sja import workloads
from sja.core.jobs import new_job
from sja.core.mig import gpu_model
from sja.protocol.messages import JobSpec, JobState, MemoryDecl, SliceState, TimeDecl
from sja.sim.cluster import slices_of
from sja.sim.model import JobModel, SimCluster, SimConfig, SimSlice, job_gpus, repartitionable
from sja.workloads.base import check_known, int_param

# --- the simulator's own workload -----------------------------------------------------------------


class SimWorkload:
    """A workload with no computation: ``units`` opaque units whose partial results are empty.

    The core's job transitions need a registered workload for a job's unit count and for merging
    results; a simulated job has neither data nor result, so merge and finalize are trivial.
    """

    name: ClassVar[str] = "sim"
    sequential: ClassVar[bool] = False
    yields: ClassVar[bool] = True
    """A simulated job checkpoints per unit and stops at a unit boundary when asked."""

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(params, {"units"})
        return {"units": int_param(params, "units", 1, 1, 2**62)}

    def total_units(self, params: dict[str, Any]) -> int:
        return int(params["units"])

    def declared_memory(self, params: dict[str, Any]) -> MemoryDecl:
        return MemoryDecl(base_mib=1024.0, per_unit_mib=0.0)

    def declared_time(self, params: dict[str, Any]) -> TimeDecl:
        return TimeDecl(warmup_s=0.0, per_unit_s=1.0)

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        return b""

    def merge(self, acc: bytes, partial: bytes) -> bytes:
        return b""

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
        return {}


workloads.WORKLOADS.setdefault(SimWorkload.name, SimWorkload())


# --- a trace job and the cluster as the decision core sees them -----------------------------------


def job_spec(m: JobModel, cfg: SimConfig) -> JobSpec:
    tj = m.trace
    gpus = job_gpus(m)
    deadline = (
        tj.deadline_s - tj.submit_s if tj.deadline_s is not None and tj.deadline_s > tj.submit_s else None
    )
    return JobSpec(
        name=_name(tj.job_id),
        tenant=_name(tj.tenant),
        workload=SimWorkload.name,
        params={"units": m.units},
        mode="jasda" if cfg.mode == "jasda" else "sja",
        eps_mem=cfg.eps_mem,
        eps_time=cfg.eps_time,
        deadline_s=deadline,
        max_parallel=max(1, min(64, max(tj.num_gpus, 1))) if gpus is None else cfg.slices_per_gpu,
        gpus=gpus,
        memory=m.decl_memory(cfg),
        # The job declares its own speed (a unit takes unit_s on what it asked for) as its full-GPU
        # speed: conservative on every slice; calibration learns each slice profile's real speed.
        # What a subjob of its program costs besides its units (start-up, checkpoint) is its
        # start-up, as a user declares a program's; the planner takes only the stack's own
        # ``start_overhead_s`` off the window.
        time=TimeDecl(
            warmup_s=m.start_s + m.checkpoint_s, per_unit_s=cfg.unit_s, rel_sd=cfg.decl_time_rel_sd
        ),
    )


def sim_job(job_id: str, spec: JobSpec, now: float, cfg: SimConfig) -> JobState:
    """A submitted job's state, as ``core.jobs.new_job`` makes it in the gateway (its prior scaled
    by what fits one planning window: the window less the stack's start overhead)."""
    return new_job(job_id, spec, now, window_s=cfg.horizon_s - cfg.start_overhead_s)


_BAD = re.compile(r"[^A-Za-z0-9_-]")


def _name(raw: str) -> str:
    return (_BAD.sub("-", raw) or "x")[:64]


def gpu_indices(cluster: SimCluster) -> dict[str, int]:
    """Each GPU's index on its node (``SliceState.gpu_index``)."""
    index_of: dict[str, int] = {}
    per_node: dict[str, int] = {}
    for g in cluster.gpus:
        index_of[g.gpu_id] = per_node.get(g.node, 0)
        per_node[g.node] = index_of[g.gpu_id] + 1
    return index_of


def slice_state(s: SimSlice, gpu_index: int) -> SliceState:
    """One slice as the inventory would publish it (free, fence 0)."""
    return SliceState(
        slice_id=s.slice_id,
        node=_name(s.node),
        pool="sim",
        gpu_index=gpu_index,
        gpu_model=s.gpu_model,
        profile=s.profile,
        mem_mib=max(1, int(s.mem_mib)),
        compute_slots=max(1, round(s.compute_share * 7)),
        compute_share=s.compute_share,
    )


def slice_states(cluster: SimCluster) -> list[SliceState]:
    """The cluster's slices as the inventory would publish them (all free, fence 0)."""
    index_of = gpu_indices(cluster)
    return [slice_state(s, index_of.get(s.gpu_id, 0)) for s in cluster.slices]


def repartition_kinds(cluster: SimCluster) -> dict[tuple[str, int, float], SliceState]:
    """Every window kind a repartitionable GPU of the cluster could offer after a re-cut, with a
    template slice state of that kind."""
    kinds: dict[tuple[str, int, float], SliceState] = {}
    for g in cluster.gpus:
        if not repartitionable(g):
            continue
        for p in gpu_model(g.model).profiles:
            for s in slices_of(dataclasses.replace(g, layout=(p.name,))):
                st = slice_state(s, 0)
                kinds.setdefault((st.profile, st.mem_mib, st.compute_share), st)
    return kinds


def unschedulable_reason(m: JobModel, largest_mib: int, cfg: SimConfig) -> dict[str, Any]:
    """``{"unschedulable": True, "reason": ...}`` for a job whose declared peak at its smallest
    subjob no slice of the cluster holds (what the gateway refuses at submission), else ``{}``."""
    need = m.decl_peak(1)
    usable = largest_mib - cfg.mem_reserve_mib
    if need <= usable:
        return {}
    return {
        "unschedulable": True,
        "reason": f"declares {need:,.0f} MiB per GPU; the largest slice holds {usable:,.0f} MiB usable",
    }


def lognormal(rng: random.Random, sd: float) -> float:
    """A mean-one log-normal factor."""
    return math.exp(rng.gauss(0.0, sd) - 0.5 * sd * sd) if sd > 0 else 1.0
