"""``sja logs``: what a command job's program wrote, per subjob, read back through the gateway from
the completions in ``SJA_COMPLETIONS`` (a real nats-server, the real executor and runner, a real
program); a subjob that fails says why in its summary too."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from sja.client import ApiError
from sja.protocol import messages as m
from tests.integration.agent.test_sequential_checkpoints import Actors, running, until_state
from tests.integration.cli.test_cli_errors import sja_async

pytestmark = pytest.mark.timeout(120)

PROGRAM = textwrap.dedent(
    """
    import os, pathlib, sys
    e = os.environ
    start, n = int(e["SJA_UNIT_START"]), int(e["SJA_UNITS"])
    print("noise " * 5000)  # more than the tail kept: only its end reaches the log
    print(f"did units {start}..{start + n}")
    print(f"warning from {start}", file=sys.stderr)
    if start == 0 and int(e["SJA_ATTEMPT"]) == 0:
        print("first try fails on purpose", file=sys.stderr)
        sys.exit(3)
    (pathlib.Path(e["SJA_STATE_OUT"]) / "s").write_text(str(start + n))
    """
)


async def test_logs_show_each_subjobs_output_and_why_one_failed(nats_url: str, tmp_path: Path) -> None:
    async with running(nats_url, tmp_path, Actors()) as stack:
        spec = m.JobSpec(
            name="logs",
            tenant="t",
            workload="command",
            # Each subjob its planned range (none goes on past its window): one log per range.
            params={
                "argv": [sys.executable, "-c", PROGRAM],
                "units": 6,
                "stop_grace_s": 0.2,
                "continue": False,
            },
            memory=m.MemoryDecl(base_mib=64.0, per_unit_mib=0.0, rel_sd=0.2),
            time=m.TimeDecl(warmup_s=0.05, per_unit_s=0.01, rel_sd=0.5),
        )
        ack = await stack.client.submit(spec, "logs-1")
        state = await until_state(
            stack.client, ack.job_id, lambda s: s.status in ("done", "failed"), 60, "the job to end"
        )
        assert state.status == "done", state.error
        failed = [h for h in state.history if h.status == "failed"]
        assert failed and "exited with 3" in failed[0].error and "on purpose" in failed[0].error
        assert all(h.error == "" for h in state.history if h.status == "ok")

        got = await stack.client.logs(ack.job_id)
        assert [s.subjob_id for s in got.subjobs] == sorted(
            (s.subjob_id for s in got.subjobs), key=lambda i: int(i.rpartition(".s")[2])
        )
        assert len(got.subjobs) == len(state.history)
        first = got.subjobs[0]
        assert first.status == "failed" and "on purpose" in first.stderr and "exited with 3" in first.error
        for s in got.subjobs:
            assert f"did units {s.unit_start}..{s.unit_start + s.units}" in s.stdout
            assert f"warning from {s.unit_start}" in s.stderr
            assert len(s.stdout) <= m.OUTPUT_TAIL_CHARS and s.stdout.rstrip().endswith(
                f"{s.unit_start + s.units}"
            )

        one = await stack.client.logs(ack.job_id, "1")
        assert [s.subjob_id for s in one.subjobs] == [f"{ack.job_id}.s1"]
        with pytest.raises(ApiError) as e:
            await stack.client.logs(ack.job_id, "999")
        assert e.value.error.code == "not_found"
        with pytest.raises(ApiError):
            await stack.client.logs("no-such-job")

        # The CLI: text, JSON, one subjob, and a one-line refusal for what is not there.
        code, out, err = await sja_async("logs", ack.job_id, "--nats", nats_url)
        assert code == 0, err
        assert f"== {ack.job_id}.s0" in out and "on purpose" in out and "did units" in out
        code, out, err = await sja_async("logs", ack.job_id, "--subjob", "1", "--json", "--nats", nats_url)
        assert code == 0, err
        assert [s["subjob_id"] for s in json.loads(out)["subjobs"]] == [f"{ack.job_id}.s1"]
        code, out, err = await sja_async("logs", "no-such-job", "--nats", nats_url)
        assert code != 0 and "no job no-such-job" in err and len(err.strip().splitlines()) == 1


SMALL_DECLARATION = textwrap.dedent(
    """
    import os, pathlib
    e = os.environ
    start, n = int(e["SJA_UNIT_START"]), int(e["SJA_UNITS"])
    block = bytearray(48 * 1024 * 1024)  # far more than the 1 MiB the job declares
    (pathlib.Path(e["SJA_STATE_OUT"]) / "s").write_text(str(start + n + len(block) * 0))
    """
)


async def test_a_peak_above_the_declaration_is_said_by_logs_and_status(nats_url: str, tmp_path: Path) -> None:
    async with running(nats_url, tmp_path, Actors()) as stack:
        spec = m.JobSpec(
            name="overrun",
            tenant="t",
            workload="command",
            params={"argv": [sys.executable, "-c", SMALL_DECLARATION], "units": 3, "stop_grace_s": 0.2},
            memory=m.MemoryDecl(base_mib=1.0, per_unit_mib=0.0, rel_sd=0.2),
            time=m.TimeDecl(warmup_s=0.05, per_unit_s=0.01, rel_sd=0.5),
        )
        ack = await stack.client.submit(spec, "overrun-1")
        state = await until_state(
            stack.client, ack.job_id, lambda s: s.status in ("done", "failed"), 60, "the job to end"
        )
        assert state.status == "done", state.error
        over = [int(h.subjob_id.rpartition(".s")[2]) for h in state.history if h.peak_mem_mib > 1.0]
        assert over, [h.peak_mem_mib for h in state.history]  # the meter saw the program's memory

        got = await stack.client.logs(ack.job_id)
        assert len(got.notes) == 1
        note = got.notes[0]
        assert note.startswith("measured ") and "above the declared 1 MiB" in note
        assert "declare at least" in note and str(over[0]) in note

        code, out, err = await sja_async("logs", ack.job_id, "--nats", nats_url)
        assert code == 0, err
        assert f"memory: {note}" in out
        code, out, err = await sja_async("status", ack.job_id, "--nats", nats_url)
        assert code == 0, err
        assert "memory:" in out and "above the declared 1 MiB" in out
        code, out, err = await sja_async("status", ack.job_id, "--json", "--nats", nats_url)
        assert code == 0, err
        assert json.loads(out)["memory"]["subjobs"] == over
        code, out, err = await sja_async("explain", ack.job_id, "--nats", nats_url)
        assert code == 0, err
        assert "above the declared 1 MiB" in out
