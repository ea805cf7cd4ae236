"""SJA in the discrete-event engine: the decision core driven in virtual time."""

from __future__ import annotations

import dataclasses

import pytest

from sja.core.bidding import propose
from sja.core.windows import WindowRequest, find_windows
from sja.protocol.messages import Offer
from sja.sim.cluster import parse_cluster
from sja.sim.engine import SjaEngine
from sja.sim.metrics import summarize
from sja.sim.model import SimConfig, TraceJob, job_model
from sja.sim.runner import metrics_of, parse_policies, run_policy
from sja.sim.translate import job_spec, sim_job, slice_states

CLUSTER = "2xA100-80GB:4g.40gb+2g.20gb+1g.20gb"
CFG = SimConfig(horizon_s=600.0, unit_s=60.0, eps_mem=0.2)


def trace(n: int = 8, mem: float = 8000.0) -> list[TraceJob]:
    return [
        TraceJob(
            job_id=f"job{i}",
            submit_s=120.0 * i,
            duration_s=600.0 + 450.0 * (i % 4),
            num_gpus=1 + (i % 3 == 2),
            mem_mib=mem,
            true_mem_mib=mem * 0.7,
            tenant=f"t{i % 2}",
        )
        for i in range(n)
    ]


def run(jobs: list[TraceJob], cfg: SimConfig = CFG) -> SjaEngine:
    engine = SjaEngine(parse_cluster(CLUSTER), jobs, cfg)
    engine.run()
    return engine


def assert_units_exactly_once(engine: SjaEngine) -> None:
    for job in engine.jobs.values():
        st = job.state
        assert st.status == "done", st.job_id
        assert st.units_done == st.total_units
        done = sorted((h.unit_start, h.units) for h in st.history if h.status == "ok")
        covered = 0
        for start, units in done:
            assert start == covered, f"{st.job_id}: gap or overlap at unit {start}"
            covered += units
        assert covered == st.total_units


def test_every_unit_completes_exactly_once_and_atomization_costs_time() -> None:
    engine = run(trace())
    assert_units_exactly_once(engine)
    m = summarize(engine.recorder)
    assert m["jobs_finished"] == 8
    ok = sum(1 for j in engine.jobs.values() for h in j.state.history if h.status == "ok")
    failed = m["subjobs"] - ok
    assert m["subjobs"] > 8  # the jobs were cut
    assert m["overhead_s"] == pytest.approx(ok * 15.0 + failed * 10.0)
    # Every job's units amount to its trace runtime.
    for job in engine.jobs.values():
        assert job.state.total_units * 60.0 >= job.model.trace.duration_s * job.model.trace.num_gpus


def test_zero_overhead_is_cheaper_than_the_default() -> None:
    # The overhead is paid per subjob on the slice: the same work holds slices longer with it. (The
    # makespan of a greedy online schedule is not monotone in it: a placement made a moment
    # earlier or later changes every later one.)
    jobs = trace()
    free = summarize(run(jobs, dataclasses.replace(CFG, start_s=0.0, checkpoint_s=0.0)).recorder)
    paid = summarize(run(jobs).recorder)
    assert free["jobs_finished"] == paid["jobs_finished"] == len(jobs)
    assert free["overhead_s"] == 0.0
    assert paid["overhead_s"] >= 15.0 * paid["subjobs"] - 5.0 * (paid["oom_count"] + paid["timeout_count"])


def test_an_oom_is_replanned_and_the_job_still_finishes() -> None:
    # Declares 10 GB (fits a 20 GB slice at eps 0.2) but really peaks at 30 GB: the first subjob on
    # a 20 GB slice runs out of memory, the core re-plans the range, and it finishes on 40 GB slices.
    liar = TraceJob(
        job_id="liar", submit_s=0.0, duration_s=1800.0, num_gpus=1, mem_mib=10000.0, true_mem_mib=30000.0
    )
    # The 20 GB slices come first in the cluster, so they are offered first.
    cluster = parse_cluster("1xA100-80GB:2g.20gb+2g.20gb+2g.20gb,1xA100-80GB:4g.40gb+3g.40gb")
    # An hour-long window, so that the wide time prior of a first subjob fits a 2g slice too.
    engine = SjaEngine(cluster, [liar], dataclasses.replace(CFG, horizon_s=3600.0))
    engine.run()
    m = summarize(engine.recorder)
    assert m["oom_count"] >= 1
    assert_units_exactly_once(engine)
    st = engine.jobs["j0"].state
    ooms = [h for h in st.history if h.status == "oom"]
    assert ooms and all(h.mem_cap_mib < 30000 for h in ooms)
    assert all(h.mem_cap_mib > 30000 for h in st.history if h.status == "ok")


def test_same_seed_same_metrics() -> None:
    jobs = trace(10)
    a = metrics_of(run_policy("sja:fair", parse_cluster(CLUSTER), jobs, CFG), jobs)
    b = metrics_of(run_policy("sja:fair", parse_cluster(CLUSTER), jobs, CFG), jobs)
    c = metrics_of(
        run_policy("sja:fair", parse_cluster(CLUSTER), jobs, dataclasses.replace(CFG, seed=7)), jobs
    )
    assert a == b
    assert a != c


@pytest.mark.parametrize("policy", ["efficiency", "fair", "sla", "auction", "token", "jasda"])
def test_every_policy_finishes_everything_through_the_agents_bidder(policy: str) -> None:
    jobs = trace(10)
    engine = run(jobs, dataclasses.replace(CFG, policy=policy))
    assert_units_exactly_once(engine)
    assert engine.counters["batches"] > 0


def test_a_long_job_is_cut_into_short_windows() -> None:
    # The prior is scaled by what fits one planning window (as the gateway makes it): a 100-hour
    # job's one-unit subjob fits a 10-minute window.
    long_job = TraceJob(job_id="long", submit_s=0.0, duration_s=100 * 3600.0, num_gpus=1, mem_mib=8000.0)
    m = job_model(long_job, CFG)
    cluster = parse_cluster("1xA100-80GB")
    window = find_windows(slice_states(cluster), WindowRequest(now=0.0, horizon_s=600.0))[0]
    offer = Offer(
        offer_id="o1",
        round=1,
        window=window,
        slice_fence=0,
        slice_revision=0,
        issued_at=0.0,
        reply_by=0.0,
        reply_to="x",
    )
    p = propose(sim_job("j0", job_spec(m, CFG), 0.0, CFG), offer, 0.0, CFG.limits())
    assert p is not None and p.candidates[0].size >= 1


def test_policy_names() -> None:
    # Plain ``sja`` is the policy the live stack clears by (``sja.core.defaults.POLICY``).
    names = parse_policies("fifo, sja ,sja:efficiency,easy,sja")
    assert names == ["fifo", "sja:fair", "sja:efficiency", "easy"]
    with pytest.raises(ValueError, match="unknown policy"):
        parse_policies("lottery")
    with pytest.raises(ValueError, match="unknown SJA clearing policy"):
        parse_policies("sja:nope")
