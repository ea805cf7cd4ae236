"""The test tree mirrors the code, and the tests that need no NATS client run without one.

Each unit and integration test module sits in a directory named after the package of
``libs/sja`` or the service of ``services/`` it tests (``stack/`` and ``deployment/`` for what spans
several services), and one deeper only in a directory named after the subpackage it tests
(``core/policies/``). ``tests/unit`` is collected in a Python where ``import nats`` fails as it does
where nats-py is not installed: every module not listed in ``tests/unit/conftest.py`` must collect,
and the core's own tests must pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
PACKAGES = {p.name for p in (ROOT / "libs" / "sja").iterdir() if (p / "__init__.py").is_file()}
SERVICES = {p.name for p in (ROOT / "services").iterdir() if (p / "__init__.py").is_file()}
ACROSS = {"stack", "deployment"}


WHOLE_TREE = {"test_layout.py", "test_import_direction.py"}
"""The modules of ``tests/unit`` that check the whole tree (its layout, its imports): the exceptions."""


def _is_subpackage(dirs: tuple[str, ...]) -> bool:
    """Whether ``dirs`` (a package or service, then directories below it) names a subpackage of
    ``libs/sja`` or ``services``."""
    return any(
        (base.joinpath(*dirs) / "__init__.py").is_file()
        for base in (ROOT / "libs" / "sja", ROOT / "services")
    )


def _misplaced(kind: str) -> list[str]:
    """Test modules of ``tests/<kind>`` not in a directory named after a package or service, or in a
    subdirectory of it not named after one of its subpackages (those of ``tests/unit`` that check
    the whole tree are the exceptions)."""
    allowed = PACKAGES | SERVICES | ACROSS
    out = []
    for p in (TESTS / kind).rglob("test_*.py"):
        if kind == "unit" and p.parent == TESTS / kind and p.name in WHOLE_TREE:
            continue
        dirs = p.relative_to(TESTS / kind).parts[:-1]
        if not dirs or dirs[0] not in allowed or (len(dirs) > 1 and not _is_subpackage(dirs)):
            out.append(str(p.relative_to(TESTS)))
    return sorted(out)


def test_every_unit_and_integration_test_sits_under_the_code_it_tests() -> None:
    assert "core" in PACKAGES and "agent" in SERVICES
    assert _misplaced("unit") == []
    assert _misplaced("integration") == []


def test_the_unit_tests_run_without_the_nats_client(tmp_path: Path) -> None:
    blocker = tmp_path / "nats"
    blocker.mkdir()
    (blocker / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'nats'\", name='nats')\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
         str(TESTS / "unit")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert collected.returncode == 0, collected.stdout[-3000:] + collected.stderr[-3000:]
    assert "tests collected" in collected.stdout
    assert "test_policy_modules.py" in collected.stdout and "test_grant_conflicts" not in collected.stdout
    ran = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
         str(TESTS / "unit" / "core" / "test_jobs.py"), str(TESTS / "unit" / "core" / "test_planner.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert ran.returncode == 0, ran.stdout[-3000:] + ran.stderr[-3000:]
    assert " passed" in ran.stdout and "failed" not in ran.stdout
