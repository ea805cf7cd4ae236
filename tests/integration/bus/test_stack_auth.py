"""The bus as ``sja up`` runs it (``LocalStack`` with ``auth``): a real nats-server configured from
``sja.bus.roles`` with passwords made at start, every service in-process with its own credentials
file. Each test is an attack, shown to be tried and to fail:

- an anonymous connection, or a wrong password, is refused;
- the credentials files are readable by their owner only, and one open to others is refused;
- a tenant cannot publish completions or grants, read the jobs bucket or the checkpoint store, nor
  listen to the scheduler's subjects; the executor cannot publish grants or subjobs;
- a completion forged with the executor's own credentials (no proof, a wrong one, one signed for
  another subjob) changes nothing of the victim's job, while the real executor's completes it;
- ``sja result`` works for a tenant under authentication, and one tenant never reads another's
  final state, through the gateway or the object store.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.js.api import ObjectStoreConfig

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import AgentService
from services.agent.settings import AgentSettings
from services.clearer.service import ClearerService
from services.clearer.settings import ClearerSettings
from services.executor.service import ExecutorSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from sja.bus import roles
from sja.bus.auth import NatsAuthError, NatsConfigError, NatsSettings, read_credentials
from sja.bus.codec import encode
from sja.bus.connection import connect
from sja.bus.natsclient import Client
from sja.bus.permissions import PermissionViolation
from sja.bus.service import Service
from sja.bus.store import stores
from sja.client import ApiError, SjaClient
from sja.core import jobs as J
from sja.core import proofs
from sja.protocol import messages as m
from sja.protocol import subjects
from sja.results import fetch_result
from sja.stack import LocalStack
from sja.workloads import checkpoint as ckpt
from sja.workloads import run_in_one_piece
from sja.workloads.command import StateSummary, pack_state
from tests.integration.hostile_stack import NODE, InstantExecutor
from tests.integration.waits import logged, rejected, wait_until

ROOT = Path(__file__).resolve().parents[3]
TENANTS = ("alpha", "beta")


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[LocalStack]:
    """The server of ``sja up``: its configuration and credentials files made as ``sja up`` makes
    them (no services started here: the tests run them in-process)."""
    s = LocalStack(out_dir=tmp_path / "stack", auth=True, tenants=TENANTS)
    s.start_nats()
    try:
        yield s
    finally:
        s.stop()


def service_auth(stack: LocalStack, service: str) -> NatsSettings:
    """A service's credentials as ``sja up`` gives them: the directory, the service's own file in it."""
    return NatsSettings(credentials=str(stack.credentials_dir / "services")).for_service(service)


class Conn:
    """A connection that records the permission violations the server reports for it."""

    def __init__(self) -> None:
        self.violations: list[PermissionViolation] = []
        self.nc: Client | None = None

    async def open(self, stack: LocalStack, user: str) -> Conn:
        auth = (
            service_auth(stack, user.removeprefix("sja-"))
            if user.startswith("sja-") and user != roles.ADMIN
            else stack.client_auth(user)
        )
        self.nc = await connect(stack.nats_url, f"test-{user}", auth=auth, on_permission_violation=self.add)
        return self

    def add(self, v: PermissionViolation) -> None:
        self.violations.append(v)

    def refused(self, subject: str) -> bool:
        return any(v.subject == subject.lower() for v in self.violations)

    async def wait_refused(self, subject: str) -> None:
        await wait_until(lambda: self.refused(subject), f"the server refuses {subject}")


@contextlib.asynccontextmanager
async def opened(stack: LocalStack, user: str) -> AsyncIterator[Conn]:
    conn = await Conn().open(stack, user)
    try:
        yield conn
    finally:
        assert conn.nc is not None
        await conn.nc.close()


# --- who may connect ---------------------------------------------------------------------------------


async def test_no_anonymous_connection_and_no_wrong_password(stack: LocalStack) -> None:
    with pytest.raises(NatsAuthError):
        await connect(stack.nats_url, "anonymous", first_connect_retries=1)
    creds = read_credentials(stack.credentials("tenant-alpha"))
    wrong = NatsSettings(user=creds.user, password=secrets.token_urlsafe(32))
    with pytest.raises(NatsAuthError):
        await connect(stack.nats_url, "guesser", auth=wrong, first_connect_retries=1)
    # Another user's name with this tenant's password: refused too.
    other = NatsSettings(user="sja-executor", password=creds.password)
    with pytest.raises(NatsAuthError):
        await connect(stack.nats_url, "borrower", auth=other, first_connect_retries=1)
    # Positive control: the tenant's own file is a login.
    async with opened(stack, "tenant-alpha") as conn:
        assert conn.nc is not None and conn.nc.is_connected


def test_credentials_files_are_private_and_an_open_one_is_refused(stack: LocalStack, tmp_path: Path) -> None:
    base = stack.credentials_dir
    assert stat.S_IMODE(base.stat().st_mode) == 0o700
    assert stat.S_IMODE((base / "services").stat().st_mode) == 0o700
    files = [*base.glob("*.json"), *(base / "services").glob("*.json"), base / "nats.conf"]
    users = {r.user for r in roles.roles(TENANTS)}
    assert {f.stem for f in files if f.suffix == ".json"} == users
    for f in files:
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    creds = read_credentials(stack.credentials())
    assert creds.user == roles.ADMIN and len(creds.password) >= 40 and creds.url == stack.nats_url
    assert creds.password not in repr(creds) and creds.password not in repr(stack.client_auth())
    # Every password is its own.
    assert len({read_credentials(stack.credentials(u)).password for u in users}) == len(users)

    leaked = tmp_path / "copy.json"
    leaked.write_bytes(stack.credentials().read_bytes())
    leaked.chmod(0o644)
    with pytest.raises(NatsConfigError, match="chmod 600"):
        NatsSettings(credentials=str(leaked)).connect_options()


def test_services_get_a_credentials_path_and_no_password_in_their_environment(
    stack: LocalStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SJA_NATS_PASSWORD", "from-the-shell")
    monkeypatch.setenv("SJA_NATS_USER", "sja-admin")
    env = stack.service_environment("executor", "executor-0")
    assert "SJA_NATS_PASSWORD" not in env and "SJA_NATS_USER" not in env
    secrets_of_all = {read_credentials(stack.credentials(r.user)).password for r in roles.roles(TENANTS)}
    assert not any(secret in value for value in env.values() for secret in secrets_of_all)
    assert env["SJA_NATS_CREDENTIALS"] == str(stack.credentials_dir / "services")


# --- what each role may do ------------------------------------------------------------------------------


async def test_a_tenant_reaches_only_its_own_request_subjects(stack: LocalStack, tmp_path: Path) -> None:
    async with (
        services(stack, tmp_path),
        opened(stack, "tenant-alpha") as tenant,
        opened(stack, roles.ADMIN) as admin,
    ):
        nc = tenant.nc
        assert nc is not None and admin.nc is not None
        forged = {
            subjects.subjob_completed("victim-job"): b"forged completion",
            subjects.grant_issued("agent-x"): b"forged grant",
            subjects.subjob_dispatched(NODE, "victim-job"): b"forged subjob",
            "$KV.sja-jobs.victim-job": b"forged state",
            "$KV.sja-slices.s0": b"forged slice",
            f"{subjects.JOB_CANCEL}.beta": b"another tenant's cancel",
            subjects.JOB_CANCEL: b"the operator's cancel",
        }
        for subject, data in forged.items():
            await nc.publish(subject, data)
        reads = (
            f"$JS.API.STREAM.INFO.KV_{subjects.BUCKET_JOBS}",
            f"$JS.API.DIRECT.GET.KV_{subjects.BUCKET_JOBS}.$KV.{subjects.BUCKET_JOBS}.victim-job",
            f"$JS.API.STREAM.INFO.OBJ_{ckpt.BUCKET}",
            f"$JS.API.CONSUMER.CREATE.OBJ_{ckpt.BUCKET}",
            "$JS.API.STREAM.NAMES",
        )
        for subject in reads:
            await nc.publish(subject, b"{}", reply=nc.new_inbox())
        await nc.subscribe("sja.v1.>")
        await nc.flush()
        for subject in (*forged, *reads):
            await tenant.wait_refused(subject)
        await tenant.wait_refused("sja.v1.>")
        # Positive control: the tenant's own API answers it (an empty listing of its jobs).
        client = SjaClient(nc, tenant="alpha")
        assert await client.jobs() == []
        assert await SjaClient(admin.nc).jobs() == []


async def test_the_executor_cannot_grant_nor_dispatch(stack: LocalStack) -> None:
    async with opened(stack, "sja-executor") as ex:
        assert ex.nc is not None
        for subject in (
            subjects.grant_issued("agent-x"),
            subjects.subjob_dispatched(NODE, "victim-job"),
            "$KV.sja-jobs.victim-job",
            subjects.JOB_CANCEL,
        ):
            await ex.nc.publish(subject, b"forged")
            await ex.nc.flush()
            await ex.wait_refused(subject)


# --- forged completions ---------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def services(stack: LocalStack, tmp: Path) -> AsyncIterator[dict[str, Service]]:
    """The scheduler in-process, each service with its own credentials (no executor yet). Leases
    are long: nothing lapses while a test forges completions."""

    def c(name: str) -> dict[str, Any]:
        return {
            "nats_url": stack.nats_url,
            "out_dir": str(tmp / "out"),
            "instance": f"{name}-t",
            "nats": service_auth(stack, name),
        }

    running: dict[str, Service] = {}
    try:
        for key, svc in (
            ("inventory", InventoryService(InventorySettings(**c("inventory")))),
            ("gateway", GatewayService(GatewaySettings(**c("gateway")))),
            ("clearer", ClearerService(ClearerSettings(**c("clearer"), lease_s=60.0))),
            (
                "agent",
                AgentService(
                    AgentSettings(
                        **c("agent"), horizon_s=3.0, heartbeat_s=0.5, lease_s=60.0, reap_every_s=0.5
                    )
                ),
            ),
            (
                "advertiser",
                AdvertiserService(AdvertiserSettings(**c("advertiser"), horizon_s=3.0, sweep_interval_s=0.1)),
            ),
        ):
            await svc.start()
            running[key] = svc
        yield running
    finally:
        for svc in reversed(list(running.values())):
            with contextlib.suppress(Exception):
                await svc.stop()


async def in_flight(stack: LocalStack, job_id: str) -> m.JobState | None:
    """The job as stored, once a subjob of it is in flight (read as the operator reads it)."""
    async with opened(stack, roles.ADMIN) as admin:
        assert admin.nc is not None
        _, jobs = await stores(admin.nc.jetstream())
        got = await jobs.get(job_id)
    return got[0] if got is not None and got[0].in_flight else None


async def test_a_completion_forged_with_the_executors_credentials_changes_nothing(
    stack: LocalStack, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    spec = m.JobSpec(
        name="victim",
        tenant="alpha",
        workload="montecarlo",
        params={"units": 4, "samples_per_unit": 2000, "seed": 7},
        max_parallel=1,
    )
    async with (
        services(stack, tmp_path) as svcs,
        opened(stack, "tenant-alpha") as victim,
        opened(stack, "sja-executor") as attacker,
    ):
        assert victim.nc is not None and attacker.nc is not None
        client = SjaClient(victim.nc, tenant="alpha")
        job_id = (await client.submit(spec)).job_id
        got: list[m.JobState] = []

        async def flight_seen() -> bool:
            state = await in_flight(stack, job_id)
            if state is not None:
                got[:] = [state]
            return state is not None

        await wait_until(flight_seen, "a subjob of the victim in flight")
        before = got[0]
        flight = before.in_flight[0]
        assert len(flight.proof_key) == proofs.PROOF_KEY_BYTES
        # The victim's status shows no secret.
        assert all(not f.proof_key for f in (await client.status(job_id)).in_flight)

        now = time.time()
        done = m.Completion(
            subjob_id=flight.subjob_id,
            job_id=job_id,
            grant_id=flight.grant_id,
            fence=1,
            slice_id=flight.slice_id,
            status="ok",
            unit_start=flight.unit_start,
            units=flight.units,
            units_done=flight.units,
            peak_mem_mib=1.0,
            duration_s=0.01,
            mem_cap_mib=1000,
            time_cap_s=flight.time_cap_s,
            started_at=now,
            finished_at=now,
            output_checkpoint=b"made up",
        )
        failed = msgspec.structs.replace(done, status="failed", units_done=0, output_checkpoint=b"")
        forgeries = [
            done,  # no proof
            proofs.signed(done, secrets.token_bytes(proofs.PROOF_KEY_BYTES)),  # a key of its own
            msgspec.structs.replace(done, proof="0" * 64),
            proofs.signed(failed, b"x" * proofs.PROOF_KEY_BYTES),
        ]
        agent = svcs["agent"]
        dropped = rejected(agent, reason="unproven")
        js = attacker.nc.jetstream()
        for i, forged in enumerate(forgeries):
            await js.publish(
                subjects.subjob_completed(job_id), encode(forged), headers={"Nats-Msg-Id": f"forged-{i}"}
            )
        await wait_until(
            lambda: rejected(agent, reason="unproven") >= dropped + len(forgeries), "every forgery dropped"
        )
        assert logged(caplog, "dropping completion of", flight.subjob_id, "does not verify")
        assert logged(caplog, "dropping completion of", flight.subjob_id, "carries no proof")

        after = await client.status(job_id)
        assert after.status == "running" and after.units_done == 0 and after.result == {}
        assert [f.subjob_id for f in after.in_flight] == [flight.subjob_id]
        assert not after.history and after.attempt_failures == 0

        # Positive control: the executor that holds the grant completes the job, correctly.
        ex = InstantExecutor(
            ExecutorSettings(
                nats_url=stack.nats_url,
                out_dir=str(tmp_path / "out"),
                instance="executor-t",
                node=NODE,
                nats=service_auth(stack, "executor"),
            )
        )
        await ex.start()
        try:

            async def finished() -> bool:
                return J.is_terminal(await client.status(job_id))

            await wait_until(finished, "the victim's job done by its executor", timeout_s=60)
        finally:
            await ex.stop()
        final = await client.status(job_id)
        assert final.status == "done" and final.units_done == 4
        assert final.result == run_in_one_piece(spec.workload, spec.params)


# --- final states ---------------------------------------------------------------------------------------


async def store_done_job(stack: LocalStack, tenant: str, name: str, files: dict[str, bytes]) -> m.JobState:
    """A finished command job of ``tenant`` whose final state is in the object store, put there as
    the executor and the agent put it (with their own credentials)."""
    state_dir = Path(stack.out_dir) / f"state-{name}"
    state_dir.mkdir(parents=True)
    for fname, data in files.items():
        (state_dir / fname).write_bytes(data)
    blob = ckpt.unpack_blob(pack_state(state_dir, StateSummary(unit_start=0, unit_end=1, files=len(files))))
    job_id = f"{name}-job"
    object_name = f"{job_id}/{job_id}.s0"
    async with opened(stack, "sja-executor") as ex:
        assert ex.nc is not None
        js = ex.nc.jetstream()
        try:
            store = await js.object_store(ckpt.BUCKET)
        except Exception:
            store = await js.create_object_store(ckpt.BUCKET, ObjectStoreConfig())
        await store.put(object_name, blob.data)
    spec = m.JobSpec(name=name, tenant=tenant, workload="command", params={"argv": ["true"], "units": 1})
    state = msgspec.structs.replace(
        J.new_job(job_id, spec, time.time()),
        status="done",
        units_done=1,
        accumulator=ckpt.make_ref(ckpt.BUCKET, object_name, blob),
    )
    async with opened(stack, "sja-agent") as agent:
        assert agent.nc is not None
        _, jobs = await stores(agent.nc.jetstream())
        await jobs.create(job_id, state)
    return state


async def test_sja_result_for_a_tenant_and_never_another_tenants_state(
    stack: LocalStack, tmp_path: Path
) -> None:
    secret = os.urandom(3 << 20)  # larger than a message may be: served in chunks
    async with (
        services(stack, tmp_path),
        opened(stack, "tenant-alpha") as alpha,
        opened(stack, "tenant-beta") as beta,
    ):
        assert alpha.nc is not None and beta.nc is not None
        files = {"weights.bin": secret, "note.txt": b"alpha"}
        alpha_job = await store_done_job(stack, "alpha", "a", files)
        beta_job = await store_done_job(stack, "beta", "b", {"note.txt": b"beta"})
        alpha_object = ckpt.unpack_ref(alpha_job.accumulator).name
        a, b = SjaClient(alpha.nc, tenant="alpha"), SjaClient(beta.nc, tenant="beta")
        got = await fetch_result(a, await a.status(alpha_job.job_id), tmp_path / "a-out")
        assert got["parts"] == 1
        assert (tmp_path / "a-out" / "weights.bin").read_bytes() == secret

        # Beta asks for alpha's state: as alpha's job, then as its own job naming alpha's object.
        with pytest.raises(ApiError, match="no job"):
            await b.stored_state(alpha_job.job_id, alpha_object)
        with pytest.raises(ApiError, match="holds no state"):
            await b.stored_state(beta_job.job_id, alpha_object)
        with pytest.raises(ApiError, match="no job"):
            await b.status(alpha_job.job_id)
        # ... and straight from the object store.
        await beta.nc.publish(f"$JS.API.STREAM.INFO.OBJ_{ckpt.BUCKET}", b"", reply=beta.nc.new_inbox())
        await beta.nc.publish(
            f"$JS.API.DIRECT.GET.OBJ_{ckpt.BUCKET}", b'{"seq": 1}', reply=beta.nc.new_inbox()
        )
        await beta.nc.flush()
        await beta.wait_refused(f"$JS.API.STREAM.INFO.OBJ_{ckpt.BUCKET}")
        await beta.wait_refused(f"$JS.API.DIRECT.GET.OBJ_{ckpt.BUCKET}")
        # Beta's own result is its own.
        await fetch_result(b, await b.status(beta_job.job_id), tmp_path / "b-out")
        assert (tmp_path / "b-out" / "note.txt").read_bytes() == b"beta"
        assert not (tmp_path / "b-out" / "weights.bin").exists()

        # The command line, finding the tenant's credentials file (and the tenant in it).
        env = {k: v for k, v in os.environ.items() if not k.startswith("SJA_NATS")}
        env["XDG_CONFIG_HOME"] = str(tmp_path / "no-config")
        cli = [sys.executable, "-m", "sja.cli.main", "--credentials", str(stack.credentials("tenant-alpha"))]
        r = await asyncio.to_thread(
            subprocess.run,
            [*cli, "result", alpha_job.job_id, "--out", str(tmp_path / "cli-out")],
            env=env,
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert r.returncode == 0, r.stderr
        assert (tmp_path / "cli-out" / "weights.bin").read_bytes() == secret
        r = await asyncio.to_thread(
            subprocess.run,
            [*cli, "result", beta_job.job_id, "--out", str(tmp_path / "cli-beta")],
            env=env,
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        assert r.returncode != 0 and "no job" in r.stderr
        assert not (tmp_path / "cli-beta" / "note.txt").exists()
