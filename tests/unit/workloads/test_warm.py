"""Warm continuation (``params.warm``): a command job's program kept alive between its subjobs on
one slice, with real processes, and every way it falls back to a cold start."""

from __future__ import annotations

import os
import signal
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from sja.execution import warm
from sja.execution.runner import run_subjob
from sja.workloads import SpecError, workload
from sja.workloads.command import summary_of

from .test_command import state_of, subjob

LIBS = str(Path(__file__).resolve().parents[3] / "libs")

# Sums the units it did; holds the sum in memory between ranges when warm, and says in its state
# how each range got it (the process's own random id, whether it loaded the state). Inside its
# sandbox a program sees only its namespace's pids: the test finds its host pid through the parked
# sandbox (``host_pid``).
WARM_COUNTER = [
    sys.executable,
    "-c",
    textwrap.dedent(
        """
        import os, sys
        ident = os.urandom(8).hex()
        sys.path.insert(0, os.environ["LIBS"])
        import sja.job
        ctx = sja.job.context()
        total = None
        while ctx is not None:
            loaded = not ctx.resumed
            if loaded:
                f = ctx.state_in / "total"
                total = int(f.read_text()) if f.exists() else 0
            total += sum(ctx.units)
            (ctx.state_out / "total").write_text(str(total))
            (ctx.state_out / "how").write_text(f"{ident} {int(loaded)}")
            print(f"range {ctx.unit_start} done")
            ctx = ctx.next_range()
        """
    ),
]


@pytest.fixture(autouse=True)
def _clean() -> Iterator[None]:
    os.environ["SJA_WARM_GRACE_S"] = "30"
    yield
    warm.evict_except("", "")
    os.environ.pop("SJA_WARM_GRACE_S", None)


def params(**kw: Any) -> dict[str, Any]:
    return {"argv": WARM_COUNTER, "units": 40, "warm": True, "env": {"LIBS": LIBS}, **kw}


def run(start: int, n: int, ckpt: bytes = b"", job: str = "j1", slice_id: str = "s-a") -> Any:
    r = run_subjob(subjob(params(), start, n, input_checkpoint=ckpt, job_id=job, slice_id=slice_id, cap=30.0))
    assert r.status == "ok", r.error
    got = state_of(r.output)
    ident, loaded = got["how"].split()
    return r, int(got["total"]), ident, loaded == "1"


def host_pid(job: str = "j1", slice_id: str = "s-a") -> int:
    """The host pid of the program parked for ``job`` on ``slice_id`` (the child of its sandbox's pid 1)."""
    box = warm._parked[(job, slice_id)].running.proc
    init = getattr(box, "init_pid", 0) or box.pid
    return int(psutil.Process(init).children()[0].pid) if getattr(box, "init_pid", 0) else init


def test_the_next_range_continues_in_the_same_process_without_reading_the_state() -> None:
    r1, t1, pid1, loaded1 = run(0, 10)
    assert (r1.warm, t1, loaded1) == ("cold", sum(range(10)), True)
    assert warm.parked() == [("j1", "s-a")]
    host1 = host_pid()
    r2, t2, pid2, loaded2 = run(10, 10, r1.output)
    assert (r2.warm, t2, pid2, loaded2) == ("resumed", sum(range(20)), pid1, False)
    assert summary_of(r2.output).unit_end == 20
    # The last range: the program exits by itself, nothing stays parked.
    r3, t3, pid3, _ = run(20, 20, r2.output)
    assert (r3.warm, t3, pid3) == ("resumed", sum(range(40)), pid1)
    assert warm.parked() == []
    assert not _alive(host1)


def test_a_process_that_died_between_subjobs_falls_back_to_a_cold_start_from_the_state() -> None:
    r1, _, pid1, _ = run(0, 10)
    os.kill(host_pid(), signal.SIGKILL)
    time.sleep(0.2)
    r2, t2, pid2, loaded2 = run(10, 10, r1.output)
    assert (r2.warm, t2, loaded2) == ("cold", sum(range(20)), True)
    assert pid2 != pid1


def test_another_slice_starts_cold_and_another_job_evicts_the_parked_process() -> None:
    r1, _, pid1, _ = run(0, 10, slice_id="s-a")
    host1 = host_pid(slice_id="s-a")
    r2, t2, pid2, loaded2 = run(10, 10, r1.output, slice_id="s-b")
    host2 = host_pid(slice_id="s-b")
    assert (r2.warm, t2, loaded2) == ("cold", sum(range(20)), True) and pid2 != pid1
    # Subjobs of another job: every parked process but theirs on their slice is stopped first.
    run(0, 5, job="j2", slice_id="s-c")
    time.sleep(0.2)
    assert not _alive(host1) and not _alive(host2)
    assert warm.parked() == [("j2", "s-c")]


def test_a_subjob_from_another_state_is_handed_to_the_live_process_which_restores_it() -> None:
    run(0, 10)
    # The same range run again elsewhere (its completion was the one kept): a different archive.
    other = run(0, 10, job="j-other", slice_id="s-z")[0].output
    _, _, pid1b, _ = run(0, 10)  # warm again for j1 on s-a (the eviction stopped the first)
    r2, t2, pid2, loaded2 = run(10, 10, other)
    assert (r2.warm, t2, pid2, loaded2) == ("handed", sum(range(20)), pid1b, True)


def test_a_parked_process_goes_when_its_grace_ends() -> None:
    os.environ["SJA_WARM_GRACE_S"] = "0.3"
    r1, _, _, _ = run(0, 10)
    host1 = host_pid()
    time.sleep(1.0)
    assert warm.parked() == [] and not _alive(host1)
    r2, t2, _, loaded2 = run(10, 10, r1.output)
    assert (r2.warm, t2, loaded2) == ("cold", sum(range(20)), True)


def test_a_program_without_the_sdk_loop_still_works_warm() -> None:
    from .test_command import COUNTER

    p = {"argv": COUNTER, "units": 20, "warm": True}
    r = run_subjob(subjob(p, 0, 10))
    assert r.status == "ok" and r.warm == "cold" and warm.parked() == []


def test_warm_needs_a_sequential_job() -> None:
    with pytest.raises(SpecError, match="sequential"):
        workload("command").validate(params(sequential=False, merge_argv=["true"]))
    with pytest.raises(SpecError, match="true or false"):
        workload("command").validate(params(warm="yes"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
