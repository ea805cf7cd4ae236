"""The Ray actor that owns one slice: pinned by a custom resource and ``CUDA_VISIBLE_DEVICES``."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import Any

import msgspec
import ray
from opentelemetry import propagate, trace

from sja.bus.codec import decode, encode
from sja.execution import code, stopclock
from sja.execution.runner import RunResult, run_subjob
from sja.protocol.messages import SliceState, Subjob

NODE_CAPACITY = 1000.0
"""Units of a node's resource; each slice actor takes one thousandth (any number fit)."""
NODE_SHARE = 1.0 / NODE_CAPACITY


def slice_resource(slice_id: str) -> str:
    """The custom Ray resource that exists only on the node owning the slice."""
    return f"sja_slice:{slice_id}"


def node_resource(node: str) -> str:
    """The custom Ray resource that names an SJA node (a Ray node may carry several SJA nodes)."""
    return f"sja_node:{node}"


def node_resources(node: str, slice_ids: Iterable[str]) -> dict[str, float]:
    """What ``ray start --resources`` must declare on the node that owns these slices."""
    out = {node_resource(node): NODE_CAPACITY}
    out.update({slice_resource(s): 1.0 for s in sorted(slice_ids)})
    return out


def cuda_visible_devices(s: SliceState) -> str:
    """The device a slice's actor sees: its MIG device (``MIG-<uuid>``) or its GPU (``GPU-<uuid>``,
    shared by the soft slices of one GPU); none for an emulated slice, or a GPU index when NVML gave
    no UUID."""
    if s.source == "declared":
        return ""
    return s.gpu_uuid or str(s.gpu_index)


def actor_env(s: SliceState) -> dict[str, str]:
    return {
        "CUDA_VISIBLE_DEVICES": cuda_visible_devices(s),
        # Device order as NVML counts GPUs, for the index fallback.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "SJA_SLICE_ID": s.slice_id,
        "SJA_SLICE_SOURCE": s.source,
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


@ray.remote(num_cpus=0, max_restarts=0, concurrency_groups={"control": 1})  # type: ignore[call-overload]
class SliceActor:
    """Runs one subjob at a time (``run``, the default group); ``yield_subjob`` reaches the subjob
    running meanwhile (the ``control`` group's own thread)."""

    def __init__(
        self,
        slice_id: str,
        out_dir: str,
        preload: str = "",
        sandbox: bytes = b"",
        slot: int = 0,
        hidden: tuple[str, ...] = (),
    ) -> None:
        import contextlib
        import importlib

        from sja.execution import sandbox as sbx
        from sja.telemetry.setup import setup_tracing

        # The sandbox of this slice's subjobs: the executor's settings, the slice's uid (``slot``),
        # and what to hide from them (the service's HOME, Ray's session, the stack's output).
        settings = (
            msgspec.json.decode(sandbox, type=sbx.SandboxSettings) if sandbox else sbx.SandboxSettings()
        )
        box = sbx.Sandbox(settings, slot=slot, hidden=hidden, owner=slice_id)
        box.sweep()  # what a previous actor of this slice left when it was killed
        sbx.check(settings, box)  # where the subjobs run (another node's Ray, a container): said at once
        sbx.configure(box)

        # Import heavy frameworks (``torch``) now: their files are in the page cache before the
        # first subjob's own import, in its sandbox (each subjob still pays that import); a
        # framework this node lacks is left to fail the subjobs that need it.
        for module in filter(None, (m.strip() for m in preload.split(","))):
            with contextlib.suppress(ImportError):
                importlib.import_module(module)
        self.slice_id = slice_id
        self.node_id = ray.get_runtime_context().get_node_id()
        setup_tracing("sja-executor-actor", out_dir=out_dir, simple=True)
        self.tracer = trace.get_tracer("sja.executor.actor")

    def info(self) -> dict[str, Any]:
        return {
            "slice_id": self.slice_id,
            "pid": os.getpid(),
            "node_id": self.node_id,
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        }

    @ray.method(concurrency_group="control")
    def yield_subjob(self, subjob_id: str, grace_s: float) -> bool:
        """Ask the open subjob ``subjob_id`` running on this slice to yield (``core.continuation``):
        ``SIGTERM`` now, ``SIGKILL`` ``grace_s`` later. False when it does not run here (it ended)."""
        return stopclock.request_yield(subjob_id, grace_s)

    def run(
        self, subjob: bytes, carrier: dict[str, str], checkpoint: bytes | None = None, code_uri: str = ""
    ) -> bytes:
        """Run a subjob; ``checkpoint`` replaces its input checkpoint when the executor fetched a
        large one from the object store (the subjob itself carries only the reference); ``code_uri``:
        the Ray package of the job's code (``sja.execution.code``), unpacked on this node first."""
        sj = decode(subjob, Subjob)
        if checkpoint is not None:
            sj = msgspec.structs.replace(sj, input_checkpoint=checkpoint)
        code_dir = ""
        if code_uri:
            started = time.time()
            try:
                code_dir = code.on_node(code_uri, code.digest_of(sj.params))
            except Exception as e:
                now = time.time()
                failed = RunResult(
                    status="failed",
                    units_done=0,
                    peak_mem_mib=0.0,
                    duration_s=round(now - started, 6),
                    started_at=started,
                    finished_at=now,
                    error=f"the job's code could not be unpacked on this node: {type(e).__name__}: {e}"[
                        :4000
                    ],
                    node_id=self.node_id,
                )
                return encode([failed, {}])
        ctx = propagate.extract(carrier)
        with self.tracer.start_as_current_span(
            "sja.execute",
            context=ctx,
            attributes={
                "sja.subjob_id": sj.subjob_id,
                "sja.job_id": sj.job_id,
                "sja.slice": sj.slice_id,
                "sja.units": sj.units,
                "sja.mem_cap_mib": sj.mem_cap_mib,
            },
        ) as span:
            result = msgspec.structs.replace(run_subjob(sj, code_dir=code_dir), node_id=self.node_id)
            span.set_attribute("sja.status", result.status)
            span.set_attribute("sja.peak_mem_mib", result.peak_mem_mib)
            span.set_attribute("sja.duration_s", result.duration_s)
            span.set_attribute("sja.device", result.device)
            span.set_attribute("sja.meter", result.meter)
            carrier_out: dict[str, str] = {}
            propagate.inject(carrier_out)
        return encode([result, carrier_out])
