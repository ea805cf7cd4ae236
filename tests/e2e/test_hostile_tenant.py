"""A hostile tenant against ``sja up`` as users run it (a real nats-server with per-role credentials,
every service a process, a local Ray, subjobs in their sandboxes), trying every attack of the
threat model in ``docs/security.md`` at once, beside a victim tenant whose job holds an API key.

The attacker brings what a tenant may bring: a program (``workload: command``) and a Python workload
of its own package, and its own tenant credentials. The program and the workload look for secrets
(their environment, other processes' environments, the service users' files, Ray's session, the
operator's credentials), try the bus and Ray over the network, and leave a double-forked daemon
behind; what they found they leave in their own job's state, where the attacker reads it back as
any tenant reads its results. With its tenant credentials the attacker tries to forge a completion,
read the job store, read and cancel the victim's job, and open the dashboard.

Every attempt is proven to have run (its outcome is in the report) and to have failed; the victim's
job ends ``done`` with the result its own program computed, and its key appears nowhere the attacker
reached.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import secrets
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import msgspec
import psutil
import pytest

from sja.bus.auth import NatsSettings, read_credentials
from sja.bus.connection import connect
from sja.client import ApiError, SjaClient
from sja.protocol import messages as m
from sja.protocol import subjects
from sja.results import fetch_result
from sja.workloads.parts import parts_of
from tests.e2e.test_up_store import sja_up
from tests.integration.waits import wait_until

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

# What the attacker's code tries, wherever it runs; it reports, it does not judge.
SNOOP = textwrap.dedent(
    """
    import glob, json, os, socket, sys

    def snoop(targets, paths, marker):
        rep = {"uid": os.getuid(), "env": dict(os.environ)}
        seen = {}
        for f in glob.glob("/proc/[0-9]*/environ") + glob.glob("/proc/[0-9]*/cmdline"):
            try:
                seen[f] = open(f, "rb").read()[:65536].decode("latin-1")
            except OSError as e:
                seen[f] = type(e).__name__
        rep["proc"] = seen
        rep["pids"] = sorted(int(p.split("/")[2]) for p in glob.glob("/proc/[0-9]*"))
        reads = {}
        for pattern in paths:
            for path in glob.glob(pattern, recursive=True) or [pattern]:
                try:
                    if os.path.isdir(path):
                        reads[path] = "dir: " + " ".join(sorted(os.listdir(path)))
                    else:
                        reads[path] = open(path, "rb").read()[:65536].decode("latin-1")
                except OSError as e:
                    reads[path] = type(e).__name__
        rep["reads"] = reads
        rep["tmp"] = sorted(os.listdir("/tmp"))
        conns = {}
        for host, port in targets:
            try:
                socket.create_connection((host, port), timeout=2).close()
                conns[f"{host}:{port}"] = "connected"
            except OSError as e:
                conns[f"{host}:{port}"] = type(e).__name__
        rep["connect"] = conns
        # A daemon: forked twice, in a session of its own, named so that the test can look for it.
        pid = os.fork()
        if pid == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(900)", marker])
            os._exit(0)
        os.waitpid(pid, 0)
        rep["daemon"] = "started"
        return rep
    """
)

PROGRAM = SNOOP + textwrap.dedent(
    """
    rep = snoop(json.loads(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3])
    out = os.environ["SJA_STATE_OUT"]
    open(os.path.join(out, "report.json"), "w").write(json.dumps(rep))
    """
)

WORKLOAD = SNOOP + textwrap.dedent(
    """
    import gc
    from sja.workloads.montecarlo import MonteCarloPi

    class Spy(MonteCarloPi):
        name = "spy"

        def validate(self, params):
            keep = ("targets", "paths", "marker")
            return {"units": int(params.get("units", 1)), **{k: params[k] for k in keep}}

        def total_units(self, params):
            return params["units"]

        def run(self, params, unit_start, units, checkpoint):
            rep = snoop(params["targets"], params["paths"], params["marker"])
            # What a workload in a service's process could reach: a NATS connection, Ray's worker.
            rep["nats_clients"] = sum(1 for o in gc.get_objects() if type(o).__name__ == "Client")
            rep["ray"] = "ray" in sys.modules
            return json.dumps(rep).encode()
    """
)

VICTIM = textwrap.dedent(
    """
    import hashlib, os
    e = os.environ
    start, n = int(e["SJA_UNIT_START"]), int(e["SJA_UNITS"])
    prev = os.path.join(e["SJA_STATE_IN"], "acc")
    acc = open(prev).read() if os.path.exists(prev) else ""
    for u in range(start, start + n):
        acc = hashlib.sha256((acc + e["API_KEY"] + str(u)).encode()).hexdigest()
    open(os.path.join(e["SJA_STATE_OUT"], "acc"), "w").write(acc)
    """
)


def victim_answer(key: str, units: int) -> str:
    acc = ""
    for u in range(units):
        acc = hashlib.sha256((acc + key + str(u)).encode()).hexdigest()
    return acc


def ray_ports() -> list[int]:
    """The ports Ray's GCS of this machine listens on (read from its command line, as an attacker
    outside a sandbox would)."""
    ports = []
    for p in psutil.process_iter(["cmdline"]):
        for arg in p.info["cmdline"] or []:
            if arg.startswith("--gcs_server_port="):
                with contextlib.suppress(ValueError):
                    ports.append(int(arg.split("=", 1)[1]))
    return ports


async def until_over(client: SjaClient, job_id: str, timeout_s: float) -> m.JobState:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        state = await client.status(job_id)
        if state.status in ("done", "failed", "cancelled"):
            return state
        assert loop.time() < deadline, (job_id, state.status, state.units_done, state.error)
        await asyncio.sleep(0.5)


def http(url: str, token: str = "") -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def test_a_hostile_tenant_finds_nothing_and_changes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sja.bus.natsd import free_port

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    pkg = tmp_path / "attacker-pkg"
    pkg.mkdir()
    (pkg / "sja_hostile_spy.py").write_text(WORKLOAD)
    # The attacker's package is installed where subjobs run (here: on every service's path; the
    # gateway and the agents never import it all the same).
    monkeypatch.setenv("PYTHONPATH", str(pkg))
    out = tmp_path / "stack"
    ui_port = free_port()
    with sja_up(
        out,
        "--cohost",
        "inventory,gateway,clearer,advertiser",
        "--tenants",
        "alpha,mallory",
        "--ui-port",
        str(ui_port),
    ) as url:
        asyncio.run(attack(url, out, pkg, ui_port))


async def attack(url: str, out: Path, pkg: Path, ui_port: int) -> None:
    creds = out / "credentials"
    secrets_of_the_house = {read_credentials(f).password for f in creds.rglob("*.json")}
    secrets_of_the_house.add((out / "dashboard.secret").read_text().strip())
    key = "victim-key-" + secrets.token_hex(16)
    marker = "sja-hostile-daemon-" + secrets.token_hex(8)
    nats_port = int(url.rsplit(":", 1)[1])
    targets = [["127.0.0.1", nats_port], ["127.0.0.1", ui_port]] + [["127.0.0.1", p] for p in ray_ports()]
    paths = [
        str(creds / "**" / "*"),
        str(Path.home() / ".config" / "sja" / "**" / "*"),
        str(Path.home() / ".ray" / "**" / "*"),
        "/tmp/ray/**/*",
        "/tmp/sja-*",
        str(out / "**" / "*.json"),
        str(out / "dashboard.secret"),
    ]

    alpha = await SjaClient.connect(
        url, tenant="alpha", auth=NatsSettings(credentials=str(creds / "tenant-alpha.json"))
    )
    mallory = await SjaClient.connect(
        url, tenant="mallory", auth=NatsSettings(credentials=str(creds / "tenant-mallory.json"))
    )
    try:
        victim_units = 6
        victim = await alpha.submit(
            m.JobSpec(
                name="victim",
                tenant="alpha",
                workload="command",
                params={
                    "argv": [sys.executable, "-c", VICTIM],
                    "units": victim_units,
                    "env": {"API_KEY": key},
                },
                memory=m.MemoryDecl(base_mib=64.0, per_unit_mib=0.0, rel_sd=0.2),
                time=m.TimeDecl(warmup_s=0.2, per_unit_s=0.05, rel_sd=0.5),
            )
        )
        program = await mallory.submit(
            m.JobSpec(
                name="snoop",
                tenant="mallory",
                workload="command",
                params={
                    "argv": [sys.executable, "-c", PROGRAM, json.dumps(targets), json.dumps(paths), marker],
                    "units": 1,
                },
                memory=m.MemoryDecl(base_mib=64.0, per_unit_mib=0.0, rel_sd=0.2),
                time=m.TimeDecl(warmup_s=1.0, per_unit_s=1.0, rel_sd=0.5),
            )
        )
        params = {"units": 1, "targets": targets, "paths": paths, "marker": marker + "-py"}
        spy = await mallory.submit(
            m.JobSpec(
                name="spy",
                tenant="mallory",
                workload="sja_hostile_spy:Spy",
                params=params,
                facts=m.WorkloadFacts(
                    total_units=1,
                    memory=m.MemoryDecl(base_mib=64.0, per_unit_mib=0.0, rel_sd=0.2),
                    time=m.TimeDecl(warmup_s=1.0, per_unit_s=1.0, rel_sd=0.5),
                ),
            )
        )

        # --- with its own tenant credentials, on the bus ------------------------------------------
        with pytest.raises(ApiError):
            await mallory.status(victim.job_id)
        with pytest.raises(ApiError):
            await mallory.cancel(victim.job_id)
        violations: list[str] = []
        nc = await connect(
            url,
            "mallory-raw",
            auth=NatsSettings(credentials=str(creds / "tenant-mallory.json")),
            on_permission_violation=lambda v: violations.append(v.subject),
        )
        try:
            forged = m.Completion(
                subjob_id=f"{victim.job_id}.s1",
                job_id=victim.job_id,
                grant_id="g-forged",
                fence=1,
                slice_id="any",
                status="failed",
                unit_start=0,
                units=1,
                units_done=0,
                peak_mem_mib=0.0,
                duration_s=0.0,
                mem_cap_mib=1,
                time_cap_s=1.0,
                started_at=0.0,
                finished_at=0.0,
                error="forged",
            )
            await nc.publish(subjects.subjob_completed(victim.job_id), msgspec.msgpack.encode(forged))
            with pytest.raises(Exception):  # noqa: B017, PT011 (a refusal or no responder: either fails)
                await nc.jetstream().key_value("sja-jobs")
            await nc.flush()
            await wait_until(
                lambda: any("completed" in s for s in violations), "the forged completion refused"
            )
        finally:
            await nc.close()

        # --- the dashboard -----------------------------------------------------------------------
        from sja import dashauth

        base = f"http://127.0.0.1:{ui_port}"
        assert http(f"{base}/api/job/{victim.job_id}")[0] == 401
        assert http(f"{base}/api/job/{victim.job_id}", "t.alpha." + "0" * 64)[0] == 401
        secret = dashauth.read_secret(out / "dashboard.secret")
        assert http(f"{base}/api/job/{victim.job_id}", dashauth.tenant_token(secret, "mallory"))[0] == 404

        # --- what its code found, read back as its own results ------------------------------------
        states = {j: await until_over(c, j, 300) for c, j in ((alpha, victim.job_id),)}
        states[program.job_id] = await until_over(mallory, program.job_id, 300)
        states[spy.job_id] = await until_over(mallory, spy.job_id, 300)
    finally:
        await alpha.close()

    try:
        got = await fetch_result(mallory, states[program.job_id], out / "mallory-result")
        assert got["parts"] == 1
        from_program = json.loads((out / "mallory-result" / "report.json").read_text())
        spy_state = states[spy.job_id]
        assert spy_state.status == "done", spy_state.error
        from_workload = json.loads(parts_of(spy_state.accumulator)[0][1])
    finally:
        await mallory.close()

    victim_state = states[victim.job_id]
    assert victim_state.status == "done", victim_state.error
    assert states[program.job_id].status == "done", states[program.job_id].error

    for name, rep in (("program", from_program), ("workload", from_workload)):
        text = json.dumps(rep)
        # It ran, and looked (proof the attempt was made) ...
        assert rep["daemon"] == "started" and rep["connect"] and rep["reads"], name
        # ... found no secret of the house nor the victim's key ...
        assert key not in text, f"{name} found the victim's key"
        for s in secrets_of_the_house:
            assert s not in text, f"{name} found a secret of the stack"
        assert not any(k.startswith("SJA_NATS") or k.startswith("RAY_") for k in rep["env"]), rep["env"]
        # ... saw no process but its sandbox's, ran as no user of the house ...
        assert len(rep["pids"]) < 10, (name, rep["pids"])
        assert rep["uid"] != 0, name
        # ... and reached neither the bus, the dashboard nor Ray.
        assert "connected" not in rep["connect"].values(), (name, rep["connect"])
    assert from_workload["nats_clients"] == 0 and not from_workload["ray"]

    # Nothing it started is alive.
    left = [
        p.pid for p in psutil.process_iter(["cmdline"]) if any(marker in a for a in (p.info["cmdline"] or []))
    ]
    assert left == [], "the attacker's daemon outlived its subjob"

    # The victim's job is untouched: its own program's answer, every unit once.
    assert await victim_result(url, out, victim_state) == victim_answer(key, victim_units)


async def victim_result(url: str, out: Path, state: m.JobState) -> str:
    alpha = await SjaClient.connect(
        url, tenant="alpha", auth=NatsSettings(credentials=str(out / "credentials" / "tenant-alpha.json"))
    )
    try:
        await fetch_result(alpha, state, out / "alpha-result")
    finally:
        await alpha.close()
    return (out / "alpha-result" / "acc").read_text()
