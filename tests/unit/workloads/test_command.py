"""The ``command`` contract, run as the slice's actor runs it (``run_subjob``), with real programs."""

from __future__ import annotations

import os
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sja.execution.runner import run_subjob
from sja.protocol.messages import Subjob
from sja.workloads import SpecError, workload
from sja.workloads.command import StateSummary, pack_state, summary_of, unpack_state

PY = sys.executable


def program(body: str) -> list[str]:
    return [PY, "-c", textwrap.dedent(body)]


COUNTER = program(
    """
    import os, pathlib
    e = os.environ
    i, o = pathlib.Path(e["SJA_STATE_IN"]), pathlib.Path(e["SJA_STATE_OUT"])
    total = int((i / "total").read_text()) if (i / "total").exists() else 0
    start, n = int(e["SJA_UNIT_START"]), int(e["SJA_UNITS"])
    total += sum(range(start, start + n))
    (o / "total").write_text(str(total))
    (o / "env").write_text(" ".join(f"{k}={e[k]}" for k in sorted(e) if k.startswith("SJA_")))
    """
)


def subjob(
    params: dict[str, Any], unit_start: int = 0, units: int = 10, cap: float = 20.0, **kw: Any
) -> Subjob:
    p = workload("command").validate(params)
    fields: dict[str, Any] = dict(
        subjob_id="j1.s0",
        seq=0,
        job_id="j1",
        tenant="alice",
        agent_id="a1",
        workload="command",
        params=p,
        unit_start=unit_start,
        units=units,
        grant_id="g1",
        fence=1,
        slice_id="local-g0-1g.5gb-2",
        node="local",
        mem_cap_mib=4096,
        time_cap_s=cap,
        planned_mem_q_mib=100.0,
        planned_duration_q_s=1.0,
    )
    fields.update(kw)
    return Subjob(**fields)


def state_of(raw: bytes) -> dict[str, str]:
    d = Path(tempfile.mkdtemp())
    unpack_state(raw, d)
    return {p.name: p.read_text() for p in d.iterdir()}


def test_a_program_continues_from_the_state_the_previous_subjob_left() -> None:
    params = {"argv": COUNTER, "units": 30}
    first = run_subjob(subjob(params, 0, 10))
    assert first.status == "ok", first.error
    assert first.units_done == 10 and first.meter == "rss-tree" and first.peak_mem_mib > 1
    second = run_subjob(subjob(params, 10, 20, input_checkpoint=first.output, attempt=2))
    assert second.status == "ok", second.error
    got = state_of(second.output)
    assert got["total"] == str(sum(range(30)))
    env = dict(kv.split("=", 1) for kv in got["env"].split())
    assert env["SJA_JOB_ID"] == "j1" and env["SJA_SUBJOB_ID"] == "j1.s0"
    assert (env["SJA_UNIT_START"], env["SJA_UNITS"], env["SJA_TOTAL_UNITS"]) == ("10", "20", "30")
    assert env["SJA_ATTEMPT"] == "2"
    assert abs(float(env["SJA_DEADLINE"]) - (time.time() + 20)) < 20
    assert summary_of(second.output).unit_end == 30


def test_a_program_too_short_for_the_sampler_still_has_a_measured_peak() -> None:
    """A shell line ends before the meter's first sample: the peak is the kernel's, which the
    sandbox's pid 1 reads when it reaps the program (``wait4``), never 0."""
    r = run_subjob(subjob({"argv": ["/bin/sh", "-c", 'echo 1 > "$SJA_STATE_OUT/done"'], "units": 5}))
    assert r.status == "ok", r.error
    assert r.meter == "rss-tree" and r.peak_mem_mib > 0.1, r


def test_a_failing_program_reports_its_last_stderr_lines() -> None:
    r = run_subjob(
        subjob(
            {
                "argv": program("import sys\nprint('bad input at line 7', file=sys.stderr)\nsys.exit(3)"),
                "units": 5,
            }
        )
    )
    assert r.status == "failed"
    assert "exited with 3" in r.error and "bad input at line 7" in r.error


@pytest.mark.parametrize(
    "body",
    [
        "import sys\nprint('RuntimeError: CUDA out of memory. Tried to allocate 2 GiB', file=sys.stderr)\n"
        "sys.exit(1)",
        "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)",
    ],
)
def test_an_out_of_memory_death_is_reported_oom(body: str) -> None:
    r = run_subjob(subjob({"argv": program(body), "units": 5}))
    assert r.status == "oom", r.error


def test_a_program_ignoring_sigterm_is_killed_at_the_cap_with_its_children() -> None:
    token = f"sja-deaf-{os.getpid()}-{time.monotonic_ns()}"
    body = f"""
    import signal, subprocess, sys, time
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    deaf = "import signal,time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    child = subprocess.Popen([sys.executable, "-c", deaf, "{token}"])
    print("forked", child.pid, flush=True)
    time.sleep(60)
    """
    t0 = time.monotonic()
    r = run_subjob(subjob({"argv": program(body), "units": 5, "stop_grace_s": 0.5}, cap=2.0))
    assert time.monotonic() - t0 < 10
    assert r.status == "timeout" and "killed" in r.error
    assert "forked" in r.stdout, "the child was started"
    left = [p for p in psutil.process_iter(["cmdline"]) if token in (p.info["cmdline"] or [])]
    alive = [p for p in left if p.status() != psutil.STATUS_ZOMBIE]
    assert alive == [], "the forked child outlived its subjob"


def test_a_program_stopped_by_sigterm_keeps_the_units_it_reported() -> None:
    body = """
    import json, os, pathlib, time
    import sja.job
    ctx = sja.job.context()
    done = 0
    for unit in ctx.units:
        if ctx.should_stop():
            break
        time.sleep(0.05)
        done += 1
    (ctx.state_out / "done").write_text(str(done))
    ctx.report(units_done=done, loss=0.5)
    """
    r = run_subjob(subjob({"argv": program(body), "units": 1000, "stop_grace_s": 1.0}, units=1000, cap=4.0))
    assert r.status == "ok", r.error
    assert 0 < r.units_done < 1000
    assert state_of(r.output)["done"] == str(r.units_done)
    assert summary_of(r.output).metrics == {"loss": 0.5}
    assert summary_of(r.output).unit_end == r.units_done


STARTS_SLOWLY = """
import os, pathlib, signal, sys, time
e = os.environ
t0 = time.time()
stopped = []
# How long before its deadline the stop signal came.
signal.signal(signal.SIGTERM, lambda *_: stopped.append(float(e["SJA_DEADLINE"]) - time.time()))
time.sleep({startup})  # a framework's import and model build
done = 0
for unit in range(int(e["SJA_UNITS"])):
    if stopped:
        break
    time.sleep(0.05)
    done += 1
pathlib.Path(e["SJA_STATE_OUT"], "s").write_text(str(done))
pathlib.Path(e["SJA_REPORT"]).write_text('{{"units_done": %d}}' % done)
print("stopped before the deadline by", stopped[0] if stopped else None, "units", done, flush=True)
"""


def test_no_stop_signal_comes_before_the_planned_start_up_and_first_unit() -> None:
    # A 4 s window, a 30 s grace asked for: half the window would stop it at 2 s, inside its 2.5 s
    # start-up. Planned at 3 s for its start-up and first unit, it is stopped no earlier than that.
    body = STARTS_SLOWLY.format(startup=2.5)
    r = run_subjob(
        subjob(
            {"argv": program(body), "units": 1000, "stop_grace_s": 30.0},
            units=1000,
            cap=4.0,
            first_unit_s=3.0,
        )
    )
    assert r.status == "ok", r.error
    assert r.units_done >= 1
    before = float(r.stdout.split("stopped before the deadline by ")[1].split()[0])
    assert before <= 4.0 - 3.0 + 0.05, r.stdout  # not the 2 s that half the window would give


def test_a_program_killed_by_the_stop_signal_during_its_start_up_is_a_window_too_short() -> None:
    # No handler: SJA's SIGTERM ends it while it starts. Its program did nothing wrong: a timeout,
    # which the job's time profile learns from, not a failure counted toward giving up.
    body = "import time; time.sleep(30)"
    r = run_subjob(subjob({"argv": program(body), "units": 10, "stop_grace_s": 1.0}, units=10, cap=3.0))
    assert r.status == "timeout", (r.status, r.error)
    assert "stopped by SJA's SIGTERM" in r.error and "window was too short" in r.error


def test_a_program_flooding_stdout_costs_no_memory_and_keeps_a_tail() -> None:
    body = """
    import os, sys, pathlib
    chunk = b"x" * 65536 + b"\\n"
    for _ in range(3000):
        sys.stdout.buffer.write(chunk)
    print("the end", file=sys.stderr)
    sys.exit(2)
    """
    r = run_subjob(subjob({"argv": program(body), "units": 5}))
    assert r.status == "failed" and "the end" in r.error
    assert len(r.error) < 5000


def test_a_bad_input_state_fails_the_subjob_saying_why() -> None:
    params = {"argv": COUNTER, "units": 30}
    r = run_subjob(subjob(params, 10, 5, input_checkpoint=b"SJA-BLOB1\nnot msgpack at all"))
    assert r.status == "failed" and "input state unreadable" in r.error
    wrong = pack_state(Path(tempfile.mkdtemp()), StateSummary(unit_start=0, unit_end=4))
    r = run_subjob(subjob(params, 10, 5, input_checkpoint=wrong))
    assert r.status == "failed" and "ends at unit 4" in r.error


def test_exit_0_without_state_fails_a_sequential_subjob() -> None:
    r = run_subjob(subjob({"argv": [PY, "-c", "pass"], "units": 5}))
    assert r.status == "failed" and "no state" in r.error


def test_a_missing_program_fails_the_subjob() -> None:
    r = run_subjob(subjob({"argv": ["/no/such/program"], "units": 5}))
    assert r.status == "failed" and "cannot start" in r.error


@given(
    argv=st.one_of(st.none(), st.just([]), st.lists(st.integers(), min_size=1)),
    units=st.one_of(st.integers(max_value=0), st.booleans(), st.text(max_size=3)),
)
@settings(max_examples=20, deadline=None)
def test_bad_command_params_are_refused_naming_the_field(argv: Any, units: Any) -> None:
    with pytest.raises(SpecError) as e:
        workload("command").validate({"argv": argv, "units": units})
    assert e.value.field in ("params.argv", "params.units")


def test_merge_argv_is_required_when_not_sequential() -> None:
    with pytest.raises(SpecError) as e:
        workload("command").validate({"argv": ["true"], "units": 3, "sequential": False})
    assert e.value.field == "params.merge_argv"
    with pytest.raises(SpecError) as e:
        workload("command").validate({"argv": ["true"], "units": 3, "env": {"SJA_UNITS": "9"}})
    assert e.value.field == "params.env"


def test_state_archives_refuse_paths_outside_their_directory(tmp_path: Path) -> None:
    import io
    import tarfile

    from sja.workloads import checkpoint as ckpt

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escape")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    raw = ckpt.pack_blob(b"", buf.getvalue())
    with pytest.raises(ValueError, match="not a state archive"):
        unpack_state(raw, tmp_path / "in")
    assert not (tmp_path / "escape").exists()
    assert os.path.isdir(tmp_path)


def test_a_state_url_keeps_states_as_files_and_a_missing_one_is_an_error(tmp_path: Path) -> None:
    from sja.workloads import statestore

    url = str(tmp_path / "states")
    assert statestore.is_external(url) and statestore.is_external("file://" + url)
    assert not statestore.is_external("sja-checkpoints")
    statestore.put("file://" + url, "job-1/job-1.s0", b"state bytes")
    assert statestore.get(url, "job-1/job-1.s0") == b"state bytes"
    assert [p.name for p in (tmp_path / "states" / "job-1").iterdir()] == ["job-1.s0"], "no temporary left"
    with pytest.raises(FileNotFoundError):
        statestore.get(url, "job-1/job-1.s9")
