"""A three-node NATS cluster under the whole stack: one server is killed mid-run and every job still
completes with the result of the job computed in one piece.

Three nats-server processes on loopback (``NatsCluster``: JetStream, routes, a server name and a store
each) carry every stream and bucket with three replicas, declared before any service starts (so that
their leaders can be moved first; the services run with ``SJA_JS_REPLICAS=3`` and find them so).
``LocalStack`` runs every service as its own process against the comma-separated URL list. Once the
first units are applied, while units are still to be granted, the server leading the ``sja-slices``
bucket (every grant's compare-and-set), onto which the leaders of every other stream and bucket and of
the meta group were moved before the run, is killed with SIGKILL; the two left keep a quorum, and
every durable write of a grant's path waits for an election. Every job completes with the right
result, and every grant's round record reaches ``SJA_ROUNDS`` (none is lost to the election). Should the
run stall, the failure message lists the stuck jobs, what each surviving server answers for them,
three seconds of round traffic and the services' last errors.

A second test starts from streams and buckets of one copy each, as a deployment on one server has
them: a service started with ``SJA_JS_REPLICAS=3`` raises every one to three copies, and what they
held (a slice, a job) is read back from the survivors after the server leading them is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import pytest

from services.gateway.service import GatewayService, GatewaySettings
from sja.audit import Mix, audit, call, mixed_specs, read_rounds, statuses
from sja.bus.cluster import NatsCluster
from sja.bus.connection import connect
from sja.bus.store import stores
from sja.bus.streams import ensure_jetstream
from sja.core import jobs as J
from sja.protocol import subjects
from sja.protocol.messages import JobSpec, SliceState
from sja.stack import LocalStack

pytestmark = pytest.mark.slow

SETTINGS = {
    "SJA_JS_REPLICAS": "3",  # as a deployment on this cluster runs (the streams have three already)
    # 4 s windows: a sandboxed interpreter's start on a slow two-core machine leaves a 2 s window
    # little time for work
    "SJA_HORIZON_S": "4.0",
    "SJA_LEASE_S": "5.0",
    "SJA_RAY_NUM_CPUS": "2",
    "SJA_LOG_LEVEL": "INFO",
}
JOBS = 20
MIX = Mix(mc_units=60, mc_samples_per_unit=50_000, mm_rows=1500, mm_inner=512)
STREAMS = [s.name for s in subjects.STREAMS] + [f"KV_{b}" for b in subjects.BUCKETS]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    c = NatsCluster(size=3, base_dir=str(tmp_path / "nats"))
    try:
        c.start(timeout_s=60)
        yield c
    finally:
        c.stop()


async def declare_settled(js: Any, replicas: int, timeout_s: float = 60.0) -> None:
    """``ensure_jetstream`` on a cluster just started, tried again while its meta leader settles."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            await ensure_jetstream(js, replicas=replicas)
            return
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.5)


async def declare_replicated(url: str) -> dict[str, str]:
    """Every stream and bucket with three replicas; returns stream -> its leader's server name."""
    nc = await connect(url, "cluster-test")
    try:
        js = nc.jetstream()
        await declare_settled(js, replicas=3)
        leaders = {}
        for name in STREAMS:
            info = await js.stream_info(name)
            assert info.config.num_replicas == 3, (name, info.config.num_replicas)
            assert info.cluster is not None and info.cluster.leader
            assert len(info.cluster.replicas or []) == 2, (name, info.cluster)
            leaders[name] = info.cluster.leader
        return leaders
    finally:
        await nc.close()


async def lead_from(url: str, server: str, timeout_s: float = 60.0) -> dict[str, str]:
    """Move the leader of every stream and bucket, and of the meta group, onto ``server`` (leader
    step-down with a preferred placement); returns stream -> leader as they end up. A stream whose
    leader cannot be moved keeps the one it has (the test then kills fewer leaders, not none)."""
    nc = await connect(url, "cluster-placement")
    try:
        js = nc.jetstream()
        request = json.dumps({"placement": {"preferred": server}}).encode()
        deadline = time.monotonic() + timeout_s
        leaders: dict[str, str] = {}
        for name in STREAMS:
            while True:
                info = await js.stream_info(name)
                leaders[name] = info.cluster.leader if info.cluster and info.cluster.leader else ""
                if leaders[name] == server or time.monotonic() > deadline:
                    break
                with contextlib.suppress(Exception):
                    await nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{name}", request, timeout=5)
                await asyncio.sleep(0.5)
        with contextlib.suppress(Exception):
            await nc.request("$JS.API.META.LEADER.STEPDOWN", request, timeout=5)
        return leaders
    finally:
        await nc.close()


async def per_node(cluster: NatsCluster, ids: list[str]) -> str:
    """Each surviving node's own answer for the jobs (a KV read served by that node) and the
    replication state of the jobs bucket: a stale replica shows here."""
    out = []
    for node in cluster.nodes:
        if not node.alive:
            continue
        nc = await connect(node.url, f"diagnose-{node.name}")
        try:
            js = nc.jetstream()
            info = await js.stream_info(f"KV_{subjects.BUCKET_JOBS}")
            _, jobs = await stores(js)
            seen = []
            for j in ids:
                got = await jobs.get(j)
                seen.append(f"{j}:{got[0].status if got else None}:r{got[1] if got else 0}")
            peers = (
                [(r.name, r.current, r.lag) for r in (info.cluster.replicas or [])] if info.cluster else []
            )
            leader = info.cluster.leader if info.cluster else ""
            out.append(
                f"{node.name}: last_seq={info.state.last_seq} leader={leader} peers={peers} jobs={seen}"
            )
        finally:
            await nc.close()
    return "; ".join(out)


async def diagnose(url: str, ids: list[str]) -> str:
    """What the bus shows for three seconds (for a stall's failure message): messages per round
    subject, the slices' states and the unfinished jobs."""
    nc = await connect(url, "cluster-diagnose")
    counts: dict[str, int] = {}

    async def count(msg: Any) -> None:
        kind = msg.subject.split(".")[2] + "." + msg.subject.split(".")[3]
        counts[kind] = counts.get(kind, 0) + 1

    try:
        for pattern in ("sja.v1.offer.>", "sja.v1.grant.>", "sja.v1.agent.>"):
            await nc.subscribe(pattern, cb=count)
        await asyncio.sleep(3.0)
        slices, jobs = await stores(nc.jetstream())
        sl = [f"{s.slice_id}:{s.status}:f{s.fence}" for s, _ in await slices.all()]
        js = [
            f"{s.job_id}:{s.status}:{s.units_done}/{s.total_units}:inflight={len(s.in_flight)}:"
            f"owner={s.owner_agent}"
            for s, _ in await jobs.all()
            if s.job_id in ids and s.status != "done"
        ]
        return f"3s of messages {counts}; slices {sl}; unfinished {js}"
    finally:
        await nc.close()


async def replication(
    url: str, victim: str, timeout_s: float = 60.0
) -> dict[str, tuple[int, str, list[tuple[str, bool]]]]:
    """Each stream's replicas, leader and peers, once every stream is led by a survivor (a stream
    that saw no traffic since the kill may still be electing: its info request times out or shows
    no leader; asked again every second up to ``timeout_s``)."""
    nc = await connect(url, "cluster-check")
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout_s
        while True:
            out = {}
            try:
                for name in STREAMS:
                    info = await js.stream_info(name)
                    assert info.cluster is not None
                    peers = [(r.name, bool(r.current)) for r in info.cluster.replicas or []]
                    out[name] = (info.config.num_replicas, info.cluster.leader or "", peers)
            except nats.errors.TimeoutError:
                out = {}
            if out and all(leader and leader != victim for _, leader, _ in out.values()):
                return out
            if time.monotonic() > deadline:
                return out
            await asyncio.sleep(1.0)
    finally:
        await nc.close()


def service_errors(stack: LocalStack, per_log: int = 8, about: Sequence[str] = ()) -> dict[str, list[str]]:
    """The last ERROR lines of every service's log (what failed around the kill), and its last
    WARNING lines naming any of ``about`` (the stuck jobs: what the services decided about them)."""
    out = {}
    for log in sorted((stack.out_dir / "logs").glob("*.log")):
        lines = [
            ln[:200]
            for ln in log.read_text(errors="replace").splitlines()
            if " ERROR " in ln or (" WARNING " in ln and any(a in ln for a in about))
        ]
        if lines:
            out[log.stem] = lines[-per_log:]
    return out


def test_jobs_complete_when_a_nats_server_dies(cluster: NatsCluster, tmp_path: Path) -> None:
    leaders = asyncio.run(declare_replicated(cluster.url))
    # The node that will be killed leads every stream and bucket (and the meta group): every durable
    # write of a grant's path (lease, job, subjob, completion, round records) waits for an election.
    victim_name = leaders["KV_sja-slices"]
    leaders = asyncio.run(lead_from(cluster.url, victim_name))
    led = sorted(name for name, leader in leaders.items() if leader == victim_name)
    stack = LocalStack(out_dir=tmp_path / "stack", env=SETTINGS, nats_url=cluster.url)
    try:
        stack.start()
        asyncio.run(stack.wait_ready())
        assert stack.nats is None, "the stack must use the cluster, not a server of its own"
        url = cluster.url
        ids = [asyncio.run(call(url, "submit", s)).job_id for s in mixed_specs(JOBS, MIX)]

        # Let work complete, then kill the server the grants go through while units are still to be
        # handed out (so that grants must be made after the kill, not only completions reported).
        total = sum(s.total_units for s in asyncio.run(statuses(url, ids)))
        deadline = time.monotonic() + 240
        while True:
            states = asyncio.run(statuses(url, ids))
            applied = sum(s.units_done for s in states)
            unplanned = sum(s.total_units - s.next_unit + sum(r.count for r in s.retry) for s in states)
            if applied > 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        done = sum(1 for s in states if s.status == "done")
        assert applied > 0 and unplanned > 0, (
            f"kill mid-run: {applied} of {total} units applied, {unplanned} unplanned"
        )
        victim = cluster.index_of(victim_name)
        killed_at, killed_wall = time.monotonic(), time.time()
        cluster.kill(victim)
        survivors = ",".join(n.url for n in cluster.nodes if n.alive)

        deadline = time.monotonic() + 120
        while True:
            states = asyncio.run(statuses(survivors, ids))
            if all(s.status in ("done", "failed", "cancelled") for s in states):
                break
            if time.monotonic() > deadline:
                behind = [s.job_id for s in states if s.status not in ("done", "failed", "cancelled")]
                stuck = [
                    (s.job_id, s.status, s.units_done, len(s.in_flight)) for s in states if s.job_id in behind
                ]
                bus = asyncio.run(diagnose(survivors, ids))
                nodes = asyncio.run(per_node(cluster, behind))
                pytest.fail(
                    f"stalled after the kill: gateway says not done: {stuck}; {bus}; per node: {nodes}; "
                    f"service errors: {service_errors(stack, about=behind)}"
                )
            time.sleep(1.0)
        recovered_s = time.monotonic() - killed_at

        for s in states:
            assert s.status == "done", (s.job_id, s.status, s.error, s.units_done, s.total_units)
        # Results equal to the job in one piece, each unit applied once, no (slice, fence) granted
        # twice, no two subjobs at once on one slice.
        all_rounds = asyncio.run(read_rounds(survivors))
        report = audit(states, all_rounds, len(ids))
        assert report.clean, report
        # No service was killed: every grant's round record reached SJA_ROUNDS, the election included.
        assert not report.unrecorded, f"grants without their round record: {report.unrecorded}"
        finished_after_kill = sum(1 for s in states if s.finished_at and s.finished_at > killed_wall)
        assert finished_after_kill > 0, "jobs finished after the kill"

        recs = [r for r in all_rounds if r.grant_id]
        after = sorted(r.cleared_at for r in recs if r.cleared_at > killed_wall)
        assert after, "grants were made after the kill"
        print(
            f"\nkilled {victim_name} (leader of {', '.join(led)}) with {done}/{JOBS} jobs done, "
            f"{applied}/{total} units applied and {unplanned} not yet handed out; "
            f"first grant {after[0] - killed_wall:.2f}s after the kill; {finished_after_kill} jobs "
            f"finished after it; all done {recovered_s:.1f}s after it; {len(recs)} grants in all"
        )
        # Still three replicas on paper, led by a survivor, with the other survivor current.
        settled = asyncio.run(replication(survivors, victim_name))
        assert settled, "no stream info from the survivors"
        for name, (replicas, leader, peers) in settled.items():
            assert replicas == 3 and leader and leader != victim_name, (name, leader)
            assert any(current for peer, current in peers if peer != victim_name), (name, peers)
        assert all(p.proc.poll() is None for p in stack.procs), "no service died with the server"
    finally:
        stack.stop()


async def wait_current(
    url: str, timeout_s: float = 60.0
) -> dict[str, tuple[int, str, list[tuple[str, bool]]]]:
    """Each stream's replicas, leader and peers once every stream has a leader and every peer has
    caught up (or as they are at ``timeout_s``)."""
    nc = await connect(url, "cluster-current")
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + timeout_s
        while True:
            out = {}
            with contextlib.suppress(nats.errors.TimeoutError, nats.js.errors.APIError):
                for name in STREAMS:
                    info = await js.stream_info(name)
                    peers = [
                        (r.name, bool(r.current))
                        for r in (info.cluster.replicas if info.cluster else None) or []
                    ]
                    out[name] = (info.config.num_replicas, info.cluster.leader if info.cluster else "", peers)
            done = len(out) == len(STREAMS) and all(
                leader and len(peers) == replicas - 1 and all(c for _, c in peers)
                for replicas, leader, peers in out.values()
            )
            if done or time.monotonic() > deadline:
                return out
            await asyncio.sleep(0.5)
    finally:
        await nc.close()


def test_a_service_raises_one_copy_streams_to_three_and_they_outlive_a_server(
    cluster: NatsCluster, tmp_path: Path
) -> None:
    """A deployment that began with one copy of each stream (the default) restarts its services with
    ``SJA_JS_REPLICAS=3``: the first service up raises every stream and bucket to three copies,
    what they held is copied to the new peers, and it is still there after the server that led
    them is killed."""
    now = time.time()
    job = J.new_job(
        "j-kept", JobSpec(name="kept", tenant="t", workload="montecarlo", params={"units": 4}), now
    )
    sl = SliceState(
        slice_id="n0-g0-1g.10gb-0",
        node="n0",
        pool="n0",
        gpu_index=0,
        gpu_model="H100-80GB",
        profile="1g.10gb",
        mem_mib=9856,
        compute_slots=1,
        compute_share=1 / 7,
        fence=7,
    )

    async def before() -> None:
        nc = await connect(cluster.url, "one-copy-deployment")
        try:
            js = nc.jetstream()
            await declare_settled(js, replicas=1)
            slices, jobs = await stores(js)
            await slices.put(sl.slice_id, sl)
            await jobs.put(job.job_id, job)
            for name in STREAMS:
                assert (await js.stream_info(name)).config.num_replicas == 1, name
        finally:
            await nc.close()

    async def raise_by_service() -> None:
        settings = GatewaySettings(
            nats_url=cluster.url, js_replicas=3, out_dir=str(tmp_path / "out"), instance="gateway-r3"
        )
        async with GatewayService(settings):
            pass

    asyncio.run(before())
    asyncio.run(raise_by_service())
    raised = asyncio.run(wait_current(cluster.url))
    for name in STREAMS:
        replicas, leader, peers = raised[name]
        assert replicas == 3 and leader, (name, raised[name])
        assert len(peers) == 2 and all(current for _, current in peers), (name, peers)

    victim = raised[f"KV_{subjects.BUCKET_JOBS}"][1]
    cluster.kill(cluster.index_of(victim))
    survivors = ",".join(n.url for n in cluster.nodes if n.alive)

    async def after() -> tuple[SliceState | None, object]:
        nc = await connect(survivors, "after-the-kill")
        try:
            deadline = time.monotonic() + 60
            while True:
                try:
                    slices, jobs = await stores(nc.jetstream())
                    got_slice, got_job = await slices.get(sl.slice_id), await jobs.get(job.job_id)
                    return (got_slice[0] if got_slice else None), (got_job[0] if got_job else None)
                except (nats.errors.TimeoutError, nats.js.errors.APIError):  # electing a new leader
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)
        finally:
            await nc.close()

    got_slice, got_job = asyncio.run(after())
    assert got_slice == sl
    assert got_job == job
