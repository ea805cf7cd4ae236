"""Protocol floor: the messages a grant needs, with no decision, no telemetry and no bookkeeping.

    python bench/protocol_floor.py --jobs 1000 --slices 512 --json

SJA's control plane pays for each grant with a fixed set of NATS operations, most of which the
durability it promises asks for (a lease by compare-and-set, the job written, the subjob and the
completion in JetStream, the slice freed by compare-and-set; the advertiser watching the slices).
This benchmark runs exactly that set, and only it, on the same server, client library and
plumbing (``sja.bus``: the connection, the leaner JetStream publish, the pull ``Fetcher``, uvloop),
with payloads of the sizes SJA's own messages have at ``(1000, 512)`` in ``bench/control_plane.py``,
as four processes in SJA's roles:

- *advertiser*: watches the ``sja-slices`` bucket; every free slice not yet offered goes, within
  5 ms (SJA's coalescing pause), into one offer batch per pool (core NATS);
- *agent*: answers each batch with one ready job per window (one reply per batch); for each grant,
  compare-and-sets the job's entry in ``sja-jobs`` and then publishes the subjob to
  ``SJA_SUBJOBS`` (``Nats-Msg-Id``); pulls completions from ``SJA_COMPLETIONS`` 16 at a time and
  acknowledges them; the job is ready again;
- *clearer*: hears the batch and its reply; compare-and-sets each picked slice to ``leased``
  against the offered revision, then sends the batch's grants (one message), its round records
  (one ``SJA_ROUNDS`` publish) and the agent's outcome (one message);
- *executor*: pulls ``SJA_SUBJOBS`` 256 at a time; for each subjob publishes the completion
  (``Nats-Msg-Id``), compare-and-sets the slice to ``free`` against the leased revision and
  acknowledges the subjob.

What is left out is everything SJA decides and records: planning and clearing (every window goes
to the first ready job), profiles, fairness, spans, metrics, logs, retries. So its rate is what SJA's
protocol allows on this machine with this client when SJA's own work costs nothing; SJA's
``grants_per_s`` divided by it is the share of the machine the decisions leave to the protocol.

Measured over ``--duration-s`` after ``--warmup-s``. The last line is a JSON object:
``grants_per_s``, ``messages_per_grant`` (nats-server ``/varz`` in + out, this process's grant
counter excluded), ``cpu_s_per_grant`` (the four roles), ``cpu_server_s_per_grant``,
``cpu_by_role_s``.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import msgspec
import psutil
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from sja.bus.connection import connect
from sja.bus.jetstream import jetstream
from sja.bus.natsd import EmbeddedNats, die_with_parent, free_port
from sja.bus.service import freeze_after_start, run_loop, tune_gc
from sja.bus.streams import ensure_jetstream
from sja.protocol import subjects

ROLES = ("agent", "clearer", "executor", "advertiser")

SIZES = {
    "offer": 570,
    "reply": 780,
    "grant": 860,
    "outcome": 440,
    "record": 940,
    "job": 2315,
    "subjob": 830,
    "completion": 370,
    "slice": 370,
}
"""Bytes per item of SJA's messages at (1000, 512), 1 % of rounds traced (a tap on the server):
an offer batch's offers, a reply's and a grant message's per window, an outcome's and the round
records' per window, a job state, a subjob, a completion, a slice state."""

COALESCE_S = 0.005
REOFFER_S = 0.1
"""A window offered and not granted is offered again after this long."""
SLICES_PER_POOL = 56

OFFER = "floor.offer"
REPLY = "floor.reply"
GRANT = "floor.grant"
OUTCOME = "floor.outcome"
READY = "floor.ready"

_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


def pad(size: int) -> bytes:
    return b"x" * size


def slice_value(status: str, pool: str) -> bytes:
    return _enc.encode({"status": status, "pool": pool, "pad": pad(SIZES["slice"] - 40)})


# --- the roles -----------------------------------------------------------------------------------


async def advertiser(url: str) -> None:
    nc = await connect(url, "floor-advertiser")
    js = jetstream(nc)
    kv = await js.key_value(subjects.BUCKET_SLICES)
    free: dict[str, tuple[int, str]] = {}
    offered: dict[str, float] = {}
    wake = asyncio.Event()
    ready = asyncio.Event()
    watcher = await kv.watchall()

    async def watch() -> None:
        async for entry in watcher:
            if entry is None:
                ready.set()
                continue
            v = _dec.decode(entry.value)
            if v["status"] == "free":
                free[entry.key] = (int(entry.revision or 0), v["pool"])
                wake.set()
            else:
                free.pop(entry.key, None)
                offered.pop(entry.key, None)

    task = asyncio.get_running_loop().create_task(watch())
    await ready.wait()
    await nc.publish(f"{READY}.advertiser", b"")
    n = 0
    while not task.done():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(wake.wait(), timeout=REOFFER_S)
        wake.clear()
        await asyncio.sleep(COALESCE_S)
        now = time.monotonic()
        by_pool: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for key, (rev, pool) in free.items():
            at = offered.get(key)
            if at is None or now - at > REOFFER_S:
                offered[key] = now
                by_pool[pool].append({"slice": key, "rev": rev, "pad": pad(SIZES["offer"] - 40)})
        for pool, offers in by_pool.items():
            n += 1
            body = {"batch_id": f"b{n}", "pool": pool, "offers": offers}
            await nc.publish(f"{OFFER}.{pool}", _enc.encode(body))


async def agent(url: str, n_jobs: int) -> None:
    nc = await connect(url, "floor-agent")
    js = jetstream(nc)
    kv = await js.key_value(subjects.BUCKET_JOBS)
    revs: dict[str, int] = {}
    for i in range(n_jobs):
        job = f"job{i:05d}"
        revs[job] = int(await kv.put(job, pad(SIZES["job"])))
    ready: collections.deque[str] = collections.deque(revs)
    held: dict[str, list[str]] = {}

    async def on_offer(msg: Msg) -> None:
        batch = _dec.decode(msg.data)
        picks = []
        for o in batch["offers"]:
            if not ready:
                break
            picks.append({"slice": o["slice"], "rev": o["rev"], "job": ready.popleft()})
        held[batch["batch_id"]] = [p["job"] for p in picks]
        reply = {
            "batch_id": batch["batch_id"],
            "pool": batch["pool"],
            "picks": picks,
            "pad": pad(SIZES["reply"] * len(batch["offers"])),
        }
        await nc.publish(REPLY, _enc.encode(reply))

    async def materialize(g: dict[str, Any]) -> None:
        job = g["job"]
        revs[job] = int(await kv.update(job, pad(SIZES["job"]), last=revs[job]))
        subjob = {k: g[k] for k in ("job", "slice", "pool", "rev", "grant_id")}
        subjob["pad"] = pad(SIZES["subjob"] - 100)
        await js.publish(
            subjects.subjob_dispatched("node000", job),
            _enc.encode(subjob),
            headers={"Nats-Msg-Id": g["grant_id"]},
        )

    async def on_grant(msg: Msg) -> None:
        grants = _dec.decode(msg.data)["grants"]
        await asyncio.gather(*(materialize(g) for g in grants))

    async def on_outcome(msg: Msg) -> None:
        out = _dec.decode(msg.data)
        won = set(out["won"])
        for job in held.pop(out["batch_id"], []):
            if job not in won:
                ready.append(job)

    await nc.subscribe(f"{OFFER}.*", cb=on_offer)
    await nc.subscribe(GRANT, cb=on_grant)
    await nc.subscribe(OUTCOME, cb=on_outcome)
    fetcher = await js.pull_consumer(
        f"{subjects.PREFIX}.subjob.completed.>",
        durable="floor-agent",
        stream=subjects.STREAM_COMPLETIONS.name,
        config=ConsumerConfig(
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=30,
            deliver_policy=DeliverPolicy.NEW,
            max_ack_pending=100_000,
        ),
    )
    await nc.publish(f"{READY}.agent", b"")
    while True:
        try:
            msgs = await fetcher.fetch(16, timeout=1.0)
        except TimeoutError:
            continue
        for m in msgs:
            ready.append(_dec.decode(m.data)["job"])
            await m.ack()


async def clearer(url: str) -> None:
    nc = await connect(url, "floor-clearer")
    js = jetstream(nc)
    kv = await js.key_value(subjects.BUCKET_SLICES)
    offers: dict[str, int] = {}

    async def on_offer(msg: Msg) -> None:
        batch = _dec.decode(msg.data)
        offers[batch["batch_id"]] = len(batch["offers"])

    async def lease(p: dict[str, Any], pool: str) -> dict[str, Any] | None:
        try:
            rev = await kv.update(p["slice"], slice_value("leased", pool), last=p["rev"])
        except Exception:
            return None  # the slice moved on since it was offered
        return {
            **p,
            "pool": pool,
            "rev": int(rev),
            "grant_id": f"g-{uuid.uuid4().hex[:20]}",
            "pad": pad(SIZES["grant"] - 90),
        }

    async def on_reply(msg: Msg) -> None:
        reply = _dec.decode(msg.data)
        n = offers.pop(reply["batch_id"], len(reply["picks"]))
        pool = reply["pool"]
        got = await asyncio.gather(*(lease(p, pool) for p in reply["picks"]))
        grants = [g for g in got if g is not None]
        if grants:
            await nc.publish(GRANT, _enc.encode({"grants": grants}))
        await js.publish(
            subjects.round_cleared(pool),
            _enc.encode({"batch_id": reply["batch_id"], "pad": pad(SIZES["record"] * n)}),
            headers={"Nats-Msg-Id": reply["batch_id"]},
        )
        body = {
            "batch_id": reply["batch_id"],
            "won": [g["job"] for g in grants],
            "pad": pad(SIZES["outcome"] * n),
        }
        await nc.publish(OUTCOME, _enc.encode(body))

    await nc.subscribe(f"{OFFER}.*", cb=on_offer)
    await nc.subscribe(REPLY, cb=on_reply)
    await nc.publish(f"{READY}.clearer", b"")
    await asyncio.Event().wait()


async def executor(url: str) -> None:
    nc = await connect(url, "floor-executor")
    js = jetstream(nc)
    kv = await js.key_value(subjects.BUCKET_SLICES)
    fetcher = await js.pull_consumer(
        f"{subjects.PREFIX}.subjob.dispatched.>",
        durable="floor-executor",
        stream=subjects.STREAM_SUBJOBS.name,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=30, max_deliver=-1),
    )
    tasks: set[asyncio.Task[None]] = set()

    async def handle(msg: Msg) -> None:
        sj = _dec.decode(msg.data)
        done = {"job": sj["job"], "slice": sj["slice"], "pad": pad(SIZES["completion"] - 40)}
        await js.publish(
            subjects.subjob_completed(sj["job"]),
            _enc.encode(done),
            headers={"Nats-Msg-Id": f"{sj['grant_id']}:done"},
        )
        with contextlib.suppress(Exception):
            await kv.update(sj["slice"], slice_value("free", sj["pool"]), last=sj["rev"])
        await msg.ack()

    await nc.publish(f"{READY}.executor", b"")
    loop = asyncio.get_running_loop()
    while True:
        try:
            msgs = await fetcher.fetch(256, timeout=0.2)
        except TimeoutError:
            continue
        for m in msgs:
            t = loop.create_task(handle(m))
            tasks.add(t)
            t.add_done_callback(tasks.discard)


def role_main(role: str, url: str, n_jobs: int) -> None:
    tune_gc()
    if role == "agent":
        run_loop(agent(url, n_jobs))
    elif role == "clearer":
        run_loop(clearer(url))
    elif role == "executor":
        run_loop(executor(url))
    else:
        run_loop(advertiser(url))


# --- the run -------------------------------------------------------------------------------------


def varz(port: int) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=5) as r:
        data: dict[str, Any] = json.loads(r.read())
        return data


def cpu(pid: int) -> float:
    with contextlib.suppress(psutil.Error):
        t = psutil.Process(pid).cpu_times()
        return float(t.user + t.system)
    return 0.0


async def prepare(url: str, n_slices: int) -> None:
    nc = await connect(url, "floor-setup")
    try:
        js = jetstream(nc)
        await ensure_jetstream(js)
        kv = await js.key_value(subjects.BUCKET_SLICES)
        for i in range(n_slices):
            await kv.put(f"slice{i:05d}", slice_value("free", f"pool{i // SLICES_PER_POOL:03d}"))
    finally:
        await nc.close()


async def measure(
    url: str, monitor: int, spawn: Any, server_pid: int, warmup_s: float, duration_s: float
) -> dict[str, Any]:
    """Count grants (and learn that every role is ready) from before the roles start."""
    nc = await connect(url, "floor-bench")
    grants = 0
    grant_msgs = 0

    async def on_grant(msg: Msg) -> None:
        nonlocal grants, grant_msgs
        grants += len(_dec.decode(msg.data)["grants"])
        grant_msgs += 1

    ready: set[str] = set()

    async def on_ready(msg: Msg) -> None:
        ready.add(msg.subject.rsplit(".", 1)[1])

    await nc.subscribe(f"{READY}.*", cb=on_ready)
    await nc.subscribe(GRANT, cb=on_grant, pending_msgs_limit=10_000_000)
    await nc.flush()
    pids: dict[str, int] = spawn()
    return await _window(
        nc, monitor, pids, server_pid, warmup_s, duration_s, ready, lambda: (grants, grant_msgs)
    )


async def _window(
    nc: Any,
    monitor: int,
    pids: dict[str, int],
    server_pid: int,
    warmup_s: float,
    duration_s: float,
    ready: set[str],
    counts: Any,
) -> dict[str, Any]:
    deadline = time.monotonic() + 120
    while len(ready) < len(ROLES) and time.monotonic() < deadline:  # noqa: ASYNC110 (a deadline)
        await asyncio.sleep(0.05)
    if len(ready) < len(ROLES):
        raise RuntimeError(f"roles not ready: {sorted(set(ROLES) - ready)}")
    await asyncio.sleep(warmup_s)
    g0, m0 = counts()
    v0, c0, s0, t0 = varz(monitor), {r: cpu(p) for r, p in pids.items()}, cpu(server_pid), time.perf_counter()
    await asyncio.sleep(duration_s)
    g1, m1 = counts()
    v1, c1, s1, t1 = varz(monitor), {r: cpu(p) for r, p in pids.items()}, cpu(server_pid), time.perf_counter()
    await nc.close()
    grants = g1 - g0
    if grants <= 0:
        raise RuntimeError("no grant in the measured window")
    msgs = (v1["in_msgs"] - v0["in_msgs"]) + (v1["out_msgs"] - v0["out_msgs"]) - (m1 - m0)
    by_role = {r: round(c1[r] - c0[r], 3) for r in pids}
    return {
        "grants_per_s": round(grants / (t1 - t0), 1),
        "grants": grants,
        "seconds": round(t1 - t0, 3),
        "messages_per_grant": round(msgs / grants, 2),
        "cpu_s_per_grant": round(sum(by_role.values()) / grants, 6),
        "cpu_server_s_per_grant": round((s1 - s0) / grants, 6),
        "cpu_by_role_s": by_role,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=1000)
    ap.add_argument("--slices", type=int, default=512)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--duration-s", type=float, default=10.0)
    ap.add_argument("--json", action="store_true", help="print only the JSON line")
    ap.add_argument("--role", choices=ROLES, help=argparse.SUPPRESS)
    ap.add_argument("--url", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.role:
        role_main(args.role, args.url, args.jobs)
        return 0
    if args.jobs < 1 or args.slices < 1:
        ap.error("--jobs and --slices must be at least 1")

    tune_gc()
    out = Path(tempfile.mkdtemp(prefix="sja-floor-"))
    monitor = free_port()
    server = EmbeddedNats(store_dir=str(out / "nats"), extra_args=["-m", str(monitor)])
    server.start()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        asyncio.run(prepare(server.url, args.slices))
        freeze_after_start()

        def spawn() -> dict[str, int]:
            for role in ROLES:
                procs[role] = subprocess.Popen(
                    [sys.executable, __file__, "--role", role, "--url", server.url, "--jobs", str(args.jobs)],
                    env={**os.environ},
                    start_new_session=True,
                    preexec_fn=die_with_parent,
                )
            return {r: p.pid for r, p in procs.items()}

        assert server.proc is not None
        result = run_loop(
            measure(server.url, monitor, spawn, server.proc.pid, args.warmup_s, args.duration_s)
        )
        for role, p in procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"the {role} role exited ({p.returncode}) during the run")
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        server.stop()
    result.update(jobs=args.jobs, slices=args.slices, load_before=round(os.getloadavg()[0], 2))
    if not args.json:
        for k, v in result.items():
            print(f"{k:24s} {v}")
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
