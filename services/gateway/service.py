"""Gateway: the request/reply API behind the CLI (micro service ``sja-gateway``): submit, status,
list, cancel, and the rounds a job took part in.

Each request is served on two subjects: the operator's (``sja.v1.job.submit``: any tenant) and the
tenant's (``sja.v1.job.submit.<tenant>``). NATS does not tell a responder who sent a request, so
tenant isolation rests on both sides: the server lets a tenant's user publish only on its own
``<tenant>`` subjects (``infra/nats/auth.conf``), and the gateway answers a ``<tenant>`` subject only
about that tenant's jobs: a submission for another tenant is ``forbidden``, another tenant's job is
``not_found`` (its existence is not revealed), and rounds show other tenants' bids anonymized.

A job's code (``sja submit --code DIR``) comes in chunks (``sja.v1.job.code[.<tenant>]``): each is kept
in the object store ``sja-code`` as a part, and the commit checks the whole archive
(``sja.workloads.codepack.check``) and keeps it as ``<tenant>/<digest>``; a ``command`` job naming
code (``params.code``) is refused unless its tenant's code of that digest is kept. Tenants write no
object store and reach no Ray: the executors hand the code to Ray.

A job's state leaves the gateway redacted (``sja.redaction.redacted``): the values of its
``params.env`` are shown to nobody, the operator included."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import msgspec
import nats.js.errors
from nats.js.api import ObjectMeta
from nats.micro.request import Request

from services.gateway.records import job_id_for, stored_states, subjob_seq
from services.gateway.settings import GatewaySettings
from sja.bus import streams
from sja.bus.codec import DecodeError, decode, encode
from sja.bus.completions import iter_completions
from sja.bus.rounds import iter_rounds
from sja.bus.service import Service
from sja.bus.watch import View
from sja.core import explain as E
from sja.core import jobs as J
from sja.core.planner import PlanLimits
from sja.protocol import subjects
from sja.protocol.messages import (
    CodeAck,
    CodeChunk,
    ErrorReply,
    JobCancel,
    JobList,
    JobListQuery,
    JobQuery,
    JobSpec,
    JobState,
    JobView,
    LogsQuery,
    LogsView,
    RoundRecord,
    RoundsQuery,
    RoundsView,
    SliceState,
    StateChunk,
    StateQuery,
    SubjobLog,
    SubmitAck,
    SubmitJob,
)
from sja.redaction import OTHER, anonymize_round, redacted
from sja.workloads import SpecError, codepack
from sja.workloads import checkpoint as ckpt

log = logging.getLogger(__name__)


class GatewayService(Service):
    name = "gateway"

    def __init__(self, settings: GatewaySettings) -> None:
        super().__init__(settings)
        self.submitted = 0
        self.planning_window_s = max(settings.horizon_s - settings.start_overhead_s, 0.0) or None
        self.limits = PlanLimits(
            mem_reserve_mib=settings.mem_reserve_mib,
            start_overhead_s=settings.start_overhead_s,
            horizon_s=settings.horizon_s,
        )
        self.cfg = settings
        self._code: Any = None
        """The object store ``sja-code`` (``_code_store``)."""
        self._states: dict[str, bytes] = {}
        """The stored states read last (object name -> bytes; ``STATES_KEPT``)."""
        self.slice_view: View[SliceState] | None = None
        """Every slice (the inventory's bucket), to refuse a job that none can ever hold."""
        self._fit_keys: dict[str, tuple[bool, int, int, float, str, str, str]] = {}
        """``J.fit_key`` of every slice in the view: most of the bucket's changes are leases, which
        leave the largest slice as it was."""
        self._largest: SliceState | None = None
        self._largest_stale = True
        """``_largest`` (``J.largest_live`` of the view) is to be worked out again: a slice came,
        went or changed what ``J.fit_key`` reads of it."""
        self.m_submitted = self.metrics.counter(
            "sja_jobs_submitted", "Jobs accepted by the gateway (not counting duplicates).", unit="{job}"
        )

    async def on_start(self) -> None:
        assert self.js is not None
        self._fit_keys.clear()
        self._largest, self._largest_stale = None, True
        self.slice_view = await self.watch(subjects.BUCKET_SLICES, SliceState, self._slice_changed)

    async def _slice_changed(self, key: str, value: SliceState | None, revision: int) -> None:
        fit = J.fit_key(value) if value is not None else None
        if self._fit_keys.get(key) != fit:
            if fit is None:
                self._fit_keys.pop(key, None)
            else:
                self._fit_keys[key] = fit
            self._largest_stale = True

    def largest_slice(self) -> SliceState | None:
        """The largest slice not offline (``J.largest_live``), scanned again only after a change
        that can move it: a submission does not go over every slice."""
        if self._largest_stale and self.slice_view is not None:
            self._largest = J.largest_live(s for s, _ in self.slice_view.entries.values())
            self._largest_stale = False
        return self._largest

    async def on_stop(self) -> None:
        if self.slice_view is not None:
            await self.slice_view.stop()

    async def add_endpoints(self, micro: Any) -> None:
        for name, subject, handler in (
            ("submit", subjects.JOB_SUBMIT, self.submit),
            ("status", subjects.JOB_STATUS, self.status),
            ("list", subjects.JOB_LIST, self.list_jobs),
            ("cancel", subjects.JOB_CANCEL, self.cancel),
            ("rounds", subjects.JOB_ROUNDS, self.rounds),
            ("explain", subjects.JOB_EXPLAIN, self.explain),
            ("logs", subjects.JOB_LOGS, self.logs),
            ("state", subjects.JOB_STATE, self.state),
            ("code", subjects.JOB_CODE, self.code),
        ):
            await micro.add_endpoint(name=name, subject=subject, handler=_typed(handler, self, subject))
            tenant_subject = subjects.tenant_request(subject, "*")
            await micro.add_endpoint(
                name=f"tenant-{name}",
                subject=tenant_subject,
                handler=_typed(handler, self, tenant_subject),
            )

    async def submit(self, data: bytes, tenant: str | None = None) -> msgspec.Struct:
        req = decode(data, SubmitJob)
        if tenant is not None and req.spec.tenant != tenant:
            return ErrorReply(
                code="forbidden",
                message=f"tenant {tenant!r} cannot submit a job for tenant {req.spec.tenant!r}",
                field="spec.tenant",
            )
        job_id = job_id_for(req.spec.name, req.spec.tenant, req.request_id)
        try:
            state = J.new_job(job_id, req.spec, time.time(), window_s=self.planning_window_s)
        except SpecError as e:
            return ErrorReply(code="bad_request", message=e.message, field=e.field)
        missing = await self._missing_code(state.spec)
        if missing is not None:
            return missing
        largest = self.largest_slice()
        why = J.never_fits(state, [largest] if largest is not None else [], self.limits)
        if why is not None:
            return ErrorReply(code="bad_request", message=why, field="spec.memory")
        assert self.jobs is not None
        notes = await self._submit_notes(req.spec)
        if await self.jobs.create(job_id, state) is None:
            return SubmitAck(job_id=job_id, duplicate=True, notes=notes)
        await self.jetstream.publish(
            subjects.job_submitted(job_id), encode(state), headers={"Nats-Msg-Id": job_id}
        )
        self.submitted += 1
        self.m_submitted.add(1, tenant=req.spec.tenant)
        log.info("job %s submitted by %s (%s)", job_id, req.spec.tenant, req.spec.workload)
        return SubmitAck(job_id=job_id, notes=notes)

    async def _code_store(self) -> Any:
        """The object store ``sja-code``, created (with its size limit) on first use."""
        if self._code is None:
            self._code = await streams.object_store(
                self.bus.jetstream(),
                codepack.BUCKET,
                "SJA: jobs' code (sja submit --code)",
                self.settings.js_replicas,
                self.cfg.code_store_max_mib,
            )
        return self._code

    async def _code_kept(self, tenant: str, digest: str) -> bool:
        store = await self._code_store()
        try:
            info = await store.get_info(codepack.object_name(tenant, digest))
        except nats.js.errors.NotFoundError:
            return False
        return info is not None and not info.deleted

    async def _missing_code(self, spec: JobSpec) -> ErrorReply | None:
        """A refusal when the job names code its tenant has not uploaded."""
        ref = spec.params.get("code", "") if spec.workload == "command" else ""
        digest = codepack.digest_of_ref(ref) if isinstance(ref, str) else ""
        if not digest or await self._code_kept(spec.tenant, digest):
            return None
        return ErrorReply(
            code="bad_request",
            message=f"no code {ref} uploaded for tenant {spec.tenant!r}: `sja submit --code DIR` uploads "
            "the directory before it submits the job",
            field="params.code",
        )

    async def code(self, data: bytes, tenant: str | None = None) -> msgspec.Struct:
        """A piece of a job's code (``CodeChunk``): kept as a part until the commit, which checks the
        whole archive and keeps it as the tenant's (``sja-code``, ``<tenant>/<digest>``)."""
        req = decode(data, CodeChunk)
        if tenant is not None and req.tenant != tenant:
            return ErrorReply(
                code="forbidden",
                message=f"tenant {tenant!r} cannot upload code for tenant {req.tenant!r}",
                field="tenant",
            )
        limit = int(self.cfg.code_max_mib * ckpt.MIB)
        if req.total > limit or req.offset + len(req.data) > req.total:
            why = (
                f"the archive is {req.total / ckpt.MIB:.1f} MiB, more than the {self.cfg.code_max_mib:g} MiB "
                "a job's code may be (SJA_CODE_MAX_MIB)"
                if req.total > limit
                else f"a chunk at {req.offset} of {len(req.data)} bytes passes the archive's {req.total}"
            )
            return ErrorReply(code="bad_request", message=why, field="code")
        if await self._code_kept(req.tenant, req.digest):
            return CodeAck(digest=req.digest, stored=True)
        store = await self._code_store()
        if req.data:
            name = codepack.part_name(req.tenant, req.digest, req.offset)
            await store.put(name, req.data, meta=ObjectMeta(name=name, description=ckpt.describe(req.tenant)))
        if not req.commit:
            return CodeAck(digest=req.digest)
        try:
            archive = await self._assemble(store, req.tenant, req.digest, req.total)
            await asyncio.to_thread(codepack.check, archive, int(self.cfg.code_unpacked_max_mib * ckpt.MIB))
        except codepack.CodeError as e:
            await self._drop_parts(store, req.tenant, req.digest)
            return ErrorReply(code="bad_request", message=f"the code archive is refused: {e}", field="code")
        name = codepack.object_name(req.tenant, req.digest)
        await store.put(name, archive, meta=ObjectMeta(name=name, description=ckpt.describe(req.tenant)))
        await self._drop_parts(store, req.tenant, req.digest)
        log.info("code %s kept for %s (%d bytes)", req.digest[:12], req.tenant, len(archive))
        return CodeAck(digest=req.digest, stored=True)

    async def _parts(self, store: Any, tenant: str, digest: str) -> list[Any]:
        prefix = codepack.parts_prefix(tenant, digest)
        try:
            objects = await store.list()
        except nats.js.errors.NotFoundError:  # an empty store
            return []
        return sorted(
            (o for o in objects if not o.deleted and o.name.startswith(prefix)), key=lambda o: o.name
        )

    async def _assemble(self, store: Any, tenant: str, digest: str, total: int) -> bytes:
        """The uploaded parts of an archive joined, checked against its size and digest."""
        data = bytearray()
        for o in await self._parts(store, tenant, digest):
            offset = int(o.name.rpartition("/")[2])
            if offset != len(data):
                continue  # a part sent again, or one of an upload that went wrong: the next one fits
            data += bytes((await store.get(o.name)).data or b"")
        if len(data) != total:
            raise codepack.CodeError(f"{len(data)} of its {total} bytes arrived")
        if codepack.digest(bytes(data)) != digest:
            raise codepack.CodeError("its bytes do not match its SHA-256")
        return bytes(data)

    async def _drop_parts(self, store: Any, tenant: str, digest: str) -> None:
        for o in await self._parts(store, tenant, digest):
            with contextlib.suppress(Exception):
                await store.delete(o.name)

    async def _job(self, job_id: str, tenant: str | None) -> tuple[JobState, int] | ErrorReply:
        """The job and its revision, or ``not_found`` (also for another tenant's job)."""
        assert self.jobs is not None
        got = await self.jobs.get(job_id)
        if got is None or (tenant is not None and got[0].spec.tenant != tenant):
            return ErrorReply(code="not_found", message=f"no job {job_id}", field="job_id")
        return got

    async def status(self, data: bytes, tenant: str | None = None) -> msgspec.Struct:
        q = decode(data, JobQuery)
        got = await self._job(q.job_id, tenant)
        if isinstance(got, ErrorReply):
            return got
        return JobView(state=redacted(got[0]))

    async def list_jobs(self, data: bytes, tenant: str | None = None) -> msgspec.Struct:
        q = decode(data, JobListQuery)
        wanted = q.tenant
        if tenant is not None:
            if wanted and wanted != tenant:
                return ErrorReply(
                    code="forbidden",
                    message=f"tenant {tenant!r} cannot list the jobs of tenant {wanted!r}",
                    field="tenant",
                )
            wanted = tenant
        assert self.jobs is not None
        states = [s for s, _ in await self.jobs.all()]
        if wanted:
            states = [s for s in states if s.spec.tenant == wanted]
        states.sort(key=lambda s: (s.submitted_at, s.job_id))
        # A listing is a summary: without the subjob history, the profiles and the accumulator a
        # job is a few hundred bytes, so thousands fit one reply (`status` has the full state).
        return JobList(
            jobs=[
                redacted(msgspec.structs.replace(s, history=[], profile=None, accumulator=b""))
                for s in states[: q.limit]
            ]
        )

    async def cancel(self, data: bytes, tenant: str | None = None) -> msgspec.Struct:
        q = decode(data, JobQuery)
        for _ in range(20):
            got = await self._job(q.job_id, tenant)
            if isinstance(got, ErrorReply):
                return got
            state, rev = got
            assert isinstance(state, JobState) and self.jobs is not None
            new = J.request_cancel(state, time.time())
            if new == state or await self.jobs.cas(q.job_id, new, rev) is not None:
                await self.bus.publish(subjects.JOB_CANCEL_REQUESTED, encode(JobCancel(job_id=q.job_id)))
                return JobView(state=redacted(new))
        return ErrorReply(code="conflict", message=f"job {q.job_id} is changing too fast; retry")

    async def rounds(self, data: bytes, tenant: str | None = None) -> msgspec.Struct:
        q = decode(data, RoundsQuery)
        got = await self._job(q.job_id, tenant)
        if isinstance(got, ErrorReply) and tenant is not None:
            return got
        # The rounds of the job's lifetime only (an operator asking about a job no longer in the
        # store reads them all): SJA_ROUNDS holds up to a GiB of every job's rounds.
        since = until = None
        if not isinstance(got, ErrorReply):
            state = got[0]
            since = state.submitted_at - ROUNDS_CLOCK_SKEW_S
            if state.finished_at is not None:
                until = state.finished_at + ROUNDS_CLOCK_SKEW_S
        records: list[RoundRecord] = []
        # Whole records: every bid of every offer has its verdict there (a batch writes the
        # verdicts its like offers share once; ``iter_rounds`` reads them back into each record).
        async for rec in iter_rounds(self.jetstream, since=since, until=until):
            if any(v.job_id == q.job_id for v in rec.verdicts):
                records.append(rec)
        records = records[-2000:]
        if tenant is not None:
            records = [anonymize_round(r, tenant) for r in records]
        return RoundsView(rounds=records)

    async def _recent_rounds(self, since: float) -> list[RoundRecord]:
        """Round records stored since ``since`` (every pool), the newest ``EXPLAIN_RECORDS``."""
        records: list[RoundRecord] = []
        async for rec in iter_rounds(self.jetstream, since=since):
            records.append(rec)
            if len(records) > 2 * EXPLAIN_RECORDS:
                del records[:EXPLAIN_RECORDS]
        return records[-EXPLAIN_RECORDS:]

    async def _submit_notes(self, spec: JobSpec) -> list[str]:
        """What the submitter should know: a deadline the policy of the latest rounds ignores."""
        if spec.deadline_s is None:
            return []
        since = time.time() - POLICY_LOOKBACK_S
        latest = await self._recent_rounds(since)
        policy = latest[-1].policy if latest else ""
        note = E.deadline_note(policy, spec)
        return [note] if note else []

    async def logs(self, data: bytes, tenant: str | None = None) -> msgspec.Struct:
        """What each subjob's program wrote last (``sja logs``): the output tails its completion
        carries, read back from ``SJA_COMPLETIONS`` (kept for the stream's age), in subjob order."""
        q = decode(data, LogsQuery)
        got = await self._job(q.job_id, tenant)
        if isinstance(got, ErrorReply):
            return got
        wanted = q.subjob if not q.subjob.isdigit() else f"{q.job_id}.s{q.subjob}"
        found: dict[str, SubjobLog] = {}
        async for c in iter_completions(self.jetstream, q.job_id):
            if wanted and c.subjob_id != wanted:
                continue
            found[c.subjob_id] = SubjobLog(
                subjob_id=c.subjob_id,
                slice_id=c.slice_id,
                status=c.status,
                unit_start=c.unit_start,
                units=c.units,
                units_done=c.units_done,
                finished_at=c.finished_at,
                error=c.error,
                stdout=c.stdout,
                stderr=c.stderr,
            )
        if wanted and not found:
            return ErrorReply(
                code="not_found", message=f"no completed subjob {wanted} of job {q.job_id}", field="subjob"
            )
        order = sorted(found.values(), key=lambda s: (subjob_seq(s.subjob_id), s.finished_at))
        over = E.memory_overrun(got[0])
        return LogsView(job_id=q.job_id, subjobs=order[-200:], notes=[over.text] if over is not None else [])

    async def state(self, data: bytes, tenant: str | None = None) -> msgspec.Struct:
        """A piece of one of a job's stored states (``sja result``), for the job's tenant (or the
        operator) only: an object of the store ``sja-checkpoints`` that the job's own state refers
        to, never any other (tenants read no object store themselves)."""
        q = decode(data, StateQuery)
        got = await self._job(q.job_id, tenant)
        if isinstance(got, ErrorReply):
            return got
        if q.name not in stored_states(got[0]):
            why = f"job {q.job_id} holds no state {q.name}"
            return ErrorReply(code="not_found", message=why, field="name")
        try:
            blob = await self._stored(q.name)
        except Exception as e:
            why = f"state {q.name} cannot be read: {type(e).__name__}: {e}"
            return ErrorReply(code="not_found", message=why, field="name")
        chunk = max(1, self.bus.max_payload - STATE_CHUNK_HEADROOM)
        return StateChunk(
            job_id=q.job_id,
            name=q.name,
            offset=q.offset,
            total=len(blob),
            data=blob[q.offset : q.offset + chunk],
        )

    async def _stored(self, name: str) -> bytes:
        """An object of ``sja-checkpoints``, the last few read kept: a state is read in chunks."""
        blob = self._states.get(name)
        if blob is None:
            store = await self.bus.jetstream().object_store(ckpt.BUCKET)
            blob = bytes((await store.get(name)).data or b"")
            self._states[name] = blob
            while len(self._states) > STATES_KEPT:
                self._states.pop(next(iter(self._states)))
        return blob

    async def explain(self, data: bytes, tenant: str | None = None) -> msgspec.Struct:
        """The job's state and, while it waits, why (``sja.core.explain``): from the rounds stored
        in the last ``EXPLAIN_LOOKBACK_S`` and the jobs in the store."""
        q = decode(data, JobQuery)
        got = await self._job(q.job_id, tenant)
        if isinstance(got, ErrorReply):
            return got
        state = got[0]
        now = time.time()
        records: list[RoundRecord] = []
        states: list[JobState] = [state]
        if not J.is_terminal(state):
            since = max(state.submitted_at, now - EXPLAIN_LOOKBACK_S) - ROUNDS_CLOCK_SKEW_S
            records = await self._recent_rounds(since)
            if tenant is not None:
                records = [anonymize_round(r, tenant) for r in records]
            assert self.jobs is not None
            states = [s for s, _ in await self.jobs.all()]
        return E.explain(state, records, states, now, self.limits)


EXPLAIN_LOOKBACK_S = 60.0
"""``explain`` reads the rounds stored this long back: the last offers of each window shape."""
EXPLAIN_RECORDS = 5000
"""At most this many of the newest of them (a busy cluster clears hundreds of rounds a second)."""
POLICY_LOOKBACK_S = 10.0
"""A submission with a deadline reads the rounds of this long back for the policy that clears them."""

ROUNDS_CLOCK_SKEW_S = 5.0
"""A job's rounds are looked for from this long before its submission (stamped by the gateway) to
this long after its end (stamped by its agent), against the times the server stored the records."""


STATE_CHUNK_HEADROOM = 16 * 1024
"""Bytes of a reply left for its envelope when a stored state is cut to the server's ``max_payload``."""

STATES_KEPT = 4
"""Stored states the gateway keeps read while a client fetches them in chunks."""


def _typed(handler: Any, service: Service | None = None, subject: str = "") -> Any:
    """Turn a ``(bytes, tenant) -> Struct`` handler into a micro endpoint with typed error replies;
    the tenant is the last token of a tenant-scoped subject, ``None`` on an operator subject. A request
    that cannot be decoded is counted as rejected on the endpoint's ``subject`` (of ``service``)."""

    async def endpoint(req: Request) -> None:
        try:
            result = await handler(req.data, subjects.tenant_of(req.subject))
        except subjects.InvalidTenant as e:
            result = ErrorReply(code="forbidden", message=str(e), field="tenant")
            if service is not None:
                service.metrics.rejected(subject or req.subject, e)
        except DecodeError as e:
            result = ErrorReply(code="bad_request", message=str(e), field=e.field)
            if service is not None:
                service.metrics.rejected(subject or req.subject, e)
        except Exception as e:
            log.exception("request on %s failed", req.subject)
            result = ErrorReply(code="internal", message=f"{type(e).__name__}: {e}")
        headers = None
        if isinstance(result, ErrorReply):
            headers = {
                "Nats-Service-Error": result.message[:256],
                "Nats-Service-Error-Code": {"bad_request": "400", "forbidden": "403", "not_found": "404"}.get(
                    result.code, "500"
                ),
            }
        await req.respond(encode(result), headers=headers)

    return endpoint


__all__ = ["OTHER", "GatewayService", "GatewaySettings", "anonymize_round", "job_id_for"]
