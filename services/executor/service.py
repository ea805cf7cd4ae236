"""Executor: one per node. Keeps a Ray actor per slice, runs the subjobs granted on this node's
slices, enforces the time cap, and publishes completions.

Each actor is pinned twice: by the custom Ray resource of its slice (``sja_slice:<id>``, which only
the owning node declares, so in a Ray cluster of many nodes the actor lands on the right one) and by
``CUDA_VISIBLE_DEVICES`` (the slice's MIG device or GPU). With ``SJA_RAY_ADDRESS`` the node's Ray
must have been started with those resources (``sja inventory --ray-resources`` prints them);
without it the executor starts a local Ray that declares them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec
import nats.js.errors
import ray
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig
from opentelemetry import propagate, trace

from services.executor import raylife
from services.executor.checkpoints import Checkpoints
from services.executor.settings import ExecutorSettings
from sja.bus.codec import DecodeError, decode, encode
from sja.bus.jetstream import delivery_count
from sja.bus.service import Service
from sja.core import continuation, proofs
from sja.core.leases import Admission
from sja.execution import code, slicelease
from sja.execution import sandbox as sbx
from sja.execution.actor import (
    NODE_SHARE,
    SliceActor,
    actor_env,
    node_resource,
    node_resources,
    slice_resource,
)
from sja.execution.runner import RunResult, completion_of, failure_status, nothing_done
from sja.protocol import subjects
from sja.protocol.messages import SliceState, Subjob, YieldRequest
from sja.telemetry.metrics import watch_consumers
from sja.workloads import checkpoint as ckpt
from sja.workloads import codepack
from sja.workloads.command import DEFAULT_STOP_GRACE_S

log = logging.getLogger(__name__)
tracer = trace.get_tracer("sja.executor")


OPEN_LEASE_S = 30.0
"""An open subjob running past its window keeps its slice's lease this far ahead of now."""
OPEN_KEEP_S = 5.0
"""How often the lease of an open subjob past its window is looked at (extended when less than
``OPEN_LEASE_S / 2`` is left)."""


@dataclass
class _Holder:
    """The subjob running on one of this executor's slices."""

    sj: Subjob
    done: asyncio.Event
    held: slicelease.Held | None
    """The slice as this executor last wrote it (an open subjob's lease moves with it)."""
    yielding: bool = False


class ExecutorService(Service):
    name = "executor"

    def __init__(self, settings: ExecutorSettings) -> None:
        super().__init__(settings)
        self.cfg = settings
        self.actors: dict[str, Any] = {}
        self.slice_info: dict[str, SliceState] = {}
        self.running: set[str] = set()
        self.holders: dict[str, _Holder] = {}
        """slice id -> the subjob running on it."""
        self.yields = 0
        """Holders asked to yield (another job won their slice)."""
        self.started_fences: dict[str, int] = {}
        """The highest fence a run was admitted at, per slice (``slicelease.start``)."""
        self.slots: dict[str, int] = {}
        """slice id -> its sandbox slot (uid ``uid_base + slot``): never reused by another slice."""
        self.ray_slices: set[str] = set()
        """Slices whose Ray resource (``sja_slice:<id>``) the cluster declares."""
        self.ran = 0
        self.pin_node = True
        """Whether actors also take a share of the node's resource (``sja_node:<node>``)."""
        self.states = Checkpoints(lambda: self.jetstream, settings)
        """Subjobs' states in the object store (or at ``state_url``), and each tenant's use of it."""
        self.hidden: tuple[str, ...] = ()
        """Paths every sandbox hides besides the defaults (``_hidden_paths``)."""
        self._code_seen: set[tuple[str, str]] = set()
        """(tenant, digest) of code this executor read from the object store and handed to Ray."""
        self.placements: deque[tuple[str, str, str]] = deque(maxlen=1000)
        """``(subjob_id, slice_id, ray_node_id)`` of recent runs: where each subjob really ran."""
        self.m_yields = self.metrics.counter(
            "sja_yields",
            "Subjobs asked to yield their slice past their window: another job won it.",
            unit="{subjob}",
        )
        self.m_busy = self.metrics.counter(
            "sja_slice_busy_seconds",
            "Seconds a slice spent running subjobs (added when each subjob ends); "
            "rate() over it is the slice's utilization.",
            unit="s",
        )

    async def on_start(self) -> None:
        # No subjob runs where its sandbox cannot be made: the operator is told what to grant.
        await asyncio.to_thread(sbx.check, self.cfg.sandbox)
        await self._load_slices()
        if self.cfg.sandbox.mode == "off":
            log.warning("!" * 20 + " %s " + "!" * 20, sbx.describe(self.cfg.sandbox, len(self.slice_info)))
        else:
            log.info("%s", sbx.describe(self.cfg.sandbox, len(self.slice_info)))
        await asyncio.to_thread(self._init_ray)
        self.hidden = self._hidden_paths()
        for s in self.slice_info.values():
            self.actors[s.slice_id] = self._new_actor(s)
        # An actor's process start (seconds) must not count against the first subjob's window.
        await asyncio.gather(*(self._ready(a) for a in self.actors.values()))
        durable = "executor-" + subjects._key(self.cfg.node)
        self._fetch = await self.jetstream.pull_consumer(
            f"{subjects.PREFIX}.subjob.dispatched.{subjects._key(self.cfg.node)}.>",
            durable=durable,
            stream=subjects.STREAM_SUBJOBS.name,
            # A subjob in progress is kept alive every few seconds; one whose executor died comes
            # back after ack_wait and is reported lost (its units are planned again).
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=ACK_WAIT_S, max_deliver=-1),
        )
        await self.subscribe(subjects.slice_yield(self.cfg.node), self._yield_requested)
        self.loop(self._pull_forever())
        self.loop(self._refresh_forever())
        self.loop(watch_consumers(self.jetstream, [(subjects.STREAM_SUBJOBS.name, durable)], self.metrics))

    async def on_stop(self) -> None:
        # A cancelled fetch leaves a late status message on the pull subscription that would hold
        # the connection's drain for its whole timeout: drop the subscription first.
        with contextlib.suppress(Exception):
            await self._fetch.stop()
        with contextlib.suppress(Exception):
            ray.shutdown()

    async def _load_slices(self) -> None:
        assert self.slices is not None
        deadline = time.monotonic() + self.cfg.wait_for_slices_s
        while True:
            states = [s for s, _ in await self.slices.all() if s.node == self.cfg.node]
            if states:
                self.slice_info = {s.slice_id: s for s in states}
                self.slots = {sid: i for i, sid in enumerate(sorted(self.slice_info))}
                # Grants made before this process started (a restart) may have had runs it does not
                # remember: their subjobs are admitted by compare-and-set, never without a write.
                self.started_fences = {s.slice_id: s.fence for s in states}
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"no slices for node {self.cfg.node!r} in the inventory")
            await asyncio.sleep(0.2)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.slice_refresh_s)
            try:
                await self.refresh_slices()
            except Exception:
                log.exception("reading the node's slices again failed")

    async def refresh_slices(self) -> None:
        """Follow the node's slices (a MIG re-cut by the inventory destroys some and makes others):
        a new slice, or one back from offline, gets an actor; one offline loses its actor once
        nothing runs on it; one whose device changed (a MIG instance made again, same placement)
        gets a new actor for the new device. A slice's Ray actor can be placed only where Ray can
        pin it: on a cluster that declares neither the slice's resource nor the node's, a new slice
        is left alone and the operator told."""
        assert self.slices is not None
        states = [s for s, _ in await self.slices.all() if s.node == self.cfg.node]
        new: list[Any] = []
        for s in states:
            sid = s.slice_id
            old = self.slice_info.get(sid)
            busy = sid in self.holders
            if s.status == "offline":
                if sid in self.actors and not busy:
                    self._stop_actor(self.actors.pop(sid))
                    log.info("slice %s is offline: its actor stopped", sid)
                continue
            moved = old is not None and old.gpu_uuid != s.gpu_uuid
            if sid in self.actors and not moved:
                continue
            if busy:
                continue  # its holder still runs on the old device: replaced once it has ended
            if sid not in self.ray_slices and not self.pin_node:
                log.error(
                    "slice %s appeared on node %s, but the Ray cluster declares neither its resource "
                    "nor the node's: restart the node's Ray with `sja inventory --ray-resources`",
                    sid,
                    self.cfg.node,
                )
                continue
            self.slice_info[sid] = s
            self.started_fences.setdefault(sid, s.fence)
            if sid in self.actors:
                self._stop_actor(self.actors.pop(sid))
            self.actors[sid] = actor = self._new_actor(s)
            new.append(actor)
            log.info("slice %s (%s, %s): actor started", sid, s.profile, s.gpu_uuid or "emulated")
        await asyncio.gather(*(self._ready(a) for a in new))

    def _join_ray(self) -> None:
        raylife.join_ray(self.cfg.ray_address)

    def _init_ray(self) -> None:
        self.pin_node = raylife.init_ray(
            self.cfg.node,
            self.cfg.ray_address,
            self.cfg.ray_num_cpus,
            node_resources(self.cfg.node, self.slice_info),
        )
        have = ray.cluster_resources()  # type: ignore[no-untyped-call]
        self.ray_slices = {sid for sid in self.slice_info if slice_resource(sid) in have}

    def _stop_actor(self, actor: Any) -> None:
        if ray.is_initialized():
            with contextlib.suppress(Exception):
                ray.kill(actor, no_restart=True)

    def _hidden_paths(self) -> tuple[str, ...]:
        """What every sandbox hides besides the executor's HOME and ``/root``: the stack's output
        directory and Ray's session directory (its temporary directory)."""
        paths = [os.path.abspath(self.settings.out_dir)]
        with contextlib.suppress(Exception):
            node = ray._private.worker._global_node
            if node is not None:
                paths.append(node.get_temp_dir_path())
        return tuple(paths)

    def _slot(self, slice_id: str) -> int:
        """The slice's sandbox slot: its index among the node's slices at start, the next unused
        one for a slice adopted later (``uid_base + slot`` is its subjobs' uid)."""
        if slice_id not in self.slots:
            self.slots[slice_id] = max(self.slots.values(), default=-1) + 1
        return self.slots[slice_id]

    def _new_actor(self, s: SliceState) -> Any:
        # Pinned by the slice's own Ray resource where the cluster declares it, else (a slice a
        # re-cut made after Ray started) by the node's.
        resources = {slice_resource(s.slice_id): 1.0} if s.slice_id in self.ray_slices else {}
        if self.pin_node:
            resources[node_resource(self.cfg.node)] = NODE_SHARE
        return SliceActor.options(  # type: ignore[attr-defined]
            resources=resources,
            runtime_env={"env_vars": {**actor_env(s), "SJA_WARM_GRACE_S": f"{self.cfg.warm_grace_s:g}"}},
            max_concurrency=1,
        ).remote(
            s.slice_id,
            self.settings.out_dir,
            self.cfg.preload,
            msgspec.json.encode(self.cfg.sandbox),
            self._slot(s.slice_id),
            self.hidden,
        )

    async def _pull_forever(self) -> None:
        while True:
            try:
                msgs = await self._fetch.fetch(len(self.actors) or 1, timeout=1.0)
            except TimeoutError:
                continue
            except Exception as e:
                if self.stopping.is_set():
                    return
                log.warning("fetch failed: %s", e)
                await asyncio.sleep(0.2)
                continue
            for msg in msgs:
                self.spawn(self.handle(msg))

    async def handle(self, msg: Msg) -> None:
        try:
            sj = decode(msg.data, Subjob)
        except DecodeError as e:
            log.error("dropping malformed subjob: %s", e)
            self.metrics.rejected(f"{subjects.PREFIX}.subjob.dispatched.{subjects._key(self.cfg.node)}.>", e)
            await msg.term()
            return
        try:
            await self._handle(msg, sj)
        except Exception:
            log.exception("subjob %s failed in the executor", sj.subjob_id)
            await msg.nak(delay=1.0)

    async def _handle(self, msg: Msg, sj: Subjob) -> None:
        assert self.slices is not None
        if sj.subjob_id in self.running:
            # Delivered again while it runs here (ack wait passed, or a replay): not a lost run.
            log.warning("subjob %s delivered again while it runs: kept running", sj.subjob_id)
            await msg.in_progress()
            return
        holder = self.holders.get(sj.slice_id)
        if holder is not None and sj.fence > holder.sj.fence:
            # A later grant of a slice whose holder continues past its window: the holder yields at
            # its next unit boundary, and this subjob starts once it is gone (core.continuation).
            keepalive = self.spawn(_keep_alive(msg))
            try:
                await self._yield(holder, f"grant {sj.grant_id} of job {sj.job_id} came for its slice")
                await holder.done.wait()
            finally:
                keepalive.cancel()
        if sj.slice_id not in self.actors:
            await self.refresh_slices()  # a slice a re-cut made since the last read
        admitted = await slicelease.start(
            self.slices,
            sj,
            known=sj.slice_id in self.actors,
            grace_s=self.cfg.grace_s,
            redelivered=delivery_count(msg) > 1,
            started=self.started_fences,
        )
        if admitted.verdict == Admission.MOVED:
            await msg.nak(delay=0.05)  # the slice moved under us; look again
            return
        if admitted.verdict != Admission.RUN:
            await self._complete(sj, _lost(time.time(), LOST_BECAUSE[admitted.verdict]), {})
            if admitted.verdict == Admission.INTERRUPTED:
                await self._free(sj)
            await msg.ack()
            return
        began = time.monotonic()
        self.running.add(sj.subjob_id)
        holder = _Holder(sj, asyncio.Event(), admitted.held)
        self.holders[sj.slice_id] = holder
        try:
            result, carrier = await self._run(msg, sj, holder)
            info = self.slice_info.get(sj.slice_id)
            profile = info.profile if info else ""
            self.m_busy.add(time.monotonic() - began, slice=sj.slice_id, profile=profile, node=self.cfg.node)
            # Still this executor's while its completion waits for the stream (a leader election can
            # take seconds): a redelivery meanwhile is not taken for a lost run.
            keepalive = self.spawn(_keep_alive(msg))
            try:
                await self._complete(sj, result, carrier)
            finally:
                keepalive.cancel()
        finally:
            self.running.discard(sj.subjob_id)
            if self.holders.get(sj.slice_id) is holder:
                del self.holders[sj.slice_id]
            holder.done.set()
        await self._free(sj, holder.held)
        await msg.ack()
        self.ran += 1

    async def _yield_requested(self, msg: Msg) -> None:
        """The clearer granted a slice of this node whose holder continues past its window."""
        try:
            req = decode(msg.data, YieldRequest)
        except DecodeError as e:
            log.error("dropping malformed yield request: %s", e)
            return
        holder = self.holders.get(req.slice_id)
        if holder is not None and holder.sj.grant_id == req.holder_grant_id and req.fence > holder.sj.fence:
            await self._yield(holder, f"grant {req.grant_id} won its slice")

    async def _yield(self, holder: _Holder, why: str) -> None:
        """Ask the holder to stop at its next unit boundary (once); it is killed if it has not
        stopped ``continuation.yield_grace_s`` later."""
        if holder.yielding or holder.done.is_set():
            return
        holder.yielding = True
        self.yields += 1
        sj = holder.sj
        self.m_yields.add(1, slice=sj.slice_id, node=self.cfg.node)
        grace = continuation.yield_grace_for(sj.params, sj.first_unit_s, DEFAULT_STOP_GRACE_S)
        log.info("subjob %s yields slice %s: %s", sj.subjob_id, sj.slice_id, why)
        actor = self.actors.get(sj.slice_id)
        while actor is not None and not holder.done.is_set():
            try:
                asked = await asyncio.wait_for(
                    asyncio.wrap_future(actor.yield_subjob.remote(sj.subjob_id, grace).future()), timeout=10
                )
            except Exception as e:
                log.warning("could not ask subjob %s to yield: %s", sj.subjob_id, e)
                asked = False
            if asked:
                return
            # Not running in the actor yet (its state still being put in place): ask again.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(holder.done.wait(), timeout=0.2)

    async def _keep_open_lease(self, holder: _Holder) -> None:
        """An open subjob's lease, kept ahead of it while it runs; when the lease moved to another
        grant, the subjob yields (the clearer's request may have been missed)."""
        assert self.slices is not None
        while not holder.done.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(holder.done.wait(), timeout=OPEN_KEEP_S)
            if holder.done.is_set() or holder.yielding:
                return
            now = time.time()
            if holder.held is not None and holder.held.state.lease_until - now > OPEN_LEASE_S / 2:
                continue
            kept = await slicelease.keep(self.slices, holder.sj, holder.held, lease_s=OPEN_LEASE_S, now=now)
            if kept is None:
                await self._yield(holder, "its slice's lease moved to another grant")
                return
            holder.held = kept

    async def _run(self, msg: Msg, sj: Subjob, holder: _Holder) -> tuple[RunResult, dict[str, str]]:
        carrier: dict[str, str] = {}
        propagate.inject(carrier, context=propagate.extract(dict(msg.headers or {})))
        actor = self.actors[sj.slice_id]
        started = time.time()
        checkpoint: bytes | None = None
        if ckpt.is_ref(sj.input_checkpoint):
            try:
                checkpoint = await self.states.fetch(sj.input_checkpoint)
            except Exception as e:
                log.error("subjob %s: input checkpoint not readable: %s", sj.subjob_id, e)
                return nothing_done(
                    "failed", started, f"input checkpoint not readable: {e}", timed=False
                ), carrier
        code_uri = ""
        digest = code.digest_of(sj.params) if sj.workload == "command" else ""
        if digest:
            try:
                code_uri = await self._code_in_ray(sj.tenant, digest)
            except Exception as e:
                log.error("subjob %s: code %s not handed to Ray: %s", sj.subjob_id, digest[:12], e)
                error = f"params.code: the job's code sha256:{digest} {e}"
                return nothing_done(
                    "failed", started, error, timed=False, final=isinstance(e, CodeGone)
                ), carrier
        # The slice (and the program in it) gets the subjob without its secret: only this process
        # signs its completion (sja.core.proofs).
        data = encode(proofs.without_proof_key(sj)) if sj.proof_key else msg.data
        ref = actor.run.remote(data, carrier, checkpoint, code_uri)
        open_ = sj.max_units > sj.units
        # An open subjob has no time cap: it runs until it is asked to yield (its actor kills it if
        # it does not stop), its lease kept meanwhile.
        limit = None if open_ else sj.time_cap_s + self.cfg.kill_margin_s
        keepalive = self.spawn(_keep_alive(msg))
        keeper = self.spawn(self._keep_open_lease(holder)) if open_ else None
        try:
            raw = await asyncio.wait_for(asyncio.wrap_future(ref.future()), timeout=limit)
            try:
                # From the slice's actor through Ray, not the bus: a training checkpoint in it can
                # be far larger than a message may be (it goes on to the object store).
                result, carrier_out = decode(raw, tuple[RunResult, dict[str, str]], max_bytes=None)
            except DecodeError as e:
                # Not the run's fault nor the slice's: running it again would read the same bytes.
                log.error("subjob %s: the actor's result is unreadable: %s", sj.subjob_id, e)
                return nothing_done(
                    "failed", started, f"the slice actor's result is unreadable: {e}"
                ), carrier
            self.placements.append((sj.subjob_id, sj.slice_id, result.node_id))
            if ckpt.is_blob(result.output):
                result = await self.states.store(sj, result)
            return result, carrier_out
        except TimeoutError:
            log.warning("subjob %s ran past its %.2fs window: stopped", sj.subjob_id, sj.time_cap_s)
            await self._restart_actor(sj.slice_id)
            return nothing_done("timeout", started, f"exceeded the window of {sj.time_cap_s:.2f}s"), carrier
        except ray.exceptions.RayError as e:
            log.error("actor for %s failed: %s", sj.slice_id, e)
            await self._restart_actor(sj.slice_id)
            return nothing_done(failure_status(e), started, str(e)[:2000]), carrier
        finally:
            keepalive.cancel()
            if keeper is not None:
                keeper.cancel()

    async def _code_in_ray(self, tenant: str, digest: str) -> str:
        """The Ray package of a tenant's code (``sja.execution.code``): read from the object store
        ``sja-code`` and put in the Ray cluster the first time this executor needs it. Raises
        ``CodeGone`` when the store does not hold it, or holds other bytes under its name."""
        key = (tenant, digest)
        # Checked each time (one key of the GCS): a Ray cluster that restarted has lost it.
        if key in self._code_seen and await asyncio.to_thread(code.in_ray, digest):
            return code.ray_uri(digest)
        try:
            store = await self.jetstream.object_store(codepack.BUCKET)
            got = await store.get(codepack.object_name(tenant, digest))
        except nats.js.errors.NotFoundError:
            raise CodeGone(f"is not in the object store {codepack.BUCKET} for tenant {tenant!r}") from None
        data = bytes(got.data or b"")
        if codepack.digest(data) != digest:
            raise CodeGone(f"in the object store {codepack.BUCKET} does not match its digest")
        uri = await asyncio.to_thread(code.to_ray, data, digest)
        self._code_seen.add(key)
        return uri

    async def _restart_actor(self, slice_id: str) -> None:
        old = self.actors.get(slice_id)
        if old is not None:
            with contextlib.suppress(Exception):
                ray.kill(old, no_restart=True)
        actor = self._new_actor(self.slice_info[slice_id])
        self.actors[slice_id] = actor
        await self._ready(actor)

    async def _ready(self, actor: Any) -> None:
        await asyncio.wait_for(asyncio.wrap_future(actor.info.remote().future()), timeout=120)

    async def _complete(self, sj: Subjob, r: RunResult, carrier: dict[str, str]) -> None:
        c = completion_of(sj, r, self.instance)
        payload = encode(c)
        limit = self.nc.max_payload - COMPLETION_HEADROOM if self.nc is not None else len(payload)
        if len(payload) > limit:
            # Retrying could never publish it, and a subjob left unanswered would be judged lost
            # and planned again for ever: the subjob fails instead, saying why.
            log.error(
                "subjob %s: completion of %d bytes is over the server's limit", sj.subjob_id, len(payload)
            )
            c = msgspec.structs.replace(
                c,
                status="failed",
                units_done=0,
                output_checkpoint=b"",
                error=(
                    f"the subjob's output ({len(r.output)} bytes) is larger than a message may be "
                    f"({self.nc.max_payload if self.nc is not None else 0} bytes, the server's max_payload): "
                    "a workload with large state returns it as a checkpoint blob, which goes to the "
                    "object store"
                ),
            )
        c = proofs.signed(c, sj.proof_key)
        payload = encode(c)
        headers = dict(carrier)
        if not headers:
            propagate.inject(headers)
        headers["Nats-Msg-Id"] = f"{sj.subjob_id}:{sj.fence}"
        await self.jetstream.publish_until(
            subjects.subjob_completed(sj.job_id), payload, headers, until=time.time() + COMPLETION_RETRY_S
        )

    async def _free(self, sj: Subjob, held: slicelease.Held | None = None) -> None:
        assert self.slices is not None
        await slicelease.free(self.slices, sj, held)


class CodeGone(Exception):
    """A job's code is not in the object store as its reference says: no retry can bring it back."""


LOST_BECAUSE: dict[Admission, str] = {
    Admission.UNKNOWN: "slice unknown to this executor",
    Admission.STALE: "lease lapsed before start (stale fence)",
    Admission.INTERRUPTED: "executor restarted during the subjob",
}


ACK_WAIT_S = 10.0

COMPLETION_HEADROOM = 4096
"""Bytes of a message left for its headers (trace context, de-duplication id) when a completion's
size is checked against the server's ``max_payload``."""

COMPLETION_RETRY_S = 60.0
"""How long a completion is tried again while ``SJA_COMPLETIONS`` cannot take it (no leader yet after
a server is lost), within the stream's duplicate window; past it the subjob is handed back (nak) and
its result lost."""


async def _keep_alive(msg: Msg) -> None:
    while True:
        await asyncio.sleep(ACK_WAIT_S / 3)
        with contextlib.suppress(Exception):
            await msg.in_progress()


def _lost(now: float, why: str) -> RunResult:
    return nothing_done("lost", now, why, now=now)
