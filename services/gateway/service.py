"""Gateway: the request/reply API behind the CLI (micro service ``sja-gateway``): submit, status,
list, cancel, and the rounds a job took part in."""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from typing import Any

import msgspec
from nats.js.api import DeliverPolicy
from nats.micro.request import Request

from sja.bus.codec import DecodeError, decode, encode
from sja.bus.service import Service
from sja.bus.settings import BaseSettings
from sja.core import jobs as J
from sja.protocol import subjects
from sja.protocol.messages import (
    ErrorReply,
    JobCancel,
    JobList,
    JobListQuery,
    JobQuery,
    JobState,
    JobView,
    RoundRecord,
    RoundsQuery,
    RoundsView,
    SubmitAck,
    SubmitJob,
)
from sja.workloads import SpecError

log = logging.getLogger(__name__)


class GatewaySettings(BaseSettings, frozen=True, kw_only=True):
    pass


def job_id_for(spec_name: str, tenant: str, request_id: str) -> str:
    """Deterministic for a client request id (so a retried submit is the same job), else unique."""
    if request_id:
        digest = hashlib.sha256(f"{tenant}/{request_id}".encode()).hexdigest()[:12]
        return f"{spec_name}-{digest}"
    return f"{spec_name}-{uuid.uuid4().hex[:12]}"


class GatewayService(Service):
    name = "gateway"

    def __init__(self, settings: GatewaySettings) -> None:
        super().__init__(settings)
        self.submitted = 0

    async def add_endpoints(self, micro: Any) -> None:
        for name, subject, handler in (
            ("submit", subjects.JOB_SUBMIT, self.submit),
            ("status", subjects.JOB_STATUS, self.status),
            ("list", subjects.JOB_LIST, self.list_jobs),
            ("cancel", subjects.JOB_CANCEL, self.cancel),
            ("rounds", subjects.JOB_ROUNDS, self.rounds),
        ):
            await micro.add_endpoint(name=name, subject=subject, handler=_typed(handler))

    async def submit(self, data: bytes) -> msgspec.Struct:
        req = decode(data, SubmitJob)
        job_id = job_id_for(req.spec.name, req.spec.tenant, req.request_id)
        try:
            state = J.new_job(job_id, req.spec, time.time())
        except SpecError as e:
            return ErrorReply(code="bad_request", message=e.message, field=e.field)
        assert self.jobs is not None
        if await self.jobs.create(job_id, state) is None:
            return SubmitAck(job_id=job_id, duplicate=True)
        await self.jetstream.publish(
            subjects.job_submitted(job_id), encode(state), headers={"Nats-Msg-Id": job_id}
        )
        self.submitted += 1
        log.info("job %s submitted by %s (%s)", job_id, req.spec.tenant, req.spec.workload)
        return SubmitAck(job_id=job_id)

    async def status(self, data: bytes) -> msgspec.Struct:
        q = decode(data, JobQuery)
        assert self.jobs is not None
        got = await self.jobs.get(q.job_id)
        if got is None:
            return ErrorReply(code="not_found", message=f"no job {q.job_id}", field="job_id")
        return JobView(state=got[0])

    async def list_jobs(self, data: bytes) -> msgspec.Struct:
        q = decode(data, JobListQuery)
        assert self.jobs is not None
        states = [s for s, _ in await self.jobs.all()]
        if q.tenant:
            states = [s for s in states if s.spec.tenant == q.tenant]
        states.sort(key=lambda s: (s.submitted_at, s.job_id))
        return JobList(jobs=states[: q.limit])

    async def cancel(self, data: bytes) -> msgspec.Struct:
        q = decode(data, JobQuery)
        assert self.jobs is not None
        for _ in range(20):
            got = await self.jobs.get(q.job_id)
            if got is None:
                return ErrorReply(code="not_found", message=f"no job {q.job_id}", field="job_id")
            state, rev = got
            assert isinstance(state, JobState)
            new = J.request_cancel(state, time.time())
            if new == state or await self.jobs.cas(q.job_id, new, rev) is not None:
                await self.bus.publish(subjects.JOB_CANCEL_REQUESTED, encode(JobCancel(job_id=q.job_id)))
                return JobView(state=new)
        return ErrorReply(code="conflict", message=f"job {q.job_id} is changing too fast; retry")

    async def rounds(self, data: bytes) -> msgspec.Struct:
        q = decode(data, RoundsQuery)
        records: list[RoundRecord] = []
        js = self.jetstream
        info = await js.stream_info(subjects.STREAM_ROUNDS.name)
        if info.state.messages:
            sub = await js.subscribe(
                f"{subjects.PREFIX}.round.cleared.>",
                ordered_consumer=True,
                deliver_policy=DeliverPolicy.ALL,
            )
            try:
                while True:
                    try:
                        msg = await sub.next_msg(timeout=2.0)
                    except TimeoutError:
                        break
                    try:
                        rec = decode(msg.data, RoundRecord)
                    except DecodeError:
                        continue
                    if any(v.job_id == q.job_id for v in rec.verdicts):
                        records.append(rec)
                    if msg.metadata.num_pending == 0:
                        break
            finally:
                await sub.unsubscribe()
        return RoundsView(rounds=records[-2000:])


def _typed(handler: Any) -> Any:
    """Turn a ``bytes -> Struct`` handler into a micro endpoint with typed error replies."""

    async def endpoint(req: Request) -> None:
        try:
            result = await handler(req.data)
        except DecodeError as e:
            result = ErrorReply(code="bad_request", message=str(e), field=e.field)
        except Exception as e:
            log.exception("request on %s failed", req.subject)
            result = ErrorReply(code="internal", message=f"{type(e).__name__}: {e}")
        headers = None
        if isinstance(result, ErrorReply):
            headers = {
                "Nats-Service-Error": result.message[:256],
                "Nats-Service-Error-Code": "400" if result.code == "bad_request" else "500",
            }
        await req.respond(encode(result), headers=headers)

    return endpoint
