"""A state directory as a tar archive, and back, safely on every Python ``requires-python`` admits.

Standard library only (``tests/unit/workloads/test_statetar.py`` runs it under the oldest Python at
hand, which has none of SJA's dependencies).

Extraction takes what the archive's producer (a tenant's program, through the executor) wrote, so it
must not write outside the directory. Python 3.11.4 and later (and the 3.8-3.10 security releases)
have ``tarfile``'s ``data`` filter for that; 3.11.0-3.11.3 do not, and there ``extract`` checks every
member itself, as the ``data`` filter would: it takes the leading ``/`` off an absolute name (it lands
inside), refuses a name or a link that leads out of the directory (``..``, an absolute link, or a
path through a link extracted before), a device, a FIFO or any other special file, and extracts
files without set-uid, set-gid or sticky bits, without write permission for group and others, owned
by the extracting user.
"""

from __future__ import annotations

import copy
import io
import os
import stat
import tarfile
from pathlib import Path
from typing import Any

HAS_DATA_FILTER = hasattr(tarfile, "data_filter")
"""Whether this Python's ``tarfile`` has the ``data`` extraction filter (3.11.4 and later)."""


_TRUSTED: dict[str, Any] = {"filter": "fully_trusted"} if HAS_DATA_FILTER else {}
"""Where filters exist, a member checked here is extracted as it is, without a warning."""


class UnsafeArchive(ValueError):
    """A member of the archive would be written outside the directory, or is not a plain file,
    directory or link inside it."""


def pack(directory: Path) -> bytes:
    """Every file, directory and link under ``directory`` (not following links), by relative name."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for path in sorted(directory.rglob("*")):
            tar.add(path, arcname=str(path.relative_to(directory)), recursive=False)
    return buf.getvalue()


def extract(data: bytes, directory: Path, *, data_filter: bool | None = None) -> None:
    """Extract the archive ``data`` into ``directory``; ``UnsafeArchive`` (a ``ValueError``) for a
    member that must not be extracted, ``tarfile.TarError`` for what is no archive. ``data_filter``
    chooses the mechanism (default: the ``data`` filter where this Python has it, else the checks
    of ``safe_members``); both refuse the same archives."""
    use_filter = HAS_DATA_FILTER if data_filter is None else data_filter
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        if use_filter:
            try:
                tar.extractall(directory, filter="data")
            except tarfile.FilterError as e:
                raise UnsafeArchive(str(e)) from None
            return
        root = os.path.realpath(directory)
        for member in tar:
            checked = safe_member(member, root)
            # Checked against what is on disk now: a link extracted before is followed.
            tar.extract(checked, root, set_attrs=not checked.isdir(), numeric_owner=True, **_TRUSTED)


def _inside(root: str, path: str) -> bool:
    return os.path.commonpath([root, path]) == root


def safe_member(member: tarfile.TarInfo, root: str) -> tarfile.TarInfo:
    """``member`` as the ``data`` filter would extract it into ``root`` (a real path), or
    ``UnsafeArchive`` naming it and why."""
    name = member.name.lstrip("/" + os.sep)
    target = os.path.realpath(os.path.join(root, name))
    if not _inside(root, target):
        raise UnsafeArchive(f"{name!r} would be extracted outside the directory")
    mode: int | None = member.mode
    if member.issym():  # its own mode is never applied (the link's target keeps its own)
        link = member.linkname
        if os.path.isabs(link):
            raise UnsafeArchive(f"{name!r} links to the absolute path {link!r}")
        if not _inside(root, os.path.realpath(os.path.join(root, os.path.dirname(name), link))):
            raise UnsafeArchive(f"{name!r} links outside the directory")
        mode = None
    elif member.islnk():
        if os.path.isabs(member.linkname):
            raise UnsafeArchive(f"{name!r} links to the absolute path {member.linkname!r}")
        if not _inside(root, os.path.realpath(os.path.join(root, member.linkname))):
            raise UnsafeArchive(f"{name!r} links outside the directory")
    elif not (member.isreg() or member.isdir()):
        raise UnsafeArchive(f"{name!r} is a special file (device, FIFO or other)")
    if mode is not None:
        # The data filter's modes: no set-uid, set-gid or sticky bit, no write for group and others;
        # files readable and writable by their owner, executable only if the owner could execute.
        mode &= 0o755
        if member.isreg() or member.islnk():
            mode |= stat.S_IRUSR | stat.S_IWUSR
            if not mode & stat.S_IXUSR:
                mode &= ~(stat.S_IXGRP | stat.S_IXOTH)
        else:
            mode |= stat.S_IRWXU
    safe = copy.copy(member)  # (``TarInfo.replace`` came with the filters)
    safe.name = name
    if mode is not None:
        safe.mode = mode
    safe.uid, safe.gid, safe.uname, safe.gname = os.geteuid(), os.getegid(), "", ""
    return safe


__all__ = ["HAS_DATA_FILTER", "UnsafeArchive", "extract", "pack", "safe_member"]
