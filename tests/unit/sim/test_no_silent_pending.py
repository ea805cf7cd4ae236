"""At the end of any simulation every job is done, failed with a reason, or unschedulable with a
reason; and SJA finishes every job best-fit finishes (declarations honest, as the trace models make
them)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sja.sim.baselines import run_baseline
from sja.sim.cluster import parse_cluster
from sja.sim.engine import SjaEngine
from sja.sim.metrics import finished_ids
from sja.sim.model import SimConfig, TraceJob

CLUSTERS = (
    "2xA100-80GB",
    "2xA100-80GB:4g.40gb+3g.40gb",
    "1xA100-40GB:3g.20gb+2g.10gb+1g.5gb+1g.5gb",
    "1xH100-80GB:4g.40gb+3g.40gb,1xA100-40GB",
    "2xA100-80GB:4g.40gb+2g.20gb+1g.20gb~repart=5",
)
POLICIES = ("efficiency", "fair", "sla", "auction", "token", "jasda")


@st.composite
def traces(draw: st.DrawFn) -> list[TraceJob]:
    n = draw(st.integers(1, 8))
    jobs = []
    for i in range(n):
        gpus = draw(st.sampled_from([1, 1, 1, 2, 4]))
        fraction = 1.0 if gpus > 1 else draw(st.sampled_from([0.1, 0.25, 0.5, 1.0]))
        decl = draw(st.floats(500.0, 90_000.0))
        honest = draw(st.booleans())
        true = decl * draw(st.floats(0.2, 1.0)) if honest else decl * draw(st.floats(1.0, 1.5))
        jobs.append(
            TraceJob(
                job_id=f"j{i}",
                submit_s=draw(st.floats(0.0, 20_000.0)),
                duration_s=draw(st.floats(1.0, 30_000.0)),
                num_gpus=gpus,
                gpu_fraction=fraction,
                mem_mib=decl,
                true_mem_mib=true,
                tenant=f"t{i % 2}",
                deadline_s=draw(st.one_of(st.none(), st.floats(1_000.0, 100_000.0))),
            )
        )
    return jobs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(jobs=traces(), cluster=st.sampled_from(CLUSTERS), policy=st.sampled_from(POLICIES))
def test_every_job_ends_done_failed_or_unschedulable_with_a_reason(
    jobs: list[TraceJob], cluster: str, policy: str
) -> None:
    cfg = SimConfig(policy=policy, horizon_s=3_600.0, unit_s=300.0)
    engine = SjaEngine(parse_cluster(cluster), jobs, cfg)
    result = engine.run()
    for rec in result.recorder.jobs.values():
        if rec.finish_s is not None:
            continue
        assert rec.unschedulable or rec.failed, f"{rec.job_id} left pending: {rec.reason!r}"
        assert rec.reason, rec.job_id
    # Honest jobs best-fit finishes, SJA finishes too.
    best = run_baseline("bestfit", parse_cluster(cluster), jobs, cfg)
    honest = {j.job_id for j in jobs if (j.true_mem_mib or 0.0) <= (j.mem_mib or 0.0)}
    missing = (finished_ids(best.recorder) & honest) - finished_ids(result.recorder)
    assert not missing, {j: result.recorder.jobs[j].reason for j in missing}
