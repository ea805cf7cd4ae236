"""Fetch a job's final state (``sja result JOB --out DIR``).

A ``command`` job's state is a directory kept as a tar archive in the object store
``sja-checkpoints`` (the job's state holds only references). A sequential job's final state is
unpacked into ``DIR``. An independent one (``sequential: false``) left one state per subjob: each is
unpacked into ``DIR/parts/<unit start, 12 digits>`` (so the names sort in unit order), and the job's
``merge_argv`` runs here, on the machine fetching the result, with ``SJA_PARTS_DIR`` (that
directory), ``SJA_STATE_OUT`` (``DIR``) and ``SJA_JOB_ID`` set, in the job's ``cwd`` or the
current directory.

Every state is checked against its digest; a missing or altered one fails with its name.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from pathlib import Path
from typing import Any

from sja.protocol.messages import JobState
from sja.redaction import is_redacted
from sja.workloads import checkpoint as ckpt
from sja.workloads import statestore
from sja.workloads.base import is_sequential
from sja.workloads.command import parts, unpack_state


class ResultError(RuntimeError):
    pass


async def _fetch(store: Any, raw: bytes) -> bytes:
    """The full checkpoint (blob) behind a reference, checked; an inline blob as it is."""
    if not ckpt.is_ref(raw):
        return raw
    ref = ckpt.unpack_ref(raw)
    try:
        if statestore.is_external(ref.bucket):
            data = await asyncio.to_thread(statestore.get, ref.bucket, ref.name)
        else:
            data = bytes((await store.get(ref.name)).data or b"")
    except Exception as e:
        raise ResultError(f"state {ref.bucket}/{ref.name} cannot be read: {type(e).__name__}: {e}") from None
    if ckpt.digest(data) != ref.sha256:
        raise ResultError(f"state {ref.bucket}/{ref.name} does not match its digest")
    return ckpt.pack_blob(ref.summary, data)


async def fetch_result(js: Any, state: JobState, out: Path, *, run_merge: bool = True) -> dict[str, Any]:
    """Write the job's final state under ``out``; returns what was written."""
    from sja.workloads import workload

    if state.status != "done":
        raise ResultError(f"job {state.job_id} is {state.status}, not done: no final state yet")
    if state.spec.workload != "command":
        raise ResultError(f"job {state.job_id} runs {state.spec.workload}: its result is `sja status`'s")
    params = state.spec.params
    await asyncio.to_thread(out.mkdir, parents=True, exist_ok=True)
    store = await js.object_store(ckpt.BUCKET)
    if is_sequential(workload("command"), params):
        raw = await _fetch(store, state.accumulator)
        await asyncio.to_thread(unpack_state, raw, out)
        return {"job_id": state.job_id, "out": str(out), "parts": 1}
    parts_dir = out / "parts"
    await asyncio.to_thread(parts_dir.mkdir, exist_ok=True)
    got = parts(state.accumulator)
    for start, raw in got:
        blob = await _fetch(store, raw)
        await asyncio.to_thread(unpack_state, blob, parts_dir / f"{start:012d}")
    merged = False
    if run_merge and params.get("merge_argv"):
        env = dict(os.environ)
        # The gateway hands the spec out redacted: a value it hid is not set here, so the merge
        # sees this machine's own value of that variable, if any.
        env.update({k: v for k, v in params.get("env", {}).items() if not is_redacted(v)})
        env.update({"SJA_PARTS_DIR": str(parts_dir), "SJA_STATE_OUT": str(out), "SJA_JOB_ID": state.job_id})
        cwd = params.get("cwd") or None
        r = await asyncio.to_thread(
            subprocess.run, params["merge_argv"], env=env, cwd=cwd, capture_output=True, text=True
        )
        if r.returncode != 0:
            tail = "\n".join(r.stderr.strip().splitlines()[-20:])
            raise ResultError(f"merge_argv exited with {r.returncode}:\n{tail}")
        merged = True
    return {"job_id": state.job_id, "out": str(out), "parts": len(got), "merged": merged}


__all__ = ["ResultError", "fetch_result"]
