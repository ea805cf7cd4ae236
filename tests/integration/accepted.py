"""A job the gateway accepted before the inventory shrank (a GPU lost since), for tests of what a
waiting job shows: the gateway now refuses at submission a job that no slice it knows can hold, so
such a job is written as the gateway wrote it then."""

from __future__ import annotations

import time
import uuid

from nats.aio.client import Client as Nats

from sja.bus.codec import encode
from sja.bus.store import stores
from sja.core.jobs import new_job
from sja.protocol import subjects
from sja.protocol.messages import JobSpec


async def accepted_earlier(nc: Nats, spec: JobSpec, window_s: float = 7.7) -> str:
    """Write ``spec`` as a submitted job (KV ``sja-jobs`` and the ``SJA_JOBS`` stream, as the gateway
    does) and return its id."""
    js = nc.jetstream()
    _, jobs = await stores(js)
    job_id = f"{spec.name}-{uuid.uuid4().hex[:12]}"
    state = new_job(job_id, spec, time.time(), window_s=window_s)
    assert await jobs.create(job_id, state) is not None
    await js.publish(subjects.job_submitted(job_id), encode(state), headers={"Nats-Msg-Id": job_id})
    return job_id
