"""The first process of a subjob's sandbox (pid 1 of its pid namespace): standard library only.

Started by ``sja.execution.sandbox`` as ``python -I -S sandbox_init.py <config fd>`` inside fresh
pid, mount, IPC and UTS namespaces (and a network namespace unless the operator allows the host's),
it reads its configuration (JSON) from the descriptor, then:

1. hides what tenant code must not see: a fresh tmpfs on ``/tmp``, ``/var/tmp`` and ``/dev/shm``,
   an empty one over each hidden directory (``/dev/null`` over a hidden file), the paths the
   interpreter needs bound back read-only when a hidden directory held them; the subjob's work
   directory (opened before ``/tmp`` was covered) is bound at ``WORK_AT``, and the job's code
   directory, if any, read-only at ``CODE_AT``;
2. brings the loopback interface up in a network namespace of its own;
3. forks the program: limits (``RLIMIT_NPROC``, ``RLIMIT_FSIZE``, ``RLIMIT_NOFILE``), no capability
   left to gain, ``no_new_privs``, the sandbox uid and gid without supplementary groups (when the
   executor is root), its working directory, and ``execve`` with the environment it was given;
4. forwards ``SIGTERM``, ``SIGINT`` and ``SIGHUP`` to every process of the namespace, reaps them, and
   when the program exits writes its wait status on the status descriptor (which the program never
   holds) and exits: the kernel then kills whatever is left in the namespace.

A failure before the program runs is written on the status descriptor too
(``{"error": ..., "stage": ...}``), so that the executor reports why.
"""

from __future__ import annotations

# Only modules that cost nothing to import (no ``typing``, ``json``, ``socket``, ``signal``,
# ``contextlib``): this runs before every subjob, and its start-up is the sandbox's cost.
import _signal as signal  # type: ignore[import-not-found]
import _socket
import ctypes
import errno
import fcntl
import marshal
import os
import resource
import struct
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType
    from typing import Any

WORK_AT = "/tmp/sja-work"
CODE_AT = "/tmp/sja-code"
"""Where the job's code directory (``params.code``) is bound, read-only."""
TMP_DIRS = ("/tmp", "/var/tmp", "/dev/shm")

MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_REMOUNT = 32
MS_BIND = 4096
MS_REC = 16384

PR_SET_PDEATHSIG = 1
PR_CAPBSET_DROP = 24
PR_SET_SECUREBITS = 28
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4
# SECBIT_NOROOT, SECBIT_NOROOT_LOCKED, SECBIT_NO_SETUID_FIXUP(_LOCKED), SECBIT_KEEP_CAPS_LOCKED,
# SECBIT_NO_CAP_AMBIENT_RAISE(_LOCKED): uid 0 in a user namespace gains nothing at exec.
SECURE_BITS = 0x01 | 0x02 | 0x04 | 0x08 | 0x20 | 0x40 | 0x80

SIOCGIFFLAGS = 0x8913
SIOCSIFFLAGS = 0x8914
IFF_UP = 0x1

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _b(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    if _libc.mount(_b(source), _b(target), _b(fstype), flags, _b(data)) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {target}: {os.strerror(e)}")


def prctl(option: int, arg: int, strict: bool = True) -> None:
    if _libc.prctl(option, arg, 0, 0, 0) != 0 and strict:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl({option}): {os.strerror(e)}")


def _under(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def hide(cfg: dict[str, Any], work_fd: int, code_fd: int | None = None) -> None:
    keep: list[tuple[str, int]] = []
    covered = [*cfg["hide"], *TMP_DIRS]
    for path in cfg.get("keep", []):
        if any(_under(path, h) for h in covered) and os.path.isdir(path):
            keep.append((path, os.open(path, os.O_PATH | os.O_DIRECTORY)))
    tmpfs = f"mode=0755,size={int(cfg.get('tmp_mib', 1024))}m"
    for path in cfg["hide"]:
        if os.path.islink(path) or not os.path.exists(path):
            continue
        if os.path.isdir(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        else:
            mount("/dev/null", path, None, MS_BIND)
    for path in TMP_DIRS:
        if os.path.isdir(path) and not os.path.islink(path):
            mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, tmpfs.replace("0755", "1777"))
    for path, fd in keep:
        os.makedirs(path, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(fd)
    os.mkdir(WORK_AT, 0o700)
    mount(f"/proc/self/fd/{work_fd}", WORK_AT, None, MS_BIND)
    os.close(work_fd)
    if code_fd is not None:
        os.mkdir(CODE_AT, 0o755)
        mount(f"/proc/self/fd/{code_fd}", CODE_AT, None, MS_BIND | MS_REC)
        mount(None, CODE_AT, None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)
        os.close(code_fd)


def loopback_up() -> None:
    s = _socket.socket(_socket.AF_INET, _socket.SOCK_DGRAM)
    try:
        got = fcntl.ioctl(s.fileno(), SIOCGIFFLAGS, struct.pack("16sH14s", b"lo", 0, b""))
        flags = struct.unpack("16sH14s", got)[1]
        fcntl.ioctl(s.fileno(), SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | IFF_UP, b""))
    finally:
        s.close()


def child(cfg: dict[str, Any]) -> None:
    """In the forked child: limits, privileges, then the program (never returns)."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE, signal.SIGXFSZ, signal.SIGCHLD):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])
    os.setsid()
    limits = cfg["limits"]
    for name, value in (
        ("nproc", resource.RLIMIT_NPROC),
        ("fsize", resource.RLIMIT_FSIZE),
        ("nofile", resource.RLIMIT_NOFILE),
    ):
        if limits.get(name):
            resource.setrlimit(value, (int(limits[name]), int(limits[name])))
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, strict=False)
    for cap in range(64):
        if _libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0 and ctypes.get_errno() == errno.EINVAL:
            break
    uid, gid = cfg.get("uid"), cfg.get("gid")
    if uid is not None and gid is not None:
        os.setgroups([])
        os.setresgid(gid, gid, gid)
        os.setresuid(uid, uid, uid)
    else:
        prctl(PR_SET_SECUREBITS, SECURE_BITS)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    os.chdir(cfg["cwd"])
    warm = cfg.get("warm_fd")
    if warm is not None:
        os.set_inheritable(warm, True)
    os.execvpe(cfg["argv"][0], cfg["argv"], cfg["env"])


def report(status_fd: int, kind: str, *fields: object) -> None:
    """One line on the status pipe: ``kind`` and its fields, tab-separated."""
    text = "\t".join([kind, *(str(f).replace("\t", " ").replace("\n", " ") for f in fields)])
    try:  # noqa: SIM105 - contextlib costs an import
        os.write(status_fd, text.encode() + b"\n")
    except OSError:
        pass


def main() -> None:
    with os.fdopen(int(sys.argv[1]), "rb") as f:
        cfg = marshal.loads(f.read())
    status_fd = cfg["status_fd"]
    os.set_inheritable(status_fd, False)
    stage = "work directory"
    try:
        work_fd = os.open(cfg["work"], os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        code_fd = None
        if cfg.get("code"):
            stage = "code directory"
            code_fd = os.open(cfg["code"], os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW)
        stage = "mounts"
        hide(cfg, work_fd, code_fd)
        if cfg.get("net") == "none":
            stage = "loopback"
            loopback_up()
    except Exception as e:
        report(status_fd, "error", stage, getattr(e, "errno", 0) or 0, e)
        os._exit(1)

    def forward(sig: int, _frame: FrameType | None) -> None:
        try:  # noqa: SIM105 - contextlib costs an import
            os.kill(-1, sig)  # from pid 1: every other process of the namespace
        except OSError:
            pass

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)
    err_r, err_w = os.pipe2(os.O_CLOEXEC)
    pid = os.fork()
    if pid == 0:
        try:
            os.close(err_r)
            child(cfg)
        except BaseException as e:
            code = e.errno if isinstance(e, OSError) and e.errno else 0
            text = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            try:
                os.write(err_w, f"{code}\t{text}".encode())
            finally:
                os._exit(127)
    os.close(err_w)
    failed = b""
    while True:
        try:
            chunk = os.read(err_r, 65536)
        except InterruptedError:
            continue
        if not chunk:
            break
        failed += chunk
    os.close(err_r)
    if failed:
        number, _, text = failed.decode(errors="replace").partition("\t")
        report(status_fd, "error", "exec", number if number.isdigit() else 0, text[:500])
        os._exit(1)
    report(status_fd, "started")
    while True:
        try:
            got, st, usage = os.wait4(-1, 0)
        except ChildProcessError:
            report(status_fd, "error", "wait", 0, "the program was not found among the children")
            os._exit(1)
        if got != pid:
            continue  # an orphan of the program, reaped
        # The kernel's peak resident memory of the program (KiB; the largest of it and the
        # descendants it waited for): a program too short for the executor's sampler still has one.
        if os.WIFSIGNALED(st):
            report(status_fd, "signal", os.WTERMSIG(st), usage.ru_maxrss)
        else:
            report(status_fd, "exit", os.WEXITSTATUS(st), usage.ru_maxrss)
        os._exit(0)  # the namespace goes with it: nothing the program started outlives it


if __name__ == "__main__":
    main()
