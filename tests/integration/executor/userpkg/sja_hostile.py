"""A hostile tenant's code, as a program (``python -m sja_hostile``) and as a Python workload
(``sja_hostile:Hostile``): each attack is tried and what it got is written down, so that a test can
prove the attempt ran and failed. The test puts this directory on ``PYTHONPATH``.

What to attack comes in ``ATTACK_*`` variables (a program's ``params.env``) or the params (a
workload): the executor's canary pid and its secret, a file of the service user, a file in its HOME,
another subjob's work directory, the nats-server's port, the limits to push past.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any, ClassVar

from sja.protocol import messages as m

MARK = "SJA-HOSTILE-REPORT:"


def _try(fn: Any) -> str:
    try:
        got = fn()
    except BaseException as e:
        return f"refused: {type(e).__name__}: {e}"
    return f"GOT: {str(got)[:300]}"


def _read(path: str) -> str:
    return Path(path).read_text(errors="replace")


def _scan_environs(secret: str) -> list[str]:
    """The pids whose environment holds ``secret`` followed by 32 hex digits (the canary's)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if re.search(
                    re.escape(secret.encode()) + b"[0-9a-f]{32}", Path(f"/proc/{entry}/environ").read_bytes()
                ):
                    found.append(entry)
    return found


def _daemon(token: str) -> int:
    """Double fork a process that sleeps for ten minutes (and holds stdout), named by ``token``."""
    pid = os.fork()
    if pid == 0:
        os.setsid()
        if os.fork() == 0:
            os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", token])
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def _fork_bomb(limit: int) -> tuple[int, str]:
    kids, error = [], ""
    for _ in range(limit):
        try:
            pid = os.fork()
        except OSError as e:
            error = f"{type(e).__name__}: {e}"
            break
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        kids.append(pid)
    return len(kids), error


def attack(cfg: dict[str, str]) -> dict[str, Any]:
    """Every attack ``cfg`` names; what each got."""
    out: dict[str, Any] = {"uid": os.getuid(), "gid": os.getgid(), "groups": os.getgroups()}
    out["env"] = sorted(os.environ)
    out["env_secrets"] = {
        k: v for k, v in os.environ.items() if re.search("SECRET-[0-9a-f]{32}", v) or k.startswith("SJA_NATS")
    }
    if cfg.get("canary_pid"):
        out["canary_environ"] = _try(lambda: _read(f"/proc/{cfg['canary_pid']}/environ"))
        out["environs_with_secret"] = _scan_environs(cfg["canary_secret"])
        out["pids_seen"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    for name in ("service_file", "home_file", "other_work"):
        if cfg.get(name):
            out[name] = _try(lambda n=name: _read(cfg[n]))
    if cfg.get("other_work_dir"):
        out["other_work_dir"] = _try(lambda: os.listdir(cfg["other_work_dir"]))
        out["tmp"] = _try(lambda: os.listdir("/tmp"))
    if cfg.get("nats_port"):
        port = int(cfg["nats_port"])
        out["nats"] = _try(lambda: socket.create_connection(("127.0.0.1", port), timeout=5).recv(64))
        with contextlib.suppress(OSError):
            host = socket.gethostbyname(socket.gethostname())
            out["nats_by_host"] = _try(lambda: socket.create_connection((host, port), timeout=5).recv(64))
    if cfg.get("daemon_token"):
        out["daemon"] = _daemon(cfg["daemon_token"])
    if cfg.get("fork"):
        out["forked"], out["fork_error"] = _fork_bomb(int(cfg["fork"]))
    if cfg.get("write_mib"):
        path = Path(cfg.get("write_to") or "/tmp/big")
        out["write"] = f"writing {cfg['write_mib']} MiB to {path}"
        print(MARK + json.dumps(out), flush=True)
        with open(path, "wb") as f:
            for _ in range(int(cfg["write_mib"])):
                f.write(b"x" * 1024 * 1024)
        out["written"] = path.stat().st_size
    return out


def _from_env() -> dict[str, str]:
    return {k[len("ATTACK_") :].lower(): v for k, v in os.environ.items() if k.startswith("ATTACK_")}


class Hostile:
    """The same attacks from a Python workload: its one unit's output is the report (JSON)."""

    name: ClassVar[str] = "hostile"
    sequential: ClassVar[bool] = False
    framework: ClassVar[str] = "numpy"

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        return dict(params)

    def total_units(self, params: dict[str, Any]) -> int:
        return 1

    def declared_memory(self, params: dict[str, Any]) -> m.MemoryDecl:
        return m.MemoryDecl(base_mib=8, per_unit_mib=1)

    def declared_time(self, params: dict[str, Any]) -> m.TimeDecl:
        return m.TimeDecl(warmup_s=0, per_unit_s=1)

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        report = attack({k: str(v) for k, v in params.items()})
        print(MARK + json.dumps(report), flush=True)
        if report.get("fork_error"):
            raise OSError(f"fork refused: {report['fork_error']}")
        return json.dumps(report).encode()

    def merge(self, acc: bytes, partial: bytes) -> bytes:
        return partial

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
        return dict(json.loads(acc)) if acc else {}


if __name__ == "__main__":
    got = attack(_from_env())
    print(MARK + json.dumps(got), flush=True)
    if got.get("fork_error"):
        sys.exit(f"fork refused: {got['fork_error']}")
