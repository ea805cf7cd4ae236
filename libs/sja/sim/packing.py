"""The FGD packing experiment: GPU-sharing pods arrive until their requests reach a multiple of the cluster's
GPU capacity, none leave, each is placed at once or rejected; the result is the share of GPU capacity
allocated at the end.

This re-implements the experiment of Weng et al., "Beware of Fragmentation: Scheduling GPU-Sharing Workloads
with Fragmentation Gradient Descent" (USENIX ATC'23), as run by its simulator
(hkust-adsl/kubernetes-scheduler-simulator, ``experiments/run_scripts``: ``-tune 1.3 --shuffle-pod=true``,
seeds 42..51):

1. The workload is every pod of the list (CPU-only pods included), sorted by name, then shuffled (seeded).
2. "Tuning" to the demand ``d``: while the GPU request total is below ``d`` x capacity, pods drawn uniformly
   *with replacement* from the list are appended, stopping before the first one that would overshoot; if
   the list already exceeds the target, uniformly drawn pods are removed until it does not.
3. Pods are placed in that order. A node is feasible when its free CPU and host memory hold the pod's
   requests (Kubernetes' NodeResourcesFit), its GPU model matches ``gpu_spec`` if any, and its GPUs hold the
   GPU request: a sharing pod needs one GPU with enough free milli, an ``n``-GPU pod ``n`` fully free GPUs.
4. ``allocated_gpu_ratio`` = allocated GPU milli / total GPU milli, in percent.

Policies (how a feasible node and GPU are chosen):

- ``bestfit``: FGD's BestFit score plugin. For each feasible node
  ``s = 0.5 (cpu_free - cpu_req)/128000 + 0.5 (gpu_free_milli - gpu_req_milli)/8000`` (after placement,
  GPU free summed over the node's GPUs; 128000 and 8000 are FGD's MaxSpecCpu/MaxSpecGpu), the node score is
  ``int((1 - s) * 100)`` and the highest wins, ties broken uniformly at random (the Kubernetes scheduler's
  ``selectHost``). On the node a sharing pod takes the GPU with the least free milli that fits (lowest index
  on ties), whole-GPU pods the lowest-indexed fully free GPUs (Open-GPU-Share's ``best`` GPU selection).
- ``sja``: the packing counterpart of SJA's gap filling. A sharing pod goes to the GPU, anywhere in the
  cluster, whose free milli is the smallest that still holds it (best fit on GPU fragments, global rather
  than within the node BestFit picked); among GPUs with that same free milli, the node BestFit scores
  highest, then at random. Whole-GPU and CPU-only pods are placed exactly as ``bestfit`` places them.
  Nothing is split or moved and time plays no part: this is a static packing result, not a result of
  SJA's time-domain atomization.
- ``random``: a feasible node uniformly at random, on it a fitting GPU uniformly at random (FGD's Random),
  as a second check against the published numbers.

The random draws are ours (numpy), not Go's, so single seeds differ from FGD's; the means are comparable.
Arrival order and tie-breaking use separate streams, so every policy sees the same arrivals for a seed.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

import numpy as np

from sja.sim.model import SimCluster, TraceJob
from sja.sim.trace import read_csv_rows

POLICIES = ("bestfit", "sja", "random")
ARRIVAL_ORDERS = ("shuffle", "trace")
DEFAULT_CHECKPOINTS = (0.8, 0.9, 1.0, 1.1, 1.2, 1.3)
"""Arrived GPU demand (fraction of capacity) at which the allocation curve is sampled, as FGD reports it."""

MILLI = 1000
MAX_SPEC_CPU_MILLI = 128_000
MAX_SPEC_GPU_MILLI = 8_000
DEFAULT_CPU_REQUEST_MILLI = 100
"""Kubernetes scores a pod without a CPU request as if it asked for 100m (``GetNonzeroRequests``)."""

# Resources of a node built from a SimCluster, which carries none: CPU at FGD's normalisation maximum (so
# the CPU term is equal for all nodes) and host memory that never binds.
_UNCONSTRAINED_CPU_MILLI = MAX_SPEC_CPU_MILLI
_UNCONSTRAINED_MEMORY_MIB = 1 << 40

_STREAM_ARRIVALS = 0
_STREAM_TIES = 1


@dataclass(frozen=True)
class PackingPod:
    """A pod as the packing experiment sees it: CPU, host memory and GPU requests."""

    name: str
    cpu_milli: int
    memory_mib: int
    num_gpus: int
    """0 for a CPU-only pod."""
    gpu_milli: int
    """Per GPU, 1..1000; below 1000 only with ``num_gpus == 1`` (a sharing pod)."""
    gpu_spec: tuple[str, ...] = ()
    """GPU models the pod may run on; empty: any."""

    @property
    def total_gpu_milli(self) -> int:
        return self.num_gpus * self.gpu_milli

    @property
    def kind(self) -> str:
        """``cpu``, ``share`` (part of one GPU), ``one`` (one whole GPU) or ``multi``."""
        if self.num_gpus == 0:
            return "cpu"
        if self.gpu_milli < MILLI:
            return "share"
        return "one" if self.num_gpus == 1 else "multi"


@dataclass(frozen=True)
class PackingNode:
    name: str
    cpu_milli: int
    memory_mib: int
    num_gpus: int
    model: str


@dataclass(frozen=True)
class PodPlacement:
    node: str
    gpus: tuple[int, ...]
    """Indices of the node's GPUs the pod took (empty for a CPU-only pod)."""


class PackingResult(TypedDict):
    policy: str
    demand: float
    seed: int
    order: str
    allocated_gpu_ratio: float
    """Percent of the cluster's GPU milli allocated at the end."""
    allocated_gpu_milli: int
    capacity_gpu_milli: int
    arrived_gpu_milli: int
    arrived_pods: int
    placed_pods: int
    rejected_pods: int
    rejected_by_kind: dict[str, int]
    curve: list[tuple[float, float]]
    """(arrived demand in percent of capacity, allocated percent) at each checkpoint reached."""


class PolicySummary(TypedDict):
    allocated_gpu_ratio: float
    """Mean over seeds, percent."""
    std: float
    per_seed: list[float]
    seeds: list[int]
    curve: list[tuple[float, float]]
    """Mean over seeds of each checkpoint's allocation."""


# --- Loading -------------------------------------------------------------------------------------------


def load_openb_pods_for_packing(path: str | Path) -> list[PackingPod]:
    """Every pod of an openb pod list (CPU-only ones included, as FGD replays them), in file order."""
    pods: list[PackingPod] = []
    for row in read_csv_rows(path, ("name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli")):
        num_gpus = row.integer("num_gpu", minimum=0)
        milli = min(row.integer("gpu_milli", minimum=0), MILLI)  # FGD's YAML converter clips at 1000
        if num_gpus > 0 and milli == 0:
            num_gpus = 0  # FGD treats a pod without GPU milli as a CPU pod
        if num_gpus == 0:
            milli = 0
        elif num_gpus > 1 and milli < MILLI:
            raise row.error("gpu_milli", f"a share of a GPU ({milli}) with num_gpu={num_gpus}")
        pods.append(
            PackingPod(
                name=row.text("name"),
                cpu_milli=row.integer("cpu_milli", minimum=0),
                memory_mib=row.integer("memory_mib", minimum=0),
                num_gpus=num_gpus,
                gpu_milli=milli,
                gpu_spec=tuple(m for m in row.text("gpu_spec").split("|") if m),
            )
        )
    return pods


def load_openb_nodes_for_packing(path: str | Path) -> list[PackingNode]:
    """The GPU nodes of an openb node list with their CPU and host memory."""
    nodes: list[PackingNode] = []
    for row in read_csv_rows(path, ("sn", "cpu_milli", "memory_mib", "gpu", "model")):
        num_gpus = row.integer("gpu", minimum=0)
        if num_gpus == 0:
            continue
        nodes.append(
            PackingNode(
                name=row.text("sn"),
                cpu_milli=row.integer("cpu_milli", minimum=0),
                memory_mib=row.integer("memory_mib", minimum=0),
                num_gpus=num_gpus,
                model=row.text("model"),
            )
        )
    return nodes


def pods_from_jobs(jobs: Iterable[TraceJob]) -> list[PackingPod]:
    """Trace jobs as pods without CPU or host-memory requests (GPU share rounded to milli)."""
    pods = []
    for j in jobs:
        milli = MILLI if j.gpu_fraction >= 1 else max(1, round(j.gpu_fraction * MILLI))
        pods.append(PackingPod(j.job_id, 0, 0, j.num_gpus, milli))
    return pods


def nodes_from_cluster(cluster: SimCluster) -> list[PackingNode]:
    """A SimCluster's nodes, each GPU 1000 milli whatever its MIG layout; CPU and memory never bind."""
    counts: dict[str, int] = {}
    models: dict[str, str] = {}
    for gpu in cluster.gpus:
        counts[gpu.node] = counts.get(gpu.node, 0) + 1
        models.setdefault(gpu.node, gpu.model)
    return [
        PackingNode(node, _UNCONSTRAINED_CPU_MILLI, _UNCONSTRAINED_MEMORY_MIB, n, models[node])
        for node, n in counts.items()
    ]


# --- Placement -----------------------------------------------------------------------------------------


class Packer:
    """Cluster state and one placement policy; ``place`` decides one pod and commits it."""

    def __init__(self, nodes: Sequence[PackingNode], policy: str, rng: np.random.Generator) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown packing policy {policy!r} (known: {', '.join(POLICIES)})")
        if not nodes:
            raise ValueError("a packing cluster needs at least one node")
        self.policy = policy
        self.rng = rng
        self.names = [n.name for n in nodes]
        self.models = np.array([n.model for n in nodes], dtype=object)
        self.cpu_free = np.array([n.cpu_milli for n in nodes], dtype=np.int64)
        self.mem_free = np.array([n.memory_mib for n in nodes], dtype=np.int64)
        width = max(n.num_gpus for n in nodes)
        # Free milli per GPU; -1 pads nodes with fewer GPUs (never fits, never counts as free).
        self.gpu_free = np.full((len(nodes), max(width, 1)), -1, dtype=np.int64)
        for i, n in enumerate(nodes):
            self.gpu_free[i, : n.num_gpus] = MILLI
        self.capacity_gpu_milli = MILLI * sum(n.num_gpus for n in nodes)
        self._spec_masks: dict[tuple[str, ...], np.ndarray] = {}

    @property
    def allocated_gpu_milli(self) -> int:
        return self.capacity_gpu_milli - int(np.clip(self.gpu_free, 0, None).sum())

    def _model_mask(self, spec: tuple[str, ...]) -> np.ndarray:
        mask = self._spec_masks.get(spec)
        if mask is None:
            mask = np.isin(self.models, list(spec))
            self._spec_masks[spec] = mask
        return mask

    def feasible(self, pod: PackingPod) -> np.ndarray:
        """Indices of the nodes that can take the pod now."""
        ok = (self.cpu_free >= pod.cpu_milli) & (self.mem_free >= pod.memory_mib)
        if pod.num_gpus > 0:
            if pod.gpu_spec:
                ok &= self._model_mask(pod.gpu_spec)
            if pod.gpu_milli < MILLI:
                ok &= (self.gpu_free >= pod.gpu_milli).any(axis=1)
            else:
                ok &= (self.gpu_free == MILLI).sum(axis=1) >= pod.num_gpus
        return np.flatnonzero(ok)

    def bestfit_scores(self, pod: PackingPod, idx: np.ndarray) -> np.ndarray:
        """FGD's BestFit node score (0..100, higher is better) for the nodes ``idx``, as integers.

        The arithmetic follows the Go code operation by operation in float64, so truncation ties match.
        """
        cpu_req = float(pod.cpu_milli or DEFAULT_CPU_REQUEST_MILLI)
        gpu_left = np.clip(self.gpu_free[idx], 0, None).sum(axis=1).astype(np.float64)
        s = (self.cpu_free[idx].astype(np.float64) - cpu_req) / MAX_SPEC_CPU_MILLI * 0.5
        s = s + (gpu_left - float(pod.total_gpu_milli)) / MAX_SPEC_GPU_MILLI * 0.5
        scores: np.ndarray = np.trunc((1.0 - s) * 100.0)
        return scores

    def _pick(self, candidates: np.ndarray) -> int:
        if len(candidates) == 1:
            return int(candidates[0])
        return int(candidates[self.rng.integers(len(candidates))])

    def _choose(self, pod: PackingPod, idx: np.ndarray) -> tuple[int, int | None]:
        """(node, GPU for a sharing pod or None) among feasible nodes ``idx``."""
        if self.policy == "random":
            node = self._pick(idx)
            if pod.kind != "share":
                return node, None
            return node, self._pick(np.flatnonzero(self.gpu_free[node] >= pod.gpu_milli))
        if self.policy == "sja" and pod.kind == "share":
            free = self.gpu_free[idx]
            fits = np.where(free >= pod.gpu_milli, free, np.iinfo(np.int64).max)
            tightest = fits.min(axis=1)
            level = tightest.min()
            holders = idx[tightest == level]
            scores = self.bestfit_scores(pod, holders)
            node = self._pick(holders[scores == scores.max()])
            return node, int(np.flatnonzero(self.gpu_free[node] == level)[0])
        scores = self.bestfit_scores(pod, idx)
        return self._pick(idx[scores == scores.max()]), None

    def place(self, pod: PackingPod) -> PodPlacement | None:
        """Choose a node (and GPUs) for the pod and commit it, or return None if no node can take it."""
        idx = self.feasible(pod)
        if len(idx) == 0:
            return None
        node, gpu = self._choose(pod, idx)
        self.cpu_free[node] -= pod.cpu_milli
        self.mem_free[node] -= pod.memory_mib
        row = self.gpu_free[node]
        if pod.kind == "share":
            if gpu is None:  # tightest fit on the node, lowest index on ties
                fits = np.where(row >= pod.gpu_milli, row, np.iinfo(np.int64).max)
                gpu = int(np.argmin(fits))
            row[gpu] -= pod.gpu_milli
            gpus: tuple[int, ...] = (gpu,)
        elif pod.num_gpus > 0:
            gpus = tuple(int(g) for g in np.flatnonzero(row == MILLI)[: pod.num_gpus])
            row[list(gpus)] = 0
        else:
            gpus = ()
        return PodPlacement(self.names[node], gpus)


# --- The experiment ------------------------------------------------------------------------------------


def arrival_sequence(
    pods: Sequence[PackingPod],
    demand: float,
    capacity_gpu_milli: int,
    rng: np.random.Generator,
    *,
    order: str = "shuffle",
) -> list[PackingPod]:
    """FGD's workload for one seed: the pods shuffled, then tuned to ``demand`` x capacity (see module doc).

    ``order="trace"`` keeps the list's own order instead of shuffling (FGD's ``--shuffle-pod=false``
    replays creation order; the openb lists are in creation order); resampling is the same.
    """
    if order not in ARRIVAL_ORDERS:
        raise ValueError(f"unknown arrival order {order!r} (known: {', '.join(ARRIVAL_ORDERS)})")
    base = sorted(pods, key=lambda p: p.name)
    arrivals = [base[int(i)] for i in rng.permutation(len(base))] if order == "shuffle" else list(pods)
    target = demand * capacity_gpu_milli
    total = sum(p.total_gpu_milli for p in arrivals)
    if total < target:
        while True:
            pod = base[int(rng.integers(len(base)))]
            if total + pod.total_gpu_milli > target:
                break
            total += pod.total_gpu_milli
            arrivals.append(pod)
    else:
        while total > target and arrivals:
            pod = arrivals.pop(int(rng.integers(len(arrivals))))
            total -= pod.total_gpu_milli
    return arrivals


def run_packing(
    pods: Sequence[PackingPod] | Sequence[TraceJob],
    cluster: Sequence[PackingNode] | SimCluster,
    policy: str,
    demand: float,
    seed: int,
    *,
    checkpoints: Sequence[float] = DEFAULT_CHECKPOINTS,
    order: str = "shuffle",
) -> PackingResult:
    """Run the packing experiment once.

    Args:
        pods: the pod list (``load_openb_pods_for_packing``); trace jobs are accepted and carry no CPU or
            host-memory request.
        cluster: the nodes (``load_openb_nodes_for_packing``); a SimCluster counts each GPU as 1000 milli
            and never binds CPU or memory.
        policy: ``bestfit``, ``sja`` or ``random``.
        demand: arriving GPU request as a multiple of capacity (1.3 = 130 %).
        seed: seeds the arrival order, the resampling and tie-breaking (non-negative).
        checkpoints: demands at which the allocation curve is sampled; those up to ``demand`` are all
            reported, the last ones with the final state (arrivals stop one pod short of the target).
        order: ``shuffle`` (FGD's published runs) or ``trace`` (the list's order), see ``arrival_sequence``.

    Returns:
        A ``PackingResult`` dict; ``allocated_gpu_ratio`` is in percent.
    """
    if not demand > 0:
        raise ValueError(f"demand must be > 0, got {demand}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    pod_list = [p if isinstance(p, PackingPod) else pods_from_jobs([p])[0] for p in pods]
    if not any(p.total_gpu_milli for p in pod_list):
        raise ValueError("the packing experiment needs pods that request GPUs")
    nodes = nodes_from_cluster(cluster) if isinstance(cluster, SimCluster) else list(cluster)
    packer = Packer(nodes, policy, np.random.default_rng([seed, _STREAM_TIES]))
    capacity = packer.capacity_gpu_milli
    arrivals = arrival_sequence(
        pod_list, demand, capacity, np.random.default_rng([seed, _STREAM_ARRIVALS]), order=order
    )

    marks = sorted(c for c in checkpoints if c > 0)
    curve: list[tuple[float, float]] = []
    arrived = placed = 0
    rejected_by_kind = {"cpu": 0, "share": 0, "one": 0, "multi": 0}
    for pod in arrivals:
        arrived += pod.total_gpu_milli
        if packer.place(pod) is None:
            rejected_by_kind[pod.kind] += 1
        else:
            placed += 1
        while marks and arrived >= marks[0] * capacity:
            curve.append((round(100 * marks.pop(0), 6), 100 * packer.allocated_gpu_milli / capacity))
    allocated = packer.allocated_gpu_milli
    curve.extend((round(100 * m, 6), 100 * allocated / capacity) for m in marks if m <= demand + 1e-9)
    return PackingResult(
        policy=policy,
        demand=demand,
        seed=seed,
        order=order,
        allocated_gpu_ratio=100 * allocated / capacity,
        allocated_gpu_milli=allocated,
        capacity_gpu_milli=capacity,
        arrived_gpu_milli=arrived,
        arrived_pods=len(arrivals),
        placed_pods=placed,
        rejected_pods=len(arrivals) - placed,
        rejected_by_kind=rejected_by_kind,
        curve=curve,
    )


def packing_summary(
    pods_path: str | Path,
    nodes_path: str | Path,
    policies: Sequence[str],
    demand: float,
    seeds: Iterable[int] | int,
    *,
    order: str = "shuffle",
) -> dict[str, PolicySummary]:
    """Mean allocation per policy over seeds (``seeds``: the seeds, or a count meaning ``range(count)``)."""
    seed_list = list(range(seeds)) if isinstance(seeds, int) else list(seeds)
    if not seed_list:
        raise ValueError("packing_summary needs at least one seed")
    pods = load_openb_pods_for_packing(pods_path)
    nodes = load_openb_nodes_for_packing(nodes_path)
    out: dict[str, PolicySummary] = {}
    for policy in policies:
        runs = [run_packing(pods, nodes, policy, demand, s, order=order) for s in seed_list]
        ratios = [r["allocated_gpu_ratio"] for r in runs]
        depth = min(len(r["curve"]) for r in runs)
        curve = [
            (runs[0]["curve"][k][0], float(np.mean([r["curve"][k][1] for r in runs]))) for k in range(depth)
        ]
        out[policy] = PolicySummary(
            allocated_gpu_ratio=float(np.mean(ratios)),
            std=float(np.std(ratios)),
            per_seed=ratios,
            seeds=seed_list,
            curve=curve,
        )
    return out


_PUBLISHED_POLICY = {"random": "01-Random", "bestfit": "05-BestFit"}


def published_allocation(path: str | Path, workload: str, policy: str) -> dict[float, float]:
    """FGD's published mean allocation (percent) by demand (percent) for a workload and policy.

    Reads ``published/fgd_summary_by_workload_policy.csv``; ``policy`` is ours (``bestfit``, ``random``) or
    FGD's column value (``05-BestFit``, ``06-FGD``, ...). Empty when the file has no such row.
    """
    wanted = _PUBLISHED_POLICY.get(policy, policy)
    with Path(path).open(newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            if row.get("workload") == workload and row.get("policy") == wanted:
                return {
                    float(k.removeprefix("alloc@")): float(v)
                    for k, v in row.items()
                    if k.startswith("alloc@") and v not in (None, "")
                }
    return {}
