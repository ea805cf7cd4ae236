"""A job's code as it travels: a directory packed into a zip archive, checked, unpacked on each node.

``sja submit --code DIR`` (or ``code: DIR`` in a ``command`` spec) packs ``DIR`` with ``pack``: its
regular files and directories, sorted, with fixed timestamps and modes (0644, or 0755 for a file its
owner may execute), so the same files always give the same bytes and the same SHA-256. The archive
goes to the gateway in chunks (``sja.v1.job.code``: tenants reach no object store and no Ray), which
checks it (``check``) and keeps it in the JetStream object store ``sja-code`` as ``<tenant>/<digest>``;
the spec carries ``sha256:<digest>`` (``params.code``). The executor hands it to the Ray cluster as a
``working_dir`` package of Ray's ``runtime_env`` (``sja.execution.code``), and each node's slice actor
unpacks it once, read-only for every subjob that runs it.

The archive format is Ray's: a zip whose members lie at its top level (what ``working_dir`` unpacks).
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import zipfile
from pathlib import Path

BUCKET = "sja-code"
"""The object store holding uploaded code (``<tenant>/<digest>``; parts of an upload under ``parts/``)."""

REF_PREFIX = "sha256:"

EXCLUDED_DIRS = frozenset(
    {
        ".git",
        ".hg",
        ".svn",
        "__pycache__",
        ".mypy_cache",
        ".pytest_cache",
        ".ruff_cache",
        ".tox",
        ".venv",
        "venv",
        "node_modules",
    }
)
"""Directories never packed (version control, caches, virtual environments)."""
EXCLUDED_SUFFIXES = (".pyc", ".pyo")

ZIP_TIME = (1980, 1, 1, 0, 0, 0)
MAX_FILES = 50_000
"""Entries an archive may hold."""

SPECIAL_BITS = stat.S_ISUID | stat.S_ISGID | stat.S_ISVTX


class CodeError(ValueError):
    """A directory that cannot be packed, or an archive that is not acceptable code (the message says
    why)."""


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ref(hexdigest: str) -> str:
    """The reference a spec carries (``params.code``)."""
    return REF_PREFIX + hexdigest


def digest_of_ref(value: str) -> str:
    return value[len(REF_PREFIX) :] if value.startswith(REF_PREFIX) else ""


def object_name(tenant: str, hexdigest: str) -> str:
    """Where the gateway keeps a tenant's code in ``sja-code``."""
    return f"{tenant}/{hexdigest}"


def part_name(tenant: str, hexdigest: str, offset: int) -> str:
    """Where a chunk of an upload in progress is kept until the upload is committed."""
    return f"parts/{tenant}/{hexdigest}/{offset:012d}"


def parts_prefix(tenant: str, hexdigest: str) -> str:
    return f"parts/{tenant}/{hexdigest}/"


def _files(directory: Path) -> list[tuple[str, Path | None]]:
    """``(name in the archive, file)`` in name order; a directory's file is ``None``."""
    out: list[tuple[str, Path | None]] = []
    for root, dirs, files in os.walk(directory, followlinks=False):
        base = Path(root)
        rel = base.relative_to(directory)
        kept = []
        for d in sorted(dirs):
            p = base / d
            if d in EXCLUDED_DIRS:
                continue
            if p.is_symlink():
                raise CodeError(
                    f"{p} is a symbolic link to a directory: code is packed from regular files and "
                    "directories (copy it in, or name the directory it points to)"
                )
            kept.append(d)
            out.append(((rel / d).as_posix() + "/", None))
        dirs[:] = kept
        for f in sorted(files):
            p = base / f
            if f.endswith(EXCLUDED_SUFFIXES):
                continue
            if not p.is_file():  # a socket, a FIFO, a device, a dangling link: not code
                if p.is_symlink():
                    raise CodeError(f"{p} is a symbolic link to nothing")
                continue
            out.append(((rel / f).as_posix(), p))
    out.sort(key=lambda e: e[0])
    return out


def pack(directory: Path, max_bytes: int) -> bytes:
    """``directory`` as a deterministic zip archive (links to files are packed as the file they point
    to). Raises ``CodeError`` when it is not a directory, holds a link to a directory, or packs to more
    than ``max_bytes``."""
    if not directory.is_dir():
        raise CodeError(f"{directory} is not a directory")
    entries = _files(directory)
    if len(entries) > MAX_FILES:
        raise CodeError(f"{directory} holds {len(entries):,} files and directories, more than {MAX_FILES:,}")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as z:
        for name, path in entries:
            info = zipfile.ZipInfo(name, date_time=ZIP_TIME)
            if path is None:
                info.external_attr = (stat.S_IFDIR | 0o755) << 16
                z.writestr(info, b"")
                continue
            try:
                executable = bool(path.stat().st_mode & stat.S_IXUSR)
                data = path.read_bytes()
            except OSError as e:
                raise CodeError(f"{path} cannot be read ({e.strerror or e})") from None
            info.external_attr = (stat.S_IFREG | (0o755 if executable else 0o644)) << 16
            info.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info, data)
            if buf.tell() > max_bytes:
                raise CodeError(
                    f"{directory} packs to more than {max_bytes / 2**20:.0f} MiB (the gateway's "
                    "SJA_CODE_MAX_MIB): leave data out of the code directory and read it from storage"
                )
    data = buf.getvalue()
    if len(data) > max_bytes:
        raise CodeError(
            f"{directory} packs to {len(data) / 2**20:.1f} MiB, more than {max_bytes / 2**20:.0f} MiB"
        )
    return data


def _bad_name(name: str) -> bool:
    if not name or "\\" in name or "\0" in name or name.startswith("/"):
        return True
    parts = name.rstrip("/").split("/")
    return any(p in ("", ".", "..") for p in parts)


def check(data: bytes, max_unpacked: int, max_files: int = MAX_FILES) -> int:
    """Refuse (``CodeError``) an archive that is not acceptable code: not a zip; a member whose name
    is absolute or leads outside (``..``), a link, a device or any other file that is not regular, a
    set-uid, set-gid or sticky bit; more than ``max_files`` members, or more than ``max_unpacked``
    bytes once unpacked (counted by unpacking, not from what the archive claims). Returns the
    unpacked size."""
    try:
        z = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, ValueError, OSError) as e:
        raise CodeError(f"not a zip archive ({e})") from None
    with z:
        infos = z.infolist()
        if len(infos) > max_files:
            raise CodeError(f"{len(infos):,} members, more than {max_files:,}")
        seen: set[str] = set()
        total = 0
        for info in infos:
            name = info.filename
            if _bad_name(name):
                raise CodeError(f"member {name[:200]!r}: a name must be relative and stay inside the archive")
            if name.rstrip("/") in seen:
                raise CodeError(f"member {name[:200]!r} appears twice")
            seen.add(name.rstrip("/"))
            mode = info.external_attr >> 16
            kind = stat.S_IFMT(mode)
            if kind not in (0, stat.S_IFREG, stat.S_IFDIR):
                raise CodeError(f"member {name[:200]!r} is not a regular file or directory")
            if mode & SPECIAL_BITS:
                raise CodeError(f"member {name[:200]!r} has a set-uid, set-gid or sticky bit")
            if info.is_dir():
                continue
            try:
                with z.open(info) as f:
                    while chunk := f.read(1 << 20):
                        total += len(chunk)
                        if total > max_unpacked:
                            raise CodeError(f"unpacks to more than {max_unpacked / 2**20:.0f} MiB")
            except (zipfile.BadZipFile, NotImplementedError, OSError, EOFError, ValueError) as e:
                raise CodeError(f"member {name[:200]!r} cannot be unpacked ({e})") from None
    return total


def normalize(tree: Path) -> None:
    """Make an unpacked tree what every subjob may read and none may change: directories 0755, files
    0644 (0755 where the owner may execute), no special bits; anything else (a link, a FIFO) removed.
    Nothing is followed."""
    for _, dirs, files, rootfd in os.fwalk(tree, follow_symlinks=False):
        for name in [*dirs, *files]:
            st = os.stat(name, dir_fd=rootfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                os.chmod(name, 0o755, dir_fd=rootfd)
            elif stat.S_ISREG(st.st_mode):
                os.chmod(name, 0o755 if st.st_mode & stat.S_IXUSR else 0o644, dir_fd=rootfd)
            else:
                os.unlink(name, dir_fd=rootfd)
        dirs[:] = [d for d in dirs if stat.S_ISDIR(os.stat(d, dir_fd=rootfd, follow_symlinks=False).st_mode)]
    os.chmod(tree, 0o755)


__all__ = [
    "BUCKET",
    "MAX_FILES",
    "REF_PREFIX",
    "CodeError",
    "check",
    "digest",
    "digest_of_ref",
    "normalize",
    "object_name",
    "pack",
    "part_name",
    "parts_prefix",
    "ref",
]
