"""Run a user's program as a subjob: sandboxed, measured, stopped at its deadline.

The program starts in its sandbox (``sja.execution.sandbox``: namespaces of its own, its own uid, an
allow-listed environment, a private work directory): ``SIGTERM`` to everything in it at
``term_at``, the sandbox torn down at ``kill_at`` and once the program exits, so nothing it started
outlives its subjob. On an emulated slice its resident memory is watched while it runs and it is
stopped once past its cap (``mem_cap_bytes``). Its stdout and stderr are read as they come and only
their last bytes kept: a program flooding its output costs neither memory nor disk.

Warm continuation (``sja.execution.warm``): a program started with a channel (``warm=True``: one
end of a socket pair, its descriptor in ``SJA_WARM_FD``) may say ``done`` on it instead of exiting;
its range then ends with the process alive (``ProgramResult.alive``), and the next range of the same
job on the same slice is handed to it through the channel (``resume``).
"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from sja.execution.meters import ProcessTreeMeter
from sja.execution.sandbox import Plain, Sandbox, Sandboxed, remove_workdir
from sja.execution.stopclock import StopClock

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
    over_cap_mib: float = 0.0
    """The resident memory at which it was stopped for passing its cap (0: it was not)."""


class Running:
    """A started program: its sandbox, work directory, output tails and (warm) channel."""

    def __init__(self, proc: Sandboxed | Plain, chan: socket.socket | None, work: Path | None = None) -> None:
        self.proc = proc
        self.chan = chan
        self.work = work
        """The subjob's work directory, removed with the program (``kill``)."""
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
        """Stop the program and everything it started, and remove its work directory."""
        self.proc.kill()
        self.close()
        if self.work is not None:
            remove_workdir(self.work)
            self.work = None

    def close(self) -> None:
        if self.chan is not None:
            with contextlib.suppress(OSError):
                self.chan.close()
            self.chan = None
        self.proc.close()

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


def start_program(
    argv: list[str],
    env: dict[str, str],
    *,
    sandbox: Sandbox,
    work: Path,
    cwd: str | None,
    warm: bool = False,
    code: str | None = None,
) -> Running:
    """Start ``argv`` in ``sandbox`` with ``work`` as its work directory; ``warm``: with a channel
    (``SJA_WARM_FD``); ``code``: the job's code directory, shown read-only (``Sandbox.code_at``).
    Raises ``OSError`` when it cannot start (no such program), ``SandboxError`` when the sandbox
    cannot be made."""
    chan: socket.socket | None = None
    theirs: socket.socket | None = None
    if warm:
        chan, theirs = socket.socketpair()
        env = {**env, "SJA_WARM_FD": str(theirs.fileno())}
    try:
        proc = sandbox.start(
            argv, env, work=work, cwd=cwd, warm_fd=None if theirs is None else theirs.fileno(), code=code
        )
    except BaseException:
        if chan is not None:
            chan.close()
        raise
    finally:
        if theirs is not None:
            theirs.close()
    return Running(proc, chan, work)


def watch(
    running: Running,
    *,
    term_at: float,
    kill_at: float,
    nvml: Any = None,
    device_uuid: str = "",
    poll_s: float = 0.05,
    mem_cap_bytes: float = 0.0,
    clock: StopClock | None = None,
) -> ProgramResult:
    """Measure a started program's range until it exits, says ``done`` (warm), passes
    ``mem_cap_bytes`` of resident memory (0: no cap) or ``kill_at``. A program that did not say
    ``done`` is gone afterwards, with all it started. ``clock``: a stop clock another thread may
    move while it runs (an open subjob's yield), read on every poll instead of
    ``term_at``/``kill_at``."""
    t0 = time.monotonic()
    proc = running.proc
    meter: ProcessTreeMeter | None = None
    try:
        meter = ProcessTreeMeter(
            proc.pid,
            nvml=nvml,
            device_uuid=device_uuid,
            exclude=proc.wrappers(),
            cap_bytes=mem_cap_bytes,
            on_over=proc.kill,
        )
        meter.start()
    except Exception:
        meter = None
    running.meter = meter
    signalled = ""
    alive = False
    try:
        while True:
            now = time.time()
            if clock is not None:
                term_at, kill_at = clock.term_at, clock.kill_at
            if meter is not None and meter.over:
                break
            if now >= kill_at:
                signalled = "kill"
                proc.kill()
                break
            if now >= term_at and not signalled:
                signalled = "term"
                proc.terminate()
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
            except Exception:  # still running
                continue
    finally:
        if not alive:
            # Whatever it left running (a forked child, a daemon) goes with its sandbox.
            proc.kill()
    duration = time.monotonic() - t0
    peak = rss = gpu = 0.0
    over = 0.0
    if meter is not None:
        peak = meter.stop()
        rss = meter.rss_peak_mib
        gpu = meter.gpu_peak / (1024 * 1024)
        over = meter.over / (1024 * 1024)
    if proc.poll() is not None:  # ended: the kernel's own peak is known (sandboxed)
        peak, rss = max(peak, proc.max_rss_mib), max(rss, proc.max_rss_mib)
    if alive:
        time.sleep(0.01)  # let the readers catch up with what it printed before ``done``
        (stdout, out_bytes), (stderr, err_bytes) = running.out.take(), running.err.take()
    else:
        for tail in (running.out, running.err):
            tail.thread.join(timeout=2.0)
        (stdout, out_bytes), (stderr, err_bytes) = running.out.take(), running.err.take()
        running.close()
    code = proc.poll()
    return ProgramResult(
        returncode=0 if alive else (code if code is not None else -9),
        signalled=signalled,
        stdout=stdout,
        stderr=stderr,
        stdout_bytes=out_bytes,
        stderr_bytes=err_bytes,
        peak_mem_mib=max(peak, over),
        rss_peak_mib=max(rss, over),
        gpu_peak_mib=gpu,
        duration_s=duration,
        alive=alive,
        over_cap_mib=over,
    )


def run_program(
    argv: list[str],
    env: dict[str, str],
    *,
    sandbox: Sandbox,
    cwd: str | None,
    term_at: float,
    kill_at: float,
    nvml: Any = None,
    device_uuid: str = "",
    poll_s: float = 0.05,
) -> ProgramResult:
    """Run ``argv`` in a sandbox of its own until it exits or ``kill_at`` (Unix seconds); its work
    directory is removed afterwards. Raises ``OSError`` when it cannot start (no such program)."""
    work = sandbox.workdir("program")
    try:
        running = start_program(argv, env, sandbox=sandbox, work=work, cwd=cwd)
        return watch(
            running, term_at=term_at, kill_at=kill_at, nvml=nvml, device_uuid=device_uuid, poll_s=poll_s
        )
    finally:
        remove_workdir(work)


def last_lines(text: str, lines: int = 20, chars: int = 2000) -> str:
    """The end of a program's output, for a completion's error."""
    kept = "\n".join(text.rstrip().splitlines()[-lines:])
    return kept[-chars:]


__all__ = ["ProgramResult", "Running", "last_lines", "run_program", "start_program", "watch"]
