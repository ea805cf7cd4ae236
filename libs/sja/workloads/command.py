"""``workload: command``: any program, run as subjobs under a contract of environment variables.

Each subjob runs ``argv`` in a sandbox of its own on the slice (``sja.execution.sandbox``),
with (see ``docs/jobs.md``):

- ``SJA_JOB_ID``, ``SJA_SUBJOB_ID``, ``SJA_UNIT_START``, ``SJA_UNITS``, ``SJA_TOTAL_UNITS``,
  ``SJA_ATTEMPT``, ``SJA_SLICE_ID``, ``SJA_MEM_CAP_MIB``, ``CUDA_VISIBLE_DEVICES``;
- ``SJA_STATE_IN``: a directory holding the state the previous subjob left (empty for the first, and
  always empty when ``sequential`` is false), ``SJA_STATE_OUT``: an empty directory to leave the
  state in;
- ``SJA_DEADLINE`` (Unix seconds) and ``SJA_STOP_GRACE_S``: ``SIGTERM`` comes ``stop_grace_s``
  before the deadline (never before its planned start-up and first unit), ``SIGKILL`` at it;
- ``SJA_REPORT``: a file where a program that stops early writes ``{"units_done": k}`` (the SDK's
  ``ctx.report`` does it); without it, exit 0 means every unit is done.

With ``warm: true`` (sequential jobs) the program may keep running between subjobs of its job on the
same slice (``sja.execution.warm``; the SDK's ``ctx.next_range()``).

``python`` or ``python3`` as ``argv[0]`` (and ``merge_argv[0]``) is the job's interpreter: ``python``
(an absolute path) when the spec names one, else the executor's own (``resolve_argv``). ``code`` is a
reference (``sha256:<digest>``) to a directory ``sja submit`` packed and uploaded through the gateway
(``sja.workloads.codepack``); each subjob runs in it (``SJA_CODE_DIR``, its working directory and
``PYTHONPATH``).

The state directory travels as a tar archive in a checkpoint blob (``checkpoint.pack_blob``): the
executor keeps it in the object store ``sja-checkpoints`` and only its reference travels on NATS.
For ``sequential: false`` every subjob's state is kept (the accumulator lists their references in
unit order); ``merge_argv`` combines them when the result is fetched (``sja result``).
"""

from __future__ import annotations

import math
import os
import re
import tarfile
from collections.abc import Callable
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
PYTHON_NAMES = ("python", "python3")
"""``argv[0]`` values that mean the job's interpreter (``resolve_argv``)."""
CODE_REF = re.compile(r"^sha256:[0-9a-f]{64}$")
"""A job's code as the gateway takes it: the SHA-256 of the archive ``sja submit`` uploaded."""


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


def check_python(value: Any) -> str:
    """``params.python`` normalized: ``""`` (the executor's own interpreter) or an absolute path.
    Whether it exists is checked where it can be: by ``sja submit`` on the machine it runs on, and by
    the executor on each node (a job naming one a node lacks fails at once, saying so)."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or "\0" in value:
        raise SpecError("params.python", f"expected the absolute path of an interpreter, got {value!r}")
    if not os.path.isabs(value) or os.path.normpath(value) != value or value.startswith("//"):
        raise SpecError(
            "params.python",
            f"expected the absolute path of an interpreter (as /opt/venv/bin/python), got {value!r}",
        )
    return value


def check_code(value: Any) -> str:
    """``params.code`` normalized: ``""`` (none) or ``sha256:<64 hex digits>``, the reference
    ``sja submit`` puts there once it uploaded the directory (``--code DIR``, or ``code: DIR``)."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str) or not CODE_REF.match(value):
        raise SpecError(
            "params.code",
            f"expected the reference of uploaded code (sha256:<64 hex digits>), got {str(value)[:100]!r}: "
            "`sja submit --code DIR` (or `code: DIR` in the spec) packs a directory, uploads it and "
            "puts its reference here",
        )
    return value


def resolve_argv(argv: list[str], python: str) -> list[str]:
    """``argv`` with ``python``/``python3`` as its program replaced by the interpreter ``python``."""
    if argv and argv[0] in PYTHON_NAMES:
        return [python, *argv[1:]]
    return list(argv)


def clean_metrics(metrics: Any) -> dict[str, Any]:
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
    yields: ClassVar[bool] = True
    """A program stops at a unit boundary on ``SIGTERM`` (the contract): its subjobs may go on past
    their window while nobody else wants the slice (``core.continuation``)."""

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(
            params,
            {
                "argv",
                "units",
                "env",
                "sequential",
                "merge_argv",
                "stop_grace_s",
                "cwd",
                "warm",
                "python",
                "code",
                "continue",
            },
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
        python = check_python(params.get("python"))
        code = check_code(params.get("code"))
        # The interpreter and the code are left out when not given: a job without them keeps the
        # parameters it always had.
        extra: dict[str, Any] = {k: v for k, v in (("python", python), ("code", code)) if v}
        go_on = params.get("continue", True)
        if not isinstance(go_on, bool):
            raise SpecError("params.continue", f"expected true or false, got {go_on!r}")
        if not go_on:
            extra["continue"] = False  # subjobs bounded by their windows (core.continuation)
        return {
            "argv": argv,
            "units": units,
            "env": dict(env),
            "sequential": sequential,
            "merge_argv": merge_argv,
            "stop_grace_s": float(grace),
            "cwd": cwd,
            "warm": warm,
            **extra,
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
        """Run the range's program: the executor's part (``sja.execution.commands``, which registers
        itself with ``set_runner`` when imported), in the subjob's sandbox."""
        if _runner is None:
            raise RuntimeError("command programs run through the executor: import sja.execution.commands")
        return _runner(params, unit_start, units, checkpoint)

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


Runner = Callable[[dict[str, Any], int, int, bytes], bytes]
_runner: Runner | None = None


def set_runner(runner: Runner) -> None:
    """Who runs a range's program (``sja.execution.commands.run_command``)."""
    global _runner
    _runner = runner


__all__ = [
    "CODE_REF",
    "PYTHON_NAMES",
    "Command",
    "StateSummary",
    "check_code",
    "check_python",
    "clean_metrics",
    "pack_state",
    "parts",
    "resolve_argv",
    "set_runner",
    "summary_of",
    "unpack_state",
]
