"""The SDK for code running as a subjob: ``ctx = sja.job.context()``.

Inside a subjob, whether a program run under the ``command`` contract (its environment carries the
subjob: ``SJA_JOB_ID``, ``SJA_UNIT_START``, ...) or a Python workload's ``run`` (the executor sets
the context in its process), ``context()`` gives:

- ``units``: the range of units to do (``range(unit_start, unit_start + count)``), ``total_units``;
- ``deadline`` (Unix seconds) and ``should_stop()``: true from ``stop_grace_s`` before the deadline,
  or once the program got ``SIGTERM`` (which ``context()`` turns into that flag instead of death);
  an open subjob (``continues``: it goes on past its window while no other job wants the slice) has
  no deadline: ``should_stop()`` turns true when it is asked to yield;
- ``slice_id``, ``cuda_visible_devices``, ``attempt`` (earlier tries of this range);
- ``state_in`` / ``state_out``: the directory holding the state the previous subjob left (empty for
  the first) and the empty one to leave the state in (command contract);
- ``report(units_done=k, **metrics)``: a subjob that stops early keeps its first ``k`` units (the
  rest is planned again); the metrics are kept with the state.

- ``next_range()`` (warm continuation, ``params.warm: true``): once this range's state is written,
  wait for the job's next range on this slice in this same process; ``None`` when there is none
  (exit then). ``ctx.resumed`` says the process already holds the state the range starts from.

For PyTorch, the CUDA allocator's peak statistics are reset when the context is made and its peak is
reported when the program ends, so GPU memory is measured without the program doing anything.

This module imports nothing heavy: a user's program pays for it only what it uses.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import math
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ENV_PREFIX = "SJA_"


class NotInSubjob(RuntimeError):
    """``context()`` called outside a subjob (no ``SJA_JOB_ID`` in the environment)."""


class Stopped(Exception):
    """Raised by a workload's ``run`` to end its subjob with a status other than ``failed``
    (``timeout``, ``oom``) and a reason. ``final``: trying again cannot help (what the job names is
    missing on the node), so the job fails at once instead of after its eighth failure."""

    def __init__(self, status: str, error: str, *, final: bool = False) -> None:
        super().__init__(f"{status}: {error}")
        self.status = status
        self.error = error
        self.final = final


@dataclass
class Context:
    job_id: str
    subjob_id: str
    unit_start: int
    count: int
    total_units: int
    attempt: int = 0
    deadline: float = math.inf
    """Unix seconds: the subjob is killed here."""
    stop_grace_s: float = 0.0
    """``should_stop()`` turns true this long before ``deadline``."""
    first_unit_s: float = 0.0
    """The subjob's planned start-up and first unit: no stop signal comes before (0: not planned)."""
    continues: bool = False
    """An open subjob: ``units`` runs to the end of the job's contiguous range, and the subjob goes on
    past its window (``deadline`` is infinite) until it is asked to yield (``SIGTERM``, then
    ``should_stop()``): stop after the current unit, save the state, report how far it got."""
    slice_id: str = ""
    cuda_visible_devices: str = ""
    mem_cap_mib: int = 0
    state_in: Path | None = None
    state_out: Path | None = None
    report_path: Path | None = None
    units_done: int | None = None
    """What ``report`` said was done; ``None``: all of ``units``."""
    metrics: dict[str, Any] = field(default_factory=dict)
    peak_mem_mib: float = 0.0
    """Peak memory measured for the subjob (set by the runner of a command; PyTorch's peak here)."""
    stdout_tail: str = ""
    stderr_tail: str = ""
    """The end of a command's output (set by its runner; the completion carries it)."""
    resumed: bool = False
    """Warm continuation: this process already holds the state this range starts from (the one its
    previous range left): do not load ``state_in`` (it is empty)."""
    code_dir: str = ""
    """Where the job's uploaded code lies on this node (``params.code``; set by the slice's actor)."""
    warm: str = ""
    """How the executor ran the range: ``cold`` (a new process), ``handed`` (to the live process,
    which restores the state) or ``resumed`` (to the live process, holding the state); ``""``: not
    warm."""
    _stop: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def units(self) -> range:
        return range(self.unit_start, self.unit_start + self.count)

    @property
    def unit_end(self) -> int:
        return self.unit_start + self.count

    def seconds_left(self) -> float:
        return self.deadline - time.time()

    def should_stop(self) -> bool:
        """Whether to save the state and return now: ``stop_grace_s`` before the deadline, or after
        ``SIGTERM``."""
        return self._stop.is_set() or time.time() >= self.deadline - self.stop_grace_s

    def request_stop(self) -> None:
        self._stop.set()

    def report(self, units_done: int | None = None, **metrics: Any) -> None:
        """Say how many of the subjob's units are done (from ``unit_start``) and any metrics
        (numbers or short strings). Call it before returning or exiting when stopping early; the
        last call counts."""
        if units_done is not None:
            if isinstance(units_done, bool) or not isinstance(units_done, int):
                raise TypeError(f"units_done must be an int, got {units_done!r}")
            if not 0 <= units_done <= self.count:
                raise ValueError(f"units_done must be between 0 and {self.count}, got {units_done}")
            self.units_done = units_done
        self.metrics.update(metrics)
        self._write_report()

    def next_range(self) -> Context | None:
        """Warm continuation: this range is over (its state is in ``state_out``, ``report`` said how
        far it got); wait in this process for the job's next range on this slice. Returns its
        context (also ``context()`` from now on), or ``None`` when there is none: the job is done,
        the job is not warm, or the executor did not give one (the program should exit then). The
        executor may also stop the process while it waits; the state it wrote is what counts."""
        global _current
        self._write_report()
        end = self.unit_start + (self.count if self.units_done is None else self.units_done)
        if end >= self.total_units or self.report_path is None:
            return None
        chan = _channel()
        if chan is None:
            return None
        try:
            chan.sendall(b"done\n")
            line = _read_line(chan)
        except OSError:
            return None
        if not line:
            return None
        msg = json.loads(line)
        os.environ.update({str(k): str(v) for k, v in msg.get("env", {}).items()})
        nxt = _from_env(os.environ)
        nxt.resumed = bool(msg.get("resumed", False))
        with _lock:
            _current = nxt
        _reset_torch_peak()
        return nxt

    def _write_report(self) -> None:
        if self.report_path is None:
            return
        out: dict[str, Any] = {"metrics": self.metrics}
        if self.units_done is not None:
            out["units_done"] = self.units_done
        peak = _torch_peak_mib()
        if peak:
            out["torch_cuda_peak_mib"] = peak
        tmp = self.report_path.with_suffix(".tmp")
        tmp.write_text(json.dumps(out, default=str), encoding="utf-8")
        os.replace(tmp, self.report_path)


_current: Context | None = None
_lock = threading.Lock()
_chan: socket.socket | None = None
_chan_buf = b""


def _channel() -> socket.socket | None:
    """The warm channel the executor gave this process (``SJA_WARM_FD``), if any."""
    global _chan
    if _chan is None:
        fd = os.environ.get("SJA_WARM_FD", "")
        if not fd.isdigit():
            return None
        try:
            _chan = socket.socket(fileno=int(fd))
        except OSError:
            return None
    return _chan


def _read_line(chan: socket.socket) -> bytes:
    global _chan_buf
    while b"\n" not in _chan_buf:
        data = chan.recv(65536)
        if not data:
            return b""
        _chan_buf += data
    line, _, _chan_buf = _chan_buf.partition(b"\n")
    return line


def _write_current_report() -> None:
    if _current is not None:
        with contextlib.suppress(OSError):
            _current._write_report()


def context() -> Context:
    """The subjob this code runs in (see the module's docstring); raises ``NotInSubjob`` outside one."""
    global _current
    with _lock:
        if _current is None:
            _current = _from_env(os.environ)
            _install_sigterm(_current)
            _reset_torch_peak()
            if _current.report_path is not None:
                atexit.register(_write_current_report)
        return _current


def current() -> Context | None:
    """The context set in this process, if any (without reading the environment)."""
    return _current


def set_current(ctx: Context | None) -> None:
    """Set (or clear) this process's context: the executor does it around a Python workload's run."""
    global _current
    with _lock:
        _current = ctx


def _int(env: Any, name: str, default: int | None = None) -> int:
    raw = env.get(ENV_PREFIX + name)
    if raw is None:
        if default is None:
            raise NotInSubjob(f"{ENV_PREFIX}{name} is not set: not running as an SJA subjob")
        return default
    return int(raw)


def _from_env(env: Any) -> Context:
    job_id = env.get("SJA_JOB_ID")
    if not job_id:
        raise NotInSubjob("SJA_JOB_ID is not set: not running as an SJA subjob (see docs/jobs.md)")

    def path(name: str) -> Path | None:
        v = env.get(ENV_PREFIX + name)
        return Path(v) if v else None

    return Context(
        job_id=job_id,
        subjob_id=env.get("SJA_SUBJOB_ID", ""),
        unit_start=_int(env, "UNIT_START"),
        count=_int(env, "UNITS"),
        total_units=_int(env, "TOTAL_UNITS"),
        attempt=_int(env, "ATTEMPT", 0),
        # An open subjob (``SJA_CONTINUE=1``) goes on past its window until SIGTERM asks it to yield.
        deadline=math.inf if env.get("SJA_CONTINUE") == "1" else float(env.get("SJA_DEADLINE") or math.inf),
        continues=env.get("SJA_CONTINUE") == "1",
        stop_grace_s=float(env.get("SJA_STOP_GRACE_S") or 0.0),
        slice_id=env.get("SJA_SLICE_ID", ""),
        cuda_visible_devices=env.get("CUDA_VISIBLE_DEVICES", ""),
        mem_cap_mib=_int(env, "MEM_CAP_MIB", 0),
        state_in=path("STATE_IN"),
        state_out=path("STATE_OUT"),
        report_path=path("REPORT"),
    )


def _install_sigterm(ctx: Context) -> None:
    if threading.current_thread() is not threading.main_thread():
        return

    def on_term(signum: int, frame: Any) -> None:
        (_current or ctx).request_stop()  # the range running now (warm: not the first)

    with contextlib.suppress(ValueError, OSError):
        signal.signal(signal.SIGTERM, on_term)


def _torch_cuda() -> Any:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    try:
        return torch.cuda if torch.cuda.is_available() else None
    except Exception:
        return None


def _reset_torch_peak() -> None:
    cuda = _torch_cuda()
    if cuda is not None:
        with contextlib.suppress(Exception):
            cuda.reset_peak_memory_stats()


def _torch_peak_mib() -> float:
    cuda = _torch_cuda()
    if cuda is None:
        return 0.0
    try:
        return float(cuda.max_memory_reserved()) / (1024 * 1024)
    except Exception:
        return 0.0


__all__ = ["Context", "NotInSubjob", "Stopped", "context", "current", "set_current"]
