"""Many nodes, one Ray cluster: a head and two worker nodes on this machine, each worker declaring
its SJA node's slices as custom resources; one executor per node. Every subjob runs on the Ray node
that owns its slice."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import msgspec
import pytest
import ray
import yaml
from ray.cluster_utils import Cluster

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.executor.service import ExecutorService, ExecutorSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from sja.bus.store import stores
from sja.client import SjaClient
from sja.core import jobs as J
from sja.execution.actor import node_resource, node_resources
from sja.inventory.declared import load_declared
from sja.protocol.messages import JobSpec, TimeDecl
from sja.workloads import facts_of, run_in_one_piece, workload
from sja.workloads.parts import combine

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

NODES = ("node-a", "node-b")
INVENTORY = {
    "nodes": [
        {"name": n, "pool": "pool", "gpus": [{"model": "A100-40GB", "layout": ["4g.20gb", "3g.20gb"]}]}
        for n in NODES
    ]
}


@pytest.fixture
def inventory_file(tmp_path: Path) -> Path:
    path = tmp_path / "inventory.yaml"
    path.write_text(yaml.safe_dump(INVENTORY), encoding="utf-8")
    return path


@pytest.fixture
def ray_cluster(inventory_file: Path) -> Iterator[Cluster]:
    if ray.is_initialized():
        ray.shutdown()
    slices = load_declared(inventory_file)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "include_dashboard": False, "object_store_memory": 80 * 1024 * 1024},
    )
    try:
        for node in NODES:
            ids = [s.slice_id for s in slices if s.node == node]
            cluster.add_node(
                num_cpus=1, resources=node_resources(node, ids), object_store_memory=80 * 1024 * 1024
            )
        cluster.wait_for_nodes()
        yield cluster
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


@contextlib.asynccontextmanager
async def running(*services: object) -> AsyncIterator[None]:
    async with contextlib.AsyncExitStack() as stack:
        for s in services:
            await stack.enter_async_context(s)  # type: ignore[arg-type]
        yield


async def test_each_subjob_runs_on_the_node_that_owns_its_slice(
    nats_url: str, tmp_path: Path, nc, inventory_file: Path, ray_cluster: Cluster
) -> None:
    def c(name: str) -> dict[str, object]:
        return {"nats_url": nats_url, "out_dir": str(tmp_path / "out"), "instance": name}

    executors = {
        node: ExecutorService(
            ExecutorSettings(**c(f"executor-{node}"), node=node, ray_address=ray_cluster.address)
        )
        for node in NODES
    }
    services = [
        InventoryService(InventorySettings(**c("inventory-t"), inventory=str(inventory_file))),
        GatewayService(GatewaySettings(**c("gateway-t"))),
        ClearerService(ClearerSettings(**c("clearer-t"))),
        AgentService(AgentSettings(**c("agent-t"), horizon_s=4.0)),
        *executors.values(),
        AdvertiserService(AdvertiserSettings(**c("advertiser-t"), horizon_s=4.0)),
    ]
    async with running(*services):
        ray_node_of = {
            node: next(n["NodeID"] for n in ray.nodes() if node_resource(node) in n.get("Resources", {}))
            for node in NODES
        }
        assert len(set(ray_node_of.values())) == 2

        client = SjaClient(nc)
        # More jobs than slices, one subjob each at a time: every slice of both nodes gets work.
        params = {"units": 300, "samples_per_unit": 50_000, "seed": 9}
        jobs = [
            await client.submit(JobSpec(name=f"mc{i}", tenant=f"t{i}", workload="montecarlo", params=params))
            for i in range(6)
        ]
        deadline = time.monotonic() + 120
        while True:
            states = [await client.status(j.job_id) for j in jobs]
            if all(J.is_terminal(s) for s in states):
                break
            assert time.monotonic() < deadline, [(s.status, s.units_done) for s in states]
            await asyncio.sleep(0.1)
        assert [s.status for s in states] == ["done"] * len(jobs)
        assert all(s.result == run_in_one_piece("montecarlo", params) for s in states)

        for node, ex in executors.items():
            assert ex.placements, f"no subjob ran on {node}"
            for subjob_id, slice_id, ray_node in ex.placements:
                assert slice_id.startswith(node + "-"), (subjob_id, slice_id)
                assert ray_node == ray_node_of[node], f"{subjob_id} on {slice_id} ran off its node"

        # A node whose Ray never declared its slices: its executor refuses to start, and says how.
        slices, _ = await stores(nc.jetstream())
        stray = load_declared(inventory_file)[0]
        stray = msgspec.structs.replace(stray, slice_id="node-c-g0-4g.20gb-0", node="node-c", pool="other")
        await slices.create(stray.slice_id, stray)
        orphan = ExecutorService(
            ExecutorSettings(**c("executor-node-c"), node="node-c", ray_address=ray_cluster.address)
        )
        with pytest.raises(RuntimeError, match=r"sja_slice:node-c-g0-4g.20gb-0.*ray start"):
            await orphan.start()
        await orphan.stop()  # a failed start keeps its connection until stopped


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@pytest.fixture
def user_code(monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user's package installed in the environment of every node (here: on the path of this
    process, which the Ray nodes started after it inherit)."""
    src = EXAMPLES / "entrypoint-pkg" / "src"
    monkeypatch.syspath_prepend(str(src))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")])))
    return src


async def test_users_code_runs_on_every_node(
    nats_url: str, tmp_path: Path, nc, inventory_file: Path, user_code: Path, ray_cluster: Cluster
) -> None:
    def c(name: str) -> dict[str, object]:
        return {"nats_url": nats_url, "out_dir": str(tmp_path / "out"), "instance": name}

    executors = {
        node: ExecutorService(
            ExecutorSettings(**c(f"executor-{node}"), node=node, ray_address=ray_cluster.address)
        )
        for node in NODES
    }
    services = [
        InventoryService(InventorySettings(**c("inventory-t"), inventory=str(inventory_file))),
        GatewayService(GatewaySettings(**c("gateway-t"))),
        ClearerService(ClearerSettings(**c("clearer-t"))),
        AgentService(AgentSettings(**c("agent-t"), horizon_s=4.0)),
        *executors.values(),
        AdvertiserService(AdvertiserSettings(**c("advertiser-t"), horizon_s=4.0)),
    ]
    async with running(*services):
        client = SjaClient(nc)
        primes = {"limit": 400_000, "block": 1000}
        slow = TimeDecl(warmup_s=0.05, per_unit_s=0.05, rel_sd=0.5)  # declared slow: cut small
        infer = [sys.executable, str(EXAMPLES / "batch-inference" / "infer.py")]
        # As `sja submit` does where the package is installed: the control plane plans it by these.
        params, facts = facts_of("sja_example_primes:Primes", primes)
        jobs = [
            await client.submit(
                JobSpec(
                    name=f"p{i}",
                    tenant="t",
                    workload="sja_example_primes:Primes",
                    params=params,
                    facts=facts,
                    time=slow,
                )
            )
            for i in range(3)
        ] + [
            await client.submit(
                JobSpec(
                    name="infer",
                    tenant="u",
                    workload="command",
                    max_parallel=2,
                    params={"argv": infer, "units": 400, "sequential": False, "merge_argv": ["true"]},
                    time=slow,
                )
            )
        ]
        deadline = time.monotonic() + 150
        while True:
            states = [await client.status(j.job_id) for j in jobs]
            if all(J.is_terminal(s) for s in states):
                break
            assert time.monotonic() < deadline, [(s.status, s.units_done) for s in states]
            await asyncio.sleep(0.2)
        assert [s.status for s in states] == ["done"] * len(jobs), [s.error for s in states]
        # The parts the control plane kept, combined where the result is fetched (`sja result`).
        w = workload("sja_example_primes:Primes")
        assert all(
            combine(w, s.spec.params, s.accumulator, sequential=False)
            == run_in_one_piece("sja_example_primes:Primes", primes)
            for s in states[:3]
        )
        assert states[3].result["units_done"] == 400
        for node, ex in executors.items():
            assert ex.placements, f"no subjob ran on {node}"


SUMS = """
import os, pathlib
from helpers import total
e = os.environ
start, n = int(e["SJA_UNIT_START"]), int(e["SJA_UNITS"])
pathlib.Path(e["SJA_STATE_OUT"], "sum").write_text(str(total(start, start + n)))
"""


async def test_a_jobs_code_reaches_every_node_through_ray(
    nats_url: str, tmp_path: Path, nc, inventory_file: Path, ray_cluster: Cluster
) -> None:
    """Code uploaded through the gateway (``sja submit --code``) is handed to the Ray cluster by the
    executors and unpacked on each node that runs the job: its subjobs run on both nodes, importing
    the code's own module."""
    from sja.workloads import codepack

    def c(name: str) -> dict[str, object]:
        return {"nats_url": nats_url, "out_dir": str(tmp_path / "out"), "instance": name}

    code = tmp_path / "code"
    code.mkdir()
    (code / "helpers.py").write_text("def total(a, b):\n    return sum(range(a, b))\n")
    (code / "sums.py").write_text(SUMS)
    executors = {
        node: ExecutorService(
            ExecutorSettings(**c(f"executor-{node}"), node=node, ray_address=ray_cluster.address)
        )
        for node in NODES
    }
    services = [
        InventoryService(InventorySettings(**c("inventory-t"), inventory=str(inventory_file))),
        GatewayService(GatewaySettings(**c("gateway-t"))),
        ClearerService(ClearerSettings(**c("clearer-t"))),
        AgentService(AgentSettings(**c("agent-t"), horizon_s=4.0)),
        *executors.values(),
        AdvertiserService(AdvertiserSettings(**c("advertiser-t"), horizon_s=4.0)),
    ]
    async with running(*services):
        client = SjaClient(nc)
        ref = await client.upload_code("u", codepack.pack(code, 1 << 20))
        job = await client.submit(
            JobSpec(
                name="sums",
                tenant="u",
                workload="command",
                max_parallel=4,
                params={
                    "argv": ["python", "sums.py"],
                    "units": 400,
                    "sequential": False,
                    "merge_argv": ["true"],
                    "code": ref,
                },
                time=TimeDecl(warmup_s=0.05, per_unit_s=0.05, rel_sd=0.5),  # declared slow: cut small
            )
        )
        deadline = time.monotonic() + 150
        while not J.is_terminal(state := await client.status(job.job_id)):
            assert time.monotonic() < deadline, (state.status, state.units_done)
            await asyncio.sleep(0.2)
        assert state.status == "done", state.error
        assert state.result["units_done"] == 400
        for node, ex in executors.items():
            ran = [p for p in ex.placements if p[0].startswith(job.job_id + ".")]
            assert ran, f"no subjob of the job ran on {node}"
