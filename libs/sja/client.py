"""A typed client for the gateway's request/reply API (what the CLI and the demo use)."""

from __future__ import annotations

from typing import TypeVar

import msgspec
from nats.aio.client import Client as Nats

from sja.bus.codec import decode_union, encode
from sja.bus.connection import connect
from sja.protocol import subjects
from sja.protocol.messages import (
    ErrorReply,
    JobList,
    JobListQuery,
    JobQuery,
    JobSpec,
    JobState,
    JobView,
    RoundRecord,
    RoundsQuery,
    RoundsView,
    SubmitAck,
    SubmitJob,
)

T = TypeVar("T")


class ApiError(Exception):
    def __init__(self, err: ErrorReply) -> None:
        where = f" (field {err.field})" if err.field else ""
        super().__init__(f"{err.code}: {err.message}{where}")
        self.error = err


class SjaClient:
    def __init__(self, nc: Nats, timeout_s: float = 10.0) -> None:
        self.nc = nc
        self.timeout_s = timeout_s

    @classmethod
    async def connect(cls, url: str, timeout_s: float = 10.0) -> SjaClient:
        return cls(await connect(url, "sja-cli"), timeout_s)

    async def close(self) -> None:
        await self.nc.drain()

    async def _call(self, subject: str, req: msgspec.Struct, typ: type[T]) -> T:
        msg = await self.nc.request(subject, encode(req), timeout=self.timeout_s)
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


def load_spec(text: str, source: str = "spec") -> JobSpec:
    """Parse a YAML or JSON job spec; errors name the field."""
    import yaml

    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{source}: not valid YAML/JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{source}: a job spec is a mapping (name, tenant, workload, params...)")
    try:
        spec = msgspec.convert(raw, JobSpec)
    except msgspec.ValidationError as e:
        raise ValueError(f"{source}: {e}") from None
    from sja.core.jobs import validate_spec
    from sja.workloads import SpecError

    try:
        validate_spec(spec)
    except SpecError as e:
        raise ValueError(f"{source}: {e}") from None
    return spec
