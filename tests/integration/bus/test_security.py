"""NATS users and permissions of the deployment (``infra/nats/nats.conf`` + ``auth.conf``), against a
real nats-server started with those files and passwords from its environment, as in its container.

- the server refuses an agent's offers and grants and an executor's grants; the publisher's error
  callback (and a service's ERROR log and counter) report it; a subscriber with the rights to read
  those subjects sees nothing, while the legitimate publisher's messages reach it;
- a tenant's credentials submit and read only that tenant's jobs: the server keeps a tenant on its
  own request subjects (and off JetStream, other inboxes and the operator API), the gateway keeps a
  tenant's subjects to its own jobs;
- the services, each with its own user, negotiate end to end (offer, replies, grant, subjob);
- credentials: a wrong password fails at once with ``NatsAuthError``; password files and TLS (with a
  client certificate) work; inconsistent options fail before any connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from nats.aio.client import Client
from nats.js.api import AckPolicy, ConsumerConfig

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import JOBS_CONSUMER, AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from services.ui.service import UiService, UiSettings
from sja.bus.auth import NatsAuthError, NatsConfigError, NatsSettings
from sja.bus.codec import decode, encode
from sja.bus.connection import connect
from sja.bus.natsd import EmbeddedNats
from sja.bus.permissions import PermissionViolation, parse_permission_violation
from sja.bus.rounds import decode_grants
from sja.bus.service import Service
from sja.bus.streams import JetStreamReplicasError, ensure_jetstream
from sja.client import ApiError, SjaClient
from sja.core import leases
from sja.dashauth import Viewer
from sja.protocol import subjects
from sja.protocol.messages import (
    AgentHeartbeat,
    Candidate,
    ErrorReply,
    Grant,
    JobSpec,
    SliceState,
    Subjob,
    Window,
)
from tests.integration.waits import wait_until

ROOT = Path(__file__).resolve().parents[3]
NATS_CONF = ROOT / "infra" / "nats" / "nats.conf"
ROLES = (
    "INVENTORY",
    "ADVERTISER",
    "CLEARER",
    "AGENT",
    "EXECUTOR",
    "GATEWAY",
    "UI",
    "ADMIN",
    "TENANT_ALPHA",
    "TENANT_BETA",
)
USERS = {
    "INVENTORY": "sja-inventory",
    "ADVERTISER": "sja-advertiser",
    "CLEARER": "sja-clearer",
    "AGENT": "sja-agent",
    "EXECUTOR": "sja-executor",
    "GATEWAY": "sja-gateway",
    "UI": "sja-ui",
    "ADMIN": "sja-admin",
    "TENANT_ALPHA": "tenant-alpha",
    "TENANT_BETA": "tenant-beta",
}


class Secured:
    """A nats-server with the deployment's configuration and fresh random passwords."""

    def __init__(self, server: EmbeddedNats, passwords: dict[str, str]) -> None:
        self.server = server
        self.passwords = passwords

    @property
    def url(self) -> str:
        return self.server.url

    def auth(self, role: str) -> NatsSettings:
        return NatsSettings(user=USERS[role], password=self.passwords[role])

    def settings(self, role: str, tmp_path: Path, instance: str) -> dict[str, Any]:
        return {
            "nats_url": self.url,
            "out_dir": str(tmp_path / "out"),
            "instance": instance,
            "nats": self.auth(role),
        }


@pytest.fixture
def secured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Secured]:
    passwords = {role: secrets.token_hex(16) for role in ROLES}
    for role, pw in passwords.items():
        monkeypatch.setenv(f"NATS_PASSWORD_{role}", pw)  # read by nats-server through $VAR
    server = EmbeddedNats(
        store_dir=str(tmp_path / "nats"),
        config_file=str(NATS_CONF),
        extra_args=["-m", "0"],
        log_file=str(tmp_path / "nats.log"),
    )
    server.start()
    try:
        yield Secured(server, passwords)
    finally:
        server.stop()


class Conn:
    """A connection that records the permission violations the server reports for it."""

    def __init__(self) -> None:
        self.violations: list[PermissionViolation] = []
        self.nc: Client | None = None

    async def open(self, url: str, name: str, auth: NatsSettings) -> Conn:
        self.nc = await connect(url, name, auth=auth, on_permission_violation=self.violations.append)
        return self

    async def wait_violation(self, subject: str, timeout_s: float = 5.0) -> PermissionViolation:
        found: PermissionViolation = await wait_until(
            lambda: next((v for v in self.violations if v.subject == subject.lower()), None),
            lambda: f"a permissions violation reported for {subject}: {self.violations}",
            timeout_s,
        )
        return found


@contextlib.asynccontextmanager
async def opened(url: str, name: str, auth: NatsSettings) -> AsyncIterator[Conn]:
    conn = await Conn().open(url, name, auth)
    try:
        yield conn
    finally:
        assert conn.nc is not None
        await conn.nc.close()


async def collect(nc: Client, subject: str) -> list[str]:
    seen: list[str] = []

    async def cb(msg: Any) -> None:
        seen.append(msg.subject)

    await nc.subscribe(subject, cb=cb)
    await nc.flush()
    return seen


# --- role separation on the negotiation subjects ---------------------------------------------------


async def test_agent_cannot_publish_offers_or_grants(
    secured: Secured, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="sja.bus.connection")
    url = secured.url
    async with (
        opened(url, "agent-x", secured.auth("AGENT")) as agent,
        opened(url, "clearer-watch", secured.auth("CLEARER")) as clearer,
        opened(url, "agent-watch", secured.auth("AGENT")) as agent_watch,
        opened(url, "advertiser", secured.auth("ADVERTISER")) as advertiser,
    ):
        assert agent.nc and clearer.nc and agent_watch.nc and advertiser.nc
        offers = await collect(clearer.nc, "sja.v1.offer.opened.>")  # the clearer may read offers
        grants = await collect(agent_watch.nc, "sja.v1.grant.issued.>")  # agents may read grants

        await agent.nc.publish("sja.v1.offer.opened.x", b"forged offer")
        await agent.nc.publish("sja.v1.grant.issued.x", b"forged grant")
        await agent.nc.flush()
        v1 = await agent.wait_violation("sja.v1.offer.opened.x")
        v2 = await agent.wait_violation("sja.v1.grant.issued.x")
        assert v1.operation == v2.operation == "publish"

        # Positive control: the roles that own these subjects reach the same subscribers.
        await advertiser.nc.publish("sja.v1.offer.opened.x", b"offer")
        await clearer.nc.publish("sja.v1.grant.issued.x", b"grant")
        for conn in (advertiser, clearer):
            assert conn.nc is not None
            await conn.nc.flush()
        await wait_until(lambda: offers and grants, "the offer and the grant delivered", 2.0)
        assert offers == ["sja.v1.offer.opened.x"], "only the advertiser's offer arrives"
        assert grants == ["sja.v1.grant.issued.x"], "only the clearer's grant arrives"
        assert advertiser.violations == [] and clearer.violations == []

    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("permissions violation" in e and "sja.v1.offer.opened.x" in e for e in errors), errors
    assert any("sja.v1.grant.issued.x" in e for e in errors), errors


async def test_executor_cannot_publish_grants_nor_subjobs(secured: Secured) -> None:
    async with (
        opened(secured.url, "executor-x", secured.auth("EXECUTOR")) as executor,
        opened(secured.url, "agent-watch", secured.auth("AGENT")) as agent,
        opened(secured.url, "clearer", secured.auth("CLEARER")) as clearer,
    ):
        assert executor.nc and agent.nc and clearer.nc
        grants = await collect(agent.nc, "sja.v1.grant.issued.>")
        await executor.nc.publish("sja.v1.grant.issued.agent-1", b"forged grant")
        await executor.nc.publish("sja.v1.subjob.dispatched.local.j", b"forged subjob")
        await executor.nc.publish("sja.v1.subjob.completed.j", b"a completion it may publish")
        await executor.nc.flush()
        await executor.wait_violation("sja.v1.grant.issued.agent-1")
        await executor.wait_violation("sja.v1.subjob.dispatched.local.j")
        # A marker grant from the role that owns the subject, sent once the server has refused the
        # forged one: the server would have routed the forged grant before refusing it, so it would
        # reach the subscriber ahead of the marker.
        await clearer.nc.publish("sja.v1.grant.issued.marker", b"marker")
        await clearer.nc.flush()
        await wait_until(lambda: grants, "the marker grant delivered")
        assert grants == ["sja.v1.grant.issued.marker"], "the forged grant never arrived"
        assert clearer.violations == []
        assert [v.subject for v in executor.violations] == [
            "sja.v1.grant.issued.agent-1",
            "sja.v1.subjob.dispatched.local.j",
        ], "completions are the executor's to publish"


async def test_a_service_logs_and_counts_a_refused_publish(
    secured: Secured, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.ERROR, logger="sja.bus.connection")
    agent = AgentService(AgentSettings(**secured.settings("AGENT", tmp_path, "agent-rogue")))
    async with agent:
        assert agent.permission_violations == 0, "an agent's own work needs no forbidden subject"
        await agent.bus.publish(subjects.grant_issued("agent-rogue"), b"forged")
        await agent.bus.flush()
        await wait_until(lambda: agent.permission_violations, "the refused publish counted", 5.0)
        assert agent.permission_violations == 1
        assert agent.last_permission_violation is not None
        assert agent.last_permission_violation.subject == "sja.v1.grant.issued.agent-rogue"
    logged = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert any("agent-rogue" in m and "sja.v1.grant.issued.agent-rogue" in m for m in logged), logged


async def test_an_agent_cannot_write_slices_nor_delete_the_shared_consumer(
    secured: Secured, tmp_path: Path
) -> None:
    """An agent could forge a lease by writing ``sja-slices``, or stop every agent's intake by
    deleting the shared ``agents`` consumer: the server refuses both, and both stay as they were."""
    inventory = InventoryService(InventorySettings(**secured.settings("INVENTORY", tmp_path, "inventory-0")))
    agent = AgentService(AgentSettings(**secured.settings("AGENT", tmp_path, "agent-0")))
    async with inventory, agent:
        assert inventory.slices is not None
        entries = await inventory.slices.all()
        assert entries, "the inventory declared its slices"
        before = {s.slice_id: rev for s, rev in entries}
        victim = sorted(before)[0]
        async with (
            opened(secured.url, "agent-x", secured.auth("AGENT")) as rogue,
            opened(secured.url, "admin", secured.auth("ADMIN")) as admin,
        ):
            assert rogue.nc and admin.nc
            forged = SliceState(**{**msgspec.structs.asdict(entries[0][0]), "status": "free", "fence": 999})
            await rogue.nc.publish(f"$KV.{subjects.BUCKET_SLICES}.{victim}", encode(forged))
            await rogue.nc.flush()
            await rogue.wait_violation(f"$KV.{subjects.BUCKET_SLICES}.{victim}")

            delete = f"$JS.API.CONSUMER.DELETE.{subjects.STREAM_JOBS.name}.{JOBS_CONSUMER}"
            with pytest.raises(Exception):  # noqa: B017, PT011 - refused: no answer comes
                await rogue.nc.jetstream().delete_consumer(subjects.STREAM_JOBS.name, JOBS_CONSUMER)
            await rogue.wait_violation(delete)
            for other in ("SJA_COMPLETIONS.agent-0", "KV_sja-jobs.x"):
                await rogue.nc.publish(f"$JS.API.CONSUMER.DELETE.{other}", b"")
                await rogue.nc.flush()
                await rogue.wait_violation(f"$JS.API.CONSUMER.DELETE.{other}")

            # Both still as they were: the consumer serves the agents, the slice kept its revision.
            info = await admin.nc.jetstream().consumer_info(subjects.STREAM_JOBS.name, JOBS_CONSUMER)
            assert info.name == JOBS_CONSUMER
            got = await inventory.slices.get(victim)
            assert got is not None and got[1] == before[victim] and got[0].fence != 999
            assert admin.violations == []
        assert agent.permission_violations == 0 and inventory.permission_violations == 0


async def test_an_agent_gives_a_grant_back_through_the_inventory(secured: Secured, tmp_path: Path) -> None:
    """``sja.v1.lease.release``: the inventory frees the slice for the grant that holds it, and
    refuses a grant or fence that does not (a stale or forged release leaves the lease alone)."""
    inventory = InventoryService(InventorySettings(**secured.settings("INVENTORY", tmp_path, "inventory-0")))
    agent = AgentService(AgentSettings(**secured.settings("AGENT", tmp_path, "agent-0")))
    async with inventory, agent:
        assert inventory.slices is not None
        free, rev = (await inventory.slices.all())[0]
        leased = leases.grant(
            free, offered_fence=free.fence, job_id="j1", grant_id="g-1", now=time.time(), lease_s=60.0
        )
        assert await inventory.slices.cas(free.slice_id, leased, rev) is not None

        def grant(grant_id: str, fence: int) -> Grant:
            window = Window(
                slice_id=free.slice_id,
                node=free.node,
                pool=free.pool,
                gpu_model=free.gpu_model,
                profile=free.profile,
                mem_mib=free.mem_mib,
                compute_share=free.compute_share,
                start_s=0.0,
            )
            candidate = Candidate(
                size=1, mem_q_mib=1.0, p_fit_mem=1.0, duration_q_s=1.0, duration_mean_s=1.0, p_fit_time=1.0
            )
            return Grant(
                grant_id=grant_id,
                offer_id="o-1",
                round=1,
                job_id="j1",
                tenant="alpha",
                agent_id="agent-0",
                window=window,
                candidate=candidate,
                fence=fence,
                lease_until=leased.lease_until,
                policy="fair",
                granted_at=0.0,
            )

        assert not await agent.release(grant("g-1", leased.fence + 1), "stale fence")
        assert not await agent.release(grant("g-other", leased.fence), "not its grant")
        still = await inventory.slices.get(free.slice_id)
        assert still is not None and still[0] == leased, (
            "a release that does not hold the lease changes nothing"
        )

        assert await agent.release(grant("g-1", leased.fence), "cannot use it")
        after = await inventory.slices.get(free.slice_id)
        assert after is not None and after[0].status == "free" and after[0].fence == leased.fence
        assert not await agent.release(grant("g-1", leased.fence), "again"), "released once"

        # A malformed request gets a typed error, not silence.
        resp = await agent.bus.request(subjects.LEASE_RELEASE, b"\x01garbage", timeout=5)
        assert decode(resp.data, ErrorReply).code == "bad_request"
        assert agent.permission_violations == 0 and inventory.permission_violations == 0


# --- tenants ---------------------------------------------------------------------------------------


def spec(name: str, tenant: str, units: int = 6) -> JobSpec:
    return JobSpec(name=name, tenant=tenant, workload="montecarlo", params={"units": units})


async def test_a_tenant_submits_and_reads_only_its_own_jobs(secured: Secured, tmp_path: Path) -> None:
    gateway = GatewayService(GatewaySettings(**secured.settings("GATEWAY", tmp_path, "gateway-t")))
    async with gateway:
        alpha = await SjaClient.connect(
            secured.url, tenant="alpha", auth=secured.auth("TENANT_ALPHA"), timeout_s=5
        )
        beta = await SjaClient.connect(
            secured.url, tenant="beta", auth=secured.auth("TENANT_BETA"), timeout_s=5
        )
        try:
            mine = (await alpha.submit(spec("a1", "alpha"))).job_id
            theirs = (await beta.submit(spec("b1", "beta"))).job_id

            # Submitting as another tenant, on one's own subject: the gateway refuses it.
            with pytest.raises(ApiError) as refused:
                await alpha.submit(spec("sneaky", "beta"))
            assert refused.value.error.code == "forbidden" and refused.value.error.field == "spec.tenant"

            # Reading another tenant's job: it does not exist for this tenant.
            assert (await alpha.status(mine)).spec.tenant == "alpha"
            for call in (alpha.status, alpha.cancel, alpha.rounds, alpha.logs):
                with pytest.raises(ApiError) as hidden:
                    await call(theirs)
                assert hidden.value.error.code == "not_found", call
            assert [s.job_id for s in await alpha.jobs()] == [mine]
            assert (await alpha.logs(mine)).subjobs == []  # its own: readable (nothing ran yet)
            with pytest.raises(ApiError, match="forbidden"):
                await alpha.jobs(tenant="beta")
            assert (await beta.status(theirs)).status == "pending", "beta's job was not cancelled"
        finally:
            await alpha.close()
            await beta.close()

        # Using beta's subjects with alpha's credentials: the server refuses the publish, and the
        # client says so at once instead of timing out.
        pretender = await SjaClient.connect(
            secured.url, tenant="beta", auth=secured.auth("TENANT_ALPHA"), timeout_s=30
        )
        try:
            for call, arg in ((pretender.status, theirs), (pretender.submit, spec("b2", "beta"))):
                with pytest.raises(ApiError) as denied:
                    await asyncio.wait_for(call(arg), timeout=5)  # type: ignore[operator]
                assert denied.value.error.code == "forbidden"
                assert "sja.v1.job." in denied.value.error.message
        finally:
            await pretender.close()

        # The operator sees every tenant's jobs, through the operator subjects.
        admin = await SjaClient.connect(secured.url, auth=secured.auth("ADMIN"), timeout_s=5)
        try:
            assert {s.job_id for s in await admin.jobs()} == {mine, theirs}
            assert (await admin.logs(theirs)).subjobs == []
        finally:
            await admin.close()
        assert gateway.submitted == 2


async def test_a_tenant_has_no_other_way_in(secured: Secured) -> None:
    """The operator API, JetStream, the job stream and other users' replies are closed to a tenant."""
    async with opened(secured.url, "tenant-cli", secured.auth("TENANT_ALPHA")) as tenant:
        assert tenant.nc is not None
        for subject in (
            subjects.JOB_SUBMIT,  # the operator's (unscoped) API
            "$JS.API.STREAM.INFO.SJA_JOBS",  # JetStream
            "$KV.sja-jobs.some-job",  # job state
            subjects.job_submitted("alpha-job"),  # the submission stream
            subjects.JOB_CANCEL_REQUESTED,
        ):
            await tenant.nc.publish(subject, b"x")
        for subject in ("_INBOX.>", "_INBOX.sja-gateway.>", "sja.v1.>", "$KV.sja-jobs.>"):
            await tenant.nc.subscribe(subject)
        await tenant.nc.flush()
        await wait_until(lambda: len(tenant.violations) >= 9, "nine permissions violations reported", 2.0)
        refused = {(v.operation, v.subject) for v in tenant.violations}
        assert ("publish", "sja.v1.job.submit") in refused
        assert ("publish", "$js.api.stream.info.sja_jobs") in refused
        assert ("publish", "sja.v1.job.submitted.alpha-job") in refused
        assert ("subscription", "_inbox.>") in refused
        assert ("subscription", "sja.v1.>") in refused
        assert len(refused) == 9, refused


def cli(*args: str, url: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SJA_")}
    full.update(env, SJA_NATS_URL=url, COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "sja.cli.main", *args], capture_output=True, text=True, env=full, timeout=60
    )


async def test_cli_uses_tenant_and_operator_credentials(secured: Secured, tmp_path: Path) -> None:
    gateway = GatewayService(GatewaySettings(**secured.settings("GATEWAY", tmp_path, "gateway-t")))
    job = tmp_path / "job.yaml"
    job.write_text("name: cli-a\ntenant: alpha\nworkload: montecarlo\nparams: {units: 4}\n")
    other = tmp_path / "other.yaml"
    other.write_text("name: cli-b\ntenant: beta\nworkload: montecarlo\nparams: {units: 4}\n")
    pw_file = tmp_path / "alpha.password"
    pw_file.write_text(secured.passwords["TENANT_ALPHA"] + "\n")
    alpha_env = {
        "SJA_NATS_USER": "tenant-alpha",
        "SJA_NATS_PASSWORD_FILE": str(pw_file),
        "SJA_TENANT": "alpha",
    }
    async with gateway:
        url = secured.url
        r = await asyncio.to_thread(cli, "submit", str(job), url=url, env=alpha_env)
        assert r.returncode == 0, r.stderr
        job_id = r.stdout.strip()
        r = await asyncio.to_thread(cli, "submit", str(other), url=url, env=alpha_env)
        assert r.returncode == 2 and "forbidden" in r.stderr and "spec.tenant" in r.stderr
        r = await asyncio.to_thread(
            cli,
            "submit",
            str(other),
            "--user",
            "tenant-beta",
            "--password",
            secured.passwords["TENANT_BETA"],
            "--tenant",
            "beta",
            url=url,
            env={},
        )
        assert r.returncode == 0, r.stderr
        beta_id = r.stdout.strip()
        r = await asyncio.to_thread(cli, "status", beta_id, url=url, env=alpha_env)
        assert r.returncode == 2 and "not_found" in r.stderr
        r = await asyncio.to_thread(cli, "jobs", url=url, env=alpha_env)
        assert r.returncode == 0 and job_id in r.stdout and beta_id not in r.stdout
        admin_env = {"SJA_NATS_USER": "sja-admin", "SJA_NATS_PASSWORD": secured.passwords["ADMIN"]}
        r = await asyncio.to_thread(cli, "jobs", url=url, env=admin_env)
        assert r.returncode == 0 and job_id in r.stdout and beta_id in r.stdout
        r = await asyncio.to_thread(cli, "jobs", url=url, env={**admin_env, "SJA_NATS_PASSWORD": "wrong"})
        assert r.returncode == 2 and "refused the credentials" in r.stderr


# --- the services with their users -----------------------------------------------------------------


async def test_services_with_their_own_users_negotiate_end_to_end(secured: Secured, tmp_path: Path) -> None:
    """Inventory, gateway, clearer, agent and advertiser each connect as their own user; a tenant's job
    goes through offer, replies, clearing and grant to a subjob that the executor's user can take."""

    def s(role: str, instance: str) -> dict[str, Any]:
        return secured.settings(role, tmp_path, instance)

    inventory = InventoryService(InventorySettings(**s("INVENTORY", "inventory-0")))
    gateway = GatewayService(GatewaySettings(**s("GATEWAY", "gateway-0")))
    clearer = ClearerService(ClearerSettings(**s("CLEARER", "clearer-0"), policy="fair"))
    agent = AgentService(AgentSettings(**s("AGENT", "agent-0"), horizon_s=4.0))
    advertiser = AdvertiserService(AdvertiserSettings(**s("ADVERTISER", "advertiser-0"), horizon_s=4.0))
    services: list[Service] = [inventory, gateway, clearer, agent, advertiser]
    async with contextlib.AsyncExitStack() as stack:
        for svc in services:  # the inventory first: it declares the slices, as in compose
            await stack.enter_async_context(svc)
        executor = await stack.enter_async_context(
            opened(secured.url, "executor-0", secured.auth("EXECUTOR"))
        )
        watcher = await stack.enter_async_context(opened(secured.url, "agent-watch", secured.auth("AGENT")))
        assert executor.nc and watcher.nc
        grants: list[Grant] = []

        async def on_grant(msg: Any) -> None:
            grants.extend(decode_grants(msg.data))

        await watcher.nc.subscribe(subjects.grant_issued("*"), cb=on_grant)
        client = await SjaClient.connect(
            secured.url, tenant="alpha", auth=secured.auth("TENANT_ALPHA"), timeout_s=5
        )
        try:
            job_id = (
                await client.submit(
                    JobSpec(
                        name="e2e",
                        tenant="alpha",
                        workload="montecarlo",
                        params={"units": 2000, "samples_per_unit": 100_000, "seed": 1},
                    )
                )
            ).job_id
            # The executor's view: its durable pull consumer on the subjob work queue.
            sub = await executor.nc.jetstream().pull_subscribe(
                f"{subjects.PREFIX}.subjob.dispatched.local.>",
                durable="executor-local",
                stream=subjects.STREAM_SUBJOBS.name,
                config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT),
            )
            subjob: Subjob | None = None
            for _ in range(20):
                with contextlib.suppress(TimeoutError):
                    msgs = await sub.fetch(1, timeout=1)
                    subjob = decode(msgs[0].data, Subjob)
                    await msgs[0].ack()
                    break
            assert subjob is not None and subjob.job_id == job_id, "no subjob was dispatched"
            assert any(g.grant_id == subjob.grant_id for g in grants)
            rounds = await wait_until(
                lambda: client.rounds(job_id), "the job's rounds recorded", 5.0, every_s=0.1
            )
            assert rounds and any(r.winner_job == job_id for r in rounds)
            assert (await client.status(job_id)).status == "running"
        finally:
            await client.close()
        for svc in services:
            assert svc.permission_violations == 0, (svc.instance, svc.last_permission_violation)
        assert executor.violations == [] and watcher.violations == []
    log = (tmp_path / "nats.log").read_text(errors="replace").lower()
    assert "violation" not in log, [ln for ln in log.splitlines() if "violation" in ln][:5]


async def test_the_dashboard_reads_with_its_own_user_and_may_write_nothing(
    secured: Secured, tmp_path: Path
) -> None:
    """The ui service as ``sja-ui``: it reads the buckets, the round records and the gateway's
    explanations without a refused publish or subscribe, and may not submit, cancel or write a
    bucket, a stream or a negotiation subject."""

    def s(role: str, instance: str) -> dict[str, Any]:
        return secured.settings(role, tmp_path, instance)

    inventory = InventoryService(InventorySettings(**s("INVENTORY", "inventory-0")))
    gateway = GatewayService(GatewaySettings(**s("GATEWAY", "gateway-0")))
    ui = UiService(UiSettings(**s("UI", "ui-0"), ui_port=0, ui_host="127.0.0.1"))
    async with inventory, gateway, ui:
        client = await SjaClient.connect(secured.url, tenant="alpha", auth=secured.auth("TENANT_ALPHA"))
        try:
            job_id = (await client.submit(JobSpec(name="seen", tenant="alpha", workload="montecarlo"))).job_id
        finally:
            await client.close()
        overview = await ui.overview()
        assert len(overview["slices"]) == 6 and [j["job_id"] for j in overview["jobs"]] == [job_id]
        page = await ui.job(job_id)
        assert page is not None and page["explanation"]["by"] == "gateway"
        # A tenant's view asks the gateway on the tenant's own subjects, also without a refusal.
        mine = await ui.job(job_id, Viewer("alpha"))
        assert mine is not None and mine["explanation"]["by"] == "gateway"
        assert await ui.job(job_id, Viewer("beta")) is None
        assert ui.permission_violations == 0, ui.last_permission_violation
        async with opened(secured.url, "ui-probe", secured.auth("UI")) as probe:
            assert probe.nc is not None
            refused = (
                "sja.v1.job.submit",
                "sja.v1.job.cancel",
                "sja.v1.job.cancel_requested",
                f"$KV.sja-jobs.{job_id}",
                "$KV.sja-slices.x",
                "sja.v1.round.cleared.x",
                "sja.v1.grant.issued.x",
                "$JS.API.STREAM.PURGE.SJA_ROUNDS",
            )
            for subject in refused:
                await probe.nc.publish(subject, b"x")
            await probe.nc.flush()
            for subject in refused:
                assert (await probe.wait_violation(subject)).operation == "publish"


# --- credentials -----------------------------------------------------------------------------------


async def test_a_service_user_may_not_change_a_stream_and_is_told_who_may(secured: Secured) -> None:
    """Services create SJA's streams (with the copies ``SJA_JS_REPLICAS`` asks) but may not edit one
    that exists: a service asked for more copies than a stream has stops with a message saying
    the operator raises it, and the stream is as it was."""
    async with opened(secured.url, "gateway-r3", secured.auth("GATEWAY")) as gw:
        assert gw.nc is not None
        js = gw.nc.jetstream(timeout=2.0)
        await ensure_jetstream(js)  # one copy each, as a one-server deployment made them
        with pytest.raises(JetStreamReplicasError) as refused:
            await ensure_jetstream(js, replicas=3)
        said = str(refused.value)
        assert "SJA_JS_REPLICAS=3" in said and "as the operator" in said, said
        assert "nats stream edit SJA_JOBS --replicas 3" in said, said
        v = await gw.wait_violation("$JS.API.STREAM.UPDATE.SJA_JOBS")
        assert v.operation == "publish"
        assert (await js.stream_info("SJA_JOBS")).config.num_replicas == 1


async def test_wrong_credentials_fail_fast_and_clearly(secured: Secured, tmp_path: Path) -> None:
    with pytest.raises(NatsAuthError, match=r"refused the credentials.*sja-agent"):
        await asyncio.wait_for(
            connect(secured.url, "t", auth=NatsSettings(user="sja-agent", password="nope")), 10
        )
    with pytest.raises(NatsAuthError):
        await asyncio.wait_for(connect(secured.url, "t"), 10)  # no credentials at all
    pw = tmp_path / "pw"
    pw.write_text(f"  {secured.passwords['AGENT']}\n")
    nc = await connect(secured.url, "t", auth=NatsSettings(user="sja-agent", password_file=str(pw)))
    await nc.close()


def test_inconsistent_options_fail_before_connecting(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    pw.write_text("x")
    for auth, message in (
        (NatsSettings(user="u", password="p", password_file=str(pw)), "not both"),
        (NatsSettings(password="p"), "needs a user"),
        (NatsSettings(user="u", password_file=str(tmp_path / "missing")), "cannot read"),
        (NatsSettings(creds=str(tmp_path / "missing.creds")), "does not exist"),
        (NatsSettings(tls_cert=str(pw)), "needs its key"),
        (NatsSettings(tls_ca=str(tmp_path / "missing.pem")), "bad NATS TLS files"),
    ):
        with pytest.raises(NatsConfigError, match=message):
            auth.connect_options()
    assert repr(NatsSettings(user="u", password="sekrit")) == "NatsSettings(user 'u')"
    assert NatsSettings(user="tenant-alpha").effective_inbox_prefix() == "_INBOX.tenant-alpha"
    assert NatsSettings(user="a.b*c").effective_inbox_prefix() == "_INBOX.a_b_c"
    assert NatsSettings().effective_inbox_prefix() == "_INBOX"
    v = parse_permission_violation('nats: permissions violation for publish to "sja.v1.offer.opened.x"')
    assert v == PermissionViolation("publish", "sja.v1.offer.opened.x", v.message if v else "")
    assert parse_permission_violation("nats: stale connection") is None


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture
def tls_files(tmp_path: Path) -> dict[str, Path]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    d = tmp_path / "tls"
    d.mkdir()
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    _openssl(
        "req",
        "-x509",
        *ec,
        "-keyout",
        "ca.key",
        "-out",
        "ca.crt",
        "-days",
        "1",
        "-subj",
        "/CN=sja-test-ca",
        cwd=d,
    )
    for name, ext in (
        ("server", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ("client", "extendedKeyUsage=clientAuth"),
    ):
        _openssl(
            "req", *ec, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN=sja-{name}", cwd=d
        )
        (d / f"{name}.ext").write_text(ext + "\n")
        _openssl(
            "x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.crt", "-days", "1", "-extfile", f"{name}.ext", cwd=d,
        )  # fmt: skip
    return {p.stem + p.suffix.replace(".", "_"): p for p in d.iterdir()}


async def test_tls_with_a_client_certificate(tls_files: dict[str, Path], tmp_path: Path) -> None:
    f = tls_files
    server = EmbeddedNats(
        store_dir=str(tmp_path / "nats-tls"),
        extra_args=[
            "--tlscert", str(f["server_crt"]), "--tlskey", str(f["server_key"]),
            "--tlscacert", str(f["ca_crt"]), "--tlsverify",
        ],
        log_file=str(tmp_path / "nats-tls.log"),
    )  # fmt: skip
    with server:
        auth = NatsSettings(
            tls_ca=str(f["ca_crt"]), tls_cert=str(f["client_crt"]), tls_key=str(f["client_key"])
        )
        nc = await connect(server.url, "tls-client", auth=auth)
        try:
            assert nc.is_connected
            seen = await collect(nc, "sja.v1.agent.heartbeat")
            await nc.publish(
                subjects.AGENT_HEARTBEAT,
                encode(AgentHeartbeat(agent_id="tls-agent", jobs=0, sent_at=0.0, interval_s=1.0)),
            )
            await nc.flush()
            await wait_until(lambda: seen, "the heartbeat delivered over TLS", 1.0)
            assert seen == [subjects.AGENT_HEARTBEAT]
        finally:
            await nc.close()
        # Without a client certificate the server refuses the handshake: no connection.
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(
                connect(server.url, "no-cert", auth=NatsSettings(tls_ca=str(f["ca_crt"]))), 2
            )


def test_a_tenant_sees_other_tenants_bids_anonymized() -> None:
    from services.gateway.service import OTHER, anonymize_round
    from sja.protocol.messages import RoundRecord, Verdict, Window

    window = Window(
        slice_id="local-g0-1g.5gb-2",
        node="local",
        pool="local",
        gpu_model="A100-40GB",
        profile="1g.5gb",
        mem_mib=4864,
        compute_share=1 / 7,
        start_s=0.0,
        end_s=4.0,
    )
    record = RoundRecord(
        offer_id="o-1",
        round=1,
        window=window,
        policy="fair",
        replies_from=["agent-0", "agent-1"],
        verdicts=[
            Verdict(
                job_id="beta-job-1",
                tenant="beta",
                agent_id="agent-1",
                won=True,
                reason="won: share 0.1",
                size=5,
            ),
            Verdict(
                job_id="alpha-job-1",
                tenant="alpha",
                agent_id="agent-0",
                won=False,
                reason="lost to beta-job-1: share 0.6 vs share 0.1",
                size=3,
            ),
        ],
        winner_job="beta-job-1",
        note="beta-job-1 took the slice",
    )
    seen = anonymize_round(record, "alpha")
    assert seen.winner_job == OTHER and "beta" not in seen.note
    other, mine = seen.verdicts
    assert (other.job_id, other.tenant, other.reason, other.won, other.size) == (OTHER, OTHER, "won", True, 5)
    assert mine.job_id == "alpha-job-1" and mine.reason == f"lost to {OTHER}: share 0.6 vs share 0.1"
    assert "beta" not in repr(seen)
    assert anonymize_round(record, "beta").verdicts[0] == record.verdicts[0], (
        "a tenant's own bids stay as they are"
    )
