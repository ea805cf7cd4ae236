"""A hostile tenant against the subjob sandbox: a program (``command``) and a Python workload, each
run through the executor's own code (``run_subjob``, as the slice's actor runs it) from a process
holding an executor's secrets, try to reach what a tenant must not. Each attack is first shown to
have run (the hostile code writes what it tried and got: ``userpkg/sja_hostile.py``), then to have
failed; a real nats-server is the bus it tries to reach, real processes the ones it tries to read.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import shutil
import socket
import subprocess
import sys
import tarfile
import textwrap
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from sja.bus.natsd import EmbeddedNats
from sja.execution import sandbox as sbx
from sja.execution.runner import RunResult, run_subjob
from sja.protocol.messages import Subjob
from sja.workloads import checkpoint as ckpt
from tests.integration.waits import wait_until

pytestmark = pytest.mark.timeout(300)

PY = sys.executable
USERPKG = str(Path(__file__).resolve().parent / "userpkg")
ROOT = Path(__file__).resolve().parents[3]
MARK = "SJA-HOSTILE-REPORT:"
KINDS = ("program", "workload")
NPROC = 48
FSIZE_MIB = 8


def subjob(workload: str, params: dict[str, Any], cap: float = 120.0, mem_cap_mib: int = 4096) -> Subjob:
    return Subjob(
        subjob_id=f"hostile.s{uuid.uuid4().hex[:6]}",
        seq=0,
        job_id="hostile",
        tenant="mallory",
        agent_id="a1",
        workload=workload,
        params=params,
        unit_start=0,
        units=1,
        grant_id="g1",
        fence=1,
        slice_id="local-g0-1g.5gb-0",
        node="local",
        mem_cap_mib=mem_cap_mib,
        time_cap_s=cap,
        planned_mem_q_mib=100.0,
        planned_duration_q_s=1.0,
    )


def attack(kind: str, cfg: dict[str, Any], **kw: Any) -> tuple[RunResult, dict[str, Any]]:
    """Run the hostile code as ``kind`` with the attacks of ``cfg``: its result and its report."""
    if kind == "program":
        env = {"PYTHONPATH": USERPKG, **{f"ATTACK_{k.upper()}": str(v) for k, v in cfg.items()}}
        params = {"argv": [PY, "-m", "sja_hostile"], "units": 1, "sequential": False, "merge_argv": ["true"]}
        sj = subjob("command", {**params, "env": env, "stop_grace_s": 1.0}, **kw)
    else:
        sj = subjob("sja_hostile:Hostile", {k: str(v) for k, v in cfg.items()}, **kw)
    r = run_subjob(sj)
    lines = [line for line in r.stdout.splitlines() if line.startswith(MARK)]
    assert lines, f"the hostile code did not run: {r.status} {r.error}\n{r.stdout}\n{r.stderr}"
    return r, json.loads(lines[-1][len(MARK) :])


@pytest.fixture
def secrets(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """This process as an executor: its NATS credentials and a token in its environment, a HOME with
    Ray's token in it, a file only the service user may read, a canary process with a secret in its
    environment; and the sandbox of slot 0 with small process and file-size limits."""
    secret = f"SECRET-{uuid.uuid4().hex}"
    base = ROOT / "build" / f"attack-{os.getpid()}-{uuid.uuid4().hex[:6]}"  # outside /tmp: not hidden by it
    home = base / "home"
    (home / ".ray").mkdir(parents=True)
    (home / ".ray" / "token").write_text(secret)
    (home / ".ray" / "token").chmod(0o644)
    base.chmod(0o755)
    home.chmod(0o755)
    service_file = base / "service-secret"
    service_file.write_text(secret)
    service_file.chmod(0o600)
    monkeypatch.setenv("SJA_NATS_USER", "sja-executor")
    monkeypatch.setenv("SJA_NATS_PASSWORD", secret)
    monkeypatch.setenv("SJA_SOME_TOKEN", secret)
    monkeypatch.setenv("PYTHONPATH", USERPKG)  # where the executor finds the tenant's package
    monkeypatch.setenv("HOME", str(home))
    canary = subprocess.Popen([PY, "-c", "import time; time.sleep(600)"], env={"CANARY": secret})
    sbx.configure(sbx.Sandbox(sbx.SandboxSettings(nproc=NPROC, fsize_mib=FSIZE_MIB), slot=0))
    try:
        yield {
            "secret": secret,
            "home_file": str(home / ".ray" / "token"),
            "service_file": str(service_file),
            "canary": canary.pid,
        }
    finally:
        sbx.configure(None)
        canary.kill()
        canary.wait()
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("kind", KINDS)
def test_no_variable_of_the_executor_and_no_other_process_environment(
    kind: str, secrets: dict[str, Any]
) -> None:
    canary = Path(f"/proc/{secrets['canary']}/environ").read_bytes()
    assert b"CANARY=" + secrets["secret"].encode() in canary
    # It searches every environment it can read for the canary's variable (it is not told the secret).
    r, got = attack(kind, {"canary_pid": secrets["canary"], "canary_secret": "CANARY=SECRET-"})
    assert r.status == "ok", r.error
    assert "PATH" in got["env"] and "HOME" in got["env"], "the attempt listed its environment"
    assert not [k for k in got["env"] if k.startswith("SJA_NATS") or k == "SJA_SOME_TOKEN"], got["env"]
    assert got["env_secrets"] == {}
    assert got["canary_environ"].startswith("refused"), got["canary_environ"]
    assert got["environs_with_secret"] == []
    assert max(got["pids_seen"]) < 100, "a pid namespace of its own: only its own processes"


@pytest.mark.parametrize("kind", KINDS)
def test_no_file_of_the_service_user_nor_in_its_home(kind: str, secrets: dict[str, Any]) -> None:
    assert Path(secrets["home_file"]).read_text() == secrets["secret"]
    r, got = attack(kind, {"home_file": secrets["home_file"], "service_file": secrets["service_file"]})
    assert r.status == "ok", r.error
    assert got["home_file"].startswith("refused"), got["home_file"]
    if sbx.is_root():  # as the executor's own uid (no root) only the hidden paths are out of reach
        assert got["service_file"].startswith("refused: PermissionError"), got["service_file"]


@pytest.mark.parametrize("kind", KINDS)
def test_no_other_subjob_work_directory(kind: str, secrets: dict[str, Any]) -> None:
    other = sbx.Sandbox(sbx.SandboxSettings(), slot=1)
    work = other.workdir("victim")
    victim = other.start(
        [
            PY,
            "-c",
            f"import pathlib, time; pathlib.Path('state').write_text('{secrets['secret']}'); "
            "print('written', flush=True); time.sleep(600)",
        ],
        sbx.environment({}),
        work=work,
    )
    try:
        assert victim.stdout.readline() == b"written\n"
        assert (work / "state").read_text() == secrets["secret"]
        r, got = attack(kind, {"other_work": str(work / "state"), "other_work_dir": str(work)})
    finally:
        victim.kill()
        victim.close()
        sbx.remove_workdir(work)
    assert r.status == "ok", r.error
    assert got["other_work"].startswith("refused"), got["other_work"]
    assert got["other_work_dir"].startswith("refused"), got["other_work_dir"]
    assert got["tmp"] == "GOT: ['sja-work']", "its /tmp holds only its own work directory"


@pytest.mark.parametrize("kind", KINDS)
def test_no_connection_to_the_bus(kind: str, secrets: dict[str, Any], nats_server: EmbeddedNats) -> None:
    port = int(nats_server.url.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        assert s.recv(4).startswith(b"INFO"), "the server answers from the host"
    r, got = attack(kind, {"nats_port": port})
    assert r.status == "ok", r.error
    assert got["nats"].startswith("refused"), got["nats"]
    assert got.get("nats_by_host", "refused").startswith("refused"), got.get("nats_by_host")


def _is_dir(path: str) -> bool:
    return Path(path).is_dir()


def _alive_with(token: str) -> list[psutil.Process]:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if token in (p.info["cmdline"] or []) and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


@pytest.mark.parametrize("kind", KINDS)
def test_a_double_forked_daemon_holding_stdout_neither_survives_nor_holds_the_subjob(
    kind: str, secrets: dict[str, Any]
) -> None:
    token = f"sja-daemon-{uuid.uuid4().hex}"
    # A window of minutes: a subjob held by its daemon's stdout would end at it, as a timeout.
    r, got = attack(kind, {"daemon_token": token}, cap=300.0)
    assert got["daemon"] > 0, "the daemon was forked"
    assert r.status == "ok", r.error
    assert _alive_with(token) == [], "the daemon outlived its subjob"


@pytest.mark.parametrize("kind", KINDS)
def test_more_processes_than_the_limit_fail_the_subjob_and_the_executor_goes_on(
    kind: str, secrets: dict[str, Any]
) -> None:
    r, got = attack(kind, {"fork": NPROC * 4})
    assert got["forked"] < NPROC, got
    assert "Resource temporarily unavailable" in got["fork_error"]
    assert r.status == "failed" and "fork refused" in r.error, r.error
    r, got = attack(kind, {})
    assert r.status == "ok", r.error


@pytest.mark.parametrize("kind", KINDS)
def test_a_file_past_the_size_limit_fails_the_subjob_saying_why(kind: str, secrets: dict[str, Any]) -> None:
    r, got = attack(kind, {"write_mib": FSIZE_MIB * 2})
    assert got["write"].startswith("writing"), "the write was tried"
    assert "written" not in got
    # Python ignores SIGXFSZ: its write fails with EFBIG, and the traceback says so.
    assert r.status == "failed" and "File too large" in r.error, r.error


def test_a_program_killed_by_the_size_limit_is_told_so(secrets: dict[str, Any]) -> None:
    script = f"echo writing; exec head -c {FSIZE_MIB * 2}M /dev/zero > /tmp/big"
    params = {"argv": ["sh", "-c", script], "units": 1, "sequential": False, "merge_argv": ["true"]}
    r = run_subjob(subjob("command", params))
    assert "writing" in r.stdout
    assert r.status == "failed" and "SIGXFSZ" in r.error and "size limit" in r.error, r.error


@pytest.mark.parametrize("kind", KINDS)
def test_it_does_not_run_as_the_executor(kind: str, secrets: dict[str, Any]) -> None:
    r, got = attack(kind, {})
    assert r.status == "ok", r.error
    if sbx.is_root():
        assert (got["uid"], got["gid"], got["groups"]) == (200000, 200000, [])
    else:  # root of a user namespace of its own, with no capability left to use
        assert got["uid"] == 0


def test_a_program_over_its_memory_cap_is_stopped_while_it_runs(secrets: dict[str, Any]) -> None:
    body = (
        "import time\nprint('allocating', flush=True)\nheld = []\n"
        "for _ in range(200):\n    held.append(bytearray(8 * 1024 * 1024))\n    time.sleep(0.01)\n"
        "time.sleep(600)\n"
    )
    params = {"argv": [PY, "-c", body], "units": 1, "sequential": False, "merge_argv": ["true"]}
    r = run_subjob(subjob("command", params, cap=300.0, mem_cap_mib=64))
    assert "allocating" in r.stdout
    assert r.status == "oom" and "exceeded the slice's 64 MiB" in r.error, r.error
    assert r.peak_mem_mib > 64


def test_a_program_that_cannot_start_in_its_sandbox_says_so(secrets: dict[str, Any]) -> None:
    params = {"argv": ["/no/such/program"], "units": 1, "sequential": False, "merge_argv": ["true"]}
    r = run_subjob(subjob("command", params))
    assert r.status == "failed" and "cannot start" in r.error and "No such file" in r.error, r.error


@pytest.mark.parametrize("kind", KINDS)
def test_an_executor_without_root_isolates_through_a_user_namespace(
    kind: str, secrets: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the executor is not root it cannot switch uids: the sandbox maps its uid to root in a
    user namespace of its own, with no capability left to undo the sandbox."""
    monkeypatch.setattr(sbx, "is_root", lambda: False)
    token = f"sja-daemon-{uuid.uuid4().hex}"
    cfg = {
        "canary_pid": secrets["canary"],
        "canary_secret": "CANARY=SECRET-",
        "home_file": secrets["home_file"],
        "daemon_token": token,
    }
    r, got = attack(kind, cfg)
    assert r.status == "ok", r.error
    assert got["uid"] == 0 and got["env_secrets"] == {} and got["environs_with_secret"] == []
    assert got["home_file"].startswith("refused"), got["home_file"]
    assert _alive_with(token) == []
    home = str(Path(secrets["home_file"]).parent.parent)
    script = f"grep Cap /proc/self/status; umount {home} && echo UNMOUNTED; cat {secrets['home_file']}"
    params = {"argv": ["sh", "-c", script], "units": 1, "sequential": False, "merge_argv": ["true"]}
    r = run_subjob(subjob("command", params))
    assert "CapEff:\t0000000000000000" in r.stdout, r.stdout
    assert "UNMOUNTED" not in r.stdout and secrets["secret"] not in r.stdout


async def test_a_subjob_dies_with_the_actor_that_started_it(secrets: dict[str, Any]) -> None:
    """A slice's actor killed (or restarted) while its subjob runs, or while a warm program is parked:
    the subjob's sandbox, and everything in it, goes with it; the next actor of the slice removes the
    work directory it left."""
    token = f"sja-orphan-{uuid.uuid4().hex}"
    actor = textwrap.dedent(
        f"""
        import sys, time
        from sja.execution import sandbox as sbx
        box = sbx.Sandbox(slot=7, owner="slice-7")
        argv = [sys.executable, "-c", "import time; time.sleep(600)", "{token}"]
        work = box.workdir("orphan")
        p = box.start(argv, sbx.environment({{}}), work=work)
        print(work, flush=True)
        time.sleep(600)
        """
    )
    proc = await asyncio.create_subprocess_exec(PY, "-c", actor, stdout=asyncio.subprocess.PIPE)
    try:
        assert proc.stdout is not None
        work = (await proc.stdout.readline()).decode().strip()
        assert _is_dir(work) and _alive_with(token), "the subjob runs"
        proc.kill()
        await proc.wait()
        await wait_until(lambda: not _alive_with(token), "the subjob to go with its actor")
        assert _is_dir(work)
        assert (
            sbx.Sandbox(slot=7, owner="slice-7").sweep() >= 1
        )  # as the slice's next actor does when it starts
        assert not _is_dir(work)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def test_links_left_in_the_state_do_not_make_the_executor_read_for_the_program(
    secrets: dict[str, Any],
) -> None:
    """The executor (root) packs what the program left in ``SJA_STATE_OUT``: links to the service's
    files are kept as links, never read through."""
    service_file, service_dir = secrets["service_file"], str(Path(secrets["service_file"]).parent)
    body = textwrap.dedent(
        f"""
        import os
        out = os.environ["SJA_STATE_OUT"]
        os.symlink({service_file!r}, os.path.join(out, "leak"))
        os.symlink({service_dir!r}, os.path.join(out, "dir"))
        os.mkfifo(os.path.join(out, "fifo"))
        open(os.path.join(out, "mine"), "w").write("my state")
        print("links made", flush=True)
        """
    )
    r = run_subjob(subjob("command", {"argv": [PY, "-c", body], "units": 1}))
    assert "links made" in r.stdout
    assert r.status == "ok", r.error
    raw = ckpt.unpack_blob(r.output).data
    assert secrets["secret"].encode() not in raw
    with tarfile.open(fileobj=io.BytesIO(raw)) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert sorted(members) == ["dir", "leak", "mine"], "the FIFO is no state"
    assert members["leak"].issym() and members["leak"].linkname == service_file
    assert members["dir"].issym() and members["mine"].isfile()
