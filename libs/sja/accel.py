"""The decision core (``sja.core``) compiled to C with mypyc, used when it has been built.

``sja.core`` is pure, typed Python and stays the reference. ``make`` compiles it once into
``build/core`` (``python -m sja.accel build``; about a minute): every decision then runs about
twice as fast, with the same numbers, since it is the same code. The compiled
modules are used only when the build matches its sources exactly (a digest written with the build): after
an edit the pure modules are used, with a warning in the log, until the next build. Where no C
compiler is found the build is skipped and everything runs as pure Python.

Importing ``sja.core`` loads nothing: a process that wants the compiled modules calls
``use_compiled_core()`` where it starts, before it imports a decision module (the ``sja`` command
does, for every service, the simulator and the demo; so do the benchmarks and the test session).

Environment: ``SJA_PURE_PYTHON=1`` ignores a build; ``SJA_COMPILED_CORE_DIR`` builds to and loads
from another directory.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

LIBS = Path(__file__).resolve().parent.parent
CORE = LIBS / "sja" / "core"
DEFAULT_DIR = LIBS.parent / "build" / "core"
STAMP = "SOURCES"
"""The file, in the build directory, holding the digest of the sources it was built from."""


def core_sources() -> list[Path]:
    """The modules compiled: all of ``sja.core`` and its subpackages (``sja.core.policies``) but
    ``sja.core``'s own ``__init__`` (which loads them). A subpackage's ``__init__`` is compiled with
    it: its compiled modules are then found through the compiled package."""
    return sorted(p for p in CORE.rglob("*.py") if p != CORE / "__init__.py")


def digest(paths: list[Path]) -> str:
    h = hashlib.sha256(f"{sys.implementation.cache_tag}\n".encode())
    for p in paths:
        # by the path within sja.core: two subpackages' modules of one name are told apart
        name = p.relative_to(CORE).as_posix() if p.is_relative_to(CORE) else p.name
        h.update(name.encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()


def build_dir() -> Path:
    return Path(os.environ.get("SJA_COMPILED_CORE_DIR") or DEFAULT_DIR)


def state() -> str:
    """``"compiled"`` (the build matches the sources), ``"stale"``, ``"absent"`` or ``"disabled"``."""
    if os.environ.get("SJA_PURE_PYTHON", "") not in ("", "0"):
        return "disabled"
    stamp = build_dir() / STAMP
    if not stamp.is_file():
        return "absent"
    return "compiled" if stamp.read_text().strip() == digest(core_sources()) else "stale"


_used: bool | None = None


def use_compiled_core() -> bool:
    """Use the compiled decision core in this process when it is built and current; whether it is.

    Call it where the process starts, before any ``sja.core`` module is imported: a module
    imported already stays the pure one (said in the log). Later calls answer as the first."""
    global _used
    if _used is not None:
        return _used
    import sja.core

    early = sorted(name for name in sys.modules if name.startswith("sja.core."))
    if early:
        log.warning(
            "the compiled decision core was asked for after %s was imported: those modules stay pure Python",
            ", ".join(early),
        )
    _used = enable(sja.core.__path__)
    return _used


def enable(package_path: list[str]) -> bool:
    """Put the compiled modules ahead of the pure ones on ``sja.core``'s path, if they match its
    sources (``use_compiled_core`` calls it with ``sja.core``'s path)."""
    how = state()
    if how == "stale":
        log.warning(
            "the compiled decision core in %s was built from other sources: using the pure Python one "
            "(run `make core`, or `python -m sja.accel build`)",
            build_dir(),
        )
    if how != "compiled":
        return False
    root = build_dir()
    # The modules share one library, a top-level module named by a hash of the group.
    if str(root) not in sys.path:
        sys.path.append(str(root))
    package_path.insert(0, str(root / "sja" / "core"))
    return True


def is_compiled() -> bool:
    """Whether ``sja.core``'s modules in use are the compiled ones."""
    import sja.core.profiles

    return not (sja.core.profiles.__file__ or "").endswith(".py")


def build(out: Path | None = None) -> Path:
    """Compile ``sja.core`` into ``out`` (default ``build_dir()``), replacing what was there."""
    from mypyc.build import mypycify
    from setuptools import setup  # type: ignore[import-untyped,unused-ignore]

    out = out or build_dir()
    sources = core_sources()
    stamp = digest(sources)
    with tempfile.TemporaryDirectory(prefix="sja-mypyc-") as tmp:
        staged = Path(tmp) / "lib"
        cwd = os.getcwd()
        os.chdir(LIBS)  # module names come from the paths relative to here
        try:
            modules = mypycify(
                # mypy's cache goes with the rest of the build's scratch, not next to the sources
                ["--cache-dir", f"{tmp}/mypy", *(str(p.relative_to(LIBS)) for p in sources)],
                opt_level="3",
                target_dir=str(Path(tmp) / "c"),
            )
            setup(
                name="sja-core-compiled",
                ext_modules=modules,
                script_args=["-q", "build_ext", "--build-lib", str(staged), "--build-temp", f"{tmp}/o"],
            )
        finally:
            os.chdir(cwd)
        if out.exists():
            shutil.rmtree(out)
        shutil.copytree(staged, out)
    (out / STAMP).write_text(stamp + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sja.accel", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="compile sja.core with mypyc")
    b.add_argument("--out", type=Path, default=None, help=f"directory (default {build_dir()})")
    b.add_argument(
        "--if-possible",
        action="store_true",
        help="where it cannot be built (no C compiler), say so and exit 0: the pure modules are used",
    )
    sub.add_parser("status", help="whether the compiled core is built and current")
    args = parser.parse_args(argv)
    if args.command == "status":
        print(f"{state()} ({build_dir()})")
        return 0
    try:
        out = build(args.out)
    except (Exception, SystemExit) as e:
        if not args.if_possible:
            raise
        print(f"sja.accel: the decision core was not compiled ({e!r}): it runs as Python", file=sys.stderr)
        return 0
    print(f"sja.accel: decision core compiled into {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
