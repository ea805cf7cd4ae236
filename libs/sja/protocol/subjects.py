"""Subjects, streams and buckets of SJA: the one registry of where every message travels.

Subjects read from broad to narrow: ``sja.v1.<entity>.<event>[.<key>]``; events are past tense,
requests are verbs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from sja.protocol import messages as m

PREFIX = "sja.v1"
TOKEN = re.compile(r"^[a-z0-9_-]+$")


def _key(token: str) -> str:
    """Make an id safe as a single subject token (ids may hold ``.``, which splits tokens)."""
    return token.replace(".", "_").replace(":", "_")


# Ephemeral (core NATS): a lost round costs only time.
def offer_opened(pool: str) -> str:
    return f"{PREFIX}.offer.opened.{_key(pool)}"


def offer_replied(pool: str) -> str:
    return f"{PREFIX}.offer.replied.{_key(pool)}"


def grant_issued(agent_id: str) -> str:
    return f"{PREFIX}.grant.issued.{_key(agent_id)}"


def outcome_sent(agent_id: str) -> str:
    return f"{PREFIX}.offer.outcome.{_key(agent_id)}"


def slice_yield(node: str) -> str:
    """The clearer to a node's executor: a slice's holder yields (``messages.YieldRequest``)."""
    return f"{PREFIX}.slice.yield.{_key(node)}"


AGENT_HEARTBEAT = f"{PREFIX}.agent.heartbeat"
DEMAND_CHANGED = f"{PREFIX}.agent.demand_changed"
JOB_CANCEL_REQUESTED = f"{PREFIX}.job.cancel_requested"

# Requests to the inventory (queue group ``inventory``: any replica answers; it frees the slice by
# compare-and-set, whichever node it is on).
LEASE_RELEASE = f"{PREFIX}.lease.release"


# Durable (JetStream).
def job_submitted(job_id: str) -> str:
    return f"{PREFIX}.job.submitted.{_key(job_id)}"


def subjob_dispatched(node: str, job_id: str) -> str:
    return f"{PREFIX}.subjob.dispatched.{_key(node)}.{_key(job_id)}"


def subjob_completed(job_id: str) -> str:
    return f"{PREFIX}.subjob.completed.{_key(job_id)}"


def round_cleared(pool: str) -> str:
    return f"{PREFIX}.round.cleared.{_key(pool)}"


# Requests (gateway, micro service ``sja-gateway``). The plain subjects are the operator's API (any
# tenant); ``<subject>.<tenant>`` is a tenant's API: the gateway answers it for that tenant's jobs
# only, and the NATS server lets a tenant's user publish only on its own (``infra/nats/auth.conf``).
JOB_SUBMIT = f"{PREFIX}.job.submit"
JOB_STATUS = f"{PREFIX}.job.status"
JOB_LIST = f"{PREFIX}.job.list"
JOB_CANCEL = f"{PREFIX}.job.cancel"
JOB_ROUNDS = f"{PREFIX}.job.rounds"
JOB_EXPLAIN = f"{PREFIX}.job.explain"
JOB_LOGS = f"{PREFIX}.job.logs"
JOB_STATE = f"{PREFIX}.job.state"
"""A finished job's stored states, in chunks (``sja result``): tenants read no object store."""
JOB_CODE = f"{PREFIX}.job.code"
"""A job's code, uploaded in chunks (``sja submit --code DIR``): tenants write no object store."""
JOB_REQUESTS = (
    JOB_SUBMIT,
    JOB_STATUS,
    JOB_LIST,
    JOB_CANCEL,
    JOB_ROUNDS,
    JOB_EXPLAIN,
    JOB_LOGS,
    JOB_STATE,
    JOB_CODE,
)

TENANT_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
"""A tenant name as a subject token: the ``JobSpec.tenant`` pattern, so no tenant is ever renamed."""


def tenant_token(tenant: str) -> str:
    """The tenant as a subject token; refuses names that are not one (no silent renaming, which could
    map two tenants onto one subject)."""
    if not TENANT_TOKEN.match(tenant):
        raise ValueError(f"invalid tenant {tenant!r}: use letters, digits, '_' and '-' (at most 64)")
    return tenant


def tenant_request(request: str, tenant: str) -> str:
    """A tenant's subject for one of ``JOB_REQUESTS``; ``tenant="*"`` gives the gateway's wildcard."""
    if request not in JOB_REQUESTS:
        raise ValueError(f"{request!r} is not a gateway request subject")
    return f"{request}.{tenant if tenant == '*' else tenant_token(tenant)}"


class InvalidTenant(ValueError):
    """A tenant-scoped request subject whose last token is no tenant name."""


def tenant_of(subject: str) -> str | None:
    """The tenant of a tenant-scoped request subject; ``None`` for an operator subject. A subject
    under a request subject whose last token is not a valid tenant name raises ``InvalidTenant``
    (it must never be taken for the operator's)."""
    base, _, last = subject.rpartition(".")
    if base in JOB_REQUESTS:
        if TENANT_TOKEN.fullmatch(last):
            return last
        raise InvalidTenant(f"{last[:80]!r} is not a tenant name")
    return None


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    work_queue: bool = False
    duplicate_window_s: float = 120.0
    max_bytes: int = -1
    """Oldest messages go first past this size (-1: kept for the stream's age limit only)."""


STREAM_JOBS = StreamSpec("SJA_JOBS", (f"{PREFIX}.job.submitted.>",))
STREAM_SUBJOBS = StreamSpec("SJA_SUBJOBS", (f"{PREFIX}.subjob.dispatched.>",), work_queue=True)
STREAM_COMPLETIONS = StreamSpec("SJA_COMPLETIONS", (f"{PREFIX}.subjob.completed.>",))
STREAM_ROUNDS = StreamSpec("SJA_ROUNDS", (f"{PREFIX}.round.cleared.>",), max_bytes=1 << 30)
"""Round records are for audit and explanation (and the fairness ledger's rebuild): a busy cluster
writes megabytes a second of them, so the stream keeps the newest GiB."""
STREAMS = (STREAM_JOBS, STREAM_SUBJOBS, STREAM_COMPLETIONS, STREAM_ROUNDS)

BUCKET_SLICES = "sja-slices"
BUCKET_JOBS = "sja-jobs"
BUCKETS = (BUCKET_SLICES, BUCKET_JOBS)


@dataclass(frozen=True)
class Route:
    """Where one message type travels and whether the bus keeps it."""

    message: type[m.Message]
    subject: str
    """Subject pattern, ``*`` standing for the key token."""
    durable: bool


REGISTRY: tuple[Route, ...] = (
    Route(m.Offer, offer_opened("*"), durable=False),
    Route(m.Reply, offer_replied("*"), durable=False),
    Route(m.OfferBatch, offer_opened("*"), durable=False),
    Route(m.BatchReply, offer_replied("*"), durable=False),
    Route(m.Grant, grant_issued("*"), durable=False),
    Route(m.GrantBatch, grant_issued("*"), durable=False),
    Route(m.Outcome, outcome_sent("*"), durable=False),
    Route(m.AgentHeartbeat, AGENT_HEARTBEAT, durable=False),
    Route(m.DemandChanged, DEMAND_CHANGED, durable=False),
    Route(m.JobCancel, JOB_CANCEL_REQUESTED, durable=False),
    Route(m.SubmitJob, JOB_SUBMIT, durable=False),
    Route(m.JobQuery, JOB_STATUS, durable=False),
    Route(m.JobListQuery, JOB_LIST, durable=False),
    Route(m.RoundsQuery, JOB_ROUNDS, durable=False),
    Route(m.StateQuery, JOB_STATE, durable=False),
    Route(m.CodeChunk, JOB_CODE, durable=False),
    Route(m.LeaseRelease, LEASE_RELEASE, durable=False),
    Route(m.YieldRequest, slice_yield("*"), durable=False),
    Route(m.JobState, job_submitted("*"), durable=True),
    Route(m.Subjob, subjob_dispatched("*", "*"), durable=True),
    Route(m.Completion, subjob_completed("*"), durable=True),
    Route(m.RoundRecord, round_cleared("*"), durable=True),
    Route(m.RoundBatch, round_cleared("*"), durable=True),
)


TENANT_ROUTES: tuple[Route, ...] = (
    Route(m.SubmitJob, tenant_request(JOB_SUBMIT, "*"), durable=False),
    Route(m.JobQuery, tenant_request(JOB_STATUS, "*"), durable=False),
    Route(m.JobListQuery, tenant_request(JOB_LIST, "*"), durable=False),
    Route(m.JobQuery, tenant_request(JOB_CANCEL, "*"), durable=False),
    Route(m.RoundsQuery, tenant_request(JOB_ROUNDS, "*"), durable=False),
    Route(m.JobQuery, tenant_request(JOB_EXPLAIN, "*"), durable=False),
    Route(m.StateQuery, tenant_request(JOB_STATE, "*"), durable=False),
    Route(m.CodeChunk, tenant_request(JOB_CODE, "*"), durable=False),
)
"""The tenant-scoped requests (``*``: the tenant), answered like their operator subjects in
``REGISTRY`` but only for the tenant's own jobs."""


def route_of(message: type[m.Message]) -> Route:
    for route in REGISTRY:
        if route.message is message:
            return route
    raise KeyError(f"no route registered for {message.__name__}")
