"""What the real CLI prints, as a subprocess against a real gateway on a real nats-server: a reader
that goes away (``sja jobs --json | head``) ends any command quietly; every command that prints a
result takes ``--json``; ``sja jobs`` at 80 columns keeps ids and statuses whole; ``sja up`` reads
``SJA_UI_PORT``; ``sja result`` gives a failed command job's last good state, saying so."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from services.gateway.service import GatewayService, GatewaySettings
from sja.cli.main import CLOSED_OUTPUT_EXIT, app
from sja.client import SjaClient
from sja.protocol import messages as m
from tests.integration.agent.test_sequential_checkpoints import Actors, running, until_state
from tests.integration.cli.test_cli_errors import HANG_GUARD_S, cli_env, one_error_line, sja_async

pytestmark = pytest.mark.timeout(180)

LONG_NAME = "nu-pytorch-mlp-training-run"


async def sja_closed_stdout(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """The CLI with a stdout whose reader has already gone (the read end of its pipe closed before it
    starts): every write it makes to stdout fails. Returns its exit status and its stderr."""
    r, w = os.pipe()
    os.close(r)
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "sja.cli.main",
            *args,
            stdout=w,
            stderr=asyncio.subprocess.PIPE,
            env=env or cli_env(),
        )
    finally:
        os.close(w)
    _, err = await asyncio.wait_for(proc.communicate(), timeout=HANG_GUARD_S)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


@pytest.fixture
async def gateway(nats_url: str, tmp_path: Path) -> AsyncIterator[list[str]]:
    """A gateway (no agent: jobs stay pending) holding 40 submitted jobs; yields their ids."""
    gw = GatewayService(GatewaySettings(nats_url=nats_url, out_dir=str(tmp_path / "out"), instance="gw-o"))
    async with gw:
        client = await SjaClient.connect(nats_url)
        try:
            ids = [
                (
                    await client.submit(
                        m.JobSpec(name=LONG_NAME, tenant="research-team-alpha", workload="montecarlo")
                    )
                ).job_id
                for _ in range(40)
            ]
        finally:
            await client.close()
        yield ids


async def test_a_reader_that_goes_away_ends_every_command_quietly(gateway: list[str], nats_url: str) -> None:
    """Before, ``sja jobs --json | head`` said ``cannot reach the SJA gateway ... (BrokenPipeError)``
    (exit 2), or Python's ``Exception ignored ... BrokenPipeError`` (exit 120)."""
    job = gateway[0]
    commands = [
        ["jobs", "--json"],
        ["jobs"],
        ["jobs", "--wide"],
        ["status", job],
        ["status", job, "--json"],
        ["trace", job],
        ["trace", job, "--json"],
        ["explain", job, "--json"],
        ["logs", job],
        ["submit", "examples/jobs/montecarlo.yaml", "--json"],
        ["cancel", gateway[1], "--json"],
        ["inventory", "--json"],
        ["--version"],
        ["jobs", "--help"],
    ]
    for args in commands:
        nats = [] if args[0] in ("inventory", "--version") or "--help" in args else ["--nats", nats_url]
        code, err = await sja_closed_stdout(*args, *nats)
        assert code in (0, CLOSED_OUTPUT_EXIT), (args, code, err)
        assert err == "", (args, err)
    # The command did its work all the same: the job it was asked to cancel is cancelled.
    client = await SjaClient.connect(nats_url)
    try:
        assert (await client.status(gateway[1])).status == "cancelled"
    finally:
        await client.close()


async def test_jobs_json_into_head_says_nothing_on_stderr(gateway: list[str], nats_url: str) -> None:
    """The pipeline itself: 40 jobs as JSON are more than the pipe holds once ``head`` has gone."""
    script = (
        f"set -o pipefail; {sys.executable} -m sja.cli.main jobs --json --nats {nats_url} | head -n 3; "
        "echo status=$?"
    )
    done = await asyncio.to_thread(
        subprocess.run,
        ["bash", "-c", script],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=HANG_GUARD_S,
    )
    assert done.stderr == "", done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "[" and len(lines) == 4, done.stdout
    assert lines[-1] in ("status=0", f"status={CLOSED_OUTPUT_EXIT}"), lines[-1]


def test_every_command_that_prints_a_result_takes_json() -> None:
    """One option for all (``JsonOpt``): ``up``, ``service``, ``demo`` run things rather than print a
    result, and ``simulate --json FILE`` writes its metrics to a file."""
    import typer.main

    group = typer.main.get_command(app)
    commands = group.commands  # type: ignore[attr-defined]
    printing = set(commands) - {"up", "service", "demo", "simulate"}
    assert {"cancel", "result", "submit", "jobs", "status"} <= printing
    for name in sorted(printing):
        flags = {o for p in commands[name].params for o in getattr(p, "opts", [])}
        assert "--json" in flags, name
        json_opt = next(p for p in commands[name].params if "--json" in p.opts)
        assert json_opt.is_flag, name


async def test_cancel_and_submit_print_json(gateway: list[str], nats_url: str, tmp_path: Path) -> None:
    code, out, err = await sja_async("cancel", gateway[2], "--json", "--nats", nats_url)
    assert code == 0, err
    got = json.loads(out)
    assert got["job_id"] == gateway[2] and got["outcome"] == "cancelled" and got["status"] == "cancelled"
    code, out, err = await sja_async("submit", "examples/jobs/montecarlo.yaml", "--json", "--nats", nats_url)
    assert code == 0, err
    acks = json.loads(out)
    assert [a["file"] for a in acks] == ["examples/jobs/montecarlo.yaml"] and acks[0]["job_id"]
    # What fails stays one line on stderr, with nothing on stdout.
    code, out, err = await sja_async("cancel", gateway[2], "--json", "--nats", nats_url)
    assert code == 1 and out == "" and "has already ended" in one_error_line(err)
    secret = tmp_path / "dashboard.secret"
    from sja import dashauth

    dashauth.write_secret(secret)
    code, out, err = await sja_async(
        "dashboard-token", "--tenant", "alpha", "--secret-file", str(secret), "--json"
    )
    assert code == 0, err
    token = json.loads(out)
    assert token["tenant"] == "alpha" and token["token"].startswith("t.alpha.")


async def test_jobs_at_80_columns_keeps_ids_and_statuses_whole(gateway: list[str], nats_url: str) -> None:
    """Before, the table squeezed every column: ``runn…``, ``pend…``."""
    for columns in ("80", "40"):
        for wide in ([], ["--wide"]):
            proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "sja.cli.main", "jobs", *wide, "--nats", nats_url,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                env={**cli_env(), "COLUMNS": columns},
            )  # fmt: skip
            out_b, err_b = await asyncio.wait_for(proc.communicate(), timeout=HANG_GUARD_S)
            out = out_b.decode()
            assert proc.returncode == 0, err_b.decode()
            assert "…" not in out, out
            assert all(len(line.rstrip()) <= int(columns) for line in out.splitlines()), out
            words = out.split()
            for job in gateway[3:]:
                assert job in words, (columns, job, out)
            assert words.count("pending") >= len(gateway) - 3, out


def test_up_reads_the_dashboard_port_from_the_environment(tmp_path: Path) -> None:
    """``SJA_UI_PORT`` is ``--ui-port``'s variable, as the service's: a value that is no port is
    refused before anything starts (before, it was ignored and the dashboard took 8080)."""
    done = subprocess.run(
        [sys.executable, "-m", "sja.cli.main", "up", "--out", str(tmp_path / "never-made")],
        capture_output=True,
        text=True,
        env={**cli_env(), "SJA_UI_PORT": "not-a-port"},
        timeout=HANG_GUARD_S,
    )
    assert done.returncode == 2, done
    line = one_error_line(done.stderr)
    assert "'--ui-port' (env var: 'SJA_UI_PORT')" in line, line
    assert not (tmp_path / "never-made").exists()
    help_text = subprocess.run(
        [sys.executable, "-m", "sja.cli.main", "up", "--help"],
        capture_output=True,
        text=True,
        env={**cli_env(), "COLUMNS": "200"},
        timeout=HANG_GUARD_S,
    ).stdout
    assert "SJA_UI_PORT" in help_text


# --- sja result of a job that did not finish ---------------------------------------------------------

# A sequential program: its state holds the next unit; units from 4 on always fail. A range that
# crosses unit 4 does the units before it and says how far it got (SJA_REPORT).
PROGRAM = textwrap.dedent(
    """
    import json, os, pathlib, sys
    e = os.environ
    start, n = int(e["SJA_UNIT_START"]), int(e["SJA_UNITS"])
    before = pathlib.Path(e["SJA_STATE_IN"]) / "next"
    have = int(before.read_text()) if before.exists() else 0
    assert have == start, (have, start)
    if start >= 4:
        print(f"unit {start} cannot be done", file=sys.stderr)
        sys.exit(1)
    done = min(start + n, 4) - start
    (pathlib.Path(e["SJA_STATE_OUT"]) / "next").write_text(str(start + done))
    if done < n:
        pathlib.Path(e["SJA_REPORT"]).write_text(json.dumps({"units_done": done}))
    """
)


def command_spec(name: str, argv: list[str]) -> m.JobSpec:
    return m.JobSpec(
        name=name,
        tenant="t",
        workload="command",
        params={"argv": argv, "units": 8, "sequential": True, "stop_grace_s": 0.2},
        memory=m.MemoryDecl(base_mib=64.0, per_unit_mib=0.0, rel_sd=0.2),
        time=m.TimeDecl(warmup_s=0.05, per_unit_s=0.01, rel_sd=0.5),
    )


async def test_result_gives_a_failed_command_jobs_last_good_state(nats_url: str, tmp_path: Path) -> None:
    """Before, ``sja result`` refused a failed job ("no final state yet") although docs/jobs.md
    promised its last good state."""
    async with running(nats_url, tmp_path, Actors()) as stack:
        partial = (await stack.client.submit(command_spec("partial", [sys.executable, "-c", PROGRAM]))).job_id
        nothing = (await stack.client.submit(command_spec("nothing", ["false"]))).job_id
        for job in (partial, nothing):
            state = await until_state(
                stack.client, job, lambda s: s.status in ("done", "failed"), 90, "the end"
            )
            assert state.status == "failed", (job, state.status, state.error)

        out = tmp_path / "partial"
        code, stdout, err = await sja_async(
            "result", partial, "--out", str(out), "--json", "--nats", nats_url
        )
        assert code == 0, err
        got = json.loads(stdout)
        assert got["complete"] is False and got["status"] == "failed"
        assert got["units_done"] == 4 and got["total_units"] == 8
        assert "did not finish" in got["note"]
        assert (out / "next").read_text() == "4"  # the state the last completed subjob left

        code, stdout, err = await sja_async(
            "result", partial, "--out", str(tmp_path / "again"), "--nats", nats_url
        )
        assert code == 0, err
        assert f"{partial}: state written to" in stdout
        assert "note:" in err and "did not finish" in err and "4 of 8 units" in err

        # A job none of whose subjobs completed left nothing: refused, saying so.
        code, stdout, err = await sja_async(
            "result", nothing, "--out", str(tmp_path / "no"), "--nats", nats_url
        )
        assert code == 2 and stdout == ""
        assert "left no state" in one_error_line(err)
