"""The stack the hostile-input tests (``tests/integration/<service>/test_bad_input.py``) run against:
every service in-process, on a nats-server with ``max_payload`` raised to 8 MiB (the ``server``
fixture of ``tests/integration/conftest.py``), and the waits they use.

The executor is the real ``ExecutorService`` (admission, lease start, completion, freeing the slice)
with its Ray actor replaced by an in-process run of the workload (``InstantExecutor``).

Waits are on events, never fixed sleeps: ``wait_until``, ``settled``, ``rejected``, ``logged`` and
``consumed`` (``tests/integration/waits.py``, shared by the other integration tests) are re-exported
here. A test that asserts an input changed nothing first proves with one of them that the input was
handled.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats.errors
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.executor.service import ExecutorService, ExecutorSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from sja.bus.codec import DecodeError, decode
from sja.bus.connection import connect
from sja.bus.natsd import EmbeddedNats
from sja.bus.rounds import decode_grants
from sja.bus.service import Service
from sja.bus.store import stores
from sja.client import ApiError, SjaClient
from sja.core import jobs as J
from sja.execution.runner import RunResult
from sja.inventory.declared import load_declared
from sja.protocol import messages as m
from sja.protocol import subjects
from sja.workloads import run_in_one_piece, workload
from tests.integration.waits import PING_TIMEOUT_S, rejected, settled, wait_until
from tests.integration.waits import consumed as consumed  # re-exported for the bad-input tests
from tests.integration.waits import logged as logged

MAX_PAYLOAD = 8 * 1024 * 1024
SCALE = max(1, int(os.environ.get("SJA_FUZZ_EXAMPLES", "1")))
FUZZ_SEED = int(os.environ.get("SJA_FUZZ_SEED", "20240611"))
REQUEST_TIMEOUT_S = 5.0
AGENT = "agent-t"
POOL = "local"
NODE = "local"
SLICES = [s.slice_id for s in load_declared("")]
TAGS = [
    cls.__struct_config__.tag
    for cls in vars(m).values()
    if isinstance(cls, type) and issubclass(cls, m.Message) and cls is not m.Message
]
PROTECTED_TENANT = "prot"
ALLOWED_ERROR_CODES = {"bad_request", "not_found", "forbidden"}


# --- the stack ---------------------------------------------------------------------------------------


class InstantExecutor(ExecutorService):
    """The executor's own message handling (decode, admit against the slice's lease, mark busy, publish
    the completion, free the slice) with the Ray actor replaced by an in-process run of the workload.
    Subjobs too big for a test (hostile but valid jobs) are reported ``failed``."""

    hold_s = 0.0
    """How long each subjob keeps its slice busy."""
    peak_mib_per_unit = 0.0
    """Peak memory reported per unit (0: 1 MiB whatever the size)."""

    def _init_ray(self) -> None:
        return None

    def _new_actor(self, s: m.SliceState) -> Any:
        return s.slice_id

    async def _ready(self, actor: Any) -> None:
        return None

    async def on_stop(self) -> None:
        # Not ray.shutdown(); and the pull subscription goes, so that stop() does not wait out the
        # connection's drain timeout (see test_stop_does_not_wait_out_the_drain_timeout).
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()

    async def _run(self, msg: Msg, sj: m.Subjob, holder: Any = None) -> tuple[RunResult, dict[str, str]]:
        started = time.time()
        if self.hold_s:
            await asyncio.sleep(self.hold_s)  # the subjob's run time: its slice stays busy meanwhile
        status, out, error = "ok", b"", ""
        try:
            w = workload(sj.workload)
            params = w.validate(dict(sj.params))
            cost = sj.units * int(params.get("samples_per_unit", 0) or params.get("cols", 1))
            if cost > 2_000_000:
                raise RuntimeError("too big for the test executor")
            out = w.run(params, sj.unit_start, sj.units, sj.input_checkpoint)
        except Exception as e:
            status, error = "failed", f"{type(e).__name__}: {e}"
        now = time.time()
        result = RunResult(
            status=status,
            units_done=sj.units if status == "ok" else 0,
            peak_mem_mib=sj.units * self.peak_mib_per_unit if self.peak_mib_per_unit else 1.0,
            duration_s=max(now - started, 1e-4),
            started_at=started,
            finished_at=now,
            output=out,
            error=error,
        )
        return result, {}


async def unsubscribe_pulls(agent: AgentService) -> None:
    """What AgentService.on_stop should do (test_stop_does_not_wait_out_the_drain_timeout): drop the
    pull subscriptions, whose last fetch's late status message otherwise keeps nc.drain() waiting for
    its whole timeout (5 s). Done here only to keep this file fast."""
    for name in ("_jobs_sub", "_done_sub"):
        sub = getattr(agent, name, None)
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()


async def every_slice_taken(stack: Stack, job_id: str) -> bool:
    """Whether ``job_id`` holds every slice, each lease made a subjob of: no round is left to win
    until the leases lapse (no executor runs the subjobs)."""
    slices = await slice_states(stack)
    got = await stack.agent.jobs.get(job_id)  # type: ignore[union-attr]
    return (
        got is not None
        and all(s.status == "leased" and s.holder_job == job_id for s, _ in slices.values())
        and len(got[0].in_flight) == len(slices)
    )


@dataclass
class Stack:
    url: str
    tmp: Path
    nc: Client
    client: SjaClient
    services: dict[str, Service] = field(default_factory=dict)

    def settings(self, name: str) -> dict[str, Any]:
        return {"nats_url": self.url, "out_dir": str(self.tmp / "out"), "instance": name}

    @property
    def agent(self) -> AgentService:
        svc = self.services["agent"]
        assert isinstance(svc, AgentService)
        return svc

    async def add(self, key: str, svc: Service) -> Service:
        await svc.start()
        self.services[key] = svc
        return svc

    async def remove(self, key: str) -> None:
        svc = self.services.pop(key)
        if isinstance(svc, AgentService):
            await unsubscribe_pulls(svc)
        await svc.stop()

    async def assert_alive(self, what: str = "") -> None:
        """Every service holds its connection and its loops and answers ``$SRV.PING`` promptly."""
        for key, svc in self.services.items():
            assert svc.nc is not None and svc.nc.is_connected, f"{what}: {key} lost its NATS connection"
            for task in svc._loops:
                assert not task.done(), f"{what}: a loop of {key} ended: {task}"
            view = getattr(svc, "view", None)
            if view is not None:
                assert view.watching, f"{what}: the KV watcher of {key} ended"
        names = list(self.services)
        pings = [
            self.nc.request(f"$SRV.PING.sja-{s.name}.{s._micro.id}", b"", timeout=PING_TIMEOUT_S)
            for s in self.services.values()
        ]
        results = await asyncio.gather(*pings, return_exceptions=True)
        dead = [(n, r) for n, r in zip(names, results, strict=True) if isinstance(r, BaseException)]
        assert not dead, f"{what}: no $SRV.PING answer from {dead}"

    async def settled(self, what: str = "", timeout_s: float = 20.0) -> None:
        """Every service has handled what this stack's client sent before: see ``settled``."""
        await self.assert_alive(what)
        await settled(self.nc, list(self.services.values()), what, timeout_s)

    def rejected(self, subject: str | None = None, reason: str | None = None) -> float:
        """Messages every service here has dropped as undecodable so far (see ``rejected``)."""
        return sum(rejected(s, subject, reason) for s in self.services.values())

    async def wait_done(self, job_ids: list[str], timeout_s: float = 20.0) -> list[m.JobState]:
        """The states of ``job_ids`` once every one of them has ended."""
        states: list[m.JobState] = []

        async def all_ended() -> list[m.JobState] | None:
            nonlocal states
            states = [await self.client.status(j) for j in job_ids]
            return states if all(J.is_terminal(s) for s in states) else None

        def where() -> str:
            return "jobs finished: " + ", ".join(
                f"{s.job_id} {s.status} {s.units_done}/{s.total_units}" for s in states
            )

        done: list[m.JobState] = await wait_until(all_ended, where, timeout_s, every_s=0.05)
        return done


@contextlib.asynccontextmanager
async def running(
    server: EmbeddedNats,
    tmp: Path,
    *,
    executor: bool = True,
    hold_s: float = 0.0,
    advertiser: bool = True,
    completion_flush_s: float = 0.05,
    peak_mib_per_unit: float = 0.0,
) -> AsyncIterator[Stack]:
    nc = await connect(server.url, "fuzzer")
    stack = Stack(url=server.url, tmp=tmp, nc=nc, client=SjaClient(nc, timeout_s=REQUEST_TIMEOUT_S))
    c = stack.settings
    try:
        await stack.add("inventory", InventoryService(InventorySettings(**c("inventory-t"))))
        await stack.add("gateway", GatewayService(GatewaySettings(**c("gateway-t"))))
        await stack.add("clearer", ClearerService(ClearerSettings(**c("clearer-t"), lease_s=3.0)))
        await stack.add(
            "agent",
            AgentService(
                AgentSettings(
                    **c(AGENT),
                    horizon_s=3.0,
                    heartbeat_s=0.5,
                    lease_s=3.0,
                    reap_every_s=0.5,
                    completion_flush_s=completion_flush_s,
                )
            ),
        )
        if executor:
            ex = InstantExecutor(ExecutorSettings(**c("executor-t"), node=NODE))
            ex.hold_s = hold_s
            ex.peak_mib_per_unit = peak_mib_per_unit
            await stack.add("executor", ex)
        if advertiser:
            await stack.add(
                "advertiser",
                AdvertiserService(
                    AdvertiserSettings(**c("advertiser-t"), horizon_s=3.0, sweep_interval_s=0.1)
                ),
            )
        yield stack
    finally:
        for key in reversed(list(stack.services)):
            with contextlib.suppress(Exception):
                await stack.remove(key)
        await nc.close()


def good_spec(name: str, seed_: int, **kw: Any) -> m.JobSpec:
    fields: dict[str, Any] = {
        "name": name,
        "tenant": PROTECTED_TENANT,
        "workload": "montecarlo",
        "max_parallel": 2,
        "params": {"units": 24, "samples_per_unit": 2000, "seed": seed_},
        "time": m.TimeDecl(warmup_s=0.0, per_unit_s=0.05, rel_sd=0.1),
    }
    return m.JobSpec(**{**fields, **kw})


def assert_intact(state: m.JobState) -> None:
    """Done, with the one-piece result, every unit applied exactly once."""
    assert state.status == "done", (state.job_id, state.status, state.error)
    assert state.result == run_in_one_piece(state.spec.workload, state.spec.params), state.job_id
    ok = sorted((h.unit_start, h.unit_start + h.units) for h in state.history if h.status == "ok")
    assert ok and ok[0][0] == 0 and ok[-1][1] == state.total_units, ok
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ok)), f"units applied twice or missed: {ok}"
    assert not state.in_flight


async def cancel_others(stack: Stack, keep: set[str]) -> None:
    """Cancel the jobs a storm managed to submit (valid hostile specs), so they stop taking slices."""
    for s in await stack.client.jobs():
        if s.job_id not in keep and not J.is_terminal(s):
            with contextlib.suppress(ApiError):
                await stack.client.cancel(s.job_id)


def unexpected_errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Exceptions the services logged that are not a refused message (``DecodeError``).

    Left out: a round of an already stopped clearer whose timer fires later (it can land in a later
    test: the event loop is shared), which is test_stopped_clearer_leaves_no_round_timer; and a NATS
    request timing out under a long storm's load, which the service retries (nak and redelivery)."""
    out = []
    for rec in caplog.records:
        text = rec.getMessage()
        if rec.name == "asyncio" and "ClearerService.close" in text:
            continue
        if rec.exc_info and rec.exc_info[0] is not None and issubclass(rec.exc_info[0], TimeoutError):
            continue
        if rec.exc_info and rec.exc_info[0] is not None and not issubclass(rec.exc_info[0], DecodeError):
            out.append(f"{rec.name}: {text}: {rec.exc_info[0].__name__}: {rec.exc_info[1]}")
    return out


def describe(kind: str, subject: str, data: bytes) -> str:
    return f"{kind} on {subject}: {len(data)} bytes {data[:300]!r}"


REQUEST_TYPES: dict[str, type[msgspec.Struct]] = {
    subjects.JOB_SUBMIT: m.SubmitAck,
    subjects.JOB_STATUS: m.JobView,
    subjects.JOB_LIST: m.JobList,
    subjects.JOB_CANCEL: m.JobView,
    subjects.JOB_ROUNDS: m.RoundsView,
    subjects.JOB_EXPLAIN: m.Explanation,
    subjects.JOB_LOGS: m.LogsView,
}
POLICY_SUBJECT = f"{subjects.PREFIX}.clearer.policy"


async def capture(nc: Client, subject: str, into: list[Msg]) -> Any:
    async def cb(msg: Msg) -> None:
        into.append(msg)

    return await nc.subscribe(subject, cb=cb)


async def slice_states(stack: Stack) -> dict[str, tuple[m.SliceState, int]]:
    slices, _ = await stores(stack.nc.jetstream())
    return {s.slice_id: (s, rev) for s, rev in await slices.all()}


async def one_subjob(stack: Stack, spec: m.JobSpec) -> tuple[str, m.Grant, m.Subjob]:
    """Submit ``spec`` and wait for its first grant and subjob (no executor runs it)."""
    grants_seen: list[Msg] = []
    subjobs_seen: list[Msg] = []
    await capture(stack.nc, subjects.grant_issued("*"), grants_seen)
    await capture(stack.nc, f"{subjects.PREFIX}.subjob.dispatched.>", subjobs_seen)
    ack = await stack.client.submit(spec)
    await wait_until(lambda: subjobs_seen, "a subjob dispatched")
    sj = decode(subjobs_seen[0].data, m.Subjob)
    grant = next(g for x in grants_seen for g in decode_grants(x.data) if g.grant_id == sj.grant_id)
    return ack.job_id, grant, sj


async def request_retrying(nc: Any, subject: str, data: bytes) -> Msg:
    """A request right after a service's start(), retried on no responders: seen now and then on a
    loaded CI machine; a client retries that (the service may be restarting), these tests too."""
    for attempt in range(20):
        try:
            reply: Msg = await nc.request(subject, data, timeout=REQUEST_TIMEOUT_S)
            return reply
        except nats.errors.NoRespondersError:
            if attempt == 19:
                raise
            await asyncio.sleep(0.1)
    raise AssertionError("unreachable")
