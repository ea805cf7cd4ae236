"""The Ray actor that owns one slice: pinned by a custom resource and ``CUDA_VISIBLE_DEVICES``."""

from __future__ import annotations

import os
from typing import Any

import ray
from opentelemetry import propagate, trace

from sja.bus.codec import decode, encode
from sja.execution.runner import run_subjob
from sja.protocol.messages import Subjob


def slice_resource(slice_id: str) -> str:
    """The custom Ray resource that exists only on the node owning the slice."""
    return f"sja_slice:{slice_id}"


@ray.remote(num_cpus=0, max_restarts=0)
class SliceActor:
    def __init__(self, slice_id: str, out_dir: str) -> None:
        from sja.telemetry.setup import setup_tracing

        self.slice_id = slice_id
        setup_tracing("sja-executor-actor", out_dir=out_dir, simple=True)
        self.tracer = trace.get_tracer("sja.executor.actor")

    def info(self) -> dict[str, Any]:
        return {
            "slice_id": self.slice_id,
            "pid": os.getpid(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        }

    def run(self, subjob: bytes, carrier: dict[str, str]) -> bytes:
        sj = decode(subjob, Subjob)
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
            result = run_subjob(sj)
            span.set_attribute("sja.status", result.status)
            span.set_attribute("sja.peak_mem_mib", result.peak_mem_mib)
            span.set_attribute("sja.duration_s", result.duration_s)
            carrier_out: dict[str, str] = {}
            propagate.inject(carrier_out)
        return encode([result, carrier_out])
