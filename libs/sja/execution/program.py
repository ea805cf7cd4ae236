"""Run a user's program as a subjob: a process group, measured, stopped at its deadline.

The program runs in a session of its own (``start_new_session``), so that what it forks is stopped
with it: ``SIGTERM`` to the group at ``term_at``, ``SIGKILL`` to the group and to every descendant
ever seen (a child that left the group included) at ``kill_at``, and once more after the program
exits, so nothing it started outlives its subjob. Its stdout and stderr are read as they come and
only their last bytes kept: a program flooding its output costs neither memory nor disk.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import IO, Any

from sja.execution.meters import ProcessTreeMeter

TAIL_BYTES = 16 * 1024
"""Bytes of each of stdout and stderr kept."""


class _Tail:
    """Reads a pipe to its end on a thread, keeping its last ``limit`` bytes."""

    def __init__(self, pipe: IO[bytes], limit: int = TAIL_BYTES) -> None:
        self.pipe = pipe
        self.limit = limit
        self.chunks: deque[bytes] = deque()
        self.size = 0
        self.total = 0
        self.thread = threading.Thread(target=self._read, name="sja-program-output", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with contextlib.suppress(Exception):
            while chunk := self.pipe.read1(65536):  # type: ignore[attr-defined]
                self.total += len(chunk)
                self.chunks.append(chunk)
                self.size += len(chunk)
                while self.size - len(self.chunks[0]) >= self.limit:
                    self.size -= len(self.chunks.popleft())

    def text(self) -> str:
        self.thread.join(timeout=2.0)
        data = b"".join(self.chunks)[-self.limit :]
        return data.decode("utf-8", errors="replace")


@dataclass(frozen=True)
class ProgramResult:
    returncode: int
    signalled: str
    """``""``, ``term`` (it was sent SIGTERM) or ``kill`` (it was still running at ``kill_at``)."""
    stdout: str
    stderr: str
    stdout_bytes: int
    stderr_bytes: int
    peak_mem_mib: float
    rss_peak_mib: float
    gpu_peak_mib: float
    duration_s: float


def _signal_group(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def _kill_all(proc: subprocess.Popen[bytes], meter: ProcessTreeMeter | None) -> None:
    _signal_group(proc.pid, signal.SIGKILL)
    if meter is not None:
        meter.processes()
        for p in list(meter.seen.values()):
            with contextlib.suppress(Exception):
                if p.is_running():  # psutil checks the start time: never a reused pid
                    p.kill()


def run_program(
    argv: list[str],
    env: dict[str, str],
    *,
    cwd: str | None,
    term_at: float,
    kill_at: float,
    nvml: Any = None,
    device_uuid: str = "",
    poll_s: float = 0.05,
) -> ProgramResult:
    """Run ``argv`` until it exits or ``kill_at`` (Unix seconds). Raises ``OSError`` when it cannot
    start (no such program)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        start_new_session=True,
        close_fds=True,
    )
    assert proc.stdout is not None and proc.stderr is not None
    out, err = _Tail(proc.stdout), _Tail(proc.stderr)
    meter: ProcessTreeMeter | None = None
    try:
        meter = ProcessTreeMeter(proc.pid, nvml=nvml, device_uuid=device_uuid)
        meter.start()
    except Exception:
        meter = None
    signalled = ""
    try:
        while True:
            now = time.time()
            if now >= kill_at:
                signalled = "kill"
                _kill_all(proc, meter)
                proc.wait()
                break
            if now >= term_at and not signalled:
                signalled = "term"
                _signal_group(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=max(0.001, min(poll_s, (term_at if not signalled else kill_at) - now)))
                break
            except subprocess.TimeoutExpired:
                continue
    finally:
        # Whatever it left running (a forked child, a daemon) goes with it.
        _kill_all(proc, meter)
        if proc.returncode is None:
            proc.wait()
    duration = time.monotonic() - t0
    peak = rss = gpu = 0.0
    if meter is not None:
        peak = meter.stop()
        rss = meter.rss_peak_mib
        gpu = meter.gpu_peak / (1024 * 1024)
    stdout, stderr = out.text(), err.text()
    for pipe in (proc.stdout, proc.stderr):
        with contextlib.suppress(Exception):
            pipe.close()
    return ProgramResult(
        returncode=int(proc.returncode),
        signalled=signalled,
        stdout=stdout,
        stderr=stderr,
        stdout_bytes=out.total,
        stderr_bytes=err.total,
        peak_mem_mib=peak,
        rss_peak_mib=rss,
        gpu_peak_mib=gpu,
        duration_s=duration,
    )


def last_lines(text: str, lines: int = 20, chars: int = 2000) -> str:
    """The end of a program's output, for a completion's error."""
    kept = "\n".join(text.rstrip().splitlines()[-lines:])
    return kept[-chars:]


__all__ = ["ProgramResult", "last_lines", "run_program"]
