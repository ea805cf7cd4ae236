"""The one place that starts tenant code: a subjob's sandbox.

Every subjob's code (a ``command`` program, or the process that runs a Python workload) starts here,
in namespaces of its own made by util-linux ``unshare``::

    unshare --pid --fork --kill-child --mount --mount-proc --ipc --uts [--net] [--user --map-root-user]
        -- python -I -S sandbox_init.py <config fd>

``sandbox_init`` (standard library only) is pid 1 of the new pid namespace: it covers ``/tmp``,
``/var/tmp``, ``/dev/shm`` and every hidden path with empty tmpfs, binds the subjob's work directory
at ``WORK_AT``, brings up the loopback interface of its network namespace, and forks the program
with limits, ``no_new_privs``, no capabilities, and (when the executor is root) the slice's own uid
and gid. The program sees only its own processes (``/proc`` is the namespace's), no network but its
own loopback (unless ``SJA_SANDBOX_NETWORK=host``), and an environment built from an allow-list
(``environment``), never the executor's. When the program exits, pid 1 writes its wait status on a
pipe only the executor holds and exits: the kernel kills everything left in the namespace, double
forks included. Killing the ``unshare`` process (``Sandboxed.kill``) tears it down the same way.

Uids: when the executor runs as root, the subjobs of slice ``i`` of the node run as uid and gid
``uid_base + i`` (no passwd entry needed): two subjobs running at once never share a uid, and
``RLIMIT_NPROC`` counts one subjob's processes. Otherwise the sandbox maps the executor's uid to root
in a user namespace of its own (``--user --map-root-user``): the program then runs as the executor's
uid outside, and the executor says so once at start (``describe``).

``SJA_SANDBOX=off`` starts programs without any of this (a process group of the executor's uid,
still with an allow-listed environment): only for an operator who trusts every tenant.
"""

from __future__ import annotations

import contextlib
import logging
import marshal
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import IO, Annotated, Literal

import msgspec

from sja.execution.sandbox_init import CODE_AT, PR_SET_PDEATHSIG, TMP_DIRS, WORK_AT, _under, prctl

log = logging.getLogger(__name__)

INIT = str(Path(__file__).with_name("sandbox_init.py"))

PASSED = frozenset(
    {
        "PATH",
        "LANG",
        "TZ",
        "CUDA_VISIBLE_DEVICES",
        "CUDA_DEVICE_ORDER",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
        "OPENBLAS_NUM_THREADS",
    }
)
"""Variables of the executor's environment a subjob gets (with ``LC_*`` and those the operator lists
in ``SJA_SANDBOX_ENV``); every other one stays out."""

DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"

NEVER_HIDDEN = frozenset(
    {"/", "/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc", "/proc", "/dev", "/sys", "/var", "/opt", "/srv"}
)
"""Paths a sandbox cannot run without (a service user's HOME may be one of them)."""

START_TIMEOUT_S = 60.0
"""How long the sandbox may take to say its program started."""


class SandboxSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The executor's sandbox for subjobs (``SJA_SANDBOX`` and ``SJA_SANDBOX_<FIELD>``)."""

    mode: Literal["on", "off"] = "on"
    """``SJA_SANDBOX``: ``off`` runs tenant code without isolation (a loud warning at start)."""
    network: Literal["none", "host"] = "none"
    """``none``: a network namespace with only loopback; ``host``: the host's network (weaker:
    tenant code can reach NATS, Ray and anything the node reaches)."""
    uid_base: Annotated[int, msgspec.Meta(ge=1, le=2**31 - 2**16)] = 200000
    """Slice ``i`` of the node runs its subjobs as uid and gid ``uid_base + i`` (executor as root)."""
    hide: tuple[str, ...] = ()
    """More paths covered with an empty tmpfs in every sandbox (the executor's HOME, ``/root``, the
    Ray session directory and the stack's output directory always are)."""
    env: tuple[str, ...] = ()
    """Names of more variables of the executor's environment passed to subjobs."""
    nproc: Annotated[int, msgspec.Meta(ge=1)] = 512
    """``RLIMIT_NPROC``: processes (threads included) of a subjob."""
    fsize_mib: Annotated[int, msgspec.Meta(ge=1)] = 16384
    """``RLIMIT_FSIZE``: the largest file a subjob may write."""
    nofile: Annotated[int, msgspec.Meta(ge=16)] = 4096
    """``RLIMIT_NOFILE``: open files per process."""
    tmp_mib: Annotated[int, msgspec.Meta(ge=1)] = 4096
    """Size of each private tmpfs (``/tmp``, ``/var/tmp``, ``/dev/shm``)."""
    mem_margin: Annotated[float, msgspec.Meta(ge=0)] = 0.1
    """On an emulated slice, a subjob whose processes' resident memory passes its cap by this
    fraction is stopped as ``oom``."""
    python_mib: Annotated[float, msgspec.Meta(ge=0)] = 512.0
    """Resident memory allowed to a Python workload's process beyond its slice's cap (the
    interpreter and the modules it imports, not counted in its measured peak)."""
    result_max_mib: Annotated[float, msgspec.Meta(gt=0)] = 4096.0
    """The largest result a Python workload's process may hand back."""


class SandboxError(ValueError):
    """The sandbox cannot be made: what the operator must grant is in the message (a configuration
    error, as a bad setting: ``sja service`` prints it as one line and exits)."""


def environment(
    contract: Mapping[str, str],
    own: Mapping[str, str] = {},
    allowed: Iterable[str] = (),
    source: Mapping[str, str] | None = None,
    home: str = WORK_AT,
) -> dict[str, str]:
    """A subjob's environment: the allow-listed variables of ``source`` (the executor's: ``PASSED``,
    ``LC_*`` and ``allowed``), the job's own (``params.env``), then the contract's ``SJA_*`` (and
    device) variables, with ``HOME`` the subjob's private directory."""
    src = os.environ if source is None else source
    extra = set(allowed)
    env = {k: v for k, v in src.items() if k in PASSED or k.startswith("LC_") or k in extra}
    env.update(own)
    env.update(contract)
    env["HOME"] = home
    env.setdefault("PATH", DEFAULT_PATH)
    return env


def is_root() -> bool:
    return os.geteuid() == 0


class Sandbox:
    """How one slice's subjobs are sandboxed: settings, the slice's index (its uid), hidden paths."""

    def __init__(
        self,
        settings: SandboxSettings | None = None,
        slot: int = 0,
        hidden: Iterable[str] = (),
        owner: str = "",
    ):
        self.settings = settings or SandboxSettings()
        self.slot = slot
        self.owner = _safe(owner or f"slot{slot}")
        """What this sandbox's work directories are named after (the slice), for ``sweep``."""
        wanted = dict.fromkeys(_abs(p) for p in (*default_hidden(), *hidden, *self.settings.hide))
        self.hidden = tuple(p for p in wanted if p not in NEVER_HIDDEN)
        """Paths covered with an empty tmpfs (never the system's own: a HOME of ``/`` hides nothing)."""

    @property
    def enabled(self) -> bool:
        return self.settings.mode == "on"

    def ids(self) -> tuple[int, int] | None:
        """The uid and gid the slice's subjobs run as; ``None`` where the executor cannot switch."""
        if not self.enabled or not is_root():
            return None
        uid = self.settings.uid_base + self.slot
        return uid, uid

    def home(self, work: Path) -> str:
        return WORK_AT if self.enabled else str(work)

    def code_at(self, code: str) -> str:
        """Where the job's code directory ``code`` is seen from inside the sandbox."""
        return CODE_AT if self.enabled else code

    def sees(self, path: str) -> bool:
        """Whether a program in this sandbox sees ``path`` of the node (not under a hidden path, nor
        under ``/tmp`` and the like, unless bound back for the interpreter: ``keep_paths``)."""
        if not self.enabled:
            return True
        path = _abs(path)
        covered = [*self.hidden, *TMP_DIRS]
        if not any(_under(path, h) for h in covered):
            return True
        return any(_under(path, k) for k in keep_paths())

    def inside(self, work: Path, path: Path) -> str:
        """Where ``path`` of the work directory is seen from inside the sandbox."""
        return str(Path(self.home(work)) / path.relative_to(work))

    def root(self) -> Path:
        """Where this executor's work directories are (mode 0700, its own)."""
        root = Path(tempfile.gettempdir()) / f"sja-subjobs-{os.geteuid()}"
        root.mkdir(mode=0o700, exist_ok=True)
        st = root.lstat()
        if not root.is_dir() or root.is_symlink() or st.st_uid != os.geteuid():
            raise SandboxError(f"{root} is not a directory of this user")
        os.chmod(root, 0o700)
        return root

    def workdir(self, tag: str) -> Path:
        """A new private work directory for a subjob: owned by the sandbox uid, mode 0700."""
        work = Path(tempfile.mkdtemp(prefix=f"{self.owner}--{_safe(tag)}-", dir=self.root()))
        self.own(work)
        return work

    def sweep(self) -> int:
        """Remove the work directories this owner's subjobs left (an actor that died with subjobs
        running or parked: their sandboxes went with it, their directories did not); how many."""
        gone = 0
        with contextlib.suppress(OSError, SandboxError):
            for work in self.root().glob(f"{self.owner}--*"):
                remove_workdir(work)
                gone += 1
        return gone

    def own(self, path: Path, recursive: bool = True) -> None:
        """Give ``path`` (and, ``recursive``, what is in it) to the sandbox uid, following no link.
        Recursively only in a tree no tenant process can change meanwhile."""
        ids = self.ids()
        if ids is None:
            return
        for p in (path, *(path.rglob("*") if recursive else ())):
            with contextlib.suppress(FileNotFoundError):
                os.chown(p, *ids, follow_symlinks=False)

    def argv(self, config_fd: int) -> list[str]:
        net = ["--net"] if self.settings.network == "none" else []
        user = [] if is_root() else ["--user", "--map-root-user"]
        return [
            _unshare(),
            "--pid",
            "--fork",
            "--kill-child",
            "--mount",
            "--mount-proc",
            "--ipc",
            "--uts",
            *net,
            *user,
            "--",
            sys.executable,
            "-I",
            "-S",
            INIT,
            str(config_fd),
        ]

    def start(
        self,
        argv: list[str],
        env: dict[str, str],
        *,
        work: Path,
        cwd: str | None = None,
        warm_fd: int | None = None,
        code: str | None = None,
    ) -> Sandboxed | Plain:
        """Start ``argv`` sandboxed (its stdout and stderr pipes to read); ``code``: a directory
        shown read-only at ``CODE_AT`` (``code_at``). Raises ``OSError`` when the program cannot be
        executed (no such file), ``SandboxError`` when the sandbox cannot be made."""
        pass_fds = () if warm_fd is None else (warm_fd,)
        if not self.enabled:
            return Plain(
                subprocess.Popen(
                    argv,
                    env=env,
                    cwd=cwd or str(work),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    close_fds=True,
                    pass_fds=pass_fds,
                )
            )
        s = self.settings
        ids = self.ids()
        status_r, status_w = os.pipe()
        config = {
            "argv": argv,
            "env": env,
            "cwd": cwd or WORK_AT,
            "work": str(work),
            "hide": list(self.hidden),
            "keep": keep_paths(),
            "net": s.network,
            "tmp_mib": s.tmp_mib,
            "uid": ids[0] if ids else None,
            "gid": ids[1] if ids else None,
            "limits": {"nproc": s.nproc, "fsize": s.fsize_mib * 1024 * 1024, "nofile": s.nofile},
            "status_fd": status_w,
            "warm_fd": warm_fd,
            "code": code,
        }
        cfg = os.memfd_create("sja-sandbox", 0)
        try:
            os.write(cfg, marshal.dumps(config))
            os.lseek(cfg, 0, os.SEEK_SET)
            proc = subprocess.Popen(
                self.argv(cfg),
                env={"PATH": os.environ.get("PATH", DEFAULT_PATH)},
                cwd="/",
                preexec_fn=_die_with_parent,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                close_fds=True,
                pass_fds=(cfg, status_w, *pass_fds),
            )
        except BaseException:
            os.close(status_r)
            raise
        finally:
            os.close(cfg)
            os.close(status_w)
        box = Sandboxed(proc, status_r)
        box.wait_started()
        return box


class _Started:
    """What the executor reads of a started program, sandboxed or not: its process and pipes."""

    proc: subprocess.Popen[bytes]
    max_rss_mib: float = 0.0
    """The kernel's peak resident memory of the program once it ended (its sandbox's pid 1 reads it
    from ``wait4``; 0: not known, as without a sandbox): the floor of the measured peak, which a
    program shorter than the meter's first sample would otherwise not have."""

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def stdout(self) -> IO[bytes]:
        assert self.proc.stdout is not None
        return self.proc.stdout

    @property
    def stderr(self) -> IO[bytes]:
        assert self.proc.stderr is not None
        return self.proc.stderr


class Sandboxed(_Started):
    """A program running in its sandbox: the ``unshare`` process, its pid 1 and the status pipe."""

    def __init__(self, proc: subprocess.Popen[bytes], status_fd: int) -> None:
        self.proc = proc
        self.status_fd = status_fd
        self._status = b""
        self._returncode: int | None = None
        self.init_pid = 0
        self._lock = threading.Lock()

    def wrappers(self) -> set[int]:
        """The processes that are the sandbox, not the program (``unshare`` and its pid 1)."""
        return {self.proc.pid, self.init_pid}

    def _line(self) -> list[str] | None:
        """The next line pid 1 wrote (``sandbox_init.report``): its kind and fields."""
        while b"\n" not in self._status:
            try:
                chunk = os.read(self.status_fd, 4096)
            except OSError:
                chunk = b""
            if not chunk:
                return None
            self._status += chunk
        line, _, self._status = self._status.partition(b"\n")
        return line.decode(errors="replace").split("\t")

    def wait_started(self) -> None:
        first = self._line()
        if first is not None and first[0] == "started":
            self.init_pid = _only_child(self.proc.pid)
            return
        self.kill()
        stderr = b""
        with contextlib.suppress(Exception):
            stderr = self.stderr.read()[-2000:]
        self.close()
        error = first if first is not None and first[0] == "error" and len(first) == 4 else None
        if error is not None and error[1] == "exec":
            raise OSError(int(error[2]) if error[2].isdigit() else 0, error[3])
        why = error[3] if error else stderr.decode(errors="replace").strip()
        stage = f" ({error[1]})" if error else ""
        raise SandboxError(f"the subjob's sandbox did not start{stage}: {why or 'no reason given'}")

    def poll(self) -> int | None:
        """The program's return code once it ended (``-N``: killed by signal ``N``), else ``None``."""
        if self.proc.poll() is None:
            return None
        return self._result()

    def _result(self) -> int:
        with self._lock:
            if self._returncode is None:
                got = self._line() or [""]
                if got[0] in ("signal", "exit") and len(got) in (2, 3) and got[1].isdigit():
                    self._returncode = -int(got[1]) if got[0] == "signal" else int(got[1])
                    if len(got) == 3 and got[2].isdigit():
                        self.max_rss_mib = int(got[2]) / 1024.0
                else:
                    self._returncode = -signal.SIGKILL  # the sandbox was killed
            return self._returncode

    def wait(self, timeout: float | None = None) -> int:
        self.proc.wait(timeout=timeout)
        return self._result()

    def terminate(self) -> None:
        """SIGTERM to every process of the sandbox (pid 1 forwards it)."""
        if self.init_pid:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(self.init_pid, signal.SIGTERM)

    def kill(self) -> None:
        """Tear the sandbox down: everything in it is killed."""
        for pid in (self.init_pid, self.proc.pid):
            if pid and self.proc.returncode is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self.status_fd)
        self.status_fd = -1
        for pipe in (self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(Exception):
                pipe.close()  # type: ignore[union-attr]


class Plain(_Started):
    """A program started without a sandbox (``SJA_SANDBOX=off``): a process group of its own."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        self.proc = proc

    def wrappers(self) -> set[int]:
        return set()

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout=timeout)

    def terminate(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.proc.wait(timeout=10)

    def close(self) -> None:
        for pipe in (self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(Exception):
                pipe.close()  # type: ignore[union-attr]


_current: Sandbox | None = None
_current_lock = threading.Lock()


def current() -> Sandbox:
    """The sandbox of this process's subjobs: the one ``configure`` set (a slice's actor sets its
    own), else one from this process's ``SJA_SANDBOX*`` variables."""
    global _current
    with _current_lock:
        if _current is None:
            _current = Sandbox(settings_from_env(os.environ))
        return _current


def configure(box: Sandbox | None) -> None:
    """Set the sandbox of this process's subjobs (``None``: back to the one from the environment)."""
    global _current
    with _current_lock:
        _current = box


def settings_from_env(env: Mapping[str, str]) -> SandboxSettings:
    """``SandboxSettings`` from ``SJA_SANDBOX`` and ``SJA_SANDBOX_*`` alone."""
    from sja.bus.settings import BaseSettings

    class _Only(BaseSettings, frozen=True, kw_only=True):
        sandbox: SandboxSettings = msgspec.field(default_factory=SandboxSettings)

    return _Only.from_env(env).sandbox


def _die_with_parent() -> None:
    """In ``unshare`` before it runs: killed when the process that started it dies (a slice's actor
    killed or restarted), which takes its sandbox down (``--kill-child``) with all in it."""
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def _only_child(pid: int) -> int:
    """The child of ``unshare`` (the sandbox's pid 1), by its host pid; 0 if not found."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children", encoding="ascii") as f:
            kids = f.read().split()
        if kids:
            return int(kids[0])
    except (OSError, ValueError):
        pass
    with contextlib.suppress(Exception):
        import psutil

        found = psutil.Process(pid).children()
        return int(found[0].pid) if found else 0
    return 0


def remove_workdir(work: Path) -> None:
    shutil.rmtree(work, ignore_errors=True)


def default_hidden() -> list[str]:
    """Paths every sandbox hides: the executor's HOME and ``/root``."""
    return [os.path.expanduser("~"), "/root"]


def keep_paths() -> list[str]:
    """What a sandboxed Python needs even where a hidden path or ``/tmp`` holds it (bound back
    read-only): the interpreter's prefixes, SJA's own sources and the executor's ``PYTHONPATH`` (where
    it finds the workloads' packages)."""
    import sja

    paths = {
        sys.prefix,
        sys.base_prefix,
        sys.exec_prefix,
        os.path.dirname(os.path.realpath(sys.executable)),
        str(Path(sja.__file__).resolve().parent.parent),
        *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if os.path.isabs(p)),
    }
    return sorted(p for p in paths if p and p != "/")


def _abs(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def _safe(tag: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in tag)[:80] or "subjob"


def _unshare() -> str:
    return shutil.which("unshare") or "/usr/bin/unshare"


def describe(settings: SandboxSettings, slots: int = 1) -> str:
    """One line for the executor's log at start: how subjobs are isolated here."""
    if settings.mode == "off":
        return "SANDBOX OFF (SJA_SANDBOX=off): tenant code runs as the executor's uid with no isolation"
    net = "loopback only" if settings.network == "none" else "THE HOST'S NETWORK (SJA_SANDBOX_NETWORK=host)"
    if is_root():
        who = f"uids {settings.uid_base}..{settings.uid_base + max(slots, 1) - 1} (one per slice)"
    else:
        who = (
            f"the executor's own uid {os.geteuid()} (not root: it cannot switch uids; a user namespace "
            "maps it to root inside the sandbox)"
        )
    return f"subjobs run sandboxed (pid, mount, IPC, UTS namespaces; network: {net}) as {who}"


def check(settings: SandboxSettings, box: Sandbox | None = None) -> None:
    """Start a trivial program in a sandbox (``box``, or one of ``settings``): raises ``SandboxError``
    with what the operator must grant when namespaces cannot be made here."""
    if settings.mode == "off":
        return
    if shutil.which("unshare") is None:
        raise SandboxError("the subjob sandbox needs util-linux 'unshare' on PATH (or SJA_SANDBOX=off)")
    box = box or Sandbox(settings, owner=f"check-{os.getpid()}")
    work = box.workdir("check")
    try:
        started = box.start(["true"], environment({}), work=work)
        code = started.wait(timeout=START_TIMEOUT_S)
        started.close()
        if code != 0:
            raise SandboxError(f"a trivial program in the sandbox exited with {code}")
    except (SandboxError, OSError, subprocess.TimeoutExpired) as e:
        grant = (
            "run the executor as root"
            if is_root()
            else (
                "run the executor as root, or allow unprivileged user namespaces "
                "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces>0; no AppArmor "
                "restriction on unprivileged user namespaces)"
            )
        )
        raise SandboxError(
            f"cannot create the subjob sandbox ({e}): {grant}; SJA_SANDBOX=off only where every tenant "
            "is trusted"
        ) from None
    finally:
        remove_workdir(work)


__all__ = [
    "CODE_AT",
    "DEFAULT_PATH",
    "PASSED",
    "WORK_AT",
    "Plain",
    "Sandbox",
    "SandboxError",
    "SandboxSettings",
    "Sandboxed",
    "check",
    "configure",
    "current",
    "describe",
    "environment",
    "keep_paths",
    "remove_workdir",
    "settings_from_env",
]
