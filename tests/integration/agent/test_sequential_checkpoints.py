"""A sequential job's state through the checkpoint store: a subjob lost to an OOM, one killed at its
time cap and one whose checkpoint could not be written all leave the job at its last committed
checkpoint, and the job goes on from there to the result of the job computed in one piece.

The stack runs in-process against a real nats-server (the object store ``sja-checkpoints`` is
JetStream's). The executor is the real ``ExecutorService`` (admission, fetching the input checkpoint
and checking its digest, the time cap, storing the output checkpoint, the completion) with each
slice's Ray actor replaced by an in-process one that runs the subjob with the real runner
(``run_subjob``: tracemalloc, the memory cap) and, where a test says so, fails it as Ray would: the
worker killed by Ray's memory monitor, or a subjob that never returns.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import itertools
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import ray.exceptions
from nats.js.api import ObjectStoreConfig

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.executor.service import ExecutorService, ExecutorSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from sja.bus.codec import MAX_MESSAGE_BYTES, decode, encode
from sja.bus.connection import connect
from sja.bus.service import Service
from sja.client import SjaClient
from sja.core import jobs as J
from sja.execution import stopclock
from sja.execution.runner import run_subjob
from sja.protocol import messages as m
from sja.workloads import WORKLOADS, facts_of, run_in_one_piece
from sja.workloads import checkpoint as ckpt
from tests.integration.waits import until_state as until_state  # re-exported for the stack tests

pytestmark = pytest.mark.timeout(180)

HORIZON_S = 2.0
"""Short windows: the job is cut into several subjobs."""
PARAMS = {"grid": 512, "sweeps": 3000, "seed": 21}
"""About 0.4 ms a sweep, 2 MiB of state in every checkpoint. The first subjob sized from a measured
speed takes about half of the job (its speed known from one short subjob, it is sized with a wide
margin): more than one subjob's work is left after it on a fast machine too."""


@dataclass
class Call:
    subjob_id: str
    unit_start: int
    units: int
    input_ref: str
    """The object the subjob's input checkpoint names (empty: the job's first subjob)."""
    input_sweep: int
    """The sweep the checkpoint the actor was given holds."""


Fault = Callable[[m.Subjob, int], str]
"""``(subjob, index among the calls that got a checkpoint) -> "" | "oom" | "hang" | "gate"``."""


@dataclass
class Actors:
    """What the in-process actors share: one worker thread (tracemalloc measures the process), the
    calls seen, and the faults to inject."""

    fault: Fault = lambda sj, i: ""
    calls: list[Call] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)
    pool: concurrent.futures.ThreadPoolExecutor = field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(1)
    )

    def close(self) -> None:
        self.gate.set()
        self.pool.shutdown(wait=True, cancel_futures=True)


class _Ref:
    def __init__(self, fut: concurrent.futures.Future[Any]) -> None:
        self._fut = fut

    def future(self) -> concurrent.futures.Future[Any]:
        return self._fut


class _Method:
    def __init__(self, fn: Callable[..., _Ref]) -> None:
        self.remote = fn


class InProcessActor:
    """The slice actor's interface (``run.remote``, ``info.remote``) without Ray."""

    def __init__(self, slice_id: str, shared: Actors) -> None:
        self.slice_id = slice_id
        self.shared = shared
        self.run = _Method(self._run)
        self.info = _Method(self._info)
        self.yield_subjob = _Method(self._yield_subjob)

    def _yield_subjob(self, subjob_id: str, grace_s: float) -> _Ref:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        fut.set_result(stopclock.request_yield(subjob_id, grace_s))
        return _Ref(fut)

    def _info(self) -> _Ref:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        fut.set_result({"slice_id": self.slice_id})
        return _Ref(fut)

    def _run(
        self, subjob: bytes, carrier: dict[str, str], checkpoint: bytes | None = None, code_uri: str = ""
    ) -> _Ref:
        sj = decode(subjob, m.Subjob)
        given = checkpoint if checkpoint is not None else sj.input_checkpoint
        summary = ckpt.summary_of(given)
        self.shared.calls.append(
            Call(
                subjob_id=sj.subjob_id,
                unit_start=sj.unit_start,
                units=sj.units,
                input_ref=ckpt.unpack_ref(sj.input_checkpoint).name if sj.input_checkpoint else "",
                input_sweep=msgspec.msgpack.decode(summary, type=_Sweep).sweep if summary else 0,
            )
        )
        index = sum(1 for c in self.shared.calls if c.input_ref) - 1
        fault = self.shared.fault(sj, index) if given else ""
        if fault == "oom":
            fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
            fut.set_exception(
                ray.exceptions.OutOfMemoryError(
                    f"Task was killed due to the node running low on memory ({sj.subjob_id})"
                )
            )
            return _Ref(fut)
        if fault == "hang":
            return _Ref(concurrent.futures.Future())  # never done: the executor stops it at its cap

        def work() -> bytes:
            if fault == "gate":
                self.shared.gate.wait(timeout=60)
            run = sj if checkpoint is None else msgspec.structs.replace(sj, input_checkpoint=checkpoint)
            return encode([run_subjob(run), {}])

        return _Ref(self.shared.pool.submit(work))


class _Sweep(msgspec.Struct, frozen=True, kw_only=True):
    sweep: int = 0


class InProcessExecutor(ExecutorService):
    shared: Actors

    def _init_ray(self) -> None:
        return None

    def _new_actor(self, s: m.SliceState) -> Any:
        return InProcessActor(s.slice_id, self.shared)

    async def _restart_actor(self, slice_id: str) -> None:
        # Not ray.kill(): there is no Ray here (it would start one). The thread of a subjob that
        # never returns is left waiting; the slice gets a fresh actor, as with Ray.
        self.actors[slice_id] = self._new_actor(self.slice_info[slice_id])

    async def on_stop(self) -> None:
        with contextlib.suppress(Exception):
            await self._sub.unsubscribe()


@dataclass
class Stack:
    client: SjaClient
    nc: Any
    executor: InProcessExecutor


@contextlib.asynccontextmanager
async def running(
    nats_url: str, tmp: Path, shared: Actors, inventory: str = "", **executor_kw: Any
) -> AsyncIterator[Stack]:
    def c(name: str) -> dict[str, Any]:
        return {"nats_url": nats_url, "out_dir": str(tmp / "out"), "instance": name}

    executor = InProcessExecutor(ExecutorSettings(**c("executor-t"), node="local", **executor_kw))
    executor.shared = shared
    services: list[Service] = [
        InventoryService(InventorySettings(**c("inventory-t"), inventory=inventory)),
        GatewayService(GatewaySettings(**c("gateway-t"))),
        ClearerService(ClearerSettings(**c("clearer-t"), lease_s=3.0)),
        AgentService(
            AgentSettings(**c("agent-t"), horizon_s=HORIZON_S, heartbeat_s=0.5, lease_s=3.0, reap_every_s=0.5)
        ),
        executor,
        AdvertiserService(AdvertiserSettings(**c("advertiser-t"), horizon_s=HORIZON_S, sweep_interval_s=0.1)),
    ]
    nc = await connect(nats_url, "test-client")
    started: list[Service] = []
    try:
        for svc in services:
            await svc.start()
            started.append(svc)
        yield Stack(client=SjaClient(nc), nc=nc, executor=executor)
    finally:
        shared.close()
        for svc in reversed(started):
            if isinstance(svc, AgentService):
                # Its pull subscriptions' late status messages would hold the drain for its timeout.
                for name in ("_jobs_sub", "_done_sub"):
                    with contextlib.suppress(Exception):
                        await getattr(svc, name).unsubscribe()
            with contextlib.suppress(Exception):
                await svc.stop()
        await nc.close()


LOST_PARAMS = {**PARAMS, "sweeps": 1500}
"""For the test that loses subjobs: the OOM it injects stays a hard bound (memory is not released
the way a stalled timeout is), so every later subjob is small and the job takes many of them."""


def spec(name: str, params: dict[str, int] = PARAMS) -> m.JobSpec:
    return m.JobSpec(name=name, tenant="t", workload="jacobi", params=params)


def assert_one_piece(state: m.JobState, params: dict[str, int] = PARAMS) -> None:
    """Done, with the one-piece grid, every sweep applied exactly once, in order."""
    assert state.status == "done", (state.status, state.error)
    assert state.result == run_in_one_piece("jacobi", params)
    ok = [(h.unit_start, h.unit_start + h.units) for h in state.history if h.status == "ok"]
    assert ok[0][0] == 0 and ok[-1][1] == params["sweeps"]
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ok)), ok


async def committed(nc: Any, acc: bytes) -> bytes:
    """The grid a job's accumulator points to, read back from the store and checked."""
    ref = ckpt.unpack_ref(acc)
    store = await nc.jetstream().object_store(ckpt.BUCKET)
    data = bytes((await store.get(ref.name)).data or b"")
    assert ckpt.digest(data) == ref.sha256 and len(data) == PARAMS["grid"] ** 2 * 8
    return data


async def test_lost_and_oom_subjobs_restart_from_the_last_committed_checkpoint(
    nats_url: str, tmp_path: Path
) -> None:
    """The first subjob given a checkpoint is killed for memory; a later one never returns and is
    stopped at its time cap. Each is run again from the checkpoint it was given, the one its job had
    committed last, and neither leaves an object behind."""
    hung: list[str] = []

    def fault(sj: m.Subjob, i: int) -> str:
        if i == 0:
            return "oom"
        # Not a one-sweep subjob: one that overran a window cannot be cut any smaller.
        if i >= 2 and sj.units > 1 and not hung:
            hung.append(sj.subjob_id)
            return "hang"
        return ""

    shared = Actors(fault=fault)
    async with running(nats_url, tmp_path, shared) as stack:
        job_id = (await stack.client.submit(spec("lost", LOST_PARAMS))).job_id
        state = await until_state(stack.client, job_id, J.is_terminal, 150, "the job to end")
        assert_one_piece(state, LOST_PARAMS)

        statuses = {h.subjob_id: h.status for h in state.history}
        assert sorted(statuses.values()).count("oom") == 1, statuses
        assert sorted(statuses.values()).count("timeout") == 1, statuses
        ok = [h for h in state.history if h.status == "ok"]
        assert len(ok) >= 3, "the job was cut into several subjobs"
        ends = {h.unit_start + h.units: f"{job_id}/{h.subjob_id}" for h in ok}

        # Every subjob started from the checkpoint committed by the ok subjob that ended where it
        # starts, and that checkpoint was at its start sweep.
        for call in shared.calls:
            assert call.input_sweep == call.unit_start, call
            assert call.input_ref == ends.get(call.unit_start, ""), call
        failed = [c for c in shared.calls if statuses[c.subjob_id] in ("oom", "timeout")]
        assert len(failed) == 2 and failed[0].input_ref != failed[1].input_ref, failed
        for f in failed:
            again = [c for c in shared.calls if c.unit_start == f.unit_start and c.subjob_id != f.subjob_id]
            assert again and all(c.input_ref == f.input_ref for c in again), (f, again)

        # Only ok subjobs stored a checkpoint; the job's last one holds the one-piece grid.
        store = await stack.nc.jetstream().object_store(ckpt.BUCKET)
        names = {o.name for o in await store.list()}
        assert names == set(ends.values())
        data = await committed(stack.nc, state.accumulator)
        assert hashlib.sha256(data).hexdigest() == state.result["solution_sha256"]


async def test_a_checkpoint_written_in_part_is_never_committed(
    nats_url: str, tmp_path: Path, nc: Any
) -> None:
    """The store fills up while the second subjob's checkpoint is written: the executor reports the
    subjob failed, the half-written object is gone, and the job keeps the first subjob's checkpoint;
    once the store has room, the job goes on from it to the one-piece result."""
    grid_bytes = PARAMS["grid"] ** 2 * 8
    js = nc.jetstream()
    # Room for one checkpoint and half of another (chunks are 128 KiB; the server refuses the chunk
    # that does not fit).
    await js.create_object_store(ckpt.BUCKET, ObjectStoreConfig(max_bytes=grid_bytes * 3 // 2))
    shared = Actors(fault=lambda sj, i: "gate" if i == 1 else "")
    async with running(nats_url, tmp_path, shared) as stack:
        job_id = (await stack.client.submit(spec("half"))).job_id
        state = await until_state(
            stack.client,
            job_id,
            lambda s: any(h.status == "failed" for h in s.history) or J.is_terminal(s),
            60,
            "a checkpoint that could not be written",
        )
        assert state.status not in ("failed", "done"), (state.status, state.error)
        first, second = state.history[0], state.history[1]
        assert (first.status, second.status) == ("ok", "failed")
        assert state.units_done == first.units
        assert ckpt.unpack_ref(state.accumulator).name == f"{job_id}/{first.subjob_id}"
        await committed(nc, state.accumulator)
        store = await js.object_store(ckpt.BUCKET)
        assert {o.name for o in await store.list()} == {f"{job_id}/{first.subjob_id}"}
        info = await js.stream_info(f"OBJ_{ckpt.BUCKET}")
        assert info.state.bytes < grid_bytes * 1.1, "the part written was purged"

        # The retry waits (in its actor) while the store is given room, then continues from the
        # first subjob's checkpoint.
        await js.update_stream(dataclasses.replace(info.config, max_bytes=-1))
        shared.gate.set()
        state = await until_state(stack.client, job_id, J.is_terminal, 120, "the job to end")
        assert_one_piece(state)
        retry = next(
            c for c in shared.calls if c.unit_start == second.unit_start and c.subjob_id != second.subjob_id
        )
        assert retry.input_ref == f"{job_id}/{first.subjob_id}"
        assert [h.status for h in state.history].count("failed") == 1
        data = await committed(nc, state.accumulator)
        assert hashlib.sha256(data).hexdigest() == state.result["solution_sha256"]


async def test_a_checkpoint_larger_than_a_message_goes_through_the_store(
    nats_url: str, tmp_path: Path
) -> None:
    """A 1024 x 1024 grid is an 8 MiB checkpoint, twice what a message on the bus may hold: it comes
    back from the slice's actor whole, is stored, and the next subjob starts from it."""
    params = {"grid": 1024, "sweeps": 400, "seed": 4}
    assert params["grid"] ** 2 * 8 >= 2 * MAX_MESSAGE_BYTES
    async with running(nats_url, tmp_path, Actors()) as stack:
        job = m.JobSpec(name="big", tenant="t", workload="jacobi", params=params)
        job_id = (await stack.client.submit(job)).job_id
        state = await until_state(stack.client, job_id, J.is_terminal, 120, "the job to end")
        assert state.status == "done", (state.status, state.error, [h.status for h in state.history])
        assert state.result == run_in_one_piece("jacobi", params)
        # nothing failed for its size; a subjob a loaded machine held past its cap may time out
        assert {h.status for h in state.history} <= {"ok", "timeout"}, [h.status for h in state.history]
        ref = ckpt.unpack_ref(state.accumulator)
        store = await stack.nc.jetstream().object_store(ckpt.BUCKET)
        data = bytes((await store.get(ref.name)).data or b"")
        assert len(data) == ref.size == params["grid"] ** 2 * 8 and ckpt.digest(data) == ref.sha256


USERPKG = str(Path(__file__).resolve().parent / "userpkg")


def _user_package(monkeypatch: pytest.MonkeyPatch) -> None:
    """The misbehaving workloads of ``userpkg/``, importable here and in a subjob's process."""
    monkeypatch.syspath_prepend(USERPKG)
    monkeypatch.setenv("PYTHONPATH", USERPKG)


async def test_an_output_larger_than_a_message_fails_the_job_with_the_reason(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A completion the server could never take is not retried until the subjob is judged lost and
    planned again (for ever): the subjob fails, saying why, and the job gives up after its failures."""
    _user_package(monkeypatch)
    async with running(nats_url, tmp_path, Actors()) as stack:
        # A tenant's package: submitted with the facts `sja submit` computes where it is installed.
        params, facts = facts_of("sja_test_outputs:BigOutput", {})
        job = m.JobSpec(
            name="big-out", tenant="t", workload="sja_test_outputs:BigOutput", params=params, facts=facts
        )
        job_id = (await stack.client.submit(job)).job_id
        state = await until_state(stack.client, job_id, J.is_terminal, 120, "the job to end")
    assert state.status == "failed"
    assert "larger than a message may be" in state.error and "(gave up)" in state.error
    assert {h.status for h in state.history} == {"failed"}
    assert len(state.history) == J.MAX_CONSECUTIVE_FAILURES


async def test_a_result_that_cannot_be_encoded_fails_the_job_and_the_agent_goes_on(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing such a result once looped the agent on OverflowError, and the job could no longer
    be cancelled: now the job fails with the reason, and the agent serves the next jobs. The agent
    runs only SJA's own workloads' ``finalize`` (a tenant's is run by its own ``sja result``): the
    workload stands here for one of SJA's own gone wrong, registered as built in."""
    _user_package(monkeypatch)
    from sja_test_outputs import HugeResult  # type: ignore[import-not-found]

    monkeypatch.setitem(WORKLOADS, "sja_test_outputs:HugeResult", HugeResult())
    async with running(nats_url, tmp_path, Actors()) as stack:
        bad = (
            await stack.client.submit(
                m.JobSpec(name="huge", tenant="t", workload="sja_test_outputs:HugeResult")
            )
        ).job_id
        state = await until_state(stack.client, bad, J.is_terminal, 60, "the job to end")
        assert state.status == "failed"
        assert "cannot be encoded" in state.error and "OverflowError" in state.error
        assert (await stack.client.cancel(bad)).status == "failed"  # answered, and changes nothing
        good = (
            await stack.client.submit(
                m.JobSpec(name="after", tenant="t", workload="sja_test_outputs:HugeResult", params={"n": 1})
            )
        ).job_id
        other = await until_state(stack.client, good, J.is_terminal, 60, "the next job to end")
        assert other.status == "failed" and "cannot be encoded" in other.error


async def test_large_states_go_to_the_storage_url_and_only_their_reference_travels(
    nats_url: str, tmp_path: Path
) -> None:
    """With ``SJA_STATE_URL`` a checkpoint over the threshold is a file under it (the object store
    holds none); the job continues from it and ends with the one-piece result."""
    store = tmp_path / "shared-state"
    async with running(nats_url, tmp_path, Actors(), state_url=str(store), state_url_min_mib=0.0) as stack:
        job_id = (await stack.client.submit(spec("jac-url"))).job_id
        state = await until_state(stack.client, job_id, J.is_terminal, 120, "the job to end")
        assert_one_piece(state)
        ref = ckpt.unpack_ref(state.accumulator)
        assert ref.bucket == str(store)
        data = (store / ref.name).read_bytes()
        assert ckpt.digest(data) == ref.sha256 and len(data) == PARAMS["grid"] ** 2 * 8
        first = next(h for h in state.history if h.status == "ok")
        assert (store / job_id / first.subjob_id).exists(), "every committed state was written there"
