"""The GPU path on a real NVIDIA GPU: NVML discovery checked against the driver's own report
(``nvidia-smi``), the memory meters on CUDA memory, the allocator's cap on a soft slice with a real
CUDA out-of-memory error, and jobs through the whole stack on the GPU.

Skipped where there is no NVIDIA driver with a GPU, or no CUDA build of PyTorch (as in CI): run it
on a GPU machine with ``pytest -m gpu tests/gpu``. Nothing here changes the GPU's MIG mode; with MIG
off it uses the whole GPU and soft slices, with MIG on the instances already there."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from sja.execution.meters import NvmlProcessMeter
from sja.execution.runner import run_subjob
from sja.inventory.nvml import catalogue_model, discover, load_nvml
from sja.protocol.messages import JobSpec, SliceState, Subjob
from sja.workloads import run_in_one_piece, workload

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]

_MIB = 1024 * 1024


@pytest.fixture(scope="module")
def nvml() -> Any:
    try:
        nvml = load_nvml()
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
        nvml.nvmlShutdown()
    except Exception as e:
        pytest.skip(f"no NVIDIA driver: {type(e).__name__}: {e}")
    if count == 0:
        pytest.skip("NVML sees no GPU")
    if shutil.which("nvidia-smi") is None:
        pytest.skip("nvidia-smi is not on the PATH")
    return nvml


@pytest.fixture(scope="module")
def torch(nvml: Any) -> Any:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA device")
    return torch


def smi(*args: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", *args], check=True, capture_output=True, text=True).stdout
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def smi_gpus() -> list[dict[str, Any]]:
    rows = smi("--query-gpu=index,uuid,name,memory.total,mig.mode.current", "--format=csv,noheader,nounits")
    return [
        {"index": int(i), "uuid": u, "name": n, "mem_mib": int(m), "mig": mig} for i, u, n, m, mig in rows
    ]


def smi_mig_uuids() -> set[str]:
    out = subprocess.run(["nvidia-smi", "-L"], check=True, capture_output=True, text=True).stdout
    return set(re.findall(r"UUID: (MIG-[^)\s]+)", out))


def first_gpu(nvml: Any) -> dict[str, Any]:
    """GPU 0 as the driver reports it; the CUDA tests below need it with MIG off."""
    g = smi_gpus()[0]
    if g["mig"] == "Enabled":
        pytest.skip("GPU 0 has MIG on: soft slices and whole-GPU CUDA need it off")
    return g


def subjob(name: str, params: dict[str, Any], units: int, mem_cap_mib: int, **kw: Any) -> Subjob:
    return Subjob(
        subjob_id=kw.pop("subjob_id", "s1"),
        seq=0,
        job_id="j1",
        tenant="t",
        agent_id="a",
        workload=name,
        params=params,
        unit_start=kw.pop("unit_start", 0),
        units=units,
        grant_id="g1",
        fence=1,
        slice_id="gpu-node-g0-soft0",
        node="gpu-node",
        mem_cap_mib=mem_cap_mib,
        time_cap_s=600.0,
        planned_mem_q_mib=1.0,
        planned_duration_q_s=1.0,
        **kw,
    )


# --- discovery ----------------------------------------------------------------------------------


def test_discovery_matches_the_driver(nvml: Any) -> None:
    """Every GPU nvidia-smi lists is found, with its UUID and memory: one whole-GPU slice when MIG
    is off, one slice per GPU instance (MIG devices nvidia-smi lists) when it is on."""
    found = discover(nvml, node="gpu-node")
    assert not found.lost, found.lost
    for g in smi_gpus():
        mine = [s for s in found.slices if s.gpu_index == g["index"]]
        model = catalogue_model(g["name"], g["mem_mib"])
        print(f"GPU {g['index']}: {g['name']} {g['mem_mib']} MiB, MIG {g['mig']}, {model and model.name}")
        for s in mine:
            print(f"  {s.slice_id} {s.profile} {s.mem_mib} MiB share {s.compute_share} {s.source}")
        if g["mig"] == "Enabled":
            assert mine and {s.source for s in mine} == {"nvml"}
            assert {s.gpu_uuid for s in mine} <= smi_mig_uuids()
            assert sum(s.mem_mib for s in mine) <= g["mem_mib"]
        else:
            assert len(mine) == 1, mine
            s = mine[0]
            assert (s.source, s.gpu_uuid, s.mem_mib) == ("whole", g["uuid"], g["mem_mib"])
            assert s.compute_share == 1.0
            if model is not None:
                assert s.gpu_model == model.name


def test_soft_slices_cut_a_gpu_without_mig(nvml: Any) -> None:
    g = first_gpu(nvml)
    soft = [s for s in discover(nvml, node="gpu-node", soft_slices="4").slices if s.gpu_index == 0]
    assert len(soft) == 4 and {s.source for s in soft} == {"soft"}
    assert {s.gpu_uuid for s in soft} == {g["uuid"]}
    assert sum(s.mem_mib for s in soft) <= g["mem_mib"]
    assert min(s.mem_mib for s in soft) >= g["mem_mib"] // 4 - 1


# --- meters and caps on CUDA memory -------------------------------------------------------------


def test_nvml_sees_this_process_cuda_memory(nvml: Any, torch: Any) -> None:
    g = first_gpu(nvml)
    meter = NvmlProcessMeter(nvml, g["uuid"], interval_s=0.005)
    meter.start()
    block = torch.empty(1024 * _MIB, dtype=torch.uint8, device="cuda")
    block.fill_(1)
    torch.cuda.synchronize()
    time.sleep(0.2)
    peak = meter.stop()
    del block
    torch.cuda.empty_cache()
    print(f"NVML per-process peak: {peak:.0f} MiB (1024 MiB allocated, plus the CUDA context)")
    assert meter.available, "NVML reported no memory for this process on its GPU"
    assert peak >= 1024


def test_a_subjob_on_the_gpu_is_measured_by_the_allocator_and_nvml(
    nvml: Any, torch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = first_gpu(nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", g["uuid"])  # as the slice's actor has it
    params = workload("torch-infer").validate(
        {"items": 32768, "batch_size": 8192, "inputs": 1024, "hidden": 4096, "seed": 0, "device": "cuda"}
    )
    r = run_subjob(subjob("torch-infer", params, 32768, mem_cap_mib=20000))
    print(f"torch-infer on the GPU: {r.status} {r.device} peak {r.peak_mem_mib} MiB ({r.meter})")
    assert (r.status, r.device) == ("ok", "cuda"), r.error
    # An 8192 x 4096 float32 activation is 128 MiB; the allocator's reserve and NVML's count (which
    # also holds the CUDA context) are each at least that, and the larger is reported.
    assert r.meter in ("torch.cuda", "nvml") and r.peak_mem_mib >= 128


def test_cut_inference_on_the_gpu_adds_up_to_the_whole(torch: Any, nvml: Any) -> None:
    first_gpu(nvml)
    w = workload("torch-infer")
    p = w.validate({"items": 50000, "batch_size": 1000, "hidden": 512, "seed": 7, "device": "cuda"})
    whole = run_in_one_piece("torch-infer", p)
    acc = b""
    for start, k in ((30000, 20000), (0, 1000), (1000, 29000)):
        acc = w.merge(acc, w.run(p, start, k, b""))
    cut = w.finalize(p, acc)
    assert sum(cut["counts"]) == sum(whole["counts"]) == 50000
    # Batches start at the same items in both runs (multiples of 1000), so float32 kernels see the
    # same inputs and give the same classes.
    assert cut == whole


def test_training_on_the_gpu_continues_from_its_checkpoints(torch: Any, nvml: Any) -> None:
    first_gpu(nvml)
    w = workload("torch-train")
    p = w.validate({"steps": 300, "batch_size": 256, "hidden": 1024, "seed": 2, "device": "cuda"})
    whole = run_in_one_piece("torch-train", p)
    acc = b""
    for start, k in ((0, 100), (100, 150), (250, 50)):
        acc = w.merge(acc, w.run(p, start, k, acc))
    cut = w.finalize(p, acc)
    print(f"one piece: loss {whole['loss']}; three pieces: loss {cut['loss']}")
    assert cut["steps"] == whole["steps"] == 300
    # The same kernels on the same inputs: bit-equal on one GPU unless a kernel is nondeterministic.
    assert cut["loss"] == pytest.approx(whole["loss"], rel=1e-4)


def test_soft_slice_cap_raises_a_real_cuda_oom_and_the_next_subjob_runs(
    nvml: Any, torch: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    g = first_gpu(nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", g["uuid"])
    held = torch.cuda.memory_allocated()
    big = workload("torch-infer").validate(
        {"items": 65536, "batch_size": 65536, "inputs": 4096, "hidden": 8192, "seed": 0, "device": "cuda"}
    )
    oom = run_subjob(subjob("torch-infer", big, 65536, mem_cap_mib=1024))
    reserved = torch.cuda.max_memory_reserved() / _MIB
    print(
        f"under a 1024 MiB cap: {oom.status}, peak {oom.peak_mem_mib} MiB ({oom.meter}), allocator {reserved}"
    )
    print(f"  {oom.error[:120]} ... {oom.error[-80:]}")
    assert oom.status == "oom" and oom.units_done == 0 and oom.output == b""
    assert "out of memory" in oom.error and "of the slice's 1024 MiB" in oom.error
    # The allocator was held to the cap, and the failed subjob's tensors were all given back.
    assert reserved <= 1024
    assert torch.cuda.memory_allocated() == held

    small = workload("torch-infer").validate({"items": 4096, "batch_size": 512, "seed": 0, "device": "cuda"})
    ok = run_subjob(subjob("torch-infer", small, 4096, mem_cap_mib=1024, subjob_id="s2"))
    assert (ok.status, ok.device) == ("ok", "cuda"), ok.error


# --- the whole stack on the GPU -----------------------------------------------------------------


@pytest.mark.slow
async def test_jobs_run_on_soft_slices_of_the_real_gpu(
    nvml: Any, torch: Any, nats_url: str, tmp_path: Path
) -> None:
    """Inventory from NVML (soft slices of 2 and 40 GB on GPU 0), one Ray actor per slice pinned to
    the GPU by its UUID, and a training, an inference and a Monte Carlo job through the stack; each
    subjob's span says where it ran and which meter measured it. Then a subjob too large for the
    small slice, sent straight to its actor: a CUDA OOM under the cap, and the actor runs on."""
    g = first_gpu(nvml)
    await run_stack(nats_url, tmp_path, source="nvml", device="cuda", gpu_uuid=g["uuid"])


async def run_stack(
    nats_url: str,
    tmp_path: Path,
    *,
    source: str,
    device: str,
    gpu_uuid: str,
    steps: int = 2000,
    items: int = 200_000,
) -> None:
    """The stack test's body; ``source`` and ``device`` let it run against the fake NVML on the CPU."""
    import nats

    from services.advertiser.service import AdvertiserService, AdvertiserSettings
    from services.agent.service import AgentService, AgentSettings
    from services.clearer.service import ClearerService, ClearerSettings
    from services.executor.service import ExecutorService, ExecutorSettings
    from services.gateway.service import GatewayService, GatewaySettings
    from services.inventory.service import InventoryService, InventorySettings
    from sja.bus.codec import decode, encode
    from sja.bus.store import stores
    from sja.client import SjaClient
    from sja.core import jobs as J
    from sja.execution.runner import RunResult

    out = tmp_path / "out"

    async def run_on(actor: Any, sj: Subjob) -> RunResult:
        raw = await asyncio.wrap_future(actor.run.remote(encode(sj), {}).future())
        result, _ = decode(raw, tuple[RunResult, dict[str, str]])
        return result

    def c(name: str) -> dict[str, Any]:
        return {"nats_url": nats_url, "out_dir": str(out), "instance": name}

    executor = ExecutorService(
        ExecutorSettings(**c("executor-g"), node="gpu-node", ray_num_cpus=4, preload="torch")
    )
    services = [
        InventoryService(
            InventorySettings(
                **c("inventory-g"), inventory_source=source, node="gpu-node", soft_slices="2048,40000"
            )
        ),
        GatewayService(GatewaySettings(**c("gateway-g"))),
        ClearerService(ClearerSettings(**c("clearer-g"))),
        AgentService(AgentSettings(**c("agent-g"), horizon_s=20.0, mem_reserve_mib=1024.0)),
        executor,
        AdvertiserService(AdvertiserSettings(**c("advertiser-g"), horizon_s=20.0)),
    ]
    nc = await nats.connect(nats_url)
    t0 = time.monotonic()
    async with contextlib.AsyncExitStack() as stack:
        for s in services:
            await stack.enter_async_context(s)  # type: ignore[arg-type]
        print(f"stack started in {time.monotonic() - t0:.1f} s")
        kv, _ = await stores(nc.jetstream())
        slices: dict[str, SliceState] = {s.slice_id: s for s, _ in await kv.all()}
        assert len(slices) == 2 and {s.source for s in slices.values()} == {"soft"}
        infos = await asyncio.gather(
            *(asyncio.wrap_future(a.info.remote().future()) for a in executor.actors.values())
        )
        assert {i["cuda_visible_devices"] for i in infos} == {gpu_uuid}

        client = SjaClient(nc)
        train = {"steps": steps, "batch_size": 512, "hidden": 1024, "seed": 3, "device": device}
        infer = {"items": items, "batch_size": 4096, "inputs": 512, "hidden": 2048, "seed": 4}
        infer["device"] = device
        mc = {"units": 40, "samples_per_unit": 50_000, "seed": 5}
        specs = [
            JobSpec(name="train", tenant="ml", workload="torch-train", params=train),
            JobSpec(name="infer", tenant="ml", workload="torch-infer", max_parallel=2, params=infer),
            JobSpec(name="mc", tenant="sim", workload="montecarlo", max_parallel=2, params=mc),
        ]
        ids = [(await client.submit(s)).job_id for s in specs]
        t1 = time.monotonic()
        states: dict[str, Any] = {}
        shown = t1
        while len(states) < len(ids):
            now = time.monotonic()
            current = {j: await client.status(j) for j in ids}
            if now - shown > 10 or now - t1 > 150:
                shown = now
                for st in current.values():
                    recent = [(h.units, round(h.duration_s, 2), h.status) for h in st.history[-4:]]
                    print(
                        f"  {now - t1:5.0f} s {st.spec.name}: {st.status} {st.units_done}/{st.total_units}, "
                        f"{len(st.history)} subjobs, in flight {len(st.in_flight)}, last {recent} {st.error}"
                    )
            assert now - t1 < 150, f"jobs not done: {set(ids) - set(states)}"
            states.update({j: st for j, st in current.items() if J.is_terminal(st)})
            await asyncio.sleep(0.5)
        print(f"jobs done in {time.monotonic() - t1:.1f} s")
        for st in states.values():
            subjobs = [(h.units, round(h.peak_mem_mib), round(h.planned_mem_q_mib)) for h in st.history]
            print(f"{st.spec.name}: {st.status}, (units, peak MiB, planned MiB) {subjobs[:10]}")
            assert st.status == "done", (st.spec.name, st.status, st.error)
        t, i, m = (states[j] for j in ids)
        assert t.result["steps"] == steps
        assert m.result == run_in_one_piece("montecarlo", mc)
        assert sum(i.result["counts"]) == items
        assert min(h.peak_mem_mib for h in t.history + i.history if h.status == "ok") > 0

        # An oversized subjob sent straight to a slice's actor: an OOM under the soft slice's cap,
        # reported and survived; the same actor then runs the next one.
        sid = next(s for s in slices if slices[s].mem_mib == 2048)
        actor, cap = executor.actors[sid], 2048
        # A 65536 x 8192 float32 activation alone is 2 GiB.
        big = {"items": 65536, "batch_size": 65536, "inputs": 4096, "hidden": 8192, "device": device}
        res = await run_on(actor, subjob("torch-infer", big, 65536, mem_cap_mib=cap, subjob_id="oom-1"))
        print(f"actor of {sid}: {res.status} {res.device}, peak {res.peak_mem_mib} MiB: {res.error[:160]}")
        assert (res.status, res.device) == ("oom", device)
        small = {"items": 1000, "device": device}
        res = await run_on(actor, subjob("torch-infer", small, 1000, mem_cap_mib=cap, subjob_id="ok-1"))
        assert (res.status, res.device) == ("ok", device), res.error
    await nc.close()

    # Every subjob of the two PyTorch jobs ran on the device, as its span recorded.
    executed = [
        json.loads(line)["attributes"]
        for f in (out / "traces").glob("sja-executor-actor-*.jsonl")
        for line in f.read_text().splitlines()
        if json.loads(line)["name"] == "sja.execute"
    ]
    torch_jobs = {t.job_id, i.job_id}
    on = [(a["sja.device"], a["sja.meter"]) for a in executed if a["sja.job_id"] in torch_jobs]
    print(f"sja.execute spans of the PyTorch jobs: {len(on)}, (device, meter): {sorted(set(on))}")
    assert on and {d for d, _ in on} == {device}
