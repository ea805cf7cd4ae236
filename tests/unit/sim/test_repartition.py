"""Repartitionable MIG GPUs in the simulator: re-cuts in the SJA engine and in best-fit, what they
cost, and the whole-GPU baselines that ignore them."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from sja.core.mig import A100_80GB, place_layout
from sja.sim.baselines import BestFitMigScheduler, _Finish
from sja.sim.cluster import parse_cluster
from sja.sim.engine import SjaEngine, _Running
from sja.sim.metrics import ScheduleRecorder
from sja.sim.model import SimConfig, TraceJob
from sja.sim.recut import Cut
from sja.sim.runner import metrics_of, run_policy

SEVEN_1G = ("1g.10gb",) * 7

CFG = SimConfig(horizon_s=3600.0, unit_s=60.0, eps_mem=0.05)


def small_jobs(n: int = 14) -> list[TraceJob]:
    """Jobs that each use a seventh of a GPU and 4 GB: a whole GPU runs one at a time."""
    return [
        TraceJob(
            job_id=f"s{i}",
            submit_s=10.0 * i,
            duration_s=1200.0,
            num_gpus=1,
            gpu_fraction=1 / 7,
            mem_mib=5000.0,
            true_mem_mib=4000.0,
        )
        for i in range(n)
    ]


# --- the SJA engine -------------------------------------------------------------------------------


class RecordingEngine(SjaEngine):
    """Records (GPU, slice, held from, until) of every subjob."""

    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.pieces: list[tuple[str, str, float, float]] = []

    def _complete(self, run: _Running) -> None:
        s = run.slice
        self.pieces.append((s.sim.gpu_id, s.sim.slice_id, run.held_from, run.completion.finished_at))
        super()._complete(run)


def engine(spec: str, jobs: list[TraceJob], cfg: SimConfig = CFG) -> RecordingEngine:
    e = RecordingEngine(parse_cluster(spec), jobs, cfg)
    e.result = e.run()  # type: ignore[attr-defined]
    return e


def test_repartitioning_helps_small_jobs_measurably() -> None:
    jobs = small_jobs()
    static = run_policy("sja:efficiency", parse_cluster("2xA100-80GB"), jobs, CFG)
    repart = run_policy("sja:efficiency", parse_cluster("2xA100-80GB~repart"), jobs, CFG)
    ms, mr = metrics_of(static, jobs), metrics_of(repart, jobs)
    assert ms["jobs_finished"] == mr["jobs_finished"] == len(jobs)
    assert ms["repartitions"] == 0
    assert mr["repartitions"] >= 2
    assert mr["makespan_s"] < 0.5 * ms["makespan_s"]
    assert mr["mean_jct_s"] < 0.5 * ms["mean_jct_s"]
    json.dumps(mr)  # the count is part of the JSON metrics


def test_repartitioning_is_deterministic() -> None:
    a, b = engine("2xA100-80GB~repart", small_jobs()), engine("2xA100-80GB~repart", small_jobs())
    assert a.recuts == b.recuts and a.recuts
    assert a.pieces == b.pieces
    assert metrics_of(a.result, small_jobs()) == metrics_of(b.result, small_jobs())  # type: ignore[attr-defined]


def test_no_slice_runs_during_a_reconfiguration_and_layouts_stay_valid() -> None:
    e = engine("2xA100-80GB:4g.40gb+3g.40gb~repart", [*small_jobs(20), _big("big", 400.0)])
    assert e.recuts
    for r in e.recuts:
        assert r.ends - r.started == pytest.approx(CFG.reconfig_s)
        for gpu, _, start, end in e.pieces:
            if gpu == r.gpu_id:
                assert end <= r.started or start >= r.ends, "a subjob overlaps a re-cut of its GPU"
    # every slice that ever ran belongs to one layout generation of its GPU; its pieces never overlap
    by_slice: dict[str, list[tuple[float, float]]] = {}
    for _, slice_id, start, end in e.pieces:
        by_slice.setdefault(slice_id, []).append((start, end))
    for spans in by_slice.values():
        spans.sort()
        assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans))
    for gpu_id, cut in e.cuts.items():
        live = [e.slices[i] for i in e.gpu_slices[gpu_id]]
        assert tuple(s.sim.profile for s in live) == cut.layout
        place_layout(A100_80GB, cut.layout)
        assert len({s.sim.slice_id for s in e.slices if s.sim.gpu_id == gpu_id}) == sum(
            1 for s in e.slices if s.sim.gpu_id == gpu_id
        ), "slice ids are unique across re-cuts"
    # the big job needed the whole GPU: some GPU went back to 7g.80gb at some point
    assert any(r.layout == ("7g.80gb",) for r in e.recuts)


def _big(job_id: str, submit: float) -> TraceJob:
    return TraceJob(
        job_id=job_id, submit_s=submit, duration_s=1800.0, num_gpus=1, mem_mib=45_000.0, true_mem_mib=40_000.0
    )


def test_reconfiguration_cost_is_accounted() -> None:
    jobs = small_jobs()
    cheap = engine("2xA100-80GB~repart", jobs, dataclasses.replace(CFG, reconfig_s=1.0))
    dear = engine("2xA100-80GB~repart=900", jobs, dataclasses.replace(CFG, reconfig_s=1.0))
    for e, cost in ((cheap, 1.0), (dear, 900.0)):
        m = metrics_of(e.result, jobs)  # type: ignore[attr-defined]
        assert m["repartitions"] == len(e.recuts) > 0
        assert m["reconfig_s"] == pytest.approx(cost * len(e.recuts))
        assert all(r.ends - r.started == pytest.approx(cost) for r in e.recuts)
        # nothing starts on a re-cut GPU before its reconfiguration ends
        first = {r.gpu_id: r.ends for r in reversed(e.recuts)}
        assert all(start >= first[g] for g, sid, start, _ in e.pieces if ".r" in sid)
    mc = metrics_of(cheap.result, jobs)  # type: ignore[attr-defined]
    md = metrics_of(dear.result, jobs)  # type: ignore[attr-defined]
    assert md["makespan_s"] > mc["makespan_s"] + 800.0


def test_a_cut_accounts_its_reconfiguration_and_names_new_slices_by_generation() -> None:
    gpu = parse_cluster("1xA100-80GB~repart=30").gpus[0]
    cut = Cut.of(gpu, ("7g.80gb",), CFG)
    assert cut.reconfig_s == 30.0
    assert Cut.of(dataclasses.replace(gpu, reconfig_s=None), ("7g.80gb",), CFG).reconfig_s == CFG.reconfig_s
    rec = ScheduleRecorder(mem_capacity_mib=81920.0, compute_capacity=1.0)
    assert cut.start(100.0, rec) == 130.0 and cut.reconfiguring
    assert rec.repartitions == 1 and rec.reconfig_s == pytest.approx(30.0)
    made = cut.finish(SEVEN_1G)
    assert not cut.reconfiguring and cut.layout == SEVEN_1G and cut.generation == 1
    assert tuple(s.profile for s in made) == SEVEN_1G
    assert all(s.gpu_id == gpu.gpu_id and s.slice_id.endswith(".r1") for s in made)
    assert len({s.slice_id for s in made}) == 7
    cut.start(200.0, rec)
    assert all(s.slice_id.endswith(".r2") for s in cut.finish(("7g.80gb",)))


def test_static_gpus_are_never_recut() -> None:
    e = engine("2xA100-80GB", small_jobs())
    assert not e.recuts and not e.cuts
    assert metrics_of(e.result, small_jobs())["repartitions"] == 0  # type: ignore[attr-defined]


# --- best-fit -------------------------------------------------------------------------------------


class RecordingBestFit(BestFitMigScheduler):
    def __init__(self, *args: object, **kw: object) -> None:
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.pieces: list[tuple[int, float, float]] = []

    def finish(self, fin: _Finish) -> None:
        for g in {self.units[u].gpu for u in fin.units}:
            self.pieces.append((g, fin.started, self.now))
        super().finish(fin)


def test_bestfit_repartitions_for_small_jobs_and_accounts_the_cost() -> None:
    jobs = small_jobs()
    static = run_policy("bestfit", parse_cluster("2xA100-80GB"), jobs, CFG)
    sched = RecordingBestFit(parse_cluster("2xA100-80GB~repart"), jobs, CFG)
    repart = sched.run()
    ms, mr = metrics_of(static, jobs), metrics_of(repart, jobs)
    assert ms["repartitions"] == 0 and mr["repartitions"] == len(sched.repartitions) >= 2
    assert mr["reconfig_s"] == pytest.approx(CFG.reconfig_s * mr["repartitions"])
    assert mr["jobs_finished"] == len(jobs)
    assert mr["makespan_s"] < 0.5 * ms["makespan_s"]
    for g, start, _layout in sched.repartitions:
        for pg, ps, pe in sched.pieces:
            if pg == g:
                assert pe <= start or ps >= start + CFG.reconfig_s
    again = RecordingBestFit(parse_cluster("2xA100-80GB~repart"), jobs, CFG)
    again.run()
    assert again.repartitions == sched.repartitions and again.pieces == sched.pieces


def test_whole_gpu_baselines_ignore_repartitionable_marks() -> None:
    jobs = small_jobs()
    for name in ("fifo", "easy"):
        a = metrics_of(run_policy(name, parse_cluster("2xA100-80GB"), jobs, CFG), jobs)
        b = metrics_of(run_policy(name, parse_cluster("2xA100-80GB~repart"), jobs, CFG), jobs)
        assert a == b and b["repartitions"] == 0
