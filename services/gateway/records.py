"""What the gateway derives from a job's records without the bus: the id of a submitted job, a
subjob's number, and the stored states a job's state refers to."""

from __future__ import annotations

import hashlib
import uuid

import msgspec

from sja.protocol.messages import JobState
from sja.workloads import checkpoint as ckpt
from sja.workloads.command import parts as command_parts


def job_id_for(spec_name: str, tenant: str, request_id: str) -> str:
    """Deterministic for a client request id (so a retried submit is the same job), else unique."""
    if request_id:
        digest = hashlib.sha256(f"{tenant}/{request_id}".encode()).hexdigest()[:12]
        return f"{spec_name}-{digest}"
    return f"{spec_name}-{uuid.uuid4().hex[:12]}"


def subjob_seq(subjob_id: str) -> int:
    """A subjob's number in its job (``JOB.s12`` is 12)."""
    tail = subjob_id.rpartition(".s")[2]
    return int(tail) if tail.isdigit() else 0


def stored_states(state: JobState) -> set[str]:
    """The object names in ``sja-checkpoints`` that the job's state refers to: its accumulator (a
    sequential job's final state) or each of its parts (an independent job's)."""
    raws = [state.accumulator]
    if state.accumulator and not ckpt.is_ref(state.accumulator) and state.spec.workload == "command":
        try:
            raws = [raw for _, raw in command_parts(state.accumulator)]
        except (msgspec.DecodeError, ValueError):
            raws = []
    names: set[str] = set()
    for raw in raws:
        if ckpt.is_ref(raw):
            ref = ckpt.unpack_ref(raw)
            if ref.bucket == ckpt.BUCKET:
                names.add(ref.name)
    return names


__all__ = ["job_id_for", "stored_states", "subjob_seq"]
