"""Fetch a job's final state (``sja result JOB --out DIR``).

A ``command`` job's state is a directory kept as a tar archive in the object store
``sja-checkpoints`` (the job's state holds only references), read through the gateway
(``sja.v1.job.state``), which serves a job's states to its own tenant only. A sequential job's final state is
unpacked into ``DIR``. An independent one (``sequential: false``) left one state per subjob: each is
unpacked into ``DIR/parts/<unit start, 12 digits>`` (so the names sort in unit order), and the job's
``merge_argv`` runs here, on the machine fetching the result, with ``SJA_PARTS_DIR`` (that
directory), ``SJA_STATE_OUT`` (``DIR``) and ``SJA_JOB_ID`` set, in the job's ``cwd`` or the
current directory.

Every state is checked against its digest; a missing or altered one fails with its name.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Protocol

import msgspec

from sja.protocol.messages import JobState
from sja.redaction import is_redacted
from sja.workloads import checkpoint as ckpt
from sja.workloads import statestore
from sja.workloads.base import is_sequential
from sja.workloads.command import parts, resolve_argv, unpack_state


class ResultError(RuntimeError):
    pass


class StateReader(Protocol):
    """Reads a job's stored state by its object name: ``SjaClient`` (through the gateway, which
    serves a job's states to its tenant only)."""

    async def stored_state(self, job_id: str, name: str) -> bytes: ...


async def _fetch(reader: StateReader, job_id: str, raw: bytes) -> bytes:
    """The full checkpoint (blob) behind a reference, checked; an inline blob as it is."""
    if not ckpt.is_ref(raw):
        return raw
    ref = ckpt.unpack_ref(raw)
    try:
        if statestore.is_external(ref.bucket):
            data = await asyncio.to_thread(statestore.get, ref.bucket, ref.name)
        else:
            data = await reader.stored_state(job_id, ref.name)
    except Exception as e:
        raise ResultError(f"state {ref.bucket}/{ref.name} cannot be read: {type(e).__name__}: {e}") from None
    if ckpt.digest(data) != ref.sha256:
        raise ResultError(f"state {ref.bucket}/{ref.name} does not match its digest")
    return ckpt.pack_blob(ref.summary, data)


async def fetch_result(
    reader: StateReader, state: JobState, out: Path, *, run_merge: bool = True
) -> dict[str, Any]:
    """Write the job's final state under ``out``; returns what was written. ``reader`` reads the
    states the job refers to (``SjaClient``: through the gateway)."""

    partial = state.status in ENDED_UNFINISHED
    if state.status != "done" and not (partial and state.spec.workload == "command"):
        if partial:
            raise ResultError(
                f"job {state.job_id} is {state.status}: only a command job's last good state is kept "
                f"for `sja result` when it did not finish ({state.units_done} of {state.total_units} "
                "units were done)"
            )
        raise ResultError(f"job {state.job_id} is {state.status}, not done: no final state yet")
    if state.spec.workload != "command":
        return await _combine_here(reader, state, out)
    if partial and not state.accumulator:
        raise ResultError(
            f"job {state.job_id} is {state.status} and no subjob of it completed: it left no state"
        )
    got = await _fetch_command(reader, state, out, run_merge=run_merge)
    return {**got, **completeness(state)}


ENDED_UNFINISHED = ("failed", "cancelled")
"""Statuses of a job that ended before its last unit: ``sja result`` gives a command job's last
good state (what its completed subjobs left), saying that the job did not finish."""


def completeness(state: JobState) -> dict[str, Any]:
    """Whether what ``sja result`` wrote is the job's final state, and if not, what it is."""
    done: dict[str, Any] = {
        "status": state.status,
        "complete": state.status == "done",
        "units_done": state.units_done,
        "total_units": state.total_units,
    }
    if state.status != "done":
        kept = "its last good state" if spec_is_sequential(state) else "the parts of its completed subjobs"
        done["note"] = (
            f"job {state.job_id} is {state.status}: it did not finish; this is {kept} "
            f"({state.units_done} of {state.total_units} units)"
        )
    return done


def spec_is_sequential(state: JobState) -> bool:
    from sja.workloads import workload

    return state.spec.workload == "command" and is_sequential(workload("command"), state.spec.params)


async def _fetch_command(
    reader: StateReader, state: JobState, out: Path, *, run_merge: bool
) -> dict[str, Any]:
    """A command job's state under ``out``: a sequential job's state unpacked there, an independent
    one's parts under ``out/parts`` and its ``merge_argv`` run over them."""
    from sja.workloads import workload

    params = state.spec.params
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    if is_sequential(workload("command"), params):
        raw = await _fetch(reader, state.job_id, state.accumulator)
        await asyncio.to_thread(unpack_state, raw, out)
        return {"job_id": state.job_id, "out": str(out), "parts": 1}
    parts_dir = out / "parts"
    await asyncio.to_thread(parts_dir.mkdir, exist_ok=True)
    got = parts(state.accumulator)
    for start, raw in got:
        blob = await _fetch(reader, state.job_id, raw)
        await asyncio.to_thread(unpack_state, blob, parts_dir / f"{start:012d}")
    merged = False
    if run_merge and params.get("merge_argv"):
        env = dict(os.environ)
        # The gateway hands the spec out redacted: a value it hid is not set here, so the merge
        # sees this machine's own value of that variable, if any.
        env.update({k: v for k, v in params.get("env", {}).items() if not is_redacted(v)})
        env.update({"SJA_PARTS_DIR": str(parts_dir), "SJA_STATE_OUT": str(out), "SJA_JOB_ID": state.job_id})
        cwd = params.get("cwd") or None
        argv = resolve_argv(params["merge_argv"], merge_python(params))
        r = await asyncio.to_thread(subprocess.run, argv, env=env, cwd=cwd, capture_output=True, text=True)
        if r.returncode != 0:
            tail = "\n".join(r.stderr.strip().splitlines()[-20:])
            raise ResultError(f"merge_argv exited with {r.returncode}:\n{tail}")
        merged = True
    return {"job_id": state.job_id, "out": str(out), "parts": len(got), "merged": merged}


def merge_python(params: dict[str, Any]) -> str:
    """The interpreter ``python`` in ``merge_argv`` means on this machine: the job's own
    (``params.python``) where it is installed here too, else the one running ``sja result``."""
    named = params.get("python", "")
    if isinstance(named, str) and named and os.path.isfile(named) and os.access(named, os.X_OK):
        return named
    return sys.executable


async def _combine_here(reader: StateReader, state: JobState, out: Path) -> dict[str, Any]:
    """A tenant's Python workload: its merge and finalize run here, in the fetching user's process
    (the control plane kept its parts and never ran its code); the result goes to ``out/result.json``.
    States kept as references (checkpoint blobs in the object store) are read through ``reader``."""
    from sja.core.jobs import spec_sequential
    from sja.workloads import SpecError, trusted, workload
    from sja.workloads.parts import combine, parts_of

    if trusted(state.spec.workload):
        raise ResultError(f"job {state.job_id} runs {state.spec.workload}: its result is `sja status`'s")
    try:
        w = workload(state.spec.workload)
    except SpecError as e:
        raise ResultError(
            f"{e.message}: install it where `sja result` runs to combine the job's parts"
        ) from None
    sequential = spec_sequential(state.spec)
    if sequential:
        acc = await _fetch(reader, state.job_id, state.accumulator)
    else:
        got = [(start, await _fetch(reader, state.job_id, raw)) for start, raw in parts_of(state.accumulator)]
        acc = _parts_enc.encode(got)
    try:
        result = await asyncio.to_thread(combine, w, state.spec.params, acc, sequential=sequential)
        text = json.dumps(result, indent=2, sort_keys=True, default=str)
    except (ValueError, TypeError) as e:
        raise ResultError(f"job {state.job_id}: {e}") from None
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    await asyncio.to_thread((out / "result.json").write_text, text + "\n", encoding="utf-8")
    return {"job_id": state.job_id, "out": str(out), "result": result}


_parts_enc = msgspec.msgpack.Encoder()

__all__ = ["ResultError", "StateReader", "fetch_result"]
