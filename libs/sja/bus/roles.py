"""Who may publish and subscribe to what on the bus: the one description of the NATS users and
their permissions, from which both servers are configured.

- ``sja up`` (``sja.stack.LocalStack`` with ``auth``) renders ``authorization_block`` with fresh
  random passwords (``generate_passwords``) into its server's configuration;
- the deployment's ``infra/nats/auth.conf`` is this module's output with each password read from
  the server's environment (``python -m sja.bus.roles > infra/nats/auth.conf``; a test keeps the file
  up to date).

Users: one per service (``sja-<service>``; every replica of a service shares its user), the operator
(``sja-admin``, for the ``sja`` and ``nats`` CLIs) and one per tenant (``tenant-<name>``).

Rules every service user follows:

- replies: a client of user U receives its replies on ``_INBOX.U.>`` (``sja.bus.connection.connect``
  sets that inbox prefix from the user name), so no user can read another's replies; services answer
  requests they received through ``allow_responses`` (one reply per request);
- discovery: each service serves NATS micro discovery (``$SRV.PING|INFO|STATS[.sja-<service>[.<id>]]``)
  and may ping its own kind (its container health check);
- JetStream: the JetStream API to read streams and buckets, and to declare SJA's own streams and
  buckets at start (idempotent); never to delete, purge, update or snapshot them. Consumers: only
  those the role uses: the create, info and next subjects of its own durable consumers, and the
  creation of ephemeral (ordered) consumers on the streams it reads (KV watches and listings); no
  role may delete a consumer;
- writes: each service publishes only the subjects, streams and KV buckets its role writes;
  acknowledgements only on the streams it consumes.

Tenants get no JetStream or KV access at all: only their own gateway request subjects (the gateway
answers them for that tenant's jobs only, final states included: ``sja.v1.job.state.<tenant>``).

Subjects are listed in ``sja.protocol.subjects``; keep both in step.
"""

from __future__ import annotations

import re
import secrets
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from sja.protocol import subjects

SERVICES = ("inventory", "advertiser", "clearer", "agent", "executor", "gateway", "ui")
"""The services with a user of their own (``sja-<service>``)."""

ADMIN = "sja-admin"
TENANT_PREFIX = "tenant-"
TENANT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}$")


JS_READ = (
    "$JS.API.INFO",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.INFO.*",
    "$JS.API.STREAM.MSG.GET.*",
    "$JS.API.DIRECT.GET.>",
)
"""Reading streams and buckets (their info, a message by sequence or subject)."""

JS_DECLARE = (
    "$JS.API.STREAM.CREATE.SJA_JOBS",
    "$JS.API.STREAM.CREATE.SJA_SUBJOBS",
    "$JS.API.STREAM.CREATE.SJA_COMPLETIONS",
    "$JS.API.STREAM.CREATE.SJA_ROUNDS",
    "$JS.API.STREAM.CREATE.KV_sja-slices",
    "$JS.API.STREAM.CREATE.KV_sja-jobs",
)
"""Declaring SJA's streams and buckets at start (idempotent: never changes one that exists)."""


def _ephemeral(stream: str) -> tuple[str, ...]:
    """Ordered (ephemeral) consumers on ``stream``: KV watches, listings, object reads."""
    return (
        f"$JS.API.CONSUMER.CREATE.{stream}",
        f"$JS.API.CONSUMER.CREATE.{stream}.>",
        f"$JS.API.CONSUMER.INFO.{stream}.*",
    )


def _requests(tenant: str = "") -> tuple[str, ...]:
    """The gateway's request subjects: the operator's, or a tenant's own."""
    return tuple(subjects.tenant_request(r, tenant) if tenant else r for r in subjects.JOB_REQUESTS)


def _discovery(user: str) -> tuple[str, ...]:
    return ("_INBOX." + user + ".>", "$SRV.*", f"$SRV.*.{user}", f"$SRV.*.{user}.*")


@dataclass(frozen=True)
class Role:
    """A NATS user and what it may do."""

    user: str
    password_var: str
    """The variable holding its password in the deployment (``NATS_PASSWORD_<...>``)."""
    doc: str
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    allow_responses: bool = True
    tenant: str = ""


def _service(name: str, doc: str, publish: Iterable[str], subscribe: Iterable[str] = ()) -> Role:
    user = f"sja-{name}"
    return Role(
        user=user,
        password_var=f"NATS_PASSWORD_{name.upper()}",
        doc=doc,
        publish=(*JS_READ, *publish, *JS_DECLARE, f"$SRV.PING.{user}"),
        subscribe=(*_discovery(user), *subscribe),
    )


def service_roles() -> tuple[Role, ...]:
    """The services' users, in the order of ``SERVICES``."""
    slices = _ephemeral("KV_sja-slices")
    jobs = _ephemeral("KV_sja-jobs")
    rounds = _ephemeral("SJA_ROUNDS")
    checkpoints = _ephemeral("OBJ_sja-checkpoints")
    code = _ephemeral("OBJ_sja-code")
    return (
        _service(
            "inventory",
            "declares slices (KV sja-slices), frees slices whose lease ran out, and frees a slice whose "
            "holder gives its grant back (sja.v1.lease.release, checked by grant and fence); with "
            "re-cutting on, reads the jobs waiting (KV sja-jobs) and asks a drained slice's holder to "
            "yield (sja.v1.slice.yield).",
            (*slices, *jobs, "$KV.sja-slices.>", "sja.v1.slice.yield.>"),
            ("sja.v1.lease.release",),
        ),
        _service(
            "advertiser",
            "reads sja-slices, publishes offers.",
            (*slices, "sja.v1.offer.opened.>"),
            ("sja.v1.agent.demand_changed",),
        ),
        _service(
            "clearer",
            "collects replies, takes the slice (KV sja-slices), publishes grants, outcomes and round "
            "records, asks a slice's executor to make the holder yield when another job won the "
            "slice it continues on (sja.v1.slice.yield), and reads the round records back at start "
            "(its fairness ledger); serves the live policy switch.",
            (
                *slices,
                *rounds,
                "$KV.sja-slices.>",
                "sja.v1.grant.issued.>",
                "sja.v1.offer.outcome.>",
                "sja.v1.round.cleared.>",
                "sja.v1.slice.yield.>",
            ),
            (
                "sja.v1.offer.opened.>",
                "sja.v1.offer.replied.>",
                "sja.v1.agent.heartbeat",
                "sja.v1.clearer.policy",
            ),
        ),
        _service(
            "agent",
            "claims jobs (SJA_JOBS, KV sja-jobs) and takes over those of silent agents (it hears their "
            "heartbeats), replays every submission (an ordered consumer on SJA_JOBS) on the slices (a "
            "watch of KV sja-slices) as the rigid reference, replies to offers, materializes subjobs into"
            " SJA_SUBJOBS (each with its secret: sja.core.proofs), gives back a slice it cannot use (a "
            "request to the inventory: it never writes KV sja-slices), folds completions that prove their"
            " grant. It may not publish offers, grants, outcomes, round records or completions, nor "
            "delete a consumer: it may only create, read and pull from the shared `agents` consumer and "
            "the per-agent ones on SJA_COMPLETIONS.",
            (
                *jobs,
                *slices,
                *_ephemeral("SJA_JOBS"),
                "$JS.API.CONSUMER.INFO.SJA_JOBS.agents",
                "$JS.API.CONSUMER.CREATE.SJA_JOBS.agents.>",
                "$JS.API.CONSUMER.MSG.NEXT.SJA_JOBS.agents",
                "$JS.API.CONSUMER.INFO.SJA_COMPLETIONS.*",
                "$JS.API.CONSUMER.CREATE.SJA_COMPLETIONS.*.>",
                "$JS.API.CONSUMER.MSG.NEXT.SJA_COMPLETIONS.*",
                "$KV.sja-jobs.>",
                "$JS.ACK.SJA_JOBS.>",
                "$JS.ACK.SJA_COMPLETIONS.>",
                "sja.v1.offer.replied.>",
                "sja.v1.agent.heartbeat",
                "sja.v1.agent.demand_changed",
                "sja.v1.subjob.dispatched.>",
                "sja.v1.lease.release",
            ),
            (
                "sja.v1.offer.opened.>",
                "sja.v1.grant.issued.>",
                "sja.v1.offer.outcome.>",
                "sja.v1.job.cancel_requested",
                "sja.v1.agent.heartbeat",
            ),
        ),
        _service(
            "executor",
            "takes subjobs from SJA_SUBJOBS, marks slices busy and free (KV sja-slices), publishes "
            "completions (signed with each subjob's secret), keeps large checkpoints in the object "
            "store sja-checkpoints, reads jobs' code from the object store sja-code (to hand it to "
            "Ray), hears the clearer's yield requests for its node's slices. It may not publish "
            "grants, offers or subjobs.",
            (
                *slices,
                *checkpoints,
                *code,
                "$JS.API.CONSUMER.INFO.SJA_SUBJOBS.*",
                "$JS.API.CONSUMER.CREATE.SJA_SUBJOBS.*.>",
                "$JS.API.CONSUMER.MSG.NEXT.SJA_SUBJOBS.*",
                "$KV.sja-slices.>",
                "$JS.ACK.SJA_SUBJOBS.>",
                "sja.v1.subjob.completed.>",
                "$JS.API.STREAM.CREATE.OBJ_sja-checkpoints",
                "$JS.API.STREAM.PURGE.OBJ_sja-checkpoints",
                "$O.sja-checkpoints.>",
            ),
            ("sja.v1.slice.yield.>",),
        ),
        _service(
            "gateway",
            "the request/reply API. Answers the operator subjects and every tenant's subjects (scoping "
            "each answer to the tenant of the subject), writes submissions (KV sja-jobs + SJA_JOBS) and "
            "cancellations; watches the slices (KV sja-slices) to refuse a job no slice holds; reads a "
            "finished job's final state from the object store sja-checkpoints for its tenant; keeps "
            "the code a tenant uploads in the object store sja-code.",
            (
                *jobs,
                *slices,
                *rounds,
                *_ephemeral("SJA_COMPLETIONS"),
                *checkpoints,
                *code,
                "$JS.API.STREAM.CREATE.OBJ_sja-code",
                "$JS.API.STREAM.PURGE.OBJ_sja-code",
                "$O.sja-code.>",
                "$KV.sja-jobs.>",
                "sja.v1.job.submitted.>",
                "sja.v1.job.cancel_requested",
            ),
            (*_requests(), *(f"{s}.*" for s in _requests())),
        ),
        _service(
            "ui",
            "the dashboard. Reads only: the two buckets, the round records (an ordered consumer on "
            "SJA_ROUNDS) and the gateway's operator requests (status, list, rounds, explain, logs), and "
            "for a tenant's view that tenant's rounds, explain and logs. It may not submit or cancel, "
            "nor write "
            "any bucket or stream.",
            (
                *jobs,
                *slices,
                *rounds,
                "sja.v1.job.status",
                "sja.v1.job.list",
                "sja.v1.job.rounds",
                "sja.v1.job.explain",
                "sja.v1.job.logs",
                # A tenant's view asks on the tenant's own subjects (other tenants' bids anonymized).
                "sja.v1.job.rounds.*",
                "sja.v1.job.explain.*",
                "sja.v1.job.logs.*",
            ),
        ),
    )


def admin_role() -> Role:
    requests = _requests()
    return Role(
        user=ADMIN,
        password_var="NATS_PASSWORD_ADMIN",
        doc="operator: the `sja` CLI for any tenant (operator subjects, or any tenant's), the live "
        "policy switch, discovery, and read-only JetStream (the `nats` CLI: streams, KV entries). Use "
        "`nats --inbox-prefix _INBOX.sja-admin ...` with the nats CLI.",
        publish=(
            *requests,
            *(f"{s}.*" for s in requests),
            "sja.v1.clearer.policy",
            "$SRV.>",
            "$JS.API.INFO",
            "$JS.API.STREAM.NAMES",
            "$JS.API.STREAM.LIST",
            "$JS.API.STREAM.INFO.*",
            "$JS.API.STREAM.MSG.GET.*",
            "$JS.API.DIRECT.GET.>",
            "$JS.API.CONSUMER.INFO.>",
            "$JS.API.CONSUMER.LIST.>",
            "$JS.API.CONSUMER.NAMES.>",
            "$JS.API.CONSUMER.CREATE.>",
            "$JS.API.CONSUMER.MSG.NEXT.>",
        ),
        subscribe=(f"_INBOX.{ADMIN}.>",),
        allow_responses=False,
    )


def tenant_user(tenant: str) -> str:
    return TENANT_PREFIX + tenant


def tenant_role(tenant: str) -> Role:
    """A tenant's user: its own request subjects and its own reply inbox, nothing else."""
    if not TENANT_NAME.match(tenant):
        raise ValueError(f"bad tenant name {tenant!r}: letters, digits, '_' and '-', at most 64")
    user = tenant_user(tenant)
    return Role(
        user=user,
        password_var=f"NATS_PASSWORD_TENANT_{tenant.upper().replace('-', '_')}",
        doc="",
        publish=_requests(tenant),
        subscribe=(f"_INBOX.{user}.>",),
        allow_responses=False,
        tenant=tenant,
    )


def roles(tenants: Iterable[str] = ()) -> tuple[Role, ...]:
    """Every user of a server: the services', the operator's and one per tenant."""
    return (*service_roles(), admin_role(), *(tenant_role(t) for t in tenants))


def generate_passwords(users: Iterable[Role]) -> dict[str, str]:
    """A fresh random password (256 bits, URL-safe text) per user."""
    return {r.user: secrets.token_urlsafe(32) for r in users}


def _quoted(items: Iterable[str], indent: str, width: int = 110) -> list[str]:
    """``"a", "b", ...`` wrapped to ``width`` columns."""
    lines: list[str] = []
    line = indent
    for item in items:
        piece = f'"{item}",'
        if line.strip() and len(line) + 1 + len(piece) > width:
            lines.append(line)
            line = indent
        line += piece if not line.strip() else " " + piece
    if line.strip():
        lines.append(line)
    return lines


def _comment(text: str, indent: str, width: int = 110) -> list[str]:
    out: list[str] = []
    line = f"{indent}# ---"
    for word in text.split():
        if len(line) + 1 + len(word) > width:
            out.append(line)
            line = f"{indent}#    "
        line += " " + word
    out.append(line)
    return out


def _password(value: str) -> str:
    if value.startswith("$"):
        return value  # a variable of the server's environment
    if not re.fullmatch(r"[A-Za-z0-9_-]+", value):
        raise ValueError("a generated password is URL-safe text")
    return f'"{value}"'


def authorization_block(users: Iterable[Role], passwords: Mapping[str, str] | None = None) -> str:
    """The server's ``authorization { ... }`` block for ``users``: each password from ``passwords``
    (user -> password, written into the file: keep it only its owner can read), else read from the
    server's environment (``$NATS_PASSWORD_<...>``)."""
    out = ["authorization {", "  timeout: 2", "  users = ["]
    for role in users:
        if role.doc:
            out += _comment(f"{role.user.removeprefix('sja-')}: {role.doc}", "    ")
        elif role.tenant:
            out.append(f"    # --- tenant {role.tenant}: only its own request subjects and reply inbox.")
        secret = passwords[role.user] if passwords is not None else f"${role.password_var}"
        out += [
            "    {",
            f"      user: {role.user}",
            f"      password: {_password(secret)}",
            "      permissions: {",
            "        publish: {",
            "          allow: [",
            *_quoted(role.publish, "            "),
            "          ]",
            "        }",
            "        subscribe: {",
            "          allow: [",
            *_quoted(role.subscribe, "            "),
            "          ]",
            "        }",
        ]
        if role.allow_responses:
            out.append("        allow_responses: true")
        out += ["      }", "    }", ""]
    if out[-1] == "":
        out.pop()
    out += ["  ]", "}", ""]
    return "\n".join(out)


DEPLOYMENT_TENANTS = ("alpha", "beta")
"""The tenants ``infra/nats/auth.conf`` lists (add one there by adding it here and regenerating)."""

HEADER = """\
# Who may publish and subscribe to what (included from nats.conf). Generated from sja.bus.roles, the
# one description of the NATS users and their permissions (`sja up` configures its server from it
# too): edit that module, then `python -m sja.bus.roles > infra/nats/auth.conf`
# (tests/unit/bus/test_roles.py fails while this file is out of date). docs/deployment.md has the
# same matrix as a table; tests/integration/bus/test_security.py checks the lines that matter against
# a real server.
#
# Passwords come from the server's environment: $NATS_PASSWORD_<ROLE> (docker compose passes them
# from .env; see infra/nats/gen-passwords.sh). To add a tenant, add it to DEPLOYMENT_TENANTS, regenerate
# this file and give the tenant's password variable a value.
"""


def deployment_auth_conf(tenants: Iterable[str] = DEPLOYMENT_TENANTS) -> str:
    """The text of ``infra/nats/auth.conf``."""
    return HEADER + "\n" + authorization_block(roles(tenants))


if __name__ == "__main__":
    sys.stdout.write(deployment_auth_conf())
