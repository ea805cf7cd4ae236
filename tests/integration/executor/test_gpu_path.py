"""The GPU path without a GPU: the inventory reads a fake NVML, the executor pins one Ray actor per
MIG instance, and jobs run through the whole stack on the CPU; a lost GPU's slices go offline."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.executor.service import ExecutorService, ExecutorSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from sja.bus.store import stores
from sja.client import SjaClient
from sja.core import jobs as J
from sja.inventory.fake_nvml import FakeNvml
from sja.inventory.nvml import discover
from sja.protocol.messages import JobSpec, MemoryDecl, SliceState
from sja.workloads import checkpoint as ckpt
from sja.workloads import run_in_one_piece
from tests.integration.waits import until_state, wait_until

pytestmark = pytest.mark.timeout(240)


def common(nats_url: str, tmp_path: Path, name: str) -> dict[str, object]:
    return {"nats_url": nats_url, "out_dir": str(tmp_path / "out"), "instance": name}


@contextlib.asynccontextmanager
async def running(*services: object) -> AsyncIterator[None]:
    async with contextlib.AsyncExitStack() as stack:
        for s in services:
            await stack.enter_async_context(s)  # type: ignore[arg-type]
        yield


async def slices_of(nc) -> dict[str, SliceState]:
    slices, _ = await stores(nc.jetstream())
    return {s.slice_id: s for s, _ in await slices.all()}


async def test_lost_gpu_goes_offline_and_comes_back_free(nats_url: str, tmp_path: Path, nc) -> None:
    inventory = InventoryService(
        InventorySettings(
            **common(nats_url, tmp_path, "inventory-t"),
            inventory_source="fake-nvml:node",
            node="gpu1",
            soft_slices="2",
            poll_interval_s=0.05,
        )
    )
    async with running(inventory):
        fake = inventory.nvml
        assert isinstance(fake, FakeNvml)
        expected = {s.slice_id for s in discover(FakeNvml("node"), node="gpu1", soft_slices="2").slices}
        first = await slices_of(nc)
        assert set(first) == expected
        assert {s.source for s in first.values()} == {"nvml", "soft"}
        assert {s.status for s in first.values()} == {"free"}

        fake.lose(2)

        async def a100_offline() -> bool:
            now = await slices_of(nc)
            return all((s.status == "offline") == (s.gpu_index == 2) for s in now.values())

        await wait_until(a100_offline, "the lost GPU's slices offline", 10.0, every_s=0.05)
        assert set(await slices_of(nc)) == expected, "offline slices are kept, not deleted"

        fake.restore(2)

        async def all_free() -> bool:
            return {s.status for s in (await slices_of(nc)).values()} == {"free"}

        await wait_until(all_free, "the GPU's slices back and free", 10.0, every_s=0.05)


async def test_unavailable_nvml_fails_the_inventory_at_start(nats_url: str, tmp_path: Path) -> None:
    inventory = InventoryService(
        InventorySettings(**common(nats_url, tmp_path, "inventory-t"), inventory_source="fake-nvml:no-driver")
    )
    with pytest.raises(Exception, match="LibraryNotFound"):
        await inventory.start()
    await inventory.stop()  # a failed start keeps its connection until stopped


TORCH_HORIZON_S = 20.0


@pytest.mark.timeout(360)  # its wait for the jobs (240 s) and the stack's start and stop
async def test_jobs_run_on_nvml_slices_through_the_stack(nats_url: str, tmp_path: Path, nc) -> None:
    """An H100 with MIG (fake NVML) as the inventory; one actor per MIG instance, pinned to its MIG
    device; a Monte Carlo job, and, when PyTorch is installed, a training job whose checkpoints go
    through the object store and a batched-inference job, all computed on the CPU."""
    c = lambda name: common(nats_url, tmp_path, name)  # noqa: E731
    try:
        import torch  # noqa: F401

        has_torch = True
    except ImportError:
        has_torch = False
    inventory = InventoryService(
        InventorySettings(**c("inventory-t"), inventory_source="fake-nvml:h100-mig", node="local")
    )
    executor = ExecutorService(
        ExecutorSettings(
            **c("executor-t"), node="local", ray_num_cpus=2, preload="torch" if has_torch else ""
        )
    )
    # Each subjob of a PyTorch job imports torch in a fresh sandboxed interpreter: 4 s on an idle
    # two-core machine, over 10 s with three jobs, Ray and the services on it. 20 s windows leave
    # every subjob room for work after that; 6 s windows made 1-step subjobs that timed out.
    services = [
        inventory,
        GatewayService(GatewaySettings(**c("gateway-t"))),
        ClearerService(ClearerSettings(**c("clearer-t"))),
        AgentService(AgentSettings(**c("agent-t"), horizon_s=TORCH_HORIZON_S)),
        executor,
        AdvertiserService(AdvertiserSettings(**c("advertiser-t"), horizon_s=TORCH_HORIZON_S)),
    ]
    async with running(*services):
        slices = await slices_of(nc)
        assert len(slices) == 4 and {s.source for s in slices.values()} == {"nvml"}
        infos = await asyncio.gather(
            *(asyncio.wrap_future(a.info.remote().future()) for a in executor.actors.values())
        )
        assert {i["slice_id"]: i["cuda_visible_devices"] for i in infos} == {
            sid: s.gpu_uuid for sid, s in slices.items()
        }
        assert all(v.startswith("MIG-") for v in (i["cuda_visible_devices"] for i in infos))

        client = SjaClient(nc)
        mc_params = {"units": 40, "samples_per_unit": 20_000, "seed": 5}
        specs = [JobSpec(name="mc", tenant="t", workload="montecarlo", max_parallel=4, params=mc_params)]
        train_params = {"steps": 60, "batch_size": 32, "hidden": 64, "seed": 3, "device": "cpu"}
        infer_params = {"items": 4000, "hidden": 64, "seed": 4}
        if has_torch:
            specs.append(JobSpec(name="train", tenant="u", workload="torch-train", params=train_params))
            specs.append(
                JobSpec(name="infer", tenant="u", workload="torch-infer", max_parallel=4, params=infer_params)
            )
        ids = [(await client.submit(s)).job_id for s in specs]
        states = [await until_state(client, j, J.is_terminal, 240, f"job {j} to end") for j in ids]
        for s in states:
            assert s.status == "done", (s.job_id, s.status, s.units_done, s.total_units)
        assert states[0].result == run_in_one_piece("montecarlo", mc_params)
        ran_on = {sid for _, sid, _ in executor.placements}
        assert ran_on <= set(slices)

        if has_torch:
            train, infer = states[1], states[2]
            whole = run_in_one_piece("torch-train", train_params)
            assert train.result["steps"] == 60
            assert train.result["weights_sha256"] == whole["weights_sha256"]
            assert train.result["checkpoint"].startswith(ckpt.BUCKET + "/" + train.job_id + "/")
            ref = ckpt.unpack_ref(train.accumulator)
            store = await nc.jetstream().object_store(ckpt.BUCKET)
            blob = await store.get(ref.name)
            assert ckpt.digest(blob.data) == ref.sha256 and ref.size > 10_000
            assert infer.result == run_in_one_piece("torch-infer", infer_params)


async def test_a_job_no_mig_instance_holds_runs_after_the_gpu_is_re_cut(
    nats_url: str, tmp_path: Path, nc
) -> None:
    """With re-cutting on, a job whose subjobs need 60 GB (no instance of the H100's 2g+1g+1g+3g
    layout holds them) gets the GPU re-cut whole through NVML; the executor follows the node's
    slices (the old instances' actors stop, the new 7g.80gb gets one, pinned to its new MIG
    device) and the job runs there to the right answer."""
    c = lambda name: common(nats_url, tmp_path, name)  # noqa: E731
    inventory = InventoryService(
        InventorySettings(
            **c("inventory-t"),
            inventory_source="fake-nvml:h100-mig",
            node="local",
            repartition="on",
            repartition_interval_s=0.5,
        )
    )
    executor = ExecutorService(
        ExecutorSettings(**c("executor-t"), node="local", ray_num_cpus=2, slice_refresh_s=0.5)
    )
    services = [
        inventory,
        GatewayService(GatewaySettings(**c("gateway-t"))),
        ClearerService(ClearerSettings(**c("clearer-t"))),
        AgentService(AgentSettings(**c("agent-t"), horizon_s=6.0)),
        executor,
        AdvertiserService(AdvertiserSettings(**c("advertiser-t"), horizon_s=6.0)),
    ]
    async with running(*services):
        before = await slices_of(nc)
        assert sorted(s.profile for s in before.values()) == ["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]
        client = SjaClient(nc)
        params = {"units": 8, "samples_per_unit": 2_000, "seed": 9}
        spec = JobSpec(
            name="big",
            tenant="t",
            workload="montecarlo",
            params=params,
            memory=MemoryDecl(base_mib=60_000, per_unit_mib=0, rel_sd=0.0),
        )
        job_id = (await client.submit(spec)).job_id
        state = await until_state(client, job_id, J.is_terminal, 150, "the big job to end")
        assert state.status == "done", (state.status, state.error)
        assert state.result == run_in_one_piece("montecarlo", params)
        after = await slices_of(nc)
        whole = [s for s in after.values() if s.profile == "7g.80gb"]
        assert len(whole) == 1 and whole[0].status == "free"
        assert {s.status for sid, s in after.items() if sid in before} == {"offline"}
        assert inventory.recutter.recuts == 1
        assert {sid for _, sid, _ in executor.placements} == {whole[0].slice_id}
        assert set(executor.actors) == {whole[0].slice_id}, "the old instances' actors stopped"
        info = await asyncio.wrap_future(executor.actors[whole[0].slice_id].info.remote().future())
        assert info["cuda_visible_devices"] == whole[0].gpu_uuid
