"""Wire messages of SJA, one ``msgspec.Struct`` per message.

Every message is frozen, keyword-only and tagged with a versioned wire id. Schema evolution follows
msgspec's rules: new fields get defaults; no renames or type changes; a breaking change is a new
``v2`` tag and subject.
"""

from __future__ import annotations

import re
import typing
from collections.abc import Iterable
from typing import Annotated, Any, Literal

import msgspec

# --- constrained scalar types, validated at decode time -------------------------------------------

ID_PATTERN = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"
NAME_PATTERN = r"^[A-Za-z0-9_-]+$"

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=128, extra_json_schema={"pattern": ID_PATTERN})]
"""Dot-separated tokens: valid as a KV key and, with dots replaced, as a subject token. The pattern is
checked by ``Tokens`` (see there), the length by msgspec."""
Name = Annotated[str, msgspec.Meta(min_length=1, max_length=64, extra_json_schema={"pattern": NAME_PATTERN})]
_DOTTED = r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
WORKLOAD_PATTERN = rf"^[A-Za-z0-9_-]+$|^{_DOTTED}:{_DOTTED}$"
WorkloadRef = Annotated[str, msgspec.Meta(min_length=1, max_length=200, pattern=WORKLOAD_PATTERN)]
"""A workload: a registered name (built in, or from the entry-point group ``sja.workloads``), or
``module:attr`` naming an importable object."""
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
PosInt = Annotated[int, msgspec.Meta(ge=1)]
NonNegFloat = Annotated[float, msgspec.Meta(ge=0.0)]
PosFloat = Annotated[float, msgspec.Meta(gt=0.0)]
Prob = Annotated[float, msgspec.Meta(ge=0.0, le=1.0)]
Eps = Annotated[float, msgspec.Meta(gt=0.0, lt=0.5)]
Share = Annotated[float, msgspec.Meta(gt=0.0, le=1.0)]
Checkpoint = Annotated[bytes, msgspec.Meta(max_length=1 << 20)]
ProofKey = Annotated[bytes, msgspec.Meta(max_length=64)]
Proof = Annotated[str, msgspec.Meta(max_length=128)]

SliceStatus = Literal["free", "leased", "busy", "offline"]
JobStatus = Literal["pending", "running", "done", "failed", "cancelled"]
SubjobStatus = Literal["ok", "oom", "timeout", "failed", "cancelled", "lost"]
ReplyMode = Literal["sja", "jasda"]


_ID_RE = re.compile(ID_PATTERN)
_NAME_RE = re.compile(NAME_PATTERN)
_valid_ids: set[str] = set()
_valid_names: set[str] = set()
VALID_TOKENS_REMEMBERED = 20_000
"""Strings remembered as valid ids (and as valid names); past it the memory starts over (one-off ids,
of offers, grants and subjobs, fill it in seconds under load; the repeated ones come back at once)."""

_token_fields: dict[type, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {}
"""Struct class -> its ``Id`` fields, ``Name`` fields and ``list[Id]`` fields (filled in at import)."""


def _bad_token(field: str, pattern: str) -> ValueError:
    # The wording and the path are msgspec's own, so a bad token reads (and names its field in
    # ``DecodeError.field``) as any other constraint does; a nested struct's path follows.
    return ValueError(f"Expected `str` matching regex {pattern!r} - at `$.{field}`")


class Tokens(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Base of the structs with ``Id`` and ``Name`` fields: their pattern is checked here, once per
    distinct string.

    As a msgspec ``pattern`` every decoded id ran a regular expression through Python's ``re``:
    ids make most of an offer, a grant or a slice state, and the check tripled the cost of
    decoding them (a slice state: 1.9 us, 0.6 us without). Ids repeat (slices, nodes, pools, the
    jobs in flight), so a string found valid is remembered and the next one costs a set lookup. The
    same strings are accepted as before, on decoding and on construction alike."""

    def __post_init__(self) -> None:
        ids, names, id_lists = _token_fields[type(self)]
        for field in ids:
            v = getattr(self, field)
            if v not in _valid_ids:
                _remember(_valid_ids, _ID_RE, field, v, ID_PATTERN)
        for field in names:
            v = getattr(self, field)
            if v not in _valid_names:
                _remember(_valid_names, _NAME_RE, field, v, NAME_PATTERN)
        for field in id_lists:
            for i, v in enumerate(getattr(self, field)):
                if v not in _valid_ids:
                    _remember(_valid_ids, _ID_RE, f"{field}[{i}]", v, ID_PATTERN)


def _remember(valid: set[str], pattern: re.Pattern[str], field: str, value: str, text: str) -> None:
    if pattern.fullmatch(value) is None:
        raise _bad_token(field, text)
    if len(valid) >= VALID_TOKENS_REMEMBERED:
        valid.clear()
    valid.add(value)


class Message(msgspec.Struct, frozen=True, kw_only=True, gc=False, tag_field="type"):
    """Base of every wire message; the tag names the message and its version.

    Messages are immutable trees (never part of a reference cycle), so neither they nor the structs
    inside them are tracked by Python's cycle collector (``gc=False``): an agent holds thousands of
    job states, and scanning them made the collector a fifth of its CPU."""


# --- slices and windows ---------------------------------------------------------------------------


class SliceState(Message, Tokens, tag="sja.slice_state.v1", frozen=True, kw_only=True):
    """One schedulable slice as stored in the ``sja-slices`` KV bucket (key = ``slice_id``)."""

    slice_id: Id
    node: Name
    pool: Name
    gpu_index: NonNegInt
    gpu_model: str
    gpu_uuid: str = ""
    profile: str
    mem_mib: PosInt
    compute_slots: PosInt
    compute_share: Share
    placement_start: NonNegInt = 0
    source: Literal["declared", "nvml", "soft", "whole"] = "declared"
    status: SliceStatus = "free"
    fence: NonNegInt = 0
    """Monotonic per slice; bumped on every grant. A holder with a lower fence is stale."""
    holder_job: str = ""
    grant_id: str = ""
    lease_until: float = 0.0
    expected_end: float = 0.0
    contestable_at: float = 0.0
    """A busy slice whose holder may continue past its window (an open subjob,
    ``core.continuation``): from this time on the slice is offered again while the holder runs, and a
    winner's grant makes the holder yield. 0: not offered while held."""
    holder_tenant: str = ""
    """The tenant of the holder's job, while ``contestable_at`` is set."""
    holder_attained_gpu_s: NonNegFloat = 0.0
    """The holder's job's attained service (GPU-seconds) when its subjob started, its window
    included (``Subjob.attained_gpu_s``): with the time held past the window, what a waiting job
    must be well below to take the slice (``core.continuation.takes_held``)."""
    holder_submitted_at: NonNegFloat = 0.0
    """When the holder's job was submitted, while ``contestable_at`` is set: a job's place in the
    order of service counts its age too (``core.continuation.service_key``)."""
    holder_due_at: NonNegFloat = 0.0
    """The instant the holder's job is due to finish by (``JobState.due_at``), while
    ``contestable_at`` is set; 0: it is not due. A due holder's slice goes to no job that is not due,
    nor to one due later."""
    recut_mib: NonNegInt = 0
    """Memory of the largest instance a re-cut of this slice's GPU can make, when its inventory
    re-cuts MIG GPUs for the work waiting (``SJA_REPARTITION=on``); 0: the layout stays. A job that
    only a re-cut GPU holds is admitted and waits for it (``windows.reachable_mib``)."""
    updated_at: float = 0.0


class Window(Tokens, frozen=True, kw_only=True, gc=False):
    """A slice plus a time interval ``[start_s, end_s)`` (wall-clock seconds since the epoch)."""

    slice_id: Id
    node: Name
    pool: Name
    gpu_model: str
    profile: str
    mem_mib: PosInt
    compute_share: Share
    start_s: float
    end_s: float | None = None
    """``None``: open-ended; planners bound it by their own horizon."""
    largest_mib: NonNegInt = 0
    """Memory of the largest slice of the window's pool (0: not known): where a job whose memory is
    unknown runs its measuring subjob."""
    held_by: str = ""
    """The job whose open subjob holds the slice past its window (``core.continuation``): a grant
    makes it yield. That job does not bid for it. Empty for a free slice."""
    held_attained_gpu_s: NonNegFloat = 0.0
    """With ``held_by``: the holder's attained service now (``core.continuation.held_attained``)."""
    held_submitted_at: NonNegFloat = 0.0
    """With ``held_by``: when the holder's job was submitted (``core.continuation.service_key``)."""
    held_due_at: NonNegFloat = 0.0
    """With ``held_by``: the instant the holder's job is due to finish by (``JobState.due_at``; 0: it
    is not due)."""
    held_tenant: str = ""
    """With ``held_by``: its tenant (a clearer charges the holder's service past its window to it,
    ``grants.learn_service``)."""

    @property
    def length_s(self) -> float | None:
        return None if self.end_s is None else max(0.0, self.end_s - self.start_s)


# --- a round ----------------------------------------------------------------------------------------


class Offer(Message, Tokens, tag="sja.offer.v1", frozen=True, kw_only=True):
    """Advertisement of one window in one negotiation round."""

    offer_id: Id
    round: NonNegInt
    window: Window
    slice_fence: NonNegInt
    """The slice's fence when the offer was made: a grant for a stale offer is refused."""
    slice_revision: NonNegInt
    """The slice's KV revision the offer was made from."""
    issued_at: float
    reply_by: float
    reply_to: str
    slice_state: SliceState | None = None
    """The slice's state at ``slice_revision``, as the advertiser saw it: the clearer writes the
    lease over it with one compare-and-set against that revision instead of reading the slice
    first (a slice that moved on since fails the compare-and-set)."""


MAX_BATCH_OFFERS = 4096


class OfferBatch(Message, Tokens, tag="sja.offer_batch.v1", frozen=True, kw_only=True):
    """Several offers of one pool published together (the windows that became free in one
    advertising tick): one message, one reply per agent, one clearing.

    Each offer is a round of its own, with a trace of its own: ``trace_contexts[i]`` is the W3C
    trace context of ``offers[i]``'s ``sja.round`` span. An offer whose entry is empty or missing
    (not sampled, or every entry left out) has the context of the message's headers, which carry
    the decision not to trace whenever some offer is not sampled (``sja.bus.tracing.start_roots``)."""

    batch_id: Id
    offers: Annotated[list[Offer], msgspec.Meta(min_length=1, max_length=MAX_BATCH_OFFERS)]
    issued_at: float
    reply_by: float
    reply_to: str
    trace_contexts: Annotated[list[dict[str, str]], msgspec.Meta(max_length=MAX_BATCH_OFFERS)] = []


class Candidate(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One candidate subjob a job could cut for a window."""

    size: PosInt
    """Work units (rows, samples blocks, steps...) the subjob would cover."""
    mem_q_mib: NonNegFloat
    """Memory at the job's ``1 - eps_mem`` quantile for this size."""
    p_fit_mem: Prob
    duration_q_s: NonNegFloat
    """Duration at the job's ``1 - eps_time`` quantile on this slice."""
    duration_mean_s: NonNegFloat
    p_fit_time: Prob
    score: float = 0.0
    bid: NonNegFloat = 0.0


class Proposal(Tokens, frozen=True, kw_only=True, gc=False):
    """A job's answer to an offer: SJA interest (one candidate) or JASDA candidates (several)."""

    job_id: Id
    tenant: Name
    mode: ReplyMode
    candidates: Annotated[list[Candidate], msgspec.Meta(min_length=1, max_length=16)]
    submitted_at: float
    remaining_units: NonNegInt
    total_units: PosInt
    priority: int = 0
    deadline_at: float | None = None
    expected_remaining_s: NonNegFloat = 0.0
    capacity: NonNegInt = 1
    """Subjobs the job could still start (``max_parallel`` minus those in flight)."""
    grants_seen: NonNegInt = 0
    """Grants the job's agent had received when it replied; the clearer subtracts the grants it
    issued since, so one job is never granted more windows than it can use at once."""
    due_at: NonNegFloat = 0.0
    """The instant the job is due to finish by (``JobState.due_at``; 0: it is not due): it comes first
    in the order of service, earliest first (``core.continuation.service_key``)."""
    attained_gpu_s: NonNegFloat = 0.0
    """GPU-seconds the job has been granted so far, as its agent counts them (what the agents
    rank a tenant's own jobs by when they shortlist bids for ``fair``)."""


class Reply(Message, Tokens, tag="sja.reply.v1", frozen=True, kw_only=True):
    """One agent process's reply to an offer: the proposals of all its jobs that can fit.

    An agent answers every offer (possibly with no proposals) so the clearer can close the round as
    soon as every live agent has spoken.
    """

    offer_id: Id
    agent_id: Id
    proposals: Annotated[list[Proposal], msgspec.Meta(max_length=10_000)] = []


class ReplyGroup(Tokens, frozen=True, kw_only=True, gc=False):
    """Proposals that stand for every offer listed (offers of one shape get the same answer)."""

    offer_ids: Annotated[list[Id], msgspec.Meta(min_length=1, max_length=MAX_BATCH_OFFERS)]
    proposals: Annotated[list[Proposal], msgspec.Meta(max_length=10_000)] = []


class BatchReply(Message, Tokens, tag="sja.batch_reply.v1", frozen=True, kw_only=True):
    """One agent process's reply to an offer batch: its jobs' proposals, grouped by like offers."""

    batch_id: Id
    agent_id: Id
    groups: Annotated[list[ReplyGroup], msgspec.Meta(max_length=MAX_BATCH_OFFERS)] = []


class Verdict(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """The clearer's reason for one proposal: won, or why it lost."""

    job_id: str
    tenant: str
    agent_id: str
    won: bool
    reason: str
    score: float = 0.0
    size: int = 0


class Grant(Message, Tokens, tag="sja.grant.v1", frozen=True, kw_only=True):
    """The winner's lease on a window."""

    grant_id: Id
    offer_id: Id
    round: NonNegInt
    job_id: Id
    tenant: Name
    agent_id: Id
    window: Window
    candidate: Candidate
    fence: PosInt
    lease_until: float
    policy: str
    granted_at: float
    slice_revision: NonNegInt = 0
    """The slice's KV revision holding this lease (0: unknown)."""
    slice_state: SliceState | None = None
    """The slice as leased at ``slice_revision``: the executor starts the subjob with one
    compare-and-set against it instead of reading the slice first."""


class YieldRequest(Message, Tokens, tag="sja.yield_request.v1", frozen=True, kw_only=True):
    """The clearer to a slice's executor (``subjects.slice_yield``): another job won the slice its
    holder continues on past its window (``core.continuation``); the holder stops at its next unit
    boundary and the winner's subjob starts once it has. Ephemeral: an executor that misses it sees
    the lease moved when it next extends its holder's lease, and the winner's subjob makes it yield
    on arrival."""

    slice_id: Id
    node: Name
    holder_grant_id: str
    """The grant the holder runs under (only that holder yields)."""
    grant_id: Id
    """The winner's grant."""
    fence: PosInt
    """The winner's fence."""
    issued_at: float


class GrantBatch(Message, Tokens, tag="sja.grant_batch.v1", frozen=True, kw_only=True):
    """The grants of one offer batch to one agent, in one message (a lone grant goes as a
    ``Grant``). ``trace_contexts[i]`` is the W3C trace context of ``grants[i]``'s ``sja.grant`` span,
    under which the agent materializes it (the message's own headers carry the round's)."""

    batch_id: Id
    grants: list[Grant]
    trace_contexts: list[dict[str, str]] = []


class Outcome(Message, Tokens, tag="sja.outcome.v1", frozen=True, kw_only=True):
    """Sent to each agent that replied: what happened to its proposals."""

    offer_id: Id
    verdicts: list[Verdict]
    pool: str = ""
    policy: str = ""
    """The policy the pool's clearer cleared with: agents shortlist their next bids by it."""


class RoundRecord(Message, Tokens, tag="sja.round_record.v1", frozen=True, kw_only=True):
    """Audit record of a cleared round (stream ``SJA_ROUNDS``): replies, winner, reasons."""

    offer_id: Id
    round: NonNegInt
    window: Window
    policy: str
    replies_from: list[str]
    verdicts: list[Verdict]
    winner_job: str = ""
    grant_id: str = ""
    fence: int = 0
    closed_because: Literal["deadline", "all_replied"] = "deadline"
    charged_gpu_s: float = 0.0
    price: float = 0.0
    """``auction``: what the winner's tenant paid."""
    """What the clearer's fairness ledger charged the winner's tenant for this grant."""
    note: str = ""
    trace_id: str = ""
    opened_at: float = 0.0
    cleared_at: float = 0.0
    batch_id: str = ""
    """The offer batch the round was cleared in (empty: an offer of its own)."""
    bids: NonNegInt = 0
    """Bids for this offer."""
    shared: int = -1
    """In a ``RoundBatch``: the index in its ``shared`` of the verdicts this offer shares with the
    other offers of its group (like offers with the same bids); ``verdicts`` then holds only the
    offer's own (its winner's). -1: ``verdicts`` holds them all. Readers see whole records
    (``sja.bus.rounds.decode_rounds``)."""
    shared_skip: int = -1
    """The entry of the shared verdicts that ``verdicts`` replaces (the winner's), -1: none."""


class RoundBatch(Message, Tokens, tag="sja.round_batch.v1", frozen=True, kw_only=True):
    """The records of the rounds of one offer batch (or a part of a large one), written to
    ``SJA_ROUNDS`` as one message: one JetStream write per batch instead of one per offer."""

    batch_id: Id
    records: Annotated[list[RoundRecord], msgspec.Meta(min_length=1, max_length=MAX_BATCH_OFFERS)]
    shared: Annotated[list[list[Verdict]], msgspec.Meta(max_length=MAX_BATCH_OFFERS)] = []
    """Verdicts shared by the records of a group of like offers (``RoundRecord.shared``): one list
    per group instead of one verdict per offer and bid."""


# --- jobs and subjobs -------------------------------------------------------------------------------


class MemoryDecl(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Declared functional memory profile: ``peak = base + per_unit * size`` with a relative spread."""

    base_mib: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]
    per_unit_mib: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]
    rel_sd: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 0.25


class TimeDecl(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Declared temporal profile on a full-speed slice: ``duration = warmup + per_unit * size``."""

    warmup_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e9)]
    per_unit_s: Annotated[float, msgspec.Meta(gt=0.0, le=1e9)]
    rel_sd: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] = 0.5


class WorkloadFacts(msgspec.Struct, frozen=True, kw_only=True, gc=False, forbid_unknown_fields=True):
    """What the control plane needs of a workload that is not built into SJA, so that it never runs
    that workload's code: the submitter's own process (``sja submit``) computes them from the
    workload with the job's parameters, or the spec states them. Only the job's own subjobs depend
    on them: facts that are wrong fail that job's subjobs, nobody else's."""

    total_units: PosInt
    sequential: bool = False
    memory: MemoryDecl | None = None
    """The workload's prior memory profile (``declared_memory``); the spec's ``memory`` wins."""
    time: TimeDecl | None = None
    """The workload's prior time profile (``declared_time``); the spec's ``time`` wins."""


class JobSpec(Tokens, frozen=True, kw_only=True, gc=False, forbid_unknown_fields=True):
    """What a user submits (YAML or JSON)."""

    name: Name
    tenant: Name
    workload: WorkloadRef
    params: dict[str, Any] = {}
    mode: ReplyMode = "jasda"
    eps_mem: Eps = 0.05
    eps_time: Eps = 0.05
    priority: int = 0
    deadline_s: PosFloat | None = None
    """Relative to submission."""
    max_parallel: Annotated[int, msgspec.Meta(ge=1, le=64)] = 1
    """How many subjobs the job may run at once."""
    gpus: Annotated[float, msgspec.Meta(gt=0.0, le=64.0)] | None = None
    """The GPUs' worth of compute its subjobs may hold at once: their slices' compute shares added
    (a ``4g`` and a ``3g`` slice of one GPU are one GPU; ``core.jobs.gpu_budget``). ``None``: one
    whole GPU per subjob, ``max_parallel``. A job that states it may run on several slices of a
    GPU at once where the GPU is cut, and on no more compute than it asked for anywhere."""
    min_units: PosInt = 1
    """Smallest subjob worth running (quantum of the work)."""
    bid_per_gpu_s: Annotated[float, msgspec.Meta(ge=0.0, le=1e6)] = 1.0
    """``auction`` policy: what the job offers per GPU-second of a window (from its tenant's budget)."""
    memory: MemoryDecl | None = None
    time: TimeDecl | None = None
    facts: WorkloadFacts | None = None
    """A workload not built into SJA: its unit count, whether it is sequential and its priors
    (``sja submit`` fills them in from the workload installed where it runs). The control plane
    never imports such a workload; only the job's sandboxed subjobs run it."""


class SubmitJob(Message, tag="sja.submit_job.v1", frozen=True, kw_only=True):
    spec: JobSpec
    request_id: Annotated[str, msgspec.Meta(max_length=128)] = ""
    """Client idempotency key: resubmitting the same id returns the same job."""


class SubmitAck(Message, Tokens, tag="sja.submit_ack.v1", frozen=True, kw_only=True):
    job_id: Id
    duplicate: bool = False
    notes: list[str] = []
    """What the submitter should know about how the job will be treated (a deadline that the
    policy clearing the job's rounds does not read)."""


class JobQuery(Message, Tokens, tag="sja.job_query.v1", frozen=True, kw_only=True):
    job_id: Id


class JobListQuery(Message, tag="sja.job_list_query.v1", frozen=True, kw_only=True):
    tenant: str = ""
    limit: Annotated[int, msgspec.Meta(ge=1, le=10_000)] = 1000


class ErrorReply(Message, tag="sja.error.v1", frozen=True, kw_only=True):
    """Typed error answer to a request."""

    code: Literal["bad_request", "not_found", "conflict", "internal", "forbidden"]
    message: str
    field: str = ""


class Subjob(Message, Tokens, tag="sja.subjob.v1", frozen=True, kw_only=True):
    """A self-contained piece of a job, materialized for a grant (work queue ``SJA_SUBJOBS``)."""

    subjob_id: Id
    seq: NonNegInt
    job_id: Id
    tenant: Name
    agent_id: Id
    workload: WorkloadRef
    params: dict[str, Any]
    unit_start: NonNegInt
    units: PosInt
    grant_id: Id
    fence: PosInt
    slice_id: Id
    node: Name
    mem_cap_mib: PosInt
    time_cap_s: PosFloat
    planned_mem_q_mib: NonNegFloat
    planned_duration_q_s: NonNegFloat
    input_checkpoint: Checkpoint = b""
    created_at: float = 0.0
    slice_revision: NonNegInt = 0
    """The slice's KV revision holding the grant's lease (from the grant; 0: unknown)."""
    slice_state: SliceState | None = None
    """The slice as leased at ``slice_revision`` (from the grant)."""
    attempt: NonNegInt = 0
    """Earlier tries of a range starting at ``unit_start`` that did not complete (``SJA_ATTEMPT``)."""
    proof_key: ProofKey = b""
    """The subjob's secret (``sja.core.proofs``): the executor signs the completion with it and
    keeps it from the program; empty: a subjob whose completion cannot be proven (refused)."""
    first_unit_s: NonNegFloat = 0.0
    """Seconds the subjob is given before any stop signal: its planned start-up and first unit (the
    ``1 - eps_time`` quantile of one unit on this slice, ``core.stopping.stop_grace``); 0: not planned (a
    stop signal no earlier than half the window)."""
    max_units: NonNegInt = 0
    """An open subjob (``core.continuation``): it may go on past its planned ``units`` through this many
    units from ``unit_start`` until it is asked to yield; 0: exactly ``units``."""
    attained_gpu_s: NonNegFloat = 0.0
    """The job's attained service (GPU-seconds) with this subjob's window charged
    (``JobState.attained_gpu_s``): the slice carries it while the subjob holds it past its window."""
    submitted_at: NonNegFloat = 0.0
    """When its job was submitted (``JobState.submitted_at``): the slice carries it with
    ``attained_gpu_s``."""
    due_at: NonNegFloat = 0.0
    """The instant its job is due to finish by (``JobState.due_at``; 0: it is not due): the slice
    carries it too."""


class Completion(Message, Tokens, tag="sja.completion.v1", frozen=True, kw_only=True):
    """Outcome of a subjob (stream ``SJA_COMPLETIONS``)."""

    subjob_id: Id
    job_id: Id
    grant_id: Id
    fence: NonNegInt
    slice_id: Id
    status: SubjobStatus
    unit_start: NonNegInt
    units: NonNegInt
    units_done: NonNegInt
    peak_mem_mib: NonNegFloat
    duration_s: NonNegFloat
    mem_cap_mib: NonNegInt
    time_cap_s: NonNegFloat
    started_at: float
    finished_at: float
    output_checkpoint: Checkpoint = b""
    error: str = ""
    executor_id: str = ""
    stdout: str = ""
    """The last of what a user's program wrote to stdout (at most ``OUTPUT_TAIL_CHARS``): ``sja logs``."""
    stderr: str = ""
    """The same for stderr."""
    yielded: bool = False
    """The subjob went on past its window and was asked to yield: another job won its slice
    (``core.continuation``)."""
    final: bool = False
    """A ``failed`` subjob that no retry can mend (the job names an interpreter or code the node
    cannot give it): the job fails at once with this error instead of after its eighth failure."""
    proof: Proof = ""
    """HMAC-SHA256 (hex) of the completion's identity and outcome under its subjob's ``proof_key``
    (``sja.core.proofs``); the agent drops a completion whose proof is missing or wrong."""


OUTPUT_TAIL_CHARS = 8 * 1024
"""Characters of each of a program's stdout and stderr a completion keeps (16 KiB in all)."""


class ProfileState(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Serialized posterior of a job's profiles (see ``sja.core.profiles``)."""

    mem: list[float]
    time: list[float]
    speed: dict[str, list[float]] = {}
    oom_bounds: list[tuple[int, float]] = []
    timeout_bounds: list[tuple[int, float]] = []
    observations: int = 0
    mem_bound: list[float] = []
    """(base, per unit) MiB of the declared peak the job vouches for; empty: none (see
    ``sja.core.profiles``)."""
    proven: list[tuple[int, float]] = []
    """(size, usable MiB) of completed subjobs: a size no larger fits a cap no smaller."""
    mem_declared: list[float] = []
    """(base, per unit) MiB the job declared, kept when a measurement contradicts ``mem_bound``;
    empty: it declared none."""


class UnitRange(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    start: NonNegInt
    count: PosInt


class InFlight(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    subjob_id: str
    grant_id: str
    slice_id: str
    unit_start: int
    units: int
    dispatched_at: float
    time_cap_s: float
    profile: str
    compute_share: float
    planned_mem_q_mib: float
    planned_duration_q_s: float
    proof_key: bytes = b""
    """The subjob's secret, sent to its executor only (``sja.core.proofs``); never shown
    (``proofs.without_secrets``)."""
    max_units: int = 0
    """An open subjob: how far past ``units`` it may go (``Subjob.max_units``); 0: bounded."""


class SubjobSummary(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """One executed subjob as remembered in the job's state."""

    subjob_id: str
    slice_id: str
    profile: str
    status: str
    unit_start: int
    units: int
    planned_mem_q_mib: float
    peak_mem_mib: float
    mem_cap_mib: int
    planned_duration_q_s: float
    duration_s: float
    time_cap_s: float
    started_at: float
    finished_at: float
    error: str = ""
    """Why it did not end ``ok`` (its first lines: the oom or timeout reason, the exit status)."""


class JobState(Message, Tokens, tag="sja.job_state.v1", frozen=True, kw_only=True):
    """Durable state of a job (KV ``sja-jobs``, key = ``job_id``)."""

    job_id: Id
    spec: JobSpec
    total_units: PosInt
    status: JobStatus = "pending"
    submitted_at: float = 0.0
    first_started_at: float | None = None
    finished_at: float | None = None
    owner_agent: str = ""
    next_unit: NonNegInt = 0
    """Units below ``next_unit`` were handed out at least once; see ``retry``."""
    retry: list[UnitRange] = []
    """Ranges whose subjob failed and that must be planned again."""
    units_done: NonNegInt = 0
    accumulator: Checkpoint = b""
    """The workload's merged partial result (its checkpoint)."""
    in_flight: list[InFlight] = []
    next_seq: NonNegInt = 0
    history: list[SubjobSummary] = []
    profile: ProfileState | None = None
    result: dict[str, Any] = {}
    error: str = ""
    cancel_requested: bool = False
    rounds_won: NonNegInt = 0
    attempt_failures: NonNegInt = 0
    timeouts_in_row: NonNegInt = 0
    """Subjobs that ran out of time since the last one that did any work
    (``jobs.MAX_CONSECUTIVE_TIMEOUTS``)."""
    bids_again_at: NonNegFloat = 0.0
    """Unix time before which the job sends no bid: its back-off after timeouts
    (``jobs.timeout_backoff_s``)."""
    bounded: bool = False
    """The job's program did not stop when asked to yield (``core.continuation``): its subjobs get
    exactly their planned range from then on."""
    grants_seen: NonNegInt = 0
    declined_grants: list[str] = []
    """The grants the job declined lately (the newest ``jobs.DECLINED_KEPT``): their slices were given
    back, so a copy of one delivered later must not become a subjob (it would run on a slice its
    lease no longer holds)."""
    attained_gpu_s: NonNegFloat = 0.0
    """GPU-seconds granted to the job so far (expected duration times compute share of every grant
    it took): what the clearer's ledger charges, counted by the agent."""
    due_at: NonNegFloat = 0.0
    """The instant the job is due to finish by, once it is due: it would finish more than
    ``core.shadow.DUE_SLACK`` times later than under the rigid reference (or its busy period would
    end more than ``core.shadow.SPAN_SLACK`` times later) unless served first from then on. Due jobs
    are served earliest first. 0: it is not due."""


class JobHead(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """Who owns a stored job and whether it is over: three fields of a ``JobState``, decoded from
    it alone (``Store.heads``), without the rest of the state (its profile, history, checkpoint).
    Only for deciding which jobs to read whole; it validates nothing else."""

    job_id: str
    owner_agent: str = ""
    status: str = "pending"


class JobCancel(Message, Tokens, tag="sja.job_cancel.v1", frozen=True, kw_only=True):
    job_id: Id


class JobView(Message, tag="sja.job_view.v1", frozen=True, kw_only=True):
    """Answer to a status query."""

    state: JobState


class JobList(Message, tag="sja.job_list.v1", frozen=True, kw_only=True):
    """Summaries: each job's state without its subjob history, profiles and accumulator."""

    jobs: list[JobState]


class RoundsQuery(Message, Tokens, tag="sja.rounds_query.v1", frozen=True, kw_only=True):
    job_id: Id


class RoundsView(Message, tag="sja.rounds_view.v1", frozen=True, kw_only=True):
    rounds: list[RoundRecord]


class LogsQuery(Message, Tokens, tag="sja.logs_query.v1", frozen=True, kw_only=True):
    job_id: Id
    subjob: str = ""
    """A subjob's id, or its number in the job (``3`` for ``JOB.s3``); empty: every subjob."""


class SubjobLog(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What a subjob's program wrote last, from its completion (stream ``SJA_COMPLETIONS``)."""

    subjob_id: str
    slice_id: str
    status: str
    unit_start: int
    units: int
    units_done: int
    finished_at: float
    error: str = ""
    stdout: str = ""
    stderr: str = ""


class LogsView(Message, tag="sja.logs_view.v1", frozen=True, kw_only=True):
    job_id: str
    subjobs: list[SubjobLog]
    notes: list[str] = []
    """What the user should know beside the output: a measured peak above the declaration."""


class StateQuery(Message, Tokens, tag="sja.state_query.v1", frozen=True, kw_only=True):
    """A piece of one of a job's stored states (``sja result``): the object ``name`` of a
    checkpoint reference the job's state holds, from byte ``offset``."""

    job_id: Id
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    offset: NonNegInt = 0


class StateChunk(Message, tag="sja.state_chunk.v1", frozen=True, kw_only=True):
    """Bytes ``offset`` to ``offset + len(data)`` of a stored state of ``total`` bytes."""

    job_id: str
    name: str
    offset: int
    total: int
    data: bytes


Sha256Hex = Annotated[str, msgspec.Meta(pattern=r"^[0-9a-f]{64}$")]


class CodeChunk(Message, Tokens, tag="sja.code_chunk.v1", frozen=True, kw_only=True):
    """A piece of a job's code on its way to the gateway (``sja submit --code DIR``): bytes
    ``offset`` to ``offset + len(data)`` of the zip archive of ``total`` bytes whose SHA-256 is
    ``digest`` (``sja.workloads.codepack``). A chunk without data asks whether the archive is kept
    already; ``commit`` (after the last chunk) has the gateway check the whole and keep it."""

    tenant: Name
    digest: Sha256Hex
    total: NonNegInt
    offset: NonNegInt = 0
    data: bytes = b""
    commit: bool = False


class CodeAck(Message, tag="sja.code_ack.v1", frozen=True, kw_only=True):
    """The gateway's answer to a ``CodeChunk``: ``stored`` once the archive is kept (a spec may then
    name ``sha256:<digest>`` as its ``params.code``)."""

    digest: str
    stored: bool = False


class WindowReason(msgspec.Struct, frozen=True, kw_only=True, gc=False):
    """What became of a job at the last offer of one window shape (pool, profile, memory)."""

    pool: str
    profile: str
    mem_mib: int
    slice_id: str
    offer_id: str
    opened_at: float
    policy: str
    outcome: Literal["won", "lost", "excluded", "invalid", "no_bid"]
    reason: str


class Explanation(Message, tag="sja.explanation.v1", frozen=True, kw_only=True):
    """Answer to an explain query: the job's state and, while it waits, why."""

    job_id: str
    status: str
    summary: str
    """The state in a sentence (what it runs, or why nothing)."""
    windows: list[WindowReason] = []
    """The last offer of each window shape seen lately, largest memory first."""
    policy: str = ""
    """The policy of the latest round seen (empty: no round seen lately)."""
    position: int = 0
    """1-based place among the jobs waiting for a window under ``order``; 0: not waiting."""
    waiting: int = 0
    order: str = ""
    """How the waiting jobs are ranked for ``position``."""
    deadline: str = ""
    """Met, missed or time left (empty: no deadline)."""
    notes: list[str] = []


class DemandChanged(Message, Tokens, tag="sja.demand_changed.v1", frozen=True, kw_only=True):
    """An agent's jobs can take more work: free windows are worth offering again at once."""

    agent_id: Id
    jobs: NonNegInt
    ready: Annotated[int, msgspec.Meta(ge=0, le=1_000_000)] = 0
    """Windows the agent's jobs became able to take since its last signal (a job claimed, a subjob
    completed): that many waiting windows are offered again at once. 0: not counted (every
    waiting window's backoff is cut short)."""


class AgentHeartbeat(Message, Tokens, tag="sja.agent_heartbeat.v1", frozen=True, kw_only=True):
    """Agents announce themselves so the clearer knows whom to wait for."""

    agent_id: Id
    jobs: NonNegInt
    sent_at: float
    interval_s: PosFloat


class LeaseRelease(Message, Tokens, tag="sja.lease_release.v1", frozen=True, kw_only=True):
    """A grant's holder gives its slice back before the lease runs out (an agent that cannot use
    a grant). The inventory checks ``grant_id`` and ``fence`` against the slice and frees it."""

    slice_id: Id
    grant_id: Id
    fence: PosInt
    job_id: str = ""
    reason: Annotated[str, msgspec.Meta(max_length=200)] = ""


class LeaseReleased(Message, tag="sja.lease_released.v1", frozen=True, kw_only=True):
    """Answer to ``LeaseRelease``. ``released``: the slice is free now; else ``reason`` says why not
    (``not_held``: the slice no longer holds that grant at that fence, the lease moved on;
    ``unknown_slice``; ``conflict``: the slice kept changing under the write)."""

    slice_id: str
    released: bool
    reason: Literal["", "not_held", "unknown_slice", "conflict"] = ""


# --- token fields ------------------------------------------------------------------------------------


def token_fields(cls: type) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """A struct's ``Id`` fields, ``Name`` fields and ``list[Id]`` fields (all empty for a struct that
    is not a registered ``Tokens``)."""
    return _token_fields.get(cls, ((), (), ()))


def register_token_fields(classes: Iterable[type]) -> None:
    """Find each struct's ``Id``, ``Name`` and ``list[Id]`` fields for ``Tokens.__post_init__``
    (this module's structs are registered at import; a struct elsewhere that derives from
    ``Tokens`` registers itself with this).

    A struct with one that does not derive from ``Tokens``, or an ``Id``/``Name`` anywhere else in
    a field's type (``Id | None``, ``dict[Id, ...]``), is refused: no id goes unchecked."""
    for cls in classes:
        if not (isinstance(cls, type) and issubclass(cls, msgspec.Struct)):
            continue
        hints = typing.get_type_hints(cls, include_extras=True)
        ids: list[str] = []
        names: list[str] = []
        id_lists: list[str] = []
        for field in cls.__struct_fields__:
            hint = hints[field]
            if hint == Id:
                ids.append(field)
            elif hint == Name:
                names.append(field)
            elif _is_id_list(hint):
                id_lists.append(field)
            elif _mentions_token(hint):
                raise TypeError(
                    f"{cls.__name__}.{field}: an Id or Name only as the field's type or in list[Id]"
                )
        if (ids or names or id_lists) and not issubclass(cls, Tokens):
            raise TypeError(f"{cls.__name__} has Id or Name fields: it must derive from Tokens")
        if issubclass(cls, Tokens):
            _token_fields[cls] = (tuple(ids), tuple(names), tuple(id_lists))


def _is_id_list(hint: Any) -> bool:
    """``list[Id]``, bare or inside ``Annotated`` (a length constraint on the list)."""
    if typing.get_origin(hint) is Annotated:
        hint = typing.get_args(hint)[0]
    return typing.get_origin(hint) is list and typing.get_args(hint)[0] == Id


def _mentions_token(hint: Any) -> bool:
    if hint in (Id, Name):
        return True
    return any(_mentions_token(a) for a in typing.get_args(hint))


register_token_fields(v for v in list(globals().values()) if getattr(v, "__module__", None) == __name__)
