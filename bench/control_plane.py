"""Control-plane benchmark: how many grants per second the services sustain, how long a round takes,
and what each grant costs in NATS messages and CPU, with executors that finish at once.

    python bench/control_plane.py --jobs 100 --slices 64 --json

A nats-server (with its monitoring port) and the inventory, gateway, clearer(s), agent(s) and
advertiser(s) run as their own processes (``LocalStack``; ``--cohost a,b,...`` runs those services in
one process, ``sja service a,b,...``) against a declared inventory of ``--slices``
emulated slices (H100-80GB cut into 7 x 1g.10gb, 8 GPUs per node, one pool per node). No real executor
runs: an *instant executor* in this process pulls ``SJA_SUBJOBS`` exactly as ``services/executor`` does
(admission against the slice's lease, lease start by compare-and-set, an ``ok`` completion on
``SJA_COMPLETIONS`` with ``Nats-Msg-Id = subjob:fence``, then the slice freed by compare-and-set) and
does it at once.

``--jobs`` jobs are kept in the system: each has ``--units`` units (8) and ``max_parallel`` 1, and is
replaced by a new submission as soon as its last unit completes. A unit is sized to one grant: the job
declares 4000 MiB per unit and the instant executor reports 5200 MiB per unit (what the job "really"
needs), so after calibration one unit fits a 1g.10gb slice and two never do. The instant executor
computes the subjob's real result (Monte Carlo, one sample per unit: microseconds), and every finished
job's result is checked against the job computed in one piece.

Measured over a steady window: after ``max(100, 2 x slices)`` warm-up subjobs (or ``--warmup-s``), for
``--grants`` more subjobs (default ``max(1000, 20 x slices)``) or ``--duration-s`` seconds, whichever comes
first (``capped``: the duration ended the window):

- ``grants_per_s``: grants that became a subjob, per second (counted where the instant executor
  receives the subjob); ``grants_issued_per_s``: every ``Grant`` the clearers published, declined ones
  included (an agent declines, and releases at once, a grant for a job that cannot take more work:
  ``grants_declined_fraction``). Per-grant costs divide by the grants that became subjobs
  (``*_per_issued_grant``: by every grant issued);
- ``grant_latency_p50/p99_ms``: ``cleared_at - opened_at`` of the round records (``SJA_ROUNDS``) of
  those grants: from the clearer receiving the offer to the grant (the compare-and-set included; ``_all``:
  every grant issued); ``offer_to_grant_*``:
  from the advertiser issuing the offer (its window's start) to the grant (``_p99_ms_by_second``: the
  p99 of each second of the window, which tells a pause from saturation); ``free_to_grant_*``: from the
  instant executor freeing a slice to that slice's next grant (what a real slice would idle through);
- ``messages_per_grant``: nats-server ``/varz`` ``in_msgs + out_msgs`` deltas per grant (JetStream's
  API and replies included; this benchmark's own grant counter excluded);
- ``cpu_s_per_grant``: user + system CPU of every service process (psutil) per grant; the server's and
  this process's (instant executor, submissions, counters) are reported beside it, and each
  service's in ``cpu_s_per_grant_by_service``;
- the raw NATS baseline on the same server and client library, measured before the stack starts:
  publish/subscribe rate, request/reply round trip, a KV compare-and-set and a JetStream publish.

``--hold-s H`` makes each subjob keep its slice ``H`` seconds before its completion: the load is then
at most ``slices / H`` grants a second (``offered_grants_per_s_max``), and the latencies are those of a
control plane below saturation rather than at it. ``--pools N`` deals the nodes into ``N`` pools
(default: a pool per node): the advertiser batches per pool, so fewer pools make larger batches.

The last line is a JSON object. ``--profile DIR`` runs every service under cProfile (slower: use it for
the profile, not the numbers) and writes ``DIR/<instance>.prof`` and ``.txt`` summaries.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import json
import math
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import nats.errors
import psutil
import yaml
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig

from services.registry import parse_cohost
from sja.accel import use_compiled_core

use_compiled_core()  # before the decision core is imported

from sja.audit import read_rounds
from sja.bus.codec import decode, encode
from sja.bus.connection import connect
from sja.bus.jetstream import JetStream, delivery_count, jetstream
from sja.bus.natsd import EmbeddedNats, die_with_parent, free_port
from sja.bus.rounds import decode_grants
from sja.bus.service import freeze_after_start, run_loop, tune_gc
from sja.bus.store import stores
from sja.bus.streams import ensure_jetstream
from sja.bus.tasks import cancel_all
from sja.client import SjaClient
from sja.core import proofs
from sja.execution import slicelease
from sja.protocol import subjects
from sja.protocol.messages import Completion, JobSpec, JobState, MemoryDecl, Subjob, TimeDecl
from sja.stack import LocalStack, ServiceProc
from sja.workloads import run_in_one_piece, workload

SLICES_PER_GPU = 7
GPUS_PER_NODE = 8
PROFILE = "1g.10gb"
HORIZON_S = 2.0
UNITS_PER_JOB = 8
DECLARED_MIB_PER_UNIT = 4000.0
TRUE_MIB_PER_UNIT = 5200.0
"""A 1g.10gb slice holds 9728 MiB after the reserve: one true unit fits and two do not; the declaration
is low enough that the (wide) prior lets one unit fit from the first offer."""
SECONDS_PER_UNIT = 0.01
"""Full-speed seconds per unit, declared and reported: time never limits a subjob here."""
SERVICES = ("inventory", "gateway", "clearer", "agent", "advertiser")


# --- inventory and jobs ------------------------------------------------------------------------------


def inventory(n_slices: int, pools: int = 0) -> dict[str, Any]:
    """``n_slices`` 1g.10gb slices: H100-80GB GPUs of 7 slices (the last one partly cut), 8 per node,
    each node its own pool, or the nodes dealt round-robin into ``pools`` pools."""
    gpus = math.ceil(n_slices / SLICES_PER_GPU)
    nodes: list[dict[str, Any]] = []
    left = n_slices
    for g in range(gpus):
        if g % GPUS_PER_NODE == 0:
            nodes.append({"name": f"node{len(nodes):03d}", "gpus": []})
            if pools:
                nodes[-1]["pool"] = f"pool{(len(nodes) - 1) % pools:03d}"
        k = min(SLICES_PER_GPU, left)
        nodes[-1]["gpus"].append({"model": "H100-80GB", "layout": [PROFILE] * k})
        left -= k
    return {"nodes": nodes}


def job_spec(i: int, units: int, tenants: int) -> JobSpec:
    return JobSpec(
        name=f"cp{i}",
        tenant=f"t{i % tenants}",
        workload="montecarlo",
        mode="sja",
        max_parallel=1,
        params={"units": units, "samples_per_unit": 1, "seed": i},
        memory=MemoryDecl(base_mib=0.0, per_unit_mib=DECLARED_MIB_PER_UNIT, rel_sd=0.05),
        time=TimeDecl(warmup_s=0.0, per_unit_s=SECONDS_PER_UNIT, rel_sd=0.1),
    )


# --- the stack, optionally sharded and profiled --------------------------------------------------------


@dataclass
class BenchStack(LocalStack):
    """``LocalStack`` with per-replica pools (clearers and advertisers shard the pools) and, with
    ``profile_dir``, every service under cProfile."""

    shards: Mapping[str, list[str]] = field(default_factory=dict)
    """service name -> comma-separated pools for replica i."""
    profile_dir: Path | None = None

    def service_environment(self, name: str, instance: str) -> dict[str, str]:
        env = super().service_environment(name, instance)
        index = int(instance.rpartition("-")[2])
        pools = self.shards.get(name)
        if pools:
            env["SJA_POOLS"] = pools[index]
        return env

    def stop(self, timeout_s: float = 20.0) -> None:
        # A profiled service writes its profile on its way out: give a busy one time to get there.
        super().stop(timeout_s=120.0 if self.profile_dir is not None else timeout_s)

    def spawn(self, name: str, index: int = 0) -> ServiceProc:
        if self.profile_dir is None:
            return super().spawn(name, index)
        instance = f"{name}-{index}"
        log_path = self.out_dir / "logs" / f"{instance}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        prof = self.profile_dir / f"{instance}.prof"
        with log_path.open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "cProfile", "-o", str(prof), "-m", "sja.cli.main", "service", name],
                env=self.service_environment(name, instance),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=die_with_parent,
            )
        sp = ServiceProc(name, instance, proc, log_path)
        self.procs.append(sp)
        return sp


def shard(pools: list[str], k: int) -> list[str]:
    k = max(1, min(k, len(pools)))
    return [",".join(pools[i::k]) for i in range(k)]


# --- the raw NATS baseline -----------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(q / 100 * len(s)) - 1))]


def p99_by_second(samples: list[tuple[float, float]], t0: float, seconds: float) -> list[float]:
    """The p99 of each whole second of the window starting at ``t0``, from ``(at, value)`` samples
    (``nan`` for a second without one). A p99 of the window high because of one pause reads as one
    high second; one high because the stack is saturated, as every second a little high."""
    n = max(1, math.ceil(seconds))
    buckets: list[list[float]] = [[] for _ in range(n)]
    for at, value in samples:
        i = int(at - t0)
        if 0 <= i < n:
            buckets[i].append(value)
    return [round(pct(b, 99), 1) for b in buckets]


async def raw_nats(url: str, n_msgs: int = 200_000, n_requests: int = 2000) -> dict[str, float]:
    """Publish/subscribe rate and round trips on the same server with the same client library."""
    pub = await connect(url, "raw-pub")
    sub = await connect(url, "raw-sub")
    out: dict[str, float] = {}
    try:
        got = 0
        done = asyncio.Event()
        last = 0.0

        async def on_msg(msg: Msg) -> None:
            nonlocal got, last
            got += 1
            if got == n_msgs:
                last = time.perf_counter()
                done.set()

        s = await sub.subscribe("bench.raw", cb=on_msg, pending_msgs_limit=n_msgs * 2)
        await sub.flush()
        payload = b"x" * 128
        t0 = time.perf_counter()
        for _ in range(n_msgs):
            await pub.publish("bench.raw", payload)
        await pub.flush()
        await asyncio.wait_for(done.wait(), timeout=120)
        out["raw_nats_msgs_per_s"] = n_msgs / (last - t0)
        await s.unsubscribe()

        async def echo(msg: Msg) -> None:
            await sub.publish(msg.reply, msg.data)

        await sub.subscribe("bench.echo", cb=echo)
        await sub.flush()
        for _ in range(50):  # the subscription may take a moment to be known to the server
            try:
                await pub.request("bench.echo", payload, timeout=5)
                break
            except nats.errors.NoRespondersError:
                await asyncio.sleep(0.05)
        rtts = []
        for _ in range(n_requests):
            t = time.perf_counter()
            await pub.request("bench.echo", payload, timeout=5)
            rtts.append(time.perf_counter() - t)
        out["raw_nats_rtt_us"] = statistics.median(rtts) * 1e6
        out["raw_nats_rtt_p99_us"] = pct(rtts, 99) * 1e6

        js = pub.jetstream()
        kv = await js.create_key_value(bucket="bench-raw", history=1)
        rev = await kv.put("k", payload)
        cas = []
        for _ in range(n_requests // 2):
            t = time.perf_counter()
            rev = await kv.update("k", payload, last=rev)
            cas.append(time.perf_counter() - t)
        out["raw_kv_cas_us"] = statistics.median(cas) * 1e6
        await js.delete_key_value("bench-raw")
        await js.add_stream(name="BENCH_RAW", subjects=["bench.js.>"])
        jsp = []
        for i in range(n_requests // 2):
            t = time.perf_counter()
            await js.publish("bench.js.x", payload, headers={"Nats-Msg-Id": str(i)})
            jsp.append(time.perf_counter() - t)
        out["raw_js_publish_us"] = statistics.median(jsp) * 1e6
        await js.delete_stream("BENCH_RAW")
    finally:
        await pub.close()
        await sub.close()
    return out


# --- the instant executor ------------------------------------------------------------------------------


@dataclass
class InstantExecutor:
    """Runs every dispatched subjob at once, with the executor's own protocol (see the module doc)."""

    nc: Client
    on_units: Any = None
    """Called with (job_id, units completed ok) after each completion."""
    js: JetStream | None = None
    freed: list[tuple[str, float]] = field(default_factory=list)
    """(slice, when this executor freed it)."""
    ran: int = 0
    lost: int = 0
    units_run: int = 0
    grant_ids: set[str] = field(default_factory=set)
    received: list[float] = field(default_factory=list)
    """perf_counter() of every subjob delivered (one per grant the agent materialized)."""
    started_fences: dict[str, int] = field(default_factory=dict)
    hold_s: float = 0.0
    """How long each subjob holds its slice before completing (0: it completes at once)."""
    _tasks: set[asyncio.Task[Any]] = field(default_factory=set)

    async def run(self, stop: asyncio.Event) -> None:
        js = self.js = jetstream(self.nc)
        self.slices, _ = await stores(js)
        fetcher = await js.pull_consumer(
            f"{subjects.PREFIX}.subjob.dispatched.>",
            durable="bench-instant-executor",
            stream=subjects.STREAM_SUBJOBS.name,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_deliver=-1),
        )
        while not stop.is_set():
            try:
                msgs = await fetcher.fetch(256, timeout=0.2)
            except TimeoutError:
                continue
            except Exception:
                await asyncio.sleep(0.05)
                continue
            for msg in msgs:
                task = asyncio.get_running_loop().create_task(self.handle(msg))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        with contextlib.suppress(Exception):
            await fetcher.stop()

    async def handle(self, msg: Msg) -> None:
        sj = decode(msg.data, Subjob)
        self.received.append(time.perf_counter())
        self.grant_ids.add(sj.grant_id)
        now = time.time()
        admitted = await slicelease.start(
            self.slices,
            sj,
            known=True,
            grace_s=2.0,
            now=now,
            redelivered=delivery_count(msg) > 1,
            started=self.started_fences,
        )
        if admitted.verdict == "moved":
            await msg.nak(delay=0.05)
            return
        if admitted.verdict != "run":
            self.lost += 1
            await self.complete(sj, "lost", now, b"", admitted.verdict, msg)
            await msg.ack()
            return
        w = workload(sj.workload)
        output = w.run(w.validate(dict(sj.params)), sj.unit_start, sj.units, sj.input_checkpoint)
        if self.hold_s > 0:
            await asyncio.sleep(self.hold_s)
        await self.complete(sj, "ok", now, output, "", msg)
        if await slicelease.free(self.slices, sj, admitted.held):
            self.freed.append((sj.slice_id, time.time()))
        await msg.ack()
        self.ran += 1
        self.units_run += sj.units
        if self.on_units is not None:
            self.on_units(sj.job_id, sj.units)

    async def complete(
        self, sj: Subjob, status: str, started: float, output: bytes, error: str, msg: Msg
    ) -> None:
        # The job as it "really" is: TRUE_MIB_PER_UNIT of memory, SECONDS_PER_UNIT at full speed.
        share = 1.0 / SLICES_PER_GPU
        ok = status == "ok"
        c = Completion(
            subjob_id=sj.subjob_id,
            job_id=sj.job_id,
            grant_id=sj.grant_id,
            fence=sj.fence,
            slice_id=sj.slice_id,
            status=status,  # type: ignore[arg-type]
            unit_start=sj.unit_start,
            units=sj.units,
            units_done=sj.units if ok else 0,
            peak_mem_mib=TRUE_MIB_PER_UNIT * sj.units if ok else 0.0,
            duration_s=sj.units * SECONDS_PER_UNIT / share + self.hold_s if ok else 0.0,
            mem_cap_mib=sj.mem_cap_mib,
            time_cap_s=sj.time_cap_s,
            started_at=started,
            finished_at=time.time(),
            output_checkpoint=output,
            error=error,
            executor_id="bench-instant",
        )
        c = proofs.signed(c, sj.proof_key)  # as the executor signs it: the agent drops it unproven
        # The completion continues the subjob's trace, as the executor's does (its run's span).
        headers = {k: v for k, v in (msg.headers or {}).items() if k in ("traceparent", "tracestate")}
        headers["Nats-Msg-Id"] = f"{sj.subjob_id}:{sj.fence}"
        assert self.js is not None
        await self.js.publish(subjects.subjob_completed(sj.job_id), encode(c), headers=headers)


# --- the run -------------------------------------------------------------------------------------------


def varz(monitor_port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/varz", timeout=5) as r:
        data: dict[str, Any] = json.loads(r.read())
        return data


def cpu_of(pids: list[int]) -> float:
    return sum(cpu_each(pids))


def cpu_each(pids: list[int]) -> list[float]:
    out = []
    for pid in pids:
        total = 0.0
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            total = t.user + t.system
        out.append(total)
    return out


@dataclass
class Sample:
    at: float
    grants: int
    grant_msgs: int
    varz: dict[str, Any]
    cpu_services: float
    cpu_each: list[float]
    cpu_server: float
    cpu_bench: float


async def run(
    url: str,
    monitor_port: int,
    service_pids: list[int],
    server_pid: int,
    n_jobs: int,
    units: int,
    tenants: int,
    warmup: int,
    warmup_s: float,
    target: int,
    duration_s: float,
    service_names: list[str] | None = None,
    hold_s: float = 0.0,
) -> dict[str, Any]:
    """``service_names``: the instance of each of ``service_pids``, for the CPU of each per grant;
    ``hold_s``: how long each subjob holds its slice (``--hold-s``)."""
    nc = await connect(url, "bench-control-plane")
    me = psutil.Process()
    server = psutil.Process(server_pid)
    grants = 0
    grant_msgs = 0
    client = SjaClient(nc, timeout_s=30.0)
    submitted: list[str] = []
    done_units: dict[str, int] = {}
    replacing = True
    pending_submits: asyncio.Queue[int] = asyncio.Queue()
    next_index = n_jobs

    async def on_grant(msg: Msg) -> None:
        nonlocal grants, grant_msgs
        grants += len(decode_grants(msg.data))
        grant_msgs += 1

    def on_units(job_id: str, n: int) -> None:
        nonlocal next_index
        done_units[job_id] = done_units.get(job_id, 0) + n
        if done_units[job_id] >= units and replacing:
            pending_submits.put_nowait(next_index)
            next_index += 1

    async def submitter() -> None:
        while True:
            i = await pending_submits.get()
            try:
                submitted.append((await client.submit(job_spec(i, units, tenants))).job_id)
            except Exception as e:
                print(f"replacement submit failed: {e!r}", file=sys.stderr)

    def sample() -> Sample:
        return Sample(
            at=time.perf_counter(),
            grants=grants,
            grant_msgs=grant_msgs,
            varz=varz(monitor_port),
            cpu_services=sum(each := cpu_each(service_pids)),
            cpu_each=each,
            cpu_server=sum(server.cpu_times()[:2]),
            cpu_bench=sum(me.cpu_times()[:2]),
        )

    await nc.subscribe(subjects.grant_issued("*"), cb=on_grant, pending_msgs_limit=10_000_000)
    executor = InstantExecutor(nc, on_units=on_units, hold_s=hold_s)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    exec_task = loop.create_task(executor.run(stop))
    t_submit = time.perf_counter()
    for i in range(n_jobs):
        submitted.append((await client.submit(job_spec(i, units, tenants))).job_id)
    submit_s = time.perf_counter() - t_submit
    sub_task = loop.create_task(submitter())
    warm_by = time.perf_counter() + warmup_s
    while len(executor.received) < warmup and time.perf_counter() < warm_by:  # noqa: ASYNC110 (a deadline)
        await asyncio.sleep(0.01)
    start = sample()
    first = len(executor.received)
    deadline = start.at + duration_s if duration_s > 0 else math.inf
    while len(executor.received) < first + target and time.perf_counter() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(0.01)
    end = sample()
    capped = len(executor.received) < first + target
    replacing = False
    # A submission in flight can swallow one cancellation (asyncio.wait_for in Python 3.11): the
    # submitter would then wait for work for ever, and the run with it.
    await cancel_all([sub_task], 10.0, "replacement submitter")
    # Let the jobs in flight finish (their results are checked), then stop the executor.
    finish_by = time.perf_counter() + (15 if capped else 60)
    states: list[JobState] = []
    while time.perf_counter() < finish_by:
        states = await client.jobs()
        if all(s.status in ("done", "failed", "cancelled") for s in states if s.job_id in set(submitted)):
            break
        await asyncio.sleep(0.5)
    stop.set()
    await exec_task
    try:
        rounds = await asyncio.wait_for(read_rounds(nc), timeout=180)
    except TimeoutError:
        print("reading the round records timed out: round figures are left out", file=sys.stderr)
        rounds = []
    await nc.close()

    window = end.at - start.at
    n = end.grants - start.grants
    subjobs = sum(1 for t in executor.received if start.at <= t <= end.at)
    wall_start = time.time() - (time.perf_counter() - start.at)
    wall_end = wall_start + window
    issued = [r for r in rounds if r.grant_id and wall_start <= r.cleared_at <= wall_end]
    in_window = [r for r in issued if r.grant_id in executor.grant_ids]
    clear_ms = [(r.cleared_at - r.opened_at) * 1e3 for r in in_window]
    clear_all_ms = [(r.cleared_at - r.opened_at) * 1e3 for r in issued]
    offer_ms = [(r.cleared_at - r.window.start_s) * 1e3 for r in in_window]
    # Free-to-grant: from the instant executor freeing a slice to that slice's next grant.
    grant_times: dict[str, list[float]] = {}
    for r in rounds:
        if r.grant_id:
            grant_times.setdefault(r.window.slice_id, []).append(r.cleared_at)
    for times in grant_times.values():
        times.sort()
    free_ms = []
    for slice_id, t_free in executor.freed:
        if not wall_start <= t_free <= wall_end:
            continue
        times = grant_times.get(slice_id, [])
        i = bisect.bisect_right(times, t_free)
        if i < len(times):
            free_ms.append((times[i] - t_free) * 1e3)
    in_msgs = end.varz["in_msgs"] - start.varz["in_msgs"]
    # Less the deliveries to this benchmark's grant counter.
    out_msgs = end.varz["out_msgs"] - start.varz["out_msgs"] - (end.grant_msgs - start.grant_msgs)
    done = [s for s in states if s.status == "done"]
    wrong = [s.job_id for s in done if s.result != run_in_one_piece(s.spec.workload, s.spec.params)]
    all_rounds = [r for r in rounds if wall_start <= r.cleared_at <= wall_end]
    reasons: dict[str, int] = {}
    for r in all_rounds:
        if not r.grant_id:
            bids_here = [v for v in r.verdicts if v.job_id]
            if r.note:
                why = r.note
            elif not bids_here:
                why = "no bid"
            elif all(v.reason.startswith("lost: took ") for v in bids_here):
                why = "every bid won another window of the batch"
            else:
                why = next(v.reason for v in bids_here if not v.reason.startswith("lost: took "))
            why = why.split(":")[0] if why.startswith(("excluded", "no bid")) else why[:60]
            reasons[why] = reasons.get(why, 0) + 1
    batch_sizes: dict[str, int] = {}
    for r in all_rounds:
        batch_sizes[r.batch_id or r.offer_id] = batch_sizes.get(r.batch_id or r.offer_id, 0) + 1
    replies = [len(r.replies_from) for r in in_window]
    bids = [r.bids or len(r.verdicts) for r in in_window]
    cpu = end.cpu_services - start.cpu_services
    msgs = in_msgs + out_msgs
    nbytes = end.varz["in_bytes"] - start.varz["in_bytes"] + end.varz["out_bytes"] - start.varz["out_bytes"]

    def per(x: float, d: float, digits: int = 6) -> float:
        return round(x / d, digits) if d else float("nan")

    return {
        "grants": subjobs,
        "grants_issued": n,
        "window_s": round(window, 3),
        "capped": capped,
        "grants_per_s": per(subjobs, window, 2),
        "grants_issued_per_s": per(n, window, 2),
        "grants_declined_fraction": round(1 - subjobs / n, 3) if n else float("nan"),
        "grant_latency_p50_ms": round(pct(clear_ms, 50), 3),
        "grant_latency_p99_ms": round(pct(clear_ms, 99), 3),
        "grant_latency_all_p50_ms": round(pct(clear_all_ms, 50), 3),
        "grant_latency_all_p99_ms": round(pct(clear_all_ms, 99), 3),
        "offer_to_grant_p50_ms": round(pct(offer_ms, 50), 3),
        "offer_to_grant_p99_ms": round(pct(offer_ms, 99), 3),
        "offer_to_grant_p99_ms_by_second": p99_by_second(
            [(r.cleared_at, (r.cleared_at - r.window.start_s) * 1e3) for r in in_window], wall_start, window
        ),
        "free_to_grant_p50_ms": round(pct(free_ms, 50), 3),
        "free_to_grant_p99_ms": round(pct(free_ms, 99), 3),
        "rounds_in_window": len(all_rounds),
        "rounds_with_replies_fraction": round(
            sum(1 for r in all_rounds if r.replies_from) / max(1, len(all_rounds)), 3
        ),
        "rounds_closed_by_deadline_fraction": round(
            sum(1 for r in all_rounds if r.closed_because == "deadline") / max(1, len(all_rounds)), 3
        ),
        "rounds_without_grant_why": dict(sorted(reasons.items(), key=lambda kv: -kv[1])[:5]),
        "bids_per_round_mean": round(statistics.mean(bids), 1) if bids else 0.0,
        "batches_in_window": len(batch_sizes),
        "offers_per_batch_mean": round(statistics.mean(batch_sizes.values()), 1) if batch_sizes else 0.0,
        "offers_per_batch_max": max(batch_sizes.values(), default=0),
        "replies_per_round_mean": round(statistics.mean(replies), 2) if replies else 0.0,
        "closed_all_replied": round(
            sum(1 for r in in_window if r.closed_because == "all_replied") / max(1, len(in_window)), 3
        ),
        "messages_per_grant": per(msgs, subjobs, 2),
        "messages_per_issued_grant": per(msgs, n, 2),
        "in_msgs_per_grant": per(in_msgs, subjobs, 2),
        "out_msgs_per_grant": per(out_msgs, subjobs, 2),
        "bytes_per_grant": per(nbytes, subjobs, 0),
        "cpu_s_per_grant": per(cpu, subjobs),
        "cpu_s_per_issued_grant": per(cpu, n),
        "cpu_services_util": round(cpu / window, 3) if window else 0.0,
        "cpu_server_s_per_grant": per(end.cpu_server - start.cpu_server, subjobs),
        "cpu_bench_s_per_grant": per(end.cpu_bench - start.cpu_bench, subjobs),
        "cpu_s_per_grant_by_service": {
            name: per(b - a, subjobs)
            for name, a, b in zip(service_names or [], start.cpu_each, end.cpu_each, strict=False)
        },
        "initial_submit_s": round(submit_s, 2),
        "jobs_submitted": len(submitted),
        "jobs_done": len(done),
        "jobs_wrong_result": len(wrong),
        "subjobs_run": executor.ran,
        "subjobs_lost": executor.lost,
        "units_per_subjob": round(executor.units_run / max(1, executor.ran), 3),
    }


def per_service_cpu(procs: list[ServiceProc]) -> dict[str, float]:
    out: dict[str, float] = {}
    for p in procs:
        out[p.instance] = cpu_of([p.proc.pid])
    return out


def summarize_profiles(profile_dir: Path, top: int = 25) -> None:
    for prof in sorted(profile_dir.glob("*.prof")):
        txt = prof.with_suffix(".txt")
        with txt.open("w") as f:
            st = pstats.Stats(str(prof), stream=f)
            st.strip_dirs().sort_stats("tottime").print_stats(top)
            st.sort_stats("cumulative").print_stats(top)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=100)
    ap.add_argument("--slices", type=int, default=64)
    ap.add_argument("--units", type=int, default=UNITS_PER_JOB, help="units (= grants) per job")
    ap.add_argument("--grants", type=int, default=0, help="grants measured (0: max(1000, 20 x slices))")
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument(
        "--pools",
        type=int,
        default=0,
        help="deal the nodes into this many pools (0: a pool per node, as an inventory without pools has)",
    )
    ap.add_argument("--clearers", type=int, default=1, help="clearer replicas (pools sharded among them)")
    ap.add_argument("--advertisers", type=int, default=1, help="advertiser replicas (pools sharded)")
    ap.add_argument("--agents", type=int, default=1, help="agent processes (jobs shared among them)")
    ap.add_argument("--duration-s", type=float, default=0.0, help="cap on the measured window (0: none)")
    ap.add_argument(
        "--warmup-s", type=float, default=0.0, help="cap on the warm-up (0: max(30, duration / 4) seconds)"
    )
    ap.add_argument("--policy", default="fair")
    ap.add_argument(
        "--reply-window-s", type=float, default=0.05, help="how long a round waits for replies (the default)"
    )
    ap.add_argument(
        "--coalesce-s", type=float, default=None, help="advertiser's coalescing pause (default: its own)"
    )
    ap.add_argument(
        "--hold-s",
        type=float,
        default=0.0,
        help="each subjob holds its slice this long before completing (0: at once). The load is then "
        "at most slices / hold grants a second: the latency at a load below saturation",
    )
    ap.add_argument(
        "--trace-sample",
        type=float,
        default=1.0,
        help="fraction of rounds traced (OTEL_TRACES_SAMPLER=parentbased_traceidratio; 1: every round)",
    )
    ap.add_argument(
        "--cohost",
        default="",
        help="services to run together in one process, comma-separated (e.g. "
        "inventory,gateway,clearer,advertiser; one replica each); default: a process per service",
    )
    ap.add_argument("--log-level", default="WARNING", help="of the services (their logs go under --out)")
    ap.add_argument("--profile", type=Path, default=None, help="run the services under cProfile, into DIR")
    ap.add_argument("--out", type=Path, default=None, help="logs and the NATS store (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep --out afterwards")
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    args = ap.parse_args(argv)
    if not 0 <= args.hold_s <= HORIZON_S / 2:
        # A subjob longer than that no longer fits the offered windows once calibrated.
        ap.error(f"--hold-s must be between 0 and {HORIZON_S / 2:g} (half the {HORIZON_S:g} s windows)")

    if args.pools < 0:
        ap.error("--pools must be 0 (a pool per node) or more")
    try:
        cohost = parse_cohost(args.cohost, SERVICES) if args.cohost else []
    except ValueError as e:
        ap.error(f"--cohost: {e}")
    if any(getattr(args, f"{n}s", 1) != 1 for n in cohost):
        ap.error("--cohost: a co-hosted service runs one replica")
    target = args.grants or max(1000, 20 * args.slices)
    warmup = max(100, 2 * args.slices)
    out = args.out or Path(tempfile.mkdtemp(prefix="sja-cp-"))
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    inv = inventory(args.slices, args.pools)
    inv_path = out / "inventory.yaml"
    inv_path.write_text(yaml.safe_dump(inv), encoding="utf-8")
    pools = sorted({n.get("pool", n["name"]) for n in inv["nodes"]})

    load_before = round(os.getloadavg()[0], 2)
    tune_gc()  # as every service process does (and this one plays the executors)
    monitor = free_port()
    server = EmbeddedNats(
        store_dir=str(out / "nats"), extra_args=["-m", str(monitor)], log_file=str(out / "logs" / "nats.log")
    )
    server.start()
    stack: BenchStack | None = None
    try:
        raw = run_loop(raw_nats(server.url))
        asyncio.run(_declare(server.url))
        if args.profile:
            args.profile.mkdir(parents=True, exist_ok=True)
        stack = BenchStack(
            out_dir=out,
            nats_url=server.url,
            env={
                "SJA_INVENTORY": str(inv_path),
                "SJA_HORIZON_S": str(HORIZON_S),
                "SJA_POLICY": args.policy,
                "SJA_LOG_LEVEL": args.log_level,
                "SJA_MAX_JOBS": str(max(10_000, args.jobs)),
                "SJA_METRICS_PORT": "0",
                "SJA_REPLY_WINDOW_S": str(args.reply_window_s),
                **({"SJA_COALESCE_S": str(args.coalesce_s)} if args.coalesce_s is not None else {}),
                "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
                "OTEL_TRACES_SAMPLER_ARG": str(args.trace_sample),
            },
            replicas={"clearer": args.clearers, "advertiser": args.advertisers, "agent": args.agents},
            groups=[cohost] if cohost else [],
            shards={"clearer": shard(pools, args.clearers), "advertiser": shard(pools, args.advertisers)},
            profile_dir=args.profile,
        )
        stack.start(order=SERVICES)
        asyncio.run(stack.wait_ready())
        freeze_after_start()
        pids = [p.proc.pid for p in stack.procs]
        assert server.proc is not None
        cpu0 = per_service_cpu(stack.procs)
        t0 = time.perf_counter()
        result = run_loop(
            run(
                server.url,
                monitor,
                pids,
                server.proc.pid,
                args.jobs,
                args.units,
                args.tenants,
                warmup,
                args.warmup_s or max(30.0, args.duration_s / 4),
                target,
                args.duration_s,
                service_names=[p.instance for p in stack.procs],
                hold_s=args.hold_s,
            )
        )
        wall = time.perf_counter() - t0
        cpu1 = per_service_cpu(stack.procs)
        rss = {}
        for p in stack.procs:
            with contextlib.suppress(psutil.Error):
                rss[p.instance] = round(psutil.Process(p.proc.pid).memory_info().rss / 2**20)
    finally:
        if stack is not None:
            stack.stop()
        server.stop()
    if args.profile:
        summarize_profiles(args.profile)
    result.update(raw)
    result.update(
        {
            "jobs": args.jobs,
            "slices": args.slices,
            "pools": len(pools),
            "units_per_job": args.units,
            "clearers": args.clearers,
            "agents": args.agents,
            "cohost": ",".join(cohost),
            "advertisers": args.advertisers,
            "cpus": os.cpu_count(),
            # The interpreter's build moves every Python process's CPU per grant (docs/performance.md).
            "python": f"{sys.version.split()[0]} {os.path.realpath(sys.executable)}",
            "loadavg_1m_before": load_before,
            "loadavg_1m_after": round(os.getloadavg()[0], 2),
            "wall_s": round(wall, 1),
            "cpu_by_service_s": {k: round(cpu1[k] - cpu0.get(k, 0.0), 2) for k in cpu1},
            "rss_mib_by_service": rss,
            "reply_window_s": args.reply_window_s,
            "trace_sample": args.trace_sample,
            "coalesce_s": args.coalesce_s,
            "hold_s": args.hold_s,
            "offered_grants_per_s_max": round(args.slices / args.hold_s, 1) if args.hold_s > 0 else None,
            "grants_per_s_vs_raw_msgs_per_s": round(result["grants_per_s"] / raw["raw_nats_msgs_per_s"], 6),
            "grant_latency_p50_vs_raw_rtt": round(
                result["grant_latency_p50_ms"] * 1e3 / raw["raw_nats_rtt_us"], 1
            ),
            "grant_latency_p99_vs_raw_rtt": round(
                result["grant_latency_p99_ms"] * 1e3 / raw["raw_nats_rtt_us"], 1
            ),
            "profiled": bool(args.profile),
        }
    )
    for k in (
        "raw_nats_msgs_per_s",
        "raw_nats_rtt_us",
        "raw_nats_rtt_p99_us",
        "raw_kv_cas_us",
        "raw_js_publish_us",
    ):
        result[k] = round(result[k], 1)
    if not args.keep and args.out is None:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
    if not args.json:
        for k, v in result.items():
            print(f"{k:34s} {v}")
    print(json.dumps(result))
    return 0


async def _declare(url: str) -> None:
    nc = await connect(url, "bench-declare")
    try:
        await ensure_jetstream(nc.jetstream())
    finally:
        await nc.close()


if __name__ == "__main__":
    sys.exit(main())
