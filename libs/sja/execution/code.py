"""A job's code on the nodes: a ``working_dir`` package of Ray's ``runtime_env``, unpacked once per node.

A ``command`` job may name code (``params.code``: ``sha256:<digest>``), a directory that ``sja
submit --code DIR`` packed and the gateway keeps in the object store ``sja-code``
(``sja.workloads.codepack``). It reaches the subjob's node through Ray:

- **the executor** (``to_ray``, in its own process: it holds the Ray cluster's credentials, which no
  tenant ever does) reads the tenant's archive from ``sja-code``, checks it against its digest, and
  puts it in the Ray cluster's GCS as a ``working_dir`` package (``gcs://_ray_pkg_sja_<digest>.zip``:
  Ray's package format and URI scheme, stored by Ray's own ``upload_package_to_gcs``), once per
  cluster;
- **the slice's actor** (``on_node``, on the slice's node) has Ray's own
  ``download_and_unpack_package`` fetch it from the GCS and unpack it, into a staging directory only
  its uid reaches; ``codepack.normalize`` makes the tree readable by every sandbox uid and writable by
  none, with no special bits; one rename puts it in the node's code cache
  (``<tmp>/sja-code-<uid>/<digest>``). Every later subjob of that code on the node finds it there;
- **the subjob's sandbox** binds that directory read-only at ``CODE_AT`` (``/tmp/sja-code``): the
  program's working directory and ``PYTHONPATH``, ``SJA_CODE_DIR``.

No Ray worker is ever started *in* the job's runtime_env: Ray puts a worker's ``working_dir`` on its
``PYTHONPATH`` and imports from it (``sitecustomize``, a module named like one Ray imports), so the
tenant's code would run in a process holding Ray's credentials, outside the sandbox. Only Ray's
package store and its unpacking are used; the program itself runs where every tenant program does.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from pathlib import Path

from sja.workloads import codepack
from sja.workloads.command import CODE_REF

CODE_AT = "/tmp/sja-code"
"""Where a subjob's sandbox shows the job's code (read-only)."""


def digest_of(params: dict[str, object]) -> str:
    """The digest of the code a ``command`` job's parameters name (``""``: none)."""
    ref = params.get("code", "")
    return codepack.digest_of_ref(ref) if isinstance(ref, str) and CODE_REF.match(ref) else ""


def ray_uri(digest: str) -> str:
    """The Ray ``working_dir`` package a job's code is kept as in the cluster's GCS."""
    return f"gcs://_ray_pkg_sja_{digest}.zip"


def in_ray(digest: str) -> bool:
    """Whether the Ray cluster holds the package of this code (executor side)."""
    from ray._private.runtime_env.packaging import package_exists

    return bool(package_exists(ray_uri(digest)))


def to_ray(archive: bytes, digest: str) -> str:
    """Put a job's code archive in the Ray cluster (unless it is there already): its package URI.
    Runs in the executor, a Ray driver (Ray initialized)."""
    from ray._private.runtime_env.packaging import package_exists, upload_package_to_gcs

    uri = ray_uri(digest)
    if not package_exists(uri):
        upload_package_to_gcs(uri, archive)
    return uri


def cache_root() -> Path:
    """The node's code cache of this uid (mode 0700: only the executor's uid reaches it; a subjob
    sees only its job's code, bound into its sandbox)."""
    root = Path(tempfile.gettempdir()) / f"sja-code-{os.geteuid()}"
    root.mkdir(mode=0o700, exist_ok=True)
    st = root.lstat()
    if root.is_symlink() or not root.is_dir() or st.st_uid != os.geteuid():
        raise OSError(f"{root} is not a directory of this user")
    os.chmod(root, 0o700)
    return root


def on_node(uri: str, digest: str) -> str:
    """The job's code unpacked on this node (from the Ray package ``uri``): its directory. Runs in
    the slice's actor (a Ray worker); the first subjob of the code on the node unpacks it."""
    root = cache_root()
    final = root / digest
    if final.is_dir() and not final.is_symlink():
        return str(final)
    import ray
    from ray._private.runtime_env.packaging import download_and_unpack_package

    gcs = ray._private.worker.global_worker.gcs_client  # type: ignore[attr-defined]
    staging = Path(tempfile.mkdtemp(prefix=".unpack-", dir=root))
    try:
        got = Path(asyncio.run(download_and_unpack_package(uri, str(staging), gcs_client=gcs)))
        if got.is_symlink() or not got.is_dir() or staging not in got.parents:
            raise OSError(f"the package {uri} did not unpack to a directory")
        # Ray sets the modes the archive states: made safe here, where only this uid reaches.
        codepack.normalize(got)
        try:
            os.rename(got, final)
        except OSError:
            if not final.is_dir():  # not another actor of the node that put it there first
                raise
        return str(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


__all__ = ["CODE_AT", "cache_root", "digest_of", "in_ray", "on_node", "ray_uri", "to_ray"]
