"""Large states outside NATS: a shared filesystem path, or any URL ``fsspec`` opens.

A checkpoint blob larger than the executor's ``state_url_min_mib`` goes to ``state_url`` (when
set) instead of the JetStream object store; the reference that travels on NATS names it the same
way (``BlobRef``: ``bucket`` is the URL, ``name`` the object under it, with size and SHA-256), so
readers tell the two apart by the bucket. A path or ``file://`` URL needs nothing more: every node
must see the same directory (NFS, a shared volume). Other schemes (``s3://``, ``gs://``) go through
``fsspec`` when it is installed.

Writes go to a temporary name first and are renamed into place, so a reader never sees half a state.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any


def is_external(bucket: str) -> bool:
    """Whether a reference's bucket is a storage URL rather than the JetStream object store."""
    return "/" in bucket or ":" in bucket


def _local(url: str) -> Path | None:
    if url.startswith("file://"):
        return Path(url[len("file://") :])
    if "://" not in url:
        return Path(url)
    return None


def _fs(url: str) -> tuple[Any, str]:
    try:
        import fsspec
    except ImportError:
        scheme = url.split(":")[0]
        raise RuntimeError(
            f"state URL {url!r} needs fsspec (pip install fsspec and its {scheme} driver)"
        ) from None
    fs, root = fsspec.core.url_to_fs(url)
    return fs, root


def put(url: str, name: str, data: bytes) -> None:
    local = _local(url)
    if local is not None:
        target = local / name
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{uuid.uuid4().hex}.tmp")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        return
    fs, root = _fs(url)
    path = f"{root.rstrip('/')}/{name}"
    partial = f"{path}.{uuid.uuid4().hex}.tmp"
    with fs.open(partial, "wb") as f:
        f.write(data)
    fs.mv(partial, path)


def get(url: str, name: str) -> bytes:
    local = _local(url)
    if local is not None:
        return (local / name).read_bytes()
    fs, root = _fs(url)
    with fs.open(f"{root.rstrip('/')}/{name}", "rb") as f:
        return bytes(f.read())


__all__ = ["get", "is_external", "put"]
