"""A one-GPU trace job's subjobs hold at most one GPU (``JobSpec.gpus``): on a cut GPU it runs on its
``4g`` and its ``3g`` slice at once, on whole GPUs on one GPU; a job using a fraction of a GPU runs
on one slice at a time, and a multi-GPU job on one slice per GPU it asked for."""

from __future__ import annotations

from sja.sim.cluster import parse_cluster
from sja.sim.engine import SjaEngine
from sja.sim.model import SimConfig, TraceJob
from sja.sim.translate import job_spec

CFG = SimConfig(horizon_s=600.0, unit_s=60.0, policy="fair")
HOURS = 3600.0


def job(name: str, duration_s: float, fraction: float = 1.0, gpus: int = 1) -> TraceJob:
    return TraceJob(
        job_id=name,
        submit_s=0.0,
        duration_s=duration_s,
        num_gpus=gpus,
        gpu_fraction=fraction,
        mem_mib=8000.0,
        true_mem_mib=6000.0,
        tenant=name,
    )


def run(jobs: list[TraceJob], cluster: str) -> SjaEngine:
    engine = SjaEngine(parse_cluster(cluster), jobs, CFG)
    engine.run()
    for j in engine.jobs.values():
        assert j.state.status == "done" and j.state.units_done == j.state.total_units
    return engine


def slices_used(engine: SjaEngine, name: str) -> set[str]:
    (j,) = [j for j in engine.jobs.values() if j.model.trace.job_id == name]
    return {h.slice_id.rsplit("-", 1)[0] for h in j.state.history if h.status == "ok"}


def finished(engine: SjaEngine, name: str) -> float:
    end = engine.recorder.jobs[name].finish_s
    assert end is not None
    return end


def test_a_one_gpu_job_runs_on_both_slices_of_a_cut_gpu_and_ends_as_on_the_whole_gpu() -> None:
    cut = run([job("a", 6 * HOURS)], "1xA100-80GB:4g.40gb+3g.40gb")
    assert len(slices_used(cut, "a")) == 2
    whole = run([job("a", 6 * HOURS)], "1xA100-80GB")
    # on one slice alone it would take 7/4 of its run; on both, about its run (plus start-ups)
    assert finished(cut, "a") < 1.1 * finished(whole, "a")
    assert finished(whole, "a") < 1.1 * 6 * HOURS


def test_on_whole_gpus_a_job_holds_no_more_gpus_than_it_asked_for() -> None:
    engine = run([job("a", 2 * HOURS)], "3xA100-80GB")
    assert len(slices_used(engine, "a")) == 1
    two = run([job("b", 2 * HOURS, gpus=2)], "3xA100-80GB")
    assert len(slices_used(two, "b")) == 2
    (b,) = two.jobs.values()
    assert b.state.spec.gpus is None and b.state.spec.max_parallel == 2


def test_a_job_using_a_fraction_of_a_gpu_runs_on_one_slice_at_a_time() -> None:
    m = job("f", 2 * HOURS, fraction=0.3)
    engine = run([m], "1xA100-80GB:4g.40gb+3g.40gb")
    (j,) = engine.jobs.values()
    assert j.state.spec.gpus is None and j.state.spec.max_parallel == 1
    spec = job_spec(j.model, CFG)
    assert spec.gpus is None
    full = [j for j in run([job("w", 2 * HOURS)], "1xA100-80GB:4g.40gb+3g.40gb").jobs.values()]
    assert full[0].state.spec.gpus == 1.0 and full[0].state.spec.max_parallel == 7
