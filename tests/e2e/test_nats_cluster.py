"""A three-node NATS cluster under the whole stack: one server is killed mid-run and every job still
completes with the result of the job computed in one piece.

Three nats-server processes on loopback (``NatsCluster``: JetStream, routes, a server name and a store
each) carry every stream and bucket with three replicas, declared before any service starts (services
declare with one replica and keep what exists). ``LocalStack`` runs every service as its own process
against the comma-separated URL list. Halfway through 20 jobs the server leading the ``sja-slices``
bucket (every grant's compare-and-set) is killed with SIGKILL; the two left keep a quorum.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import DeliverPolicy

from sja.bus.cluster import NatsCluster
from sja.bus.codec import decode
from sja.bus.connection import connect, ensure_jetstream
from sja.client import SjaClient
from sja.protocol import subjects
from sja.protocol.messages import JobSpec, JobState, RoundRecord
from sja.stack import LocalStack
from sja.workloads import run_in_one_piece

pytestmark = pytest.mark.slow

SETTINGS = {
    "SJA_HORIZON_S": "2.0",
    "SJA_LEASE_S": "3.0",
    "SJA_RAY_NUM_CPUS": "2",
    "SJA_LOG_LEVEL": "INFO",
}
JOBS = 20
STREAMS = [s.name for s in subjects.STREAMS] + [f"KV_{b}" for b in subjects.BUCKETS]


def specs(n: int) -> list[JobSpec]:
    out = []
    for i in range(n):
        if i % 2:
            out.append(
                JobSpec(
                    name=f"mc{i}",
                    tenant=f"t{i % 3}",
                    workload="montecarlo",
                    max_parallel=2,
                    params={"units": 40, "samples_per_unit": 40_000, "seed": i},
                )
            )
        else:
            out.append(
                JobSpec(
                    name=f"mm{i}",
                    tenant=f"t{i % 3}",
                    workload="matmul",
                    params={"rows": 1200, "inner": 384, "cols": 384, "seed": i},
                )
            )
    return out


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    c = NatsCluster(size=3, base_dir=str(tmp_path / "nats"))
    try:
        c.start(timeout_s=60)
        yield c
    finally:
        c.stop()


async def declare_replicated(url: str) -> dict[str, str]:
    """Every stream and bucket with three replicas; returns stream -> its leader's server name."""
    nc = await connect(url, "cluster-test")
    try:
        js = nc.jetstream()
        deadline = time.monotonic() + 60
        while True:
            try:
                await ensure_jetstream(js, replicas=3)
                break
            except Exception:  # the meta leader may still be settling
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
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


async def call(url: str, fn: str, *args: object) -> Any:
    """A gateway call that rides out the loss of a server (and a JetStream leader election)."""
    last: Exception | None = None
    for _ in range(120):
        try:
            c = await SjaClient.connect(url, timeout_s=3.0)
            try:
                return await getattr(c, fn)(*args)
            finally:
                await c.close()
        except Exception as e:  # retried: an election or a reconnect in progress
            last = e
            await asyncio.sleep(0.5)
    raise AssertionError(f"{fn} kept failing: {last}")


async def statuses(url: str, ids: list[str]) -> list[JobState]:
    c = await SjaClient.connect(url, timeout_s=5.0)
    try:
        out = []
        for j in ids:
            for attempt in range(20):
                try:
                    out.append(await c.status(j))
                    break
                except Exception:
                    if attempt == 19:
                        raise
                    await asyncio.sleep(0.5)
        return out
    finally:
        await c.close()


async def rounds(url: str) -> list[RoundRecord]:
    nc = await connect(url, "cluster-check")
    js = nc.jetstream()
    out: list[RoundRecord] = []
    sub = await js.subscribe(
        f"{subjects.PREFIX}.round.cleared.>", ordered_consumer=True, deliver_policy=DeliverPolicy.ALL
    )
    while True:
        msg = await sub.next_msg(timeout=10.0)
        out.append(decode(msg.data, RoundRecord))
        if msg.metadata.num_pending == 0:
            break
    await nc.close()
    return out


async def replication(url: str) -> dict[str, tuple[int, str, list[tuple[str, bool]]]]:
    nc = await connect(url, "cluster-check")
    try:
        js = nc.jetstream()
        out = {}
        for name in STREAMS:
            info = await js.stream_info(name)
            assert info.cluster is not None
            peers = [(r.name, bool(r.current)) for r in info.cluster.replicas or []]
            out[name] = (info.config.num_replicas, info.cluster.leader or "", peers)
        return out
    finally:
        await nc.close()


def test_jobs_complete_when_a_nats_server_dies(cluster: NatsCluster, tmp_path: Path) -> None:
    leaders = asyncio.run(declare_replicated(cluster.url))
    stack = LocalStack(out_dir=tmp_path / "stack", env=SETTINGS, nats_url=cluster.url)
    try:
        stack.start()
        asyncio.run(stack.wait_ready())
        assert stack.nats is None, "the stack must use the cluster, not a server of its own"
        url = cluster.url
        ids = [asyncio.run(call(url, "submit", s)).job_id for s in specs(JOBS)]

        # Let a good part of the work happen, then kill the server the grants go through.
        deadline = time.monotonic() + 240
        while True:
            states = asyncio.run(statuses(url, ids))
            done = sum(1 for s in states if s.status == "done")
            if done >= 3 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert 0 < done < JOBS, f"kill mid-run: {done} of {JOBS} jobs done"
        victim = cluster.index_of(leaders["KV_sja-slices"])
        killed_at, killed_wall = time.monotonic(), time.time()
        cluster.kill(victim)
        survivors = ",".join(n.url for n in cluster.nodes if n.alive)

        deadline = time.monotonic() + 300
        while True:
            states = asyncio.run(statuses(survivors, ids))
            if all(s.status in ("done", "failed", "cancelled") for s in states):
                break
            assert time.monotonic() < deadline, [(s.job_id, s.status, s.units_done) for s in states]
            time.sleep(1.0)
        recovered_s = time.monotonic() - killed_at

        for s in states:
            assert s.status == "done", (s.job_id, s.status, s.error, s.units_done, s.total_units)
            assert s.result == run_in_one_piece(s.spec.workload, s.spec.params), s.job_id
            ok = sorted((h.unit_start, h.unit_start + h.units) for h in s.history if h.status == "ok")
            assert ok[0][0] == 0 and ok[-1][1] == s.total_units, s.job_id
            assert all(a[1] == b[0] for a, b in itertools.pairwise(ok)), f"{s.job_id}: units applied once"
        finished_after_kill = sum(1 for s in states if s.finished_at and s.finished_at > killed_wall)
        assert finished_after_kill > 0, "jobs finished after the kill"

        # No (slice, fence) granted twice; no two subjobs at once on one slice.
        recs = [r for r in asyncio.run(rounds(survivors)) if r.grant_id]
        keys = [(r.window.slice_id, r.fence) for r in recs]
        assert len(keys) == len(set(keys))
        after = sorted(r.cleared_at for r in recs if r.cleared_at > killed_wall)
        assert after, "grants were made after the kill"
        print(
            f"\nkilled {cluster.nodes[victim].name} (leader of KV_sja-slices) with {done}/{JOBS} jobs done; "
            f"first grant {after[0] - killed_wall:.2f}s after the kill; {finished_after_kill} jobs "
            f"finished after it; all done {recovered_s:.1f}s after it; {len(recs)} grants in all"
        )
        by_slice: dict[str, list[tuple[float, float]]] = {}
        for s in states:
            for h in s.history:
                if h.status == "ok":
                    by_slice.setdefault(h.slice_id, []).append((h.started_at, h.finished_at))
        for slice_id, spans in by_slice.items():
            spans.sort()
            for (_a0, a1), (b0, _b1) in itertools.pairwise(spans):
                assert b0 >= a1 - 1e-3, f"two subjobs ran at once on {slice_id}"

        # Still three replicas on paper, led by a survivor, with the other survivor current.
        victim_name = cluster.nodes[victim].name
        for name, (replicas, leader, peers) in asyncio.run(replication(survivors)).items():
            assert replicas == 3 and leader and leader != victim_name, (name, leader)
            assert any(current for peer, current in peers if peer != victim_name), (name, peers)
        assert all(p.proc.poll() is None for p in stack.procs), "no service died with the server"
    finally:
        stack.stop()
