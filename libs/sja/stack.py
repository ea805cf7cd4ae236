"""The one-machine stack: an embedded nats-server and every service as its own process."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from sja.bus import roles
from sja.bus.auth import Credentials, NatsSettings, private_dir, write_credentials
from sja.bus.connection import connect
from sja.bus.natsclient import Client
from sja.bus.natsd import EmbeddedNats, die_with_parent, free_port

DEFAULT_ORDER = ("inventory", "gateway", "clearer", "agent", "executor", "advertiser")
UP_ORDER = (*DEFAULT_ORDER, "ui")
"""What ``sja up`` runs: the scheduler's services and the dashboard (which only reads)."""

DEFAULT_TENANTS = ("alpha", "beta", "prod", "research")
"""The tenants ``sja up`` makes users for unless told others (those of the examples and the demo)."""

CREDENTIALS_DIR = "credentials"
"""Under a stack's ``out_dir``: its credentials (0700), the server's configuration and one file per
user (0600): ``nats.conf``, ``sja-admin.json``, ``tenant-<name>.json``, ``services/sja-<service>.json``."""

_CREDENTIAL_VARIABLES = ("SJA_NATS_USER", "SJA_NATS_PASSWORD", "SJA_NATS_PASSWORD_FILE", "SJA_NATS_CREDS")


async def discover(nc: Client, wait_s: float = 0.5) -> dict[str, str]:
    """instance id -> micro service name (``sja-<service>``) of every service that answers NATS
    micro discovery (``$SRV.PING``) within ``wait_s``."""
    inbox = nc.new_inbox()
    sub = await nc.subscribe(inbox)
    await nc.publish("$SRV.PING", b"", reply=inbox)
    seen: dict[str, str] = {}
    end = time.monotonic() + wait_s
    try:
        while time.monotonic() < end:
            try:
                msg = await sub.next_msg(timeout=max(0.01, end - time.monotonic()))
            except TimeoutError:
                break
            with contextlib.suppress(ValueError, KeyError):  # a status message (no responders)
                info = json.loads(msg.data)
                seen[info["metadata"]["instance"]] = info["name"]
    finally:
        await sub.unsubscribe()
    return seen


@dataclass
class ServiceProc:
    name: str
    """A service's name, or several joined by commas (co-hosted in this process)."""
    instance: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    @property
    def instances(self) -> list[str]:
        """The instance ids of the services in the process (``<service>-<index>`` each)."""
        if "," not in self.name:
            return [self.instance]
        index = self.instance.rpartition("-")[2]
        return [f"{n}-{index}" for n in self.name.split(",")]


def _reap(procs: list[ServiceProc]) -> None:
    """SIGKILL the process groups of ``procs`` still running, and wait for them."""
    for p in procs:
        if p.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.proc.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.proc.wait(timeout=5)
    procs.clear()


@dataclass
class LocalStack:
    """Starts nats-server (JetStream, store under ``out_dir``) and the services as child processes.

    ``env`` holds ``SJA_*`` settings for every service; ``service_env`` per service name (a
    co-hosted process gets those of each of its services). ``groups`` lists services that run
    together in one process (``sja service a,b``), one replica each.

    ``auth``: the server takes only the users of ``sja.bus.roles`` (the services', the operator's
    and one per tenant of ``tenants``) with passwords made at start, written to files under
    ``<out_dir>/credentials`` that only their owner can read (``prepare_auth``); each service reads
    its own through ``SJA_NATS_CREDENTIALS``, never a password in its environment. ``credentials``
    and ``client_auth`` give the operator's (or a tenant's) to a client.
    """

    out_dir: Path
    env: Mapping[str, str] = field(default_factory=dict)
    service_env: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    replicas: Mapping[str, int] = field(default_factory=dict)
    groups: Sequence[Sequence[str]] = ()
    nats_url: str = ""
    nats: EmbeddedNats | None = None
    procs: list[ServiceProc] = field(default_factory=list)
    auth: bool = False
    tenants: Sequence[str] = DEFAULT_TENANTS

    def __post_init__(self) -> None:
        # A stack dropped without ``stop`` (its owner interrupted, a test timed out in its teardown)
        # still takes its processes with it when it is collected, or at the latest at exit: no
        # service outlives the stack that started it.
        weakref.finalize(self, _reap, self.procs)

    @property
    def credentials_dir(self) -> Path:
        return self.out_dir / CREDENTIALS_DIR

    def credentials(self, user: str = roles.ADMIN) -> Path:
        """The credentials file of ``user`` (the operator's by default, or ``tenant-<name>``)."""
        if user.startswith("sja-") and user != roles.ADMIN:
            return self.credentials_dir / "services" / f"{user}.json"
        return self.credentials_dir / f"{user}.json"

    def client_auth(self, user: str = roles.ADMIN) -> NatsSettings | None:
        """How a client connects as ``user`` (``None`` when the stack runs without ``auth``)."""
        return NatsSettings(credentials=str(self.credentials(user))) if self.auth else None

    def prepare_auth(self, url: str) -> Path:
        """Make a password for every user, write each to its own file (0600, directories 0700) with
        ``url``, and the server's configuration; returns the configuration's path."""
        users = roles.roles(self.tenants)
        passwords = roles.generate_passwords(users)
        base = private_dir(self.credentials_dir)
        private_dir(base / "services")
        for role in users:
            creds = Credentials(user=role.user, password=passwords[role.user], url=url, tenant=role.tenant)
            write_credentials(self.credentials(role.user), creds)
        conf = base / "nats.conf"
        tmp = base / ".nats.conf.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write("# Made by `sja up` from sja.bus.roles, with this run's passwords.\n")
            f.write(roles.authorization_block(users, passwords))
        os.replace(tmp, conf)
        return conf

    def start_nats(self) -> str:
        if self.nats_url:
            return self.nats_url
        store = self.out_dir / "nats"
        store.mkdir(parents=True, exist_ok=True)
        self.nats = EmbeddedNats(store_dir=str(store), log_file=str(self.out_dir / "logs" / "nats.log"))
        if self.auth:
            self.nats.port = free_port()
            self.nats.config_file = str(self.prepare_auth(self.nats.url))
        (self.out_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.nats.start()
        self.nats_url = self.nats.url
        return self.nats_url

    def service_environment(self, name: str, instance: str) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        for n in name.split(","):
            env.update(self.service_env.get(n, {}))
        env["SJA_NATS_URL"] = self.nats_url
        if self.auth:
            # Each service's own file (a co-hosted process: each of its services' own); no password
            # in the environment, where any process of this uid could read it.
            for key in _CREDENTIAL_VARIABLES:
                env.pop(key, None)
            env["SJA_NATS_CREDENTIALS"] = str(self.credentials_dir / "services")
        env["SJA_OUT_DIR"] = str(self.out_dir)
        # Co-hosted services are named <service>-<SJA_INSTANCE>: the index alone gives each the id
        # it would have in a process of its own.
        env["SJA_INSTANCE"] = instance.rpartition("-")[2] if "," in name else instance
        env.setdefault("PYTHONUNBUFFERED", "1")
        base_port = int(env.get("SJA_METRICS_PORT", "0") or 0)
        if base_port:
            # One machine, one port each: the n-th process started gets base + n.
            env["SJA_METRICS_PORT"] = str(base_port + len(self.procs))
        return env

    def spawn(self, name: str, index: int = 0) -> ServiceProc:
        instance = f"{name}-{index}"
        log_path = self.out_dir / "logs" / f"{instance}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = log_path.open("ab")
        proc = subprocess.Popen(
            [sys.executable, "-m", "sja.cli.main", "service", name],
            env=self.service_environment(name, instance),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        log.close()
        sp = ServiceProc(name, instance, proc, log_path)
        self.procs.append(sp)
        return sp

    def processes(self, order: tuple[str, ...] = DEFAULT_ORDER) -> list[str]:
        """The processes ``start`` runs, in order: a service's name, or a group's names joined by
        commas (in ``order``), placed where its first member comes."""
        out: list[str] = []
        grouped: dict[str, str] = {}
        for group in self.groups:
            members = [n for n in order if n in group]
            missing = sorted(set(group) - set(members))
            if missing:
                raise ValueError(f"co-hosted service {missing[0]!r} is not among {', '.join(order)}")
            for n in members:
                if n in grouped:
                    raise ValueError(f"service {n!r} is in two co-hosted groups")
                if self.replicas.get(n, 1) != 1:
                    raise ValueError(f"co-hosted service {n!r} runs one replica, not {self.replicas[n]}")
                grouped[n] = ",".join(members)
        for name in order:
            proc = grouped.get(name, name)
            if proc not in out:
                out.append(proc)
        return out

    def start(self, order: tuple[str, ...] = DEFAULT_ORDER) -> None:
        """Start NATS, then the inventory's process (and wait for it: executors need its slices),
        then the rest. Call ``wait_ready`` afterwards."""
        procs = self.processes(order)
        self.start_nats()
        first, rest = procs[:1], procs[1:]
        for name in first:
            for i in range(self.replicas.get(name, 1)):
                self.spawn(name, i)
        asyncio.run(self.wait_ready())
        for name in rest:
            for i in range(self.replicas.get(name, 1)):
                self.spawn(name, i)

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait until every spawned service answers NATS micro discovery (``$SRV.PING``)."""
        nc = await connect(self.nats_url, "sja-supervisor", auth=self.client_auth())
        try:
            expected = {i for p in self.procs for i in p.instances}
            deadline = time.monotonic() + timeout_s
            seen: set[str] = set()
            while time.monotonic() < deadline:
                for p in self.procs:
                    if p.proc.poll() is not None:
                        tail = p.log_path.read_text(errors="replace")[-3000:]
                        raise RuntimeError(f"service {p.instance} exited early:\n{tail}")
                seen.update(await discover(nc))
                if expected <= seen:
                    return
            missing = ", ".join(sorted(expected - seen))
            raise TimeoutError(f"services not ready after {timeout_s:.0f}s: {missing}")
        finally:
            await nc.close()

    def process_of(self, instance: str) -> ServiceProc:
        """The running process with that instance id, or the one hosting the service of that id."""
        for p in self.procs:
            if instance in (p.instance, *p.instances) and p.proc.poll() is None:
                return p
        raise KeyError(instance)

    def kill(self, instance: str) -> ServiceProc:
        """SIGKILL one service process and everything it started (crash test): the process with
        that instance id, or the one hosting the service of that id. ``restart`` takes the
        returned process's ``instance``."""
        p = self.process_of(instance)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.proc.pid, signal.SIGKILL)
        p.proc.wait(timeout=10)
        self.procs.remove(p)
        return p

    def restart(self, instance: str) -> ServiceProc:
        """Start a killed replica again under the same instance id (it resumes its durable state)."""
        name, _, index = instance.rpartition("-")
        return self.spawn(name, int(index))

    def stop(self, timeout_s: float = 20.0) -> None:
        for p in reversed(self.procs):
            if p.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        for p in self.procs:
            remaining = max(0.1, deadline - time.monotonic())
            try:
                p.proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.proc.pid, signal.SIGKILL)
                p.proc.wait(timeout=5)
        self.procs.clear()
        if self.nats is not None:
            self.nats.stop()
            self.nats = None

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
