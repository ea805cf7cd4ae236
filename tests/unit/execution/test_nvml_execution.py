"""Running on slices: device pinning, memory meters (NVML, CUDA allocator, resident size), CUDA OOM,
checkpoint blobs, and the PyTorch workloads (on the CPU; skipped without torch)."""

from __future__ import annotations

import mmap
import os
import sys
from types import SimpleNamespace
from typing import Any, ClassVar

import msgspec
import pytest

from sja.core import jobs as J
from sja.core.planner import PlanLimits, plan_candidates
from sja.core.profile_cache import profile_of
from sja.execution.actor import actor_env, cuda_visible_devices, node_resource, node_resources, slice_resource
from sja.execution.meters import NvmlProcessMeter, RssMeter
from sja.execution.runner import is_oom, run_subjob, run_workload
from sja.inventory.declared import load_declared
from sja.inventory.fake_nvml import FakeNvml
from sja.inventory.nvml import discover
from sja.protocol.messages import JobSpec, MemoryDecl, Subjob, TimeDecl, Window
from sja.workloads import GPU, WORKLOADS, SpecError, run_in_one_piece, workload
from sja.workloads import checkpoint as ckpt

_MIB = 1024 * 1024


def subjob(name: str, params: dict[str, Any], units: int, mem_cap_mib: int = 4096, **kw: Any) -> Subjob:
    return Subjob(
        subjob_id="s1",
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
        slice_id="local-g0-1g.10gb-2",
        node="local",
        mem_cap_mib=mem_cap_mib,
        time_cap_s=60.0,
        planned_mem_q_mib=1.0,
        planned_duration_q_s=1.0,
        **kw,
    )


# --- pinning ------------------------------------------------------------------------------------


def test_actors_see_their_mig_device_or_gpu_and_nothing_when_emulated() -> None:
    slices = discover(FakeNvml("node"), node="n1", soft_slices="2").slices
    mig = next(s for s in slices if s.source == "nvml")
    soft = [s for s in slices if s.source == "soft"]
    assert cuda_visible_devices(mig) == mig.gpu_uuid and mig.gpu_uuid.startswith("MIG-")
    assert {cuda_visible_devices(s) for s in soft} == {soft[0].gpu_uuid}
    assert soft[0].gpu_uuid.startswith("GPU-")
    declared = load_declared(None)[0]
    assert cuda_visible_devices(declared) == ""
    env = actor_env(mig)
    assert env["CUDA_VISIBLE_DEVICES"] == mig.gpu_uuid and env["SJA_SLICE_ID"] == mig.slice_id
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    no_uuid = msgspec.structs.replace(soft[0], gpu_uuid="")
    assert cuda_visible_devices(no_uuid) == "1", "without a UUID the GPU index"


def test_node_resources_name_the_node_and_each_slice() -> None:
    res = node_resources("gpu7", ["b", "a"])
    assert res == {node_resource("gpu7"): 1000.0, slice_resource("a"): 1.0, slice_resource("b"): 1.0}
    assert list(res)[1:] == ["sja_slice:a", "sja_slice:b"]


# --- meters -------------------------------------------------------------------------------------


def test_nvml_process_meter_reads_this_process_on_its_mig_device() -> None:
    nvml = FakeNvml("h100-mig")
    slices = discover(nvml, node="n1").slices
    target, other = slices[1].gpu_uuid, slices[2].gpu_uuid
    nvml.add_process(target, pid=os.getpid(), used_bytes=700 * _MIB)
    nvml.add_process(target, pid=1, used_bytes=5000 * _MIB)  # someone else's process
    nvml.add_process(other, pid=os.getpid(), used_bytes=9000 * _MIB)  # this process, another slice
    meter = NvmlProcessMeter(nvml, target, interval_s=0.001)
    meter.start()
    assert meter.stop() == pytest.approx(700)
    assert meter.available and nvml.initialized == 0


def test_rss_meter_sees_allocations_tracemalloc_does_not_attribute() -> None:
    meter = RssMeter()
    meter.start()
    # 64 MiB of fresh anonymous pages, each touched (an allocator could hand back memory the
    # process already holds resident, which no resident-size meter would see grow).
    block = mmap.mmap(-1, 64 * _MIB)
    for i in range(0, 64 * _MIB, 4096):
        block[i] = 1
    peak = meter.stop()
    block.close()
    assert 48 <= peak <= 256


def test_oom_classification() -> None:
    class OutOfMemoryError(RuntimeError):  # torch.OutOfMemoryError's name
        pass

    assert is_oom(MemoryError())
    assert is_oom(OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_oom(RuntimeError("[enforce fail at alloc_cpu.cpp] DefaultCPUAllocator: can't allocate memory"))
    assert not is_oom(RuntimeError("shape mismatch"))
    assert not is_oom(ValueError("out of memory"))


# --- a CUDA device, as the runner sees it -------------------------------------------------------


class _FakeCuda:
    def __init__(self, total_mib: int) -> None:
        self.total = total_mib * _MIB
        self.fraction: float | None = None
        self.peak = 0
        self.emptied = 0

    def is_available(self) -> bool:
        return True

    def get_device_properties(self, index: int) -> Any:
        return SimpleNamespace(total_memory=self.total)

    def set_per_process_memory_fraction(self, fraction: float, device: int) -> None:
        self.fraction = fraction

    def synchronize(self) -> None:
        pass

    def empty_cache(self) -> None:
        self.emptied += 1

    def reset_peak_memory_stats(self) -> None:
        self.peak = 0

    def allocate(self, mib: int) -> None:
        assert self.fraction is not None
        if mib * _MIB > self.fraction * self.total:
            raise _OutOfMemoryError(f"CUDA out of memory. Tried to allocate {mib} MiB")
        self.peak = max(self.peak, mib * _MIB)

    def max_memory_allocated(self) -> int:
        return self.peak

    def max_memory_reserved(self) -> int:
        return self.peak


class _OutOfMemoryError(RuntimeError):
    pass


_OutOfMemoryError.__name__ = "OutOfMemoryError"


class _GpuAlloc:
    """A workload that allocates ``params["mib"]`` on the (fake) GPU."""

    name: ClassVar[str] = "gpu-alloc"
    sequential: ClassVar[bool] = False
    framework: ClassVar[str] = "torch"
    cuda: ClassVar[_FakeCuda | None] = None

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        return params

    def total_units(self, params: dict[str, Any]) -> int:
        return 1

    def declared_memory(self, params: dict[str, Any]) -> MemoryDecl:
        return MemoryDecl(base_mib=1, per_unit_mib=1)

    def declared_time(self, params: dict[str, Any]) -> TimeDecl:
        return TimeDecl(warmup_s=0, per_unit_s=1)

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        assert self.cuda is not None
        self.cuda.allocate(params["mib"])
        return b"done"

    def merge(self, acc: bytes, partial: bytes) -> bytes:
        return partial

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
        return {}


@pytest.fixture
def fake_gpu(monkeypatch: pytest.MonkeyPatch) -> _FakeCuda:
    cuda = _FakeCuda(total_mib=81559)
    monkeypatch.setitem(sys.modules, "torch", SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(WORKLOADS, _GpuAlloc.name, _GpuAlloc())
    monkeypatch.setattr(_GpuAlloc, "cuda", cuda)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    return cuda


def test_soft_slice_cap_is_enforced_by_the_allocator_and_oom_keeps_the_peak(fake_gpu: _FakeCuda) -> None:
    # What a Python workload's sandboxed process runs (``run_workload``), here in this process, where
    # the fake device is.
    ok = run_workload(subjob("gpu-alloc", {"mib": 15000}, 1, mem_cap_mib=20389))
    assert fake_gpu.fraction == pytest.approx(20389 / 81559)
    assert (ok.status, ok.device, ok.meter, ok.peak_mem_mib) == ("ok", "cuda", "torch.cuda", 15000)
    assert fake_gpu.emptied >= 2, "the cache is emptied before and after each subjob"

    oom = run_workload(subjob("gpu-alloc", {"mib": 30000}, 1, mem_cap_mib=20389))
    assert oom.status == "oom" and oom.units_done == 0 and oom.output == b""
    assert "CUDA out of memory" in oom.error and "of the slice's 20389 MiB" in oom.error

    # The allocator holds the cap: a subjob within it is not judged again after the fact.
    assert run_workload(subjob("gpu-alloc", {"mib": 100}, 1, mem_cap_mib=20389)).status == "ok"


# --- checkpoints --------------------------------------------------------------------------------


def test_checkpoint_blobs_and_references() -> None:
    raw = ckpt.pack_blob(b"summary", b"x" * 1000)
    assert ckpt.is_blob(raw) and not ckpt.is_ref(raw)
    blob = ckpt.unpack_blob(raw)
    ref = ckpt.make_ref(ckpt.BUCKET, "job/sub", blob)
    assert ckpt.is_ref(ref) and len(ref) < 200
    assert ckpt.summary_of(ref) == ckpt.summary_of(raw) == b"summary"
    assert ckpt.unpack_ref(ref).sha256 == ckpt.digest(b"x" * 1000)
    assert ckpt.where(ref) == "sja-checkpoints/job/sub" and ckpt.where(raw) == "inline"
    assert ckpt.where(b"") == "" and ckpt.summary_of(b"") == b""
    with pytest.raises(ValueError, match="not a checkpoint"):
        ckpt.unpack_blob(ref)


# --- PyTorch workloads --------------------------------------------------------------------------


def test_torch_workloads_register_without_importing_torch() -> None:
    import subprocess

    code = (
        "import sys, sja.workloads as w; w.workload('torch-train').validate({}); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    assert set(GPU) <= set(WORKLOADS)


@pytest.mark.parametrize(
    ("name", "params", "field"),
    [
        ("torch-train", {"device": "tpu"}, "params.device"),
        ("torch-train", {"steps": 0}, "params.steps"),
        ("torch-train", {"lr": 0.1}, "params.lr"),
        ("torch-infer", {"classes": 1}, "params.classes"),
        ("torch-infer", {"items": "many"}, "params.items"),
    ],
)
def test_torch_workload_params_are_validated(name: str, params: dict[str, Any], field: str) -> None:
    with pytest.raises(SpecError) as exc:
        workload(name).validate(params)
    assert exc.value.field == field


def test_training_cut_into_pieces_ends_with_the_weights_of_one_piece() -> None:
    pytest.importorskip("torch")
    w = workload("torch-train")
    p = w.validate({"steps": 24, "batch_size": 16, "hidden": 32, "seed": 2, "device": "cpu"})
    whole = run_in_one_piece("torch-train", p)
    acc = b""
    for start, k in ((0, 7), (7, 1), (8, 16)):
        acc = w.merge(acc, w.run(p, start, k, acc))
    assert w.finalize(p, acc) == whole and whole["steps"] == 24
    with pytest.raises(ValueError, match="checkpoint is at step 8"):
        w.run(p, 10, 2, w.run(p, 0, 8, b""))
    other = w.validate({**p, "seed": 3})
    assert run_in_one_piece("torch-train", other)["weights_sha256"] != whole["weights_sha256"]


def test_inference_ranges_add_up_to_the_whole() -> None:
    pytest.importorskip("torch")
    w = workload("torch-infer")
    p = w.validate({"items": 1500, "batch_size": 64, "hidden": 32, "seed": 1})
    whole = run_in_one_piece("torch-infer", p)
    acc = b""
    for start, k in ((900, 600), (0, 1), (1, 899)):
        acc = w.merge(acc, w.run(p, start, k, b""))
    assert w.finalize(p, acc) == whole
    assert sum(whole["counts"]) == whole["items"] == 1500


def test_torch_subjob_on_the_cpu_is_measured_and_capped_after_the_fact() -> None:
    pytest.importorskip("torch")
    params = {"items": 4000, "batch_size": 4000, "inputs": 512, "hidden": 2048, "seed": 0}
    r = run_subjob(subjob("torch-infer", params, 4000))
    assert (r.status, r.device, r.meter) == ("ok", "cpu", "rss")
    assert r.peak_mem_mib > 30, "a 4000 x 2048 float64 activation is 62 MiB"
    capped = run_subjob(subjob("torch-infer", params, 4000, mem_cap_mib=8))
    assert capped.status == "oom" and "exceeded the slice's 8 MiB" in capped.error


def test_gpu_jobs_are_declared_at_a_gpu_rate_and_can_start_on_a_quarter_of_a_gpu() -> None:
    """At a CPU's rate a 2048-wide training step was declared 6.6 s, 26 s on a quarter of a GPU: no
    window of the default horizon could hold even one, and the job stayed pending for ever."""
    soft = discover(FakeNvml("h100-nomig"), node="n1", soft_slices="4").slices[0]
    now = 1_000_000.0
    window = Window(
        slice_id=soft.slice_id,
        node=soft.node,
        pool=soft.pool,
        gpu_model=soft.gpu_model,
        profile=soft.profile,
        mem_mib=soft.mem_mib,
        compute_share=soft.compute_share,
        start_s=now,
        end_s=None,
    )
    limits = PlanLimits(mem_reserve_mib=1024.0, horizon_s=8.0)  # the agent's default horizon
    jobs = {
        "torch-train": {"steps": 3000, "batch_size": 512, "hidden": 2048},
        "torch-infer": {"items": 400_000, "batch_size": 4096, "inputs": 512, "hidden": 2048},
    }
    for name, params in jobs.items():
        w = workload(name)
        for device in ("auto", "cuda"):
            spec = JobSpec(name="g", tenant="t", workload=name, params={**params, "device": device})
            state = J.new_job("g-1", spec, now, window_s=limits.horizon_s - limits.start_overhead_s)
            req = J.plan_request(state, window, now, state.total_units)
            assert plan_candidates(profile_of(state), req, limits, "jasda"), (name, device)
        gpu = w.declared_time(w.validate({**params, "device": "cuda"}))
        cpu = w.declared_time(w.validate({**params, "device": "cpu"}))
        assert cpu.per_unit_s >= 100 * gpu.per_unit_s, (name, cpu, gpu)
