"""What the CLI prints, without a server: ``sja status`` and ``sja jobs`` from hand-made states at
a narrow terminal, and ``sja up``'s lines with ``sja`` written as the user can run it."""

from __future__ import annotations

import io
import os
from pathlib import Path

import msgspec
from rich.console import Console

from sja.cli.main import sja_command, up_banner
from sja.cli.render import render_jobs, render_status
from sja.core.jobs import new_job
from sja.protocol.messages import InFlight, JobSpec, JobState, SubjobSummary

NOW = 10_000.0


def state(
    name: str, status: str, workload: str = "montecarlo", tenant: str = "research-team-alpha"
) -> JobState:
    spec = JobSpec(name=name, tenant=tenant, workload="montecarlo", params={"units": 2000})
    s = new_job(f"{name}-0123456789ab", spec, NOW - 100)
    return msgspec.structs.replace(
        s,
        spec=msgspec.structs.replace(s.spec, workload=workload),
        status=status,
        units_done=1234,
        next_seq=99,
    )


def shown(renderable: object, width: int) -> str:
    console = Console(width=width, file=io.StringIO(), color_system=None)
    console.print(renderable)
    out = console.file.getvalue()  # type: ignore[attr-defined]
    assert isinstance(out, str)
    return out


def test_jobs_never_cut_an_id_or_a_status() -> None:
    """At 80 columns the table squeezed every column to ``runn…``; now the id and the status stay
    whole at any width, the other columns giving way."""
    states = [
        state("nu-pytorch-mlp-training-run", "running", workload="sja_example_primes:Primes"),
        state("x", "cancelled", tenant="b"),
    ]
    for width in (200, 80, 60, 40):
        for wide in (False, True):
            out = shown(render_jobs(states, NOW, wide=wide, width=width), width)
            assert "…" not in out, out
            words = out.split()
            for s in states:
                assert s.job_id in words and s.status in words, (width, out)
    short = [state("a", "pending", tenant="t")]
    assert shown(render_jobs(short, NOW, width=120), 120).split()[:3] == ["job", "status", "units"]


def test_status_writes_unit_ranges_one_way() -> None:
    h = SubjobSummary(
        subjob_id="j.s0", slice_id="s", profile="1g.5gb", status="ok", unit_start=0, units=8,
        planned_mem_q_mib=1, peak_mem_mib=1, mem_cap_mib=1, planned_duration_q_s=1, duration_s=1,
        time_cap_s=1, started_at=NOW - 5, finished_at=NOW - 4,
    )  # fmt: skip
    f = InFlight(
        subjob_id="j.s1", grant_id="g", slice_id="s", unit_start=8, units=1, dispatched_at=NOW - 1,
        time_cap_s=5, profile="1g.5gb", compute_share=1.0, planned_mem_q_mib=1, planned_duration_q_s=1,
    )  # fmt: skip
    s = msgspec.structs.replace(state("j", "running"), history=[h], in_flight=[f])
    out = "".join(shown(part, 200) for part in render_status(s, NOW))
    assert "0-7 (8)" in out and "8 (1)" in out
    assert "0-8" not in out and "0..8" not in out and "0+8" not in out


def test_up_names_sja_as_it_can_be_run(tmp_path: Path) -> None:
    """``sja`` only when the ``sja`` on ``PATH`` is this one; else its path (``.venv/bin/sja``
    from the repository), never a bare ``sja`` that the shell would not find."""
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    for name in ("sja", "python"):
        (venv / name).write_text("#!/bin/sh\n")
        (venv / name).chmod(0o755)
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "sja").write_text("#!/bin/sh\n")
    (other / "sja").chmod(0o755)
    script, python = str(venv / "sja"), str(venv / "python")
    assert sja_command(script, python, path="/usr/bin", cwd=tmp_path) == ".venv/bin/sja"
    assert sja_command(script, python, path=f"{venv}{os.pathsep}/usr/bin", cwd=tmp_path) == "sja"
    # Another `sja` first on PATH: not this one.
    assert sja_command(script, python, path=f"{other}{os.pathsep}{venv}", cwd=tmp_path) == ".venv/bin/sja"
    # Outside the directory: the full path.
    assert sja_command(script, python, path="/usr/bin", cwd=other) == script
    # Run as `python -m sja.cli.main`: the venv's script beside the interpreter.
    assert sja_command("/x/libs/sja/cli/main.py", python, path="/usr/bin", cwd=tmp_path) == ".venv/bin/sja"
    # No script at all: the interpreter and the module.
    bare = tmp_path / "bare"
    bare.mkdir()
    assert sja_command("/x/main.py", str(bare / "python"), path="", cwd=tmp_path) == (
        f"{bare / 'python'} -m sja.cli.main"
    )


def test_up_prints_every_command_whole_at_any_width() -> None:
    lines = up_banner(
        ".venv/bin/sja",
        nats_url="nats://127.0.0.1:4222",
        store="temporary store",
        logs="out/stack/logs",
        operator_file="/root/.config/sja/credentials.json",
        tenant_files="out/stack/credentials/tenant-<name>.json",
        dashboard="http://127.0.0.1:8080/?token=o." + "0" * 64,
        secret_file="/work/out/stack/dashboard.secret",
    )
    commands = [line for line in lines if ".venv/bin/sja " in line]
    assert any("submit examples/jobs/matmul.yaml" in c for c in commands)
    assert any("dashboard-token --tenant NAME" in c for c in commands)
    assert not any(" sja " in f" {line} " for line in lines), "a bare `sja`"
    console = Console(width=40, file=io.StringIO(), color_system=None)
    for line in lines:
        console.print(line, soft_wrap=True, highlight=False, markup=False)
    printed = console.file.getvalue().splitlines()  # type: ignore[attr-defined]
    assert printed == lines
