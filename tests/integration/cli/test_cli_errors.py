"""The real CLI, as a subprocess, when something it needs is missing: no NATS server at the URL, no
gateway on a running server, a job id that does not exist. Each is one line on stderr and a non-zero
exit, never a hang or a traceback."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.gateway.service import GatewayService, GatewaySettings
from sja.bus.connection import NatsUnreachableError, connect
from sja.bus.natsd import free_port
from sja.client import SjaClient
from sja.protocol.messages import JobSpec

# A guard against a hang only: these commands fail within seconds, a hang fails the test.
HANG_GUARD_S = 60


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SJA_", "OTEL_"))}
    env["PYTHONUNBUFFERED"] = "1"
    return env


def sja(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "sja.cli.main", *args],
        capture_output=True,
        text=True,
        env=cli_env(),
        timeout=HANG_GUARD_S,
    )


async def sja_async(*args: str) -> tuple[int, str, str]:
    """The CLI without blocking the event loop (a gateway in this process must keep answering)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sja.cli.main",
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env=cli_env(),
    )
    out, err = await asyncio.wait_for(proc.communicate(), timeout=HANG_GUARD_S)
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("error: "), stderr
    return lines[0]


@pytest.mark.parametrize(
    "args",
    [["jobs"], ["status", "job-1"], ["trace", "job-1"], ["submit", "examples/jobs/matmul.yaml"]],
    ids=lambda a: a[0],
)
def test_no_nats_server_is_one_line_and_exit_2(args: list[str]) -> None:
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    done = sja(*args, "--nats", url)
    assert done.returncode == 2, done
    line = one_error_line(done.stderr)
    assert f"no NATS server answers at {url}" in line
    assert "sja up" in line


async def test_a_client_gives_up_on_a_missing_server_but_a_service_would_wait() -> None:
    url = f"nats://127.0.0.1:{free_port()}"
    with pytest.raises(NatsUnreachableError, match=url):
        await SjaClient.connect(url)
    # Without a bound (what services use) the first connection keeps trying.
    waiting = asyncio.ensure_future(connect(url, "waiting-service", connect_timeout_s=0.5))
    done, _ = await asyncio.wait({waiting}, timeout=2)
    assert not done, "an unbounded first connection must keep waiting for its server"
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting


@pytest.mark.parametrize("args", [["jobs"], ["status", "job-1"], ["trace", "job-1"], ["cancel", "job-1"]])
def test_no_gateway_is_one_line_and_exit_2(nats_url: str, args: list[str]) -> None:
    done = sja(*args, "--nats", nats_url)
    assert done.returncode == 2, done
    line = one_error_line(done.stderr)
    assert f"no SJA gateway answers at {nats_url}" in line
    assert "sja up" in line
    assert "Traceback" not in done.stderr


async def test_trace_tells_an_unknown_job_from_one_with_no_round_yet(nats_url: str, tmp_path: Path) -> None:
    gw = GatewayService(GatewaySettings(nats_url=nats_url, out_dir=str(tmp_path / "out"), instance="gw-0"))
    async with gw:
        client = await SjaClient.connect(nats_url)
        try:
            ack = await client.submit(
                JobSpec(name="mc", tenant="t", workload="montecarlo", params={"units": 3})
            )
        finally:
            await client.close()

        code, out, err = await sja_async("trace", "no-such-job", "--nats", nats_url)
        assert code == 2, (out, err)
        assert "no job no-such-job" in one_error_line(err)

        code, out, err = await sja_async("trace", ack.job_id, "--nats", nats_url)
        assert code == 0, (out, err)
        assert f"job {ack.job_id} (pending, 0/3 units) has taken part in no round yet" in out


def test_service_and_up_name_a_bad_list_of_services() -> None:
    """Refused before anything starts (``up`` makes no directory, starts no server)."""
    for spec, message in [
        ("clearer,scheduler", "unknown service 'scheduler'"),
        ("clearer,clearer", "service 'clearer' named twice"),
        ("clearer,", "no service named"),
    ]:
        for args in (["service", spec], ["up", "--cohost", spec, "--out", "/nonexistent/never-made"]):
            out = sja(*args)
            assert out.returncode == 2, out
            assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


def test_version_and_conventional_help() -> None:
    done = sja("--version")
    assert done.returncode == 0 and done.stdout.startswith("sja "), done
    for command in (
        "up",
        "submit",
        "status",
        "jobs",
        "trace",
        "explain",
        "logs",
        "cancel",
        "simulate",
        "demo",
    ):
        help_text = subprocess.run(
            [sys.executable, "-m", "sja.cli.main", command, "--help"],
            capture_output=True,
            text=True,
            env={**cli_env(), "COLUMNS": "200"},
            timeout=HANG_GUARD_S,
        ).stdout
        for label in ("<bool>", "<str>", "<int>", "<float>", "<path>", "<list["):
            assert label not in help_text, (command, label, help_text)
    up_help = subprocess.run(
        [sys.executable, "-m", "sja.cli.main", "up", "--help"],
        capture_output=True,
        text=True,
        env={**cli_env(), "COLUMNS": "200"},
        timeout=HANG_GUARD_S,
    ).stdout
    assert "[efficiency|fair|sla|auction|token|jasda]" in up_help


def test_the_policy_choices_are_the_registered_policies() -> None:
    import typing

    from sja.cli import choices
    from sja.core.policies import POLICIES
    from sja.sim.baselines import BASELINES

    assert list(typing.get_args(choices.PolicyName)) == list(POLICIES)
    assert choices.SIMULATED_BASELINES == BASELINES


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["up", "--policy", "nope", "--out", "/nonexistent/never-made"], "'nope' is not one of 'efficiency'"),
        (["demo", "--policy", "nope"], "'nope' is not one of 'efficiency'"),
        (
            ["simulate", "--trace", "x.csv", "--format", "csv", "--policy", "fifo,nope"],
            "unknown policy 'nope'",
        ),
        (["simulate", "--trace", "x.csv", "--format", "parquet"], "'parquet' is not one of 'alibaba-openb'"),
        (["jobs", "--bogus"], "No such option: --bogus"),
    ],
    ids=["up", "demo", "simulate-policy", "simulate-format", "unknown-option"],
)
def test_a_bad_command_line_is_one_line(args: list[str], words: str) -> None:
    done = sja(*args)
    assert done.returncode == 2, done
    line = one_error_line(done.stderr)
    assert words in line and "--help" in line, line


def test_submit_reports_every_problem_of_every_file_and_sends_nothing(tmp_path: Path) -> None:
    png = tmp_path / "picture.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nworkload: montecarlo\nmax_parallel: two\neps_mem: 0.9\n")
    good = tmp_path / "good.yaml"
    good.write_text("name: x\ntenant: t\nworkload: montecarlo\n")
    # No server at the URL: nothing is sent when a file is bad (it would fail to connect otherwise).
    done = sja("submit", str(good), str(png), str(bad), "--nats", f"nats://127.0.0.1:{free_port()}")
    assert done.returncode == 2, done
    lines = done.stderr.strip().splitlines()
    assert lines == [
        f"error: {png}: not a text file (byte 0x89 at offset 0 is not UTF-8); a job spec is YAML or JSON",
        f"error: {bad}: tenant: missing (required)",
        f"error: {bad}: eps_mem: must be more than 0 and less than 0.5, not 0.9",
        f"error: {bad}: max_parallel: must be a whole number, not text",
    ], done.stderr


async def test_cancel_of_a_job_that_has_ended_says_so(nats_url: str, tmp_path: Path) -> None:
    gw = GatewayService(GatewaySettings(nats_url=nats_url, out_dir=str(tmp_path / "out"), instance="gw-c"))
    async with gw:
        client = await SjaClient.connect(nats_url)
        try:
            ack = await client.submit(
                JobSpec(name="mc", tenant="t", workload="montecarlo", params={"units": 3})
            )
        finally:
            await client.close()
        # No agent has it: nothing runs, so the first cancel ends it at once.
        code, out, err = await sja_async("cancel", ack.job_id, "--nats", nats_url)
        assert code == 0 and out.strip() == f"{ack.job_id}: cancelled", (out, err)
        code, out, err = await sja_async("cancel", ack.job_id, "--nats", nats_url)
        assert code == 1, (out, err)
        assert f"job {ack.job_id} has already ended (cancelled): nothing to cancel" in one_error_line(err)
