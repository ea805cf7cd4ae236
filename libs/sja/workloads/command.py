"""``workload: command``: any program, run as subjobs under a contract of environment variables.

Each subjob runs ``argv`` as a process of its own on the slice, with (see ``docs/jobs.md``):

- ``SJA_JOB_ID``, ``SJA_SUBJOB_ID``, ``SJA_UNIT_START``, ``SJA_UNITS``, ``SJA_TOTAL_UNITS``,
  ``SJA_ATTEMPT``, ``SJA_SLICE_ID``, ``SJA_MEM_CAP_MIB``, ``CUDA_VISIBLE_DEVICES``;
- ``SJA_STATE_IN``: a directory holding the state the previous subjob left (empty for the first, and
  always empty when ``sequential`` is false), ``SJA_STATE_OUT``: an empty directory to leave the
  state in;
- ``SJA_DEADLINE`` (Unix seconds) and ``SJA_STOP_GRACE_S``: ``SIGTERM`` comes ``stop_grace_s``
  before the deadline (at most half the window), ``SIGKILL`` at it;
- ``SJA_REPORT``: a file where a program that stops early writes ``{"units_done": k}`` (the SDK's
  ``ctx.report`` does it); without it, exit 0 means every unit is done.

With ``warm: true`` (sequential jobs) the program may keep running between subjobs of its job on the
same slice (``sja.execution.warm``; the SDK's ``ctx.next_range()``).

The state directory travels as a tar archive in a checkpoint blob (``checkpoint.pack_blob``): the
executor keeps it in the object store ``sja-checkpoints`` and only its reference travels on NATS.
For ``sequential: false`` every subjob's state is kept (the accumulator lists their references in
unit order); ``merge_argv`` combines them when the result is fetched (``sja result``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tarfile
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

import msgspec

from sja.protocol.messages import MemoryDecl, TimeDecl
from sja.workloads import checkpoint as ckpt
from sja.workloads import statetar
from sja.workloads.base import SpecError, check_known

DEFAULT_STOP_GRACE_S = 30.0
MAX_UNITS = 10**12
METRICS_KEPT = 32
OOM_MARKERS = (
    "CUDA out of memory",
    "OutOfMemoryError",
    "MemoryError",
    "std::bad_alloc",
    "Cannot allocate memory",
)
"""Text in a failed program's stderr that means it ran out of memory."""


class StateSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What the job's state keeps of a subjob's state directory (the tar is the blob's data)."""

    unit_start: int = 0
    unit_end: int = 0
    files: int = 0
    metrics: dict[str, Any] = {}


_enc = msgspec.msgpack.Encoder()
_summary_dec = msgspec.msgpack.Decoder(StateSummary)
_parts_dec = msgspec.msgpack.Decoder(list[tuple[int, bytes]])


def _str_list(params: dict[str, Any], name: str, required: bool) -> list[str]:
    value = params.get(name)
    if not required and (value is None or value == []):
        return []
    if not isinstance(value, list) or not value or not all(isinstance(a, str) for a in value):
        raise SpecError(f"params.{name}", f"expected a non-empty list of strings, got {value!r}")
    return list(value)


def _clean_metrics(metrics: Any) -> dict[str, Any]:
    """A program's metrics as the job's state may keep them: at most ``METRICS_KEPT`` keys; numbers
    within 64 bits, booleans and short strings; anything else as its (short) text."""
    out: dict[str, Any] = {}
    if not isinstance(metrics, dict):
        return out
    for k, v in list(metrics.items())[:METRICS_KEPT]:
        key = str(k)[:64]
        if (
            isinstance(v, bool)
            or (isinstance(v, int) and -(2**63) <= v < 2**64)
            or (isinstance(v, float) and math.isfinite(v))
        ):
            out[key] = v
        else:
            out[key] = str(v)[:200]
    return out


def pack_state(directory: Path, summary: StateSummary) -> bytes:
    return ckpt.pack_blob(_enc.encode(summary), statetar.pack(directory))


def unpack_state(raw: bytes, directory: Path) -> StateSummary:
    """Extract a state checkpoint into ``directory``; ``ValueError`` when it is not one."""
    if ckpt.is_ref(raw):
        raise ValueError("the state reference was not resolved (the executor fetches it from the store)")
    try:
        blob = ckpt.unpack_blob(raw)
        summary = _summary_dec.decode(blob.summary) if blob.summary else StateSummary()
        # Safe on every Python 3.11 (the ``data`` filter, or the same checks where it is missing).
        statetar.extract(blob.data, directory)
    except (ValueError, msgspec.DecodeError, tarfile.TarError, OSError) as e:
        raise ValueError(f"not a state archive: {type(e).__name__}: {e}") from None
    return summary


def summary_of(raw: bytes) -> StateSummary:
    s = ckpt.summary_of(raw)
    return _summary_dec.decode(s) if s else StateSummary()


def parts(acc: bytes) -> list[tuple[int, bytes]]:
    """The states of an independent command job, ``(unit_start, checkpoint)`` in unit order."""
    return _parts_dec.decode(acc) if acc else []


class Command:
    name: ClassVar[str] = "command"
    sequential: ClassVar[bool] = True
    """The default; ``is_sequential`` gives a job's own."""
    framework: ClassVar[str] = "command"

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(
            params, {"argv", "units", "env", "sequential", "merge_argv", "stop_grace_s", "cwd", "warm"}
        )
        argv = _str_list(params, "argv", True)
        units = params.get("units")
        if isinstance(units, bool) or not isinstance(units, int) or not 1 <= units <= MAX_UNITS:
            raise SpecError("params.units", f"expected an integer from 1 to {MAX_UNITS}, got {units!r}")
        env = params.get("env", {})
        if not isinstance(env, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in env.items()
        ):
            raise SpecError("params.env", "expected a map of strings to strings")
        if any(k.startswith("SJA_") or k == "CUDA_VISIBLE_DEVICES" for k in env):
            raise SpecError("params.env", "SJA_* and CUDA_VISIBLE_DEVICES are set by the executor")
        sequential = params.get("sequential", True)
        if not isinstance(sequential, bool):
            raise SpecError("params.sequential", f"expected true or false, got {sequential!r}")
        merge_argv = _str_list(params, "merge_argv", not sequential)
        grace = params.get("stop_grace_s", DEFAULT_STOP_GRACE_S)
        if isinstance(grace, bool) or not isinstance(grace, int | float) or not 0 <= grace <= 3600:
            raise SpecError("params.stop_grace_s", f"expected seconds from 0 to 3600, got {grace!r}")
        cwd = params.get("cwd", "")
        if not isinstance(cwd, str):
            raise SpecError("params.cwd", f"expected a path, got {cwd!r}")
        warm = params.get("warm", False)
        if not isinstance(warm, bool):
            raise SpecError("params.warm", f"expected true or false, got {warm!r}")
        if warm and not sequential:
            raise SpecError("params.warm", "warm continuation needs sequential: true")
        return {
            "argv": argv,
            "units": units,
            "env": dict(env),
            "sequential": sequential,
            "merge_argv": merge_argv,
            "stop_grace_s": float(grace),
            "cwd": cwd,
            "warm": warm,
        }

    def is_sequential(self, params: dict[str, Any]) -> bool:
        return bool(params.get("sequential", True))

    def total_units(self, params: dict[str, Any]) -> int:
        return int(params["units"])

    def declared_memory(self, params: dict[str, Any]) -> MemoryDecl:
        # A program's own declaration belongs in the spec (``memory:``); this is a wide prior.
        return MemoryDecl(base_mib=512.0, per_unit_mib=0.0, rel_sd=0.5)

    def declared_time(self, params: dict[str, Any]) -> TimeDecl:
        return TimeDecl(warmup_s=2.0, per_unit_s=1.0, rel_sd=1.0)

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        from sja import job
        from sja.execution.program import last_lines, start_program, watch

        ctx = job.current()
        if ctx is None:  # run outside an executor (the one-piece reference): no deadline
            ctx = job.Context(
                job_id="local",
                subjob_id="local",
                unit_start=unit_start,
                count=units,
                total_units=params["units"],
            )
        from sja.execution import warm as warm_reg

        warm = bool(params.get("warm")) and self.is_sequential(params)
        held = warm_reg.take(ctx.job_id, ctx.slice_id) if warm else None
        in_digest = warm_reg.state_digest(checkpoint) if held is not None else ""
        # The parked process already holds the state this subjob starts from: nothing to read.
        resumed = held is not None and bool(in_digest) and held.digest == in_digest
        keep: Any = None
        tmp = Path(tempfile.mkdtemp(prefix="sja-subjob-"))
        try:
            state_in, state_out, report = tmp / "state_in", tmp / "state_out", tmp / "report.json"
            state_in.mkdir()
            state_out.mkdir()

            def restore() -> None:
                try:
                    before = unpack_state(checkpoint, state_in)
                except ValueError as e:
                    raise job.Stopped("failed", f"input state unreadable: {e}") from None
                if before.unit_end != unit_start:
                    raise job.Stopped(
                        "failed",
                        f"input state ends at unit {before.unit_end}, the subjob starts at unit {unit_start}",
                    )

            if checkpoint and self.is_sequential(params):
                if resumed:
                    held_end = summary_of(checkpoint).unit_end
                    if held_end != unit_start:
                        raise job.Stopped(
                            "failed",
                            f"input state ends at unit {held_end}, the subjob starts at unit {unit_start}",
                        )
                else:
                    restore()
            now = time.time()
            deadline = ctx.deadline if math.isfinite(ctx.deadline) else now + 10 * 365 * 86400
            grace = min(params["stop_grace_s"], max(0.0, (deadline - now) / 2))
            env = dict(os.environ)
            env.update(params["env"])
            env.update(
                {
                    "SJA_JOB_ID": ctx.job_id,
                    "SJA_SUBJOB_ID": ctx.subjob_id,
                    "SJA_UNIT_START": str(unit_start),
                    "SJA_UNITS": str(units),
                    "SJA_TOTAL_UNITS": str(params["units"]),
                    "SJA_ATTEMPT": str(ctx.attempt),
                    "SJA_STATE_IN": str(state_in),
                    "SJA_STATE_OUT": str(state_out),
                    "SJA_REPORT": str(report),
                    "SJA_DEADLINE": f"{deadline:.3f}",
                    "SJA_STOP_GRACE_S": f"{grace:.3f}",
                    "SJA_MEM_CAP_MIB": str(ctx.mem_cap_mib),
                    "SJA_SLICE_ID": ctx.slice_id,
                    "CUDA_VISIBLE_DEVICES": ctx.cuda_visible_devices or env.get("CUDA_VISIBLE_DEVICES", ""),
                }
            )
            nvml, device = _nvml_for(env)
            running = None
            if held is not None:
                sent = {k: v for k, v in env.items() if k.startswith("SJA_") or k == "CUDA_VISIBLE_DEVICES"}
                if held.running.send({"env": sent, "resumed": resumed}):
                    running = held.running
                else:  # it died since: start afresh, from the state
                    held.running.kill()
                    if resumed and checkpoint:
                        restore()
                    resumed = False
            try:
                if running is None:
                    running = start_program(params["argv"], env, cwd=params["cwd"] or None, warm=warm)
            except OSError as e:
                raise job.Stopped("failed", f"cannot start {params['argv'][0]!r}: {e}") from None
            keep = running
            r = watch(running, term_at=deadline - grace, kill_at=deadline, nvml=nvml, device_uuid=device)
            if not r.alive:
                keep = None
            handed = held is not None and running is held.running
            if warm:
                ctx.warm = "resumed" if resumed else ("handed" if handed else "cold")
            ctx.stdout_tail, ctx.stderr_tail = r.stdout, r.stderr
            reported = _read_report(report)
            torch_peak = reported.get("torch_cuda_peak_mib", 0.0)
            ctx.peak_mem_mib = max(r.peak_mem_mib, torch_peak if isinstance(torch_peak, int | float) else 0.0)
            tail = last_lines(r.stderr) or last_lines(r.stdout)
            if r.signalled == "kill":
                raise job.Stopped(
                    "timeout",
                    f"still running at the window's end ({deadline - now:.1f}s after it started; SIGTERM "
                    f"was sent {grace:.1f}s before): killed. Last output:\n{tail}",
                )
            if r.returncode != 0:
                oom = r.returncode == -9 or any(m in r.stderr for m in OOM_MARKERS)
                how = (
                    f"killed by signal {-r.returncode}" if r.returncode < 0 else f"exited with {r.returncode}"
                )
                raise job.Stopped("oom" if oom else "failed", f"{how}. Last stderr lines:\n{tail}")
            done = reported.get("units_done", units)
            if isinstance(done, bool) or not isinstance(done, int) or not 0 <= done <= units:
                raise job.Stopped("failed", f"{report.name}: units_done must be 0 to {units}, got {done!r}")
            if done == 0:
                raise job.Stopped("timeout", "stopped before its first unit was done")
            ctx.units_done = done
            files = sum(1 for _ in state_out.rglob("*"))
            if files == 0 and self.is_sequential(params):
                raise job.Stopped("failed", "exited 0 but left no state in SJA_STATE_OUT")
            summary = StateSummary(
                unit_start=unit_start,
                unit_end=unit_start + done,
                files=files,
                metrics=_clean_metrics(reported.get("metrics", {})),
            )
            out = pack_state(state_out, summary)
            if keep is not None:
                warm_reg.park(ctx.job_id, ctx.slice_id, keep, warm_reg.state_digest(out))
                keep = None
            return out
        finally:
            if keep is not None:  # the range did not end well: the process goes
                keep.kill()
            shutil.rmtree(tmp, ignore_errors=True)

    def merge(self, acc: bytes, partial: bytes) -> bytes:
        # Only the references are kept (the states are in the object store), in unit order.
        got = parts(acc)
        got.append((summary_of(partial).unit_start, partial))
        got.sort(key=lambda p: p[0])
        return _enc.encode(got)

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
        if self.is_sequential(params):
            s = summary_of(acc)
            return {
                "units_done": s.unit_end,
                "state": ckpt.where(acc),
                "files": s.files,
                "metrics": s.metrics,
            }
        got = parts(acc)
        last = summary_of(got[-1][1]) if got else StateSummary()
        return {
            "units_done": sum(summary_of(raw).unit_end - start for start, raw in got),
            "parts": len(got),
            "state": [ckpt.where(raw) for _, raw in got][:64],
            "metrics": last.metrics,
        }


def _read_report(path: Path) -> dict[str, Any]:
    try:
        if path.stat().st_size > 1024 * 1024:
            return {}
        got = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _nvml_for(env: dict[str, str]) -> tuple[Any, str]:
    device = env.get("CUDA_VISIBLE_DEVICES", "")
    if not device or env.get("SJA_SLICE_SOURCE", "") in ("", "declared") or device.isdigit():
        return None, ""
    try:
        from sja.inventory.nvml import load_nvml

        return load_nvml(), device
    except Exception:
        return None, ""


__all__ = ["Command", "StateSummary", "pack_state", "parts", "summary_of", "unpack_state"]
