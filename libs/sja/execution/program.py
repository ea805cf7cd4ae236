"""Run a user's program as a subjob: a process group, measured, stopped at its deadline.

The program runs in a session of its own (``start_new_session``), so that what it forks is stopped
with it: ``SIGTERM`` to the group at ``term_at``, ``SIGKILL`` to the group and to every descendant
ever seen (a child that left the group included) at ``kill_at``, and once more after the program
exits, so nothing it started outlives its subjob. Its stdout and stderr are read as they come and
only their last bytes kept: a program flooding its output costs neither memory nor disk.

Warm continuation (``sja.execution.warm``): a program started with a channel (``warm=True``: one
end of a socket pair, its descriptor in ``SJA_WARM_FD``) may say ``done`` on it instead of exiting;
its range then ends with the process alive (``ProgramResult.alive``), and the next range of the same
job on the same slice is handed to it through the channel (``resume``).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
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
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._read, name="sja-program-output", daemon=True)
        self.thread.start()

    def _read(self) -> None:
        with contextlib.suppress(Exception):
            while chunk := self.pipe.read1(65536):  # type: ignore[attr-defined]
                with self.lock:
                    self.total += len(chunk)
                    self.chunks.append(chunk)
                    self.size += len(chunk)
                    while self.size - len(self.chunks[0]) >= self.limit:
                        self.size -= len(self.chunks.popleft())

    def text(self) -> str:
        self.thread.join(timeout=2.0)
        return self.take()[0]

    def take(self) -> tuple[str, int]:
        """What was kept so far and the bytes read, and start afresh (a warm program's next range)."""
        with self.lock:
            data = b"".join(self.chunks)[-self.limit :]
            total = self.total
            self.chunks.clear()
            self.size = self.total = 0
        return data.decode("utf-8", errors="replace"), total


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
    alive: bool = False
    """A warm program said ``done`` on its channel: its range is over, the process still runs."""


class Running:
    """A started program: its process, output tails and (warm) channel."""

    def __init__(self, proc: subprocess.Popen[bytes], chan: socket.socket | None) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self.proc = proc
        self.chan = chan
        self.out, self.err = _Tail(proc.stdout), _Tail(proc.stderr)
        self.meter: ProcessTreeMeter | None = None
        self._buf = b""

    def alive(self) -> bool:
        return self.proc.poll() is None and self.chan is not None

    def send(self, message: dict[str, Any]) -> bool:
        """Hand the program its next range; false when it is gone."""
        if not self.alive() or self.chan is None:
            return False
        try:
            self.chan.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            return False
        return True

    def kill(self) -> None:
        _kill_all(self.proc, self.meter)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=5)
        self.close()

    def close(self) -> None:
        if self.chan is not None:
            with contextlib.suppress(OSError):
                self.chan.close()
            self.chan = None
        for pipe in (self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(Exception):
                pipe.close()  # type: ignore[union-attr]

    def _said_done(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for ``done`` on the channel."""
        if self.chan is None:
            return False
        ready, _, _ = select.select([self.chan], [], [], timeout)
        if not ready:
            return False
        try:
            data = self.chan.recv(4096)
        except OSError:
            data = b""
        if not data:  # it closed its end: only its exit ends the range now
            with contextlib.suppress(OSError):
                self.chan.close()
            self.chan = None
            return False
        self._buf += data
        if b"\n" in self._buf:
            line, _, self._buf = self._buf.partition(b"\n")
            return line.strip() == b"done"
        return False


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


def start_program(argv: list[str], env: dict[str, str], *, cwd: str | None, warm: bool = False) -> Running:
    """Start ``argv`` in a session of its own; ``warm``: with a channel (``SJA_WARM_FD``). Raises
    ``OSError`` when it cannot start (no such program)."""
    chan: socket.socket | None = None
    pass_fds: tuple[int, ...] = ()
    theirs: socket.socket | None = None
    if warm:
        chan, theirs = socket.socketpair()
        env = {**env, "SJA_WARM_FD": str(theirs.fileno())}
        pass_fds = (theirs.fileno(),)
    try:
        proc = subprocess.Popen(
            argv,
            env=env,
            cwd=cwd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            close_fds=True,
            pass_fds=pass_fds,
        )
    except OSError:
        if chan is not None:
            chan.close()
        raise
    finally:
        if theirs is not None:
            theirs.close()
    return Running(proc, chan)


def watch(
    running: Running,
    *,
    term_at: float,
    kill_at: float,
    nvml: Any = None,
    device_uuid: str = "",
    poll_s: float = 0.05,
) -> ProgramResult:
    """Measure a started program's range until it exits, says ``done`` (warm) or ``kill_at``. A
    program that did not say ``done`` is gone afterwards, with all it started."""
    t0 = time.monotonic()
    proc = running.proc
    meter: ProcessTreeMeter | None = None
    try:
        meter = ProcessTreeMeter(proc.pid, nvml=nvml, device_uuid=device_uuid)
        meter.start()
    except Exception:
        meter = None
    running.meter = meter
    signalled = ""
    alive = False
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
            wait = max(0.001, min(poll_s, (term_at if not signalled else kill_at) - now))
            if running.chan is not None:
                if running._said_done(wait):
                    alive = proc.poll() is None
                    break
                if proc.poll() is not None:
                    break
                continue
            try:
                proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
    finally:
        if not alive:
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
    if alive:
        time.sleep(0.01)  # let the readers catch up with what it printed before ``done``
        (stdout, out_bytes), (stderr, err_bytes) = running.out.take(), running.err.take()
    else:
        for tail in (running.out, running.err):
            tail.thread.join(timeout=2.0)
        (stdout, out_bytes), (stderr, err_bytes) = running.out.take(), running.err.take()
        running.close()
    return ProgramResult(
        returncode=0 if alive else int(proc.returncode),
        signalled=signalled,
        stdout=stdout,
        stderr=stderr,
        stdout_bytes=out_bytes,
        stderr_bytes=err_bytes,
        peak_mem_mib=peak,
        rss_peak_mib=rss,
        gpu_peak_mib=gpu,
        duration_s=duration,
        alive=alive,
    )


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
    return watch(
        start_program(argv, env, cwd=cwd),
        term_at=term_at,
        kill_at=kill_at,
        nvml=nvml,
        device_uuid=device_uuid,
        poll_s=poll_s,
    )


def last_lines(text: str, lines: int = 20, chars: int = 2000) -> str:
    """The end of a program's output, for a completion's error."""
    kept = "\n".join(text.rstrip().splitlines()[-lines:])
    return kept[-chars:]


__all__ = ["ProgramResult", "Running", "last_lines", "run_program", "start_program", "watch"]
