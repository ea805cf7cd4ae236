"""A typed client for the gateway's request/reply API (what the CLI and the demo use).

Without a tenant the client uses the operator subjects (``sja.v1.job.submit``, ...), as the
one-machine stack always has. With ``tenant`` it uses that tenant's subjects
(``sja.v1.job.submit.<tenant>``): the only ones a tenant's NATS user may publish on, answered by the
gateway for that tenant's jobs only. A request the server refuses for this user fails at once with
``ApiError`` code ``forbidden`` (rather than waiting for a reply that cannot come).
"""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import nats.errors
from nats.aio.client import Client as Nats

from sja.bus.auth import NatsSettings
from sja.bus.codec import decode_union, encode
from sja.bus.connection import connect
from sja.bus.permissions import PermissionViolation
from sja.protocol import subjects
from sja.protocol.messages import (
    CodeAck,
    CodeChunk,
    ErrorReply,
    Explanation,
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
    StateChunk,
    StateQuery,
    SubmitAck,
    SubmitJob,
)

T = TypeVar("T")

NO_RESPONDER_RETRIES = 10

CODE_CHUNK_HEADROOM = 16 * 1024
"""Bytes of a request left for its envelope when code is cut to the server's ``max_payload``."""

CONNECT_TIMEOUT_S = 2.0
FIRST_CONNECT_RETRIES = 2
"""A client gives up after three tries per server (``NatsUnreachableError``): a command run with no
server at its URL fails within seconds instead of waiting for one forever, as a service does."""


class ApiError(Exception):
    def __init__(self, err: ErrorReply) -> None:
        where = f" (field {err.field})" if err.field else ""
        super().__init__(f"{err.code}: {err.message}{where}")
        self.error = err


class Denials:
    """Permission violations the server reported for a client's connection, matched to requests."""

    def __init__(self) -> None:
        self.seen: list[PermissionViolation] = []
        self._waiters: dict[str, list[asyncio.Future[PermissionViolation]]] = {}

    def report(self, violation: PermissionViolation) -> None:
        self.seen.append(violation)
        for fut in self._waiters.pop(violation.subject.lower(), []):
            if not fut.done():
                fut.set_result(violation)

    def watch(self, subject: str) -> asyncio.Future[PermissionViolation]:
        fut: asyncio.Future[PermissionViolation] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault(subject.lower(), []).append(fut)
        return fut

    def forget(self, subject: str, fut: asyncio.Future[PermissionViolation]) -> None:
        waiters = self._waiters.get(subject.lower(), [])
        if fut in waiters:
            waiters.remove(fut)
        if not waiters:
            self._waiters.pop(subject.lower(), None)
        fut.cancel()


class SjaClient:
    def __init__(
        self,
        nc: Nats,
        timeout_s: float = 10.0,
        *,
        tenant: str = "",
        denials: Denials | None = None,
    ) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        self.tenant = subjects.tenant_token(tenant) if tenant else ""
        self.denials = denials

    @classmethod
    async def connect(
        cls,
        url: str,
        timeout_s: float = 10.0,
        *,
        tenant: str = "",
        auth: NatsSettings | None = None,
    ) -> SjaClient:
        """Connect to the gateway's NATS; ``tenant`` scopes every request to that tenant (required with a
        tenant's credentials), ``auth`` gives the credentials (none: an open server). With no server
        at ``url`` this fails within seconds with ``NatsUnreachableError``."""
        if tenant:
            subjects.tenant_token(tenant)  # a bad name fails here, before any connection
        denials = Denials()
        nc = await connect(
            url,
            "sja-cli",
            connect_timeout_s=CONNECT_TIMEOUT_S,
            first_connect_retries=FIRST_CONNECT_RETRIES,
            auth=auth,
            on_permission_violation=denials.report,
        )
        return cls(nc, timeout_s, tenant=tenant, denials=denials)

    async def close(self) -> None:
        await self.nc.drain()

    def _subject(self, request: str) -> str:
        return subjects.tenant_request(request, self.tenant) if self.tenant else request

    async def _call(self, request: str, req: msgspec.Struct, typ: type[T]) -> T:
        """One request; "no responders" (a gateway starting or restarting) is retried for a while."""
        for attempt in range(NO_RESPONDER_RETRIES):
            try:
                return await self._call_once(request, req, typ)
            except nats.errors.NoRespondersError:
                if attempt == NO_RESPONDER_RETRIES - 1:
                    raise
                await asyncio.sleep(0.2)
        raise AssertionError("unreachable")

    async def _call_once(self, request: str, req: msgspec.Struct, typ: type[T]) -> T:
        subject = self._subject(request)
        if self.denials is None:
            msg = await self.nc.request(subject, encode(req), timeout=self.timeout_s)
        else:
            denied = self.denials.watch(subject)
            call = asyncio.ensure_future(self.nc.request(subject, encode(req), timeout=self.timeout_s))
            try:
                pending: set[asyncio.Future[Any]] = {call, denied}
                await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                if denied.done() and not call.done():
                    call.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await call
                    raise ApiError(
                        ErrorReply(
                            code="forbidden",
                            message=f"the NATS server refused to publish on {subject} for these "
                            "credentials" + (f" (tenant {self.tenant})" if self.tenant else ""),
                        )
                    )
                try:
                    msg = call.result()
                except TimeoutError:
                    refused = [v for v in self.denials.seen if v.operation == "subscription"]
                    if not refused:
                        raise
                    raise ApiError(
                        ErrorReply(
                            code="forbidden",
                            message=f"no reply can arrive: the NATS server refused the subscription to "
                            f"{refused[-1].subject} for these credentials (check the inbox prefix)",
                        )
                    ) from None
            finally:
                self.denials.forget(subject, denied)
                if not call.done():
                    call.cancel()
        reply = decode_union(msg.data, typ | ErrorReply)
        if isinstance(reply, ErrorReply):
            raise ApiError(reply)
        result: T = reply
        return result

    async def submit(self, spec: JobSpec, request_id: str = "") -> SubmitAck:
        return await self._call(subjects.JOB_SUBMIT, SubmitJob(spec=spec, request_id=request_id), SubmitAck)

    async def status(self, job_id: str) -> JobState:
        return (await self._call(subjects.JOB_STATUS, JobQuery(job_id=job_id), JobView)).state

    async def jobs(self, tenant: str = "") -> list[JobState]:
        return (await self._call(subjects.JOB_LIST, JobListQuery(tenant=tenant), JobList)).jobs

    async def cancel(self, job_id: str) -> JobState:
        return (await self._call(subjects.JOB_CANCEL, JobQuery(job_id=job_id), JobView)).state

    async def rounds(self, job_id: str) -> list[RoundRecord]:
        return (await self._call(subjects.JOB_ROUNDS, RoundsQuery(job_id=job_id), RoundsView)).rounds

    async def explain(self, job_id: str) -> Explanation:
        return await self._call(subjects.JOB_EXPLAIN, JobQuery(job_id=job_id), Explanation)

    async def stored_state(self, job_id: str, name: str) -> bytes:
        """One of the job's stored states (an object its state refers to), read through the gateway
        in chunks: the gateway serves it to the job's tenant only."""
        data = bytearray()
        while True:
            got = await self._call(
                subjects.JOB_STATE, StateQuery(job_id=job_id, name=name, offset=len(data)), StateChunk
            )
            if got.offset != len(data) or got.total < len(data) + len(got.data):
                raise ApiError(ErrorReply(code="internal", message=f"state {name}: a chunk out of place"))
            data += got.data
            if len(data) >= got.total or not got.data:
                break
        if len(data) != got.total:
            short = f"state {name}: {len(data)} of {got.total} bytes"
            raise ApiError(ErrorReply(code="internal", message=short))
        return bytes(data)

    async def upload_code(self, tenant: str, archive: bytes) -> str:
        """Upload a job's code (a zip archive, ``sja.workloads.codepack.pack``) through the gateway, in
        chunks, unless the tenant's code of the same digest is kept already; the reference a spec
        names it by (``params.code``)."""
        from sja.workloads import codepack

        digest, total = codepack.digest(archive), len(archive)
        ack = await self._call(
            subjects.JOB_CODE, CodeChunk(tenant=tenant, digest=digest, total=total), CodeAck
        )
        if not ack.stored:
            size = max(1, self.nc.max_payload - CODE_CHUNK_HEADROOM)
            for offset in range(0, total, size):
                chunk = CodeChunk(
                    tenant=tenant,
                    digest=digest,
                    total=total,
                    offset=offset,
                    data=archive[offset : offset + size],
                )
                if (await self._call(subjects.JOB_CODE, chunk, CodeAck)).stored:
                    break  # the same code arrived meanwhile (another upload)
            else:
                commit = CodeChunk(tenant=tenant, digest=digest, total=total, offset=total, commit=True)
                ack = await self._call(subjects.JOB_CODE, commit, CodeAck)
                if not ack.stored:
                    raise ApiError(ErrorReply(code="internal", message="the gateway did not keep the code"))
        return codepack.ref(digest)

    async def logs(self, job_id: str, subjob: str = "") -> LogsView:
        """What each subjob's program wrote last (or one subjob's: its id or number)."""
        return await self._call(subjects.JOB_LOGS, LogsQuery(job_id=job_id, subjob=subjob), LogsView)


class SpecErrors(ValueError):
    """Every problem found in a job spec, each naming its field: ``problems`` holds one line per
    problem (``SOURCE: FIELD: what is wrong``); ``str()`` is all of them, one per line."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("\n".join(problems))
        self.problems = problems


def _command_locals(
    raw: dict[str, Any],
    source: str,
    base: Path | None,
    code: Path | None,
    archives: dict[str, bytes] | None,
) -> tuple[dict[str, Any], list[str]]:
    """A ``command`` spec's parts that name this machine's files: its code directory, packed and
    named by its reference, and its interpreter, which must be an executable file."""
    import os

    from sja.workloads import codepack
    from sja.workloads.command import CODE_REF

    params = dict(raw.get("params") or {})
    problems: list[str] = []
    named = params.get("code")
    directory = code
    if directory is None and isinstance(named, str) and named and not CODE_REF.match(named):
        directory = Path(named).expanduser()
        if not directory.is_absolute() and base is not None:
            directory = base / directory
    if directory is not None:
        try:
            archive = codepack.pack(directory, CODE_MAX_BYTES)
        except codepack.CodeError as e:
            field = "--code" if code is not None else "params.code"
            problems.append(f"{source}: {field}: {e}")
            params.pop("code", None)  # said once, here
        else:
            params["code"] = codepack.ref(codepack.digest(archive))
            if archives is not None:
                archives[params["code"]] = archive
    python = params.get("python")
    if isinstance(python, str) and os.path.isabs(python):
        if not os.path.exists(python):
            problems.append(
                f"{source}: params.python: {python} does not exist here: name an interpreter installed "
                "where you submit and on every executor node, or leave it out for the executor's own"
            )
        elif not os.path.isfile(python) or not os.access(python, os.X_OK):
            problems.append(f"{source}: params.python: {python} is not an executable file")
    return {**raw, "params": params}, problems


def read_spec_file(path: Path) -> str:
    """A spec file's text; a file that cannot be read or is not text fails naming the file."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SpecErrors([f"{path}: no such file"]) from None
    except IsADirectoryError:
        raise SpecErrors([f"{path}: is a directory, not a job spec file"]) from None
    except OSError as e:
        raise SpecErrors([f"{path}: cannot be read ({e.strerror or e})"]) from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SpecErrors(
            [
                f"{path}: not a text file (byte 0x{data[e.start]:02x} at offset {e.start} is not "
                "UTF-8); a job spec is YAML or JSON"
            ]
        ) from None


CODE_MAX_BYTES = 64 * 1024 * 1024
"""The largest code archive ``sja submit`` packs (the gateway's own limit, ``SJA_CODE_MAX_MIB``, may
be lower: it refuses a larger one, saying so)."""


def load_spec(
    text: str,
    source: str = "spec",
    *,
    base: Path | None = None,
    code: Path | None = None,
    archives: dict[str, bytes] | None = None,
) -> JobSpec:
    """Parse a YAML or JSON job spec. Every problem is reported at once (``SpecErrors``, a
    ``ValueError``), each on one line naming the source and the field, in SJA's words.

    A ``command`` job's code (``code``, or a directory its ``params.code`` names, relative to
    ``base``) is packed (``sja.workloads.codepack``); the spec then names it by its reference, and
    the archive is put in ``archives`` under that reference, for the caller to upload. Its
    interpreter (``params.python``) must be an executable file here: where the job is submitted, as
    on every executor node."""
    import yaml

    from sja.core.jobs import validate_spec
    from sja.protocol.wording import plain, struct_problems
    from sja.workloads import SpecError, facts_of, trusted, workload

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise SpecErrors([f"{source}: not valid YAML/JSON{where}: {problem}"]) from None
    if not isinstance(raw, dict):
        raise SpecErrors([f"{source}: a job spec is a mapping (name, tenant, workload, params...)"])
    found = struct_problems(raw, JobSpec)
    problems = [f"{source}: {field}: {why}" for field, why in found]
    if raw.get("workload") == "command" and isinstance(raw.get("params", {}), dict):
        raw, more = _command_locals(raw, source, base, code, archives)
        problems += more
    elif code is not None:
        problems.append(f"{source}: --code: only a command job takes code (this is {raw.get('workload')!r})")
    bad_fields = {field.split(".")[0] for field, _ in found}
    if "workload" not in bad_fields and "params" not in bad_fields and isinstance(raw.get("workload"), str):
        # The workload's own parameters, checked even when other fields are wrong.
        name = raw["workload"]
        try:
            if trusted(name):
                workload(name).validate(dict(raw.get("params") or {}))
            elif "facts" not in raw or "facts" in bad_fields:
                # A tenant's workload runs here, in the submitter's own process, and nowhere in the
                # control plane: its facts travel with the spec.
                params, facts = facts_of(name, dict(raw.get("params") or {}))
                raw = {**raw, "params": params, "facts": msgspec.to_builtins(facts)}
        except SpecError as e:
            if e.field == "workload" and not trusted(name):
                problems.append(
                    f"{source}: workload: {e.message}; install it where `sja submit` runs (it computes "
                    "the job's facts from it), or state them in the spec (facts: {total_units: N, "
                    "sequential: false})"
                )
            else:
                problems.append(f"{source}: {e.field}: {e.message}")
    if problems:
        raise SpecErrors(problems)
    try:
        spec = msgspec.convert(raw, JobSpec)
    except (msgspec.ValidationError, ValueError) as e:
        raise SpecErrors([f"{source}: {plain(str(e))}"]) from None
    try:
        validate_spec(spec)
    except SpecError as e:
        raise SpecErrors([f"{source}: {e.field}: {e.message}"]) from None
    return spec
