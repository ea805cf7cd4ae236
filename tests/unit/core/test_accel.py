"""The compiled decision core (``sja.accel``): used only when it matches its sources, and deciding
exactly as the pure Python core does."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sja import accel
from sja.core.policies import POLICIES

# One simulated run per policy on a small cluster: every decision of the core (windows, proposals,
# materialization, calibration from completions and OOMs, clearing, re-cutting idle GPUs) is made,
# and each job's whole history comes out.
SCRIPT = """
import hashlib, json, sys
import msgspec
from sja import accel
accel.use_compiled_core()
from sja.protocol.messages import JobState
from sja.sim.cluster import parse_cluster
from sja.sim.engine import SjaEngine
from sja.sim.model import SimConfig, TraceJob

jobs = [
    TraceJob(
        job_id=f"job{i}",
        submit_s=90.0 * i,
        duration_s=500.0 + 350.0 * (i % 5),
        num_gpus=1 + (i % 4 == 3),
        mem_mib=6000.0 + 1500.0 * (i % 3),
        # some jobs declare less memory than they use: OOMs, censored observations, re-planning
        true_mem_mib=(6000.0 + 1500.0 * (i % 3)) * (1.4 if i % 5 == 2 else 0.7),
        tenant=f"t{i % 3}",
    )
    for i in range(14)
] + [
    # declares 10 GB, peaks at 30 GB: out of memory on a 20 GB slice, re-planned onto 40 GB; and
    # one that peaks at 45 GB: out of memory on 20 and 40 GB slices, re-planned onto the H100
    TraceJob(
        job_id="liar", submit_s=0.0, duration_s=1800.0, num_gpus=1, mem_mib=10000.0, true_mem_mib=30000.0
    ),
    TraceJob(
        job_id="big-liar", submit_s=0.0, duration_s=900.0, num_gpus=1, mem_mib=10000.0, true_mem_mib=45000.0
    ),
]
out = {"compiled": accel.is_compiled(), "runs": {}}
for policy in sys.argv[1:]:
    cfg = SimConfig(horizon_s=3600.0, unit_s=60.0, eps_mem=0.2, policy=policy, seed=3)
    cluster = parse_cluster("1xA100-80GB:2g.20gb+2g.20gb+2g.20gb,1xA100-80GB:4g.40gb+3g.40gb,1xH100-80GB")
    engine = SjaEngine(cluster, jobs, cfg)
    engine.run()
    # by value: a float field the pure core left holding an int (19712) holds 19712.0 compiled
    states = [
        msgspec.msgpack.encode(msgspec.convert(msgspec.to_builtins(engine.jobs[k].state), JobState))
        for k in sorted(engine.jobs)
    ]
    out["runs"][policy] = {
        "digest": hashlib.sha256(b"".join(states)).hexdigest(),
        "done": sum(engine.jobs[k].state.status == "done" for k in engine.jobs),
        "subjobs": sum(len(engine.jobs[k].state.history) for k in engine.jobs),
        "ooms": sum(h.status == "oom" for k in engine.jobs for h in engine.jobs[k].state.history),
    }
print(json.dumps(out))
"""


def _run(env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, *sorted(POLICIES)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


@pytest.mark.skipif(accel.state() != "compiled", reason="the compiled core is not built (make core)")
def test_compiled_core_decides_exactly_as_the_pure_one() -> None:
    compiled = _run({})
    pure = _run({"SJA_PURE_PYTHON": "1"})
    assert compiled["compiled"] is True and pure["compiled"] is False
    assert compiled["runs"] == pure["runs"]
    runs = compiled["runs"]
    assert isinstance(runs, dict) and set(runs) == set(POLICIES)
    assert all(r["done"] == 16 and r["subjobs"] > 15 and r["ooms"] >= 1 for r in runs.values())


def test_ci_uses_the_compiled_core() -> None:
    """`make test` builds it first; where it cannot be built, CI should say so, not run slower."""
    if not os.environ.get("CI"):
        pytest.skip("only CI requires the compiled core")
    assert accel.state() == "compiled"
    assert accel.is_compiled()


def _fake_build(tmp_path: Path, stamp: str) -> Path:
    (tmp_path / "sja" / "core").mkdir(parents=True)
    (tmp_path / accel.STAMP).write_text(stamp)
    return tmp_path


def test_a_build_of_other_sources_is_not_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.delenv("SJA_PURE_PYTHON", raising=False)
    monkeypatch.setenv("SJA_COMPILED_CORE_DIR", str(_fake_build(tmp_path, "0" * 64)))
    assert accel.state() == "stale"
    path = ["/the/package"]
    with caplog.at_level(logging.WARNING, logger="sja.accel"):
        assert accel.enable(path) is False
    assert path == ["/the/package"]
    assert "built from other sources" in caplog.text


def test_a_matching_build_goes_first_unless_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = _fake_build(tmp_path, accel.digest(accel.core_sources()))
    monkeypatch.setenv("SJA_COMPILED_CORE_DIR", str(root))
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setenv("SJA_PURE_PYTHON", "1")
    path = ["/the/package"]
    assert accel.state() == "disabled" and accel.enable(path) is False and path == ["/the/package"]
    monkeypatch.delenv("SJA_PURE_PYTHON")
    assert accel.state() == "compiled" and accel.enable(path) is True
    assert path == [str(root / "sja" / "core"), "/the/package"]
    assert str(root) in sys.path


def test_no_build_is_pure_python(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SJA_PURE_PYTHON", raising=False)
    monkeypatch.setenv("SJA_COMPILED_CORE_DIR", str(tmp_path / "nothing"))
    path: list[str] = []
    assert accel.state() == "absent" and accel.enable(path) is False and path == []


def test_a_changed_source_changes_the_digest(tmp_path: Path) -> None:
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 2\n")
    before = accel.digest([a, b])
    b.write_text("y = 3\n")
    assert accel.digest([a, b]) != before
    assert accel.digest([a]) != accel.digest([b])


def test_the_core_s_subpackages_are_compiled_with_it() -> None:
    """``sja.core.policies`` (a package of one module per policy) is compiled like the rest; the
    digest tells apart modules of one name in different packages."""
    names = {p.relative_to(accel.CORE).as_posix() for p in accel.core_sources()}
    assert {"policies/__init__.py", "policies/base.py", "policies/fair.py", "planner.py"} <= names
    assert "__init__.py" not in names


def _python(code: str, **env: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip() + "\n" + done.stderr


def test_importing_the_core_loads_nothing() -> None:
    """``import sja.core`` has no side effect: no compiled module, not even ``sja.accel``."""
    out = _python(
        "import sys, sja.core, sja.core.jobs, sja.core.policies\n"
        "print('accel' if 'sja.accel' in sys.modules else 'none', sja.core.jobs.__file__.endswith('.py'))"
    )
    assert out.splitlines()[0] == "none True"


@pytest.mark.skipif(accel.state() != "compiled", reason="the compiled core is not built (make core)")
def test_the_compiled_core_is_used_where_the_process_asks_first() -> None:
    out = _python("from sja import accel; print(accel.use_compiled_core(), accel.is_compiled())")
    assert out.splitlines()[0] == "True True"
    # Asked for too late: the module imported before stays pure, and the log says so.
    late = _python(
        "import logging; logging.basicConfig()\n"
        "import sja.core.profiles\n"
        "from sja import accel; accel.use_compiled_core(); print(sja.core.profiles.__file__.endswith('.py'))"
    )
    assert late.splitlines()[0] == "True" and "stay pure Python" in late
    # The command line asks for it first.
    cli = _python("import sja.cli.main\nfrom sja import accel; print(accel.is_compiled())")
    assert cli.splitlines()[0] == "True"
