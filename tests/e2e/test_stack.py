"""End to end: every service as its own process (``LocalStack``), a real nats-server and a local Ray.

Jobs from two tenants run to completion through real negotiation rounds; results equal the one-piece
computation; each round's spans form one tree across processes (one trace per offer, also in a batch)
and a job's span links to its rounds; the CLI works against it.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sja.client import SjaClient
from sja.protocol.messages import JobSpec, JobState
from sja.stack import LocalStack
from sja.telemetry.setup import read_spans
from sja.workloads import checkpoint as ckpt
from sja.workloads import run_in_one_piece

pytestmark = pytest.mark.slow

SETTINGS = {
    "SJA_HORIZON_S": "3.0",
    "SJA_POLICY": "fair",
    "SJA_LOG_LEVEL": "INFO",
    "SJA_RAY_NUM_CPUS": "2",
}


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    out = tmp_path_factory.mktemp("stack")
    s = LocalStack(out_dir=out, env=SETTINGS, auth=True)  # as `sja up`: a user per service
    try:
        s.start()
        asyncio.run(s.wait_ready())
        yield s
    finally:
        s.stop()


async def wait_terminal(client: SjaClient, ids: list[str], timeout_s: float) -> list[JobState]:
    deadline = time.monotonic() + timeout_s
    while True:
        states = [await client.status(j) for j in ids]
        if all(s.status in ("done", "failed", "cancelled") for s in states):
            return states
        if time.monotonic() > deadline:
            raise AssertionError(f"jobs not finished: {[(s.job_id, s.status) for s in states]}")
        await asyncio.sleep(0.3)


JOBS = [
    JobSpec(
        name="mm-a",
        tenant="alpha",
        workload="matmul",
        max_parallel=2,
        params={"rows": 3000, "inner": 1024, "cols": 1024, "seed": 11},
    ),
    JobSpec(
        name="mc-a",
        tenant="alpha",
        workload="montecarlo",
        mode="sja",
        params={"units": 120, "samples_per_unit": 100_000, "seed": 12},
    ),
    JobSpec(
        name="mm-b",
        tenant="beta",
        workload="matmul",
        mode="sja",
        params={"rows": 2000, "inner": 1024, "cols": 512, "seed": 13},
    ),
    JobSpec(
        name="mc-b",
        tenant="beta",
        workload="montecarlo",
        max_parallel=2,
        params={"units": 200, "samples_per_unit": 100_000, "seed": 14},
    ),
    JobSpec(
        # sequential: each subjob continues from the last one's checkpoint (the object store)
        name="jac-b",
        tenant="beta",
        workload="jacobi",
        params={"grid": 256, "sweeps": 3000, "seed": 15},
    ),
]


def test_jobs_complete_correctly_through_separate_processes(stack: LocalStack) -> None:
    async def go() -> list[JobState]:
        client = await SjaClient.connect(stack.nats_url, auth=stack.client_auth())
        try:
            ids = [(await client.submit(spec)).job_id for spec in JOBS]
            return await wait_terminal(client, ids, 240)
        finally:
            await client.close()

    states = asyncio.run(go())
    for s in states:
        assert s.status == "done", (s.job_id, s.status, s.error)
        assert s.result == run_in_one_piece(s.spec.workload, s.spec.params), s.job_id
        assert s.units_done == s.total_units
        ok = [h for h in s.history if h.status == "ok"]
        assert sum(h.units for h in ok) == s.total_units
        for h in ok:
            assert h.peak_mem_mib <= h.mem_cap_mib
            assert h.duration_s <= h.time_cap_s + 1.0
    assert sum(len(s.history) for s in states) > len(states), "work was cut into subjobs"
    jac = next(s for s in states if s.spec.workload == "jacobi")
    assert ckpt.where(jac.accumulator).startswith(f"{ckpt.BUCKET}/{jac.job_id}/"), "kept in the store"
    names = {p.name for p in stack.procs}
    assert names == {"inventory", "advertiser", "clearer", "agent", "executor", "gateway"}
    assert all(p.proc.poll() is None for p in stack.procs), "no service died"


def render_tree(spans: list[dict[str, object]], root_id: str) -> list[str]:
    children: dict[object, list[dict[str, object]]] = {}
    for s in spans:
        children.setdefault(s["parent_id"], []).append(s)
    lines: list[str] = []

    def walk(span_id: object, depth: int) -> None:
        for child in sorted(children.get(span_id, []), key=lambda s: str(s["name"])):
            lines.append("  " * depth + str(child["name"]))
            walk(child["span_id"], depth + 1)

    root = next(s for s in spans if s["span_id"] == root_id)
    lines.append(str(root["name"]))
    walk(root_id, 1)
    return lines


EXPECTED_ROUND = [
    "sja.round",
    "  sja.clear",
    "    sja.grant",
    "      sja.materialize",
    "        sja.execute",
    "          sja.complete",
    "            sja.calibrate",
    "  sja.reply",
]


TRACED_JOB = JobSpec(
    name="traced",
    tenant="gamma",
    workload="montecarlo",
    max_parallel=3,
    params={"units": 90, "samples_per_unit": 100_000, "seed": 21},
)


def test_one_round_is_one_trace_across_processes(stack: LocalStack) -> None:
    """Each offer is a round with a trace of its own, also when it came in a batch of several:
    advertiser, agent, clearer and executor actor spans form one tree per round; the job's own
    span links to every round it won."""

    async def go() -> JobState:
        client = await SjaClient.connect(stack.nats_url, auth=stack.client_auth())
        try:
            job_id = (await client.submit(TRACED_JOB)).job_id
            return (await wait_terminal(client, [job_id], 240))[0]
        finally:
            await client.close()

    state = asyncio.run(go())
    assert state.status == "done", (state.status, state.error)
    job_id = state.job_id

    def attrs(span: dict[str, object]) -> dict[str, object]:
        got = span["attributes"]
        assert isinstance(got, dict)
        return got

    deadline = time.monotonic() + 30
    while True:
        spans = read_spans(stack.out_dir)
        by_id = {s["span_id"]: s for s in spans}
        traces: dict[object, list[dict[str, object]]] = {}
        for s in spans:
            traces.setdefault(s["trace_id"], []).append(s)
        won = [
            t
            for t in traces.values()
            if any(s["name"] == "sja.clear" and attrs(s).get("sja.job_id") == job_id for s in t)
        ]
        done = [t for t in won if any(s["name"] == "sja.calibrate" for s in t)]
        job_spans = [s for s in spans if s["name"] == "sja.job" and attrs(s).get("sja.job_id") == job_id]
        links = job_spans[0]["links"] if job_spans else []
        assert isinstance(links, list)
        # A round that came in a batch of several offers is a trace of its own too: any job's (the
        # module's jobs share the stack; which offers this job wins is the clearing's to say).
        batched = [
            t
            for t in traces.values()
            if any(s["name"] == "sja.calibrate" for s in t)
            and any(s["name"] == "sja.round" and int(attrs(s)["sja.offers"]) > 1 for s in t)
        ]
        if (batched and job_spans and all(link in by_id for link in links)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert done, "no round of the job reached its calibration"
    assert batched, "no round that came in a multi-offer batch reached its calibration"

    # One trace per round: one sja.round (the root) and at most one sja.clear, for the same offer.
    for t in traces.values():
        rounds = [s for s in t if s["name"] == "sja.round"]
        if not rounds:
            continue
        assert len(rounds) == 1 and rounds[0]["parent_id"] is None
        clears = [s for s in t if s["name"] == "sja.clear"]
        assert len(clears) <= 1
        offer_id = attrs(rounds[0])["sja.offer_id"]
        assert all(attrs(s)["sja.offer_id"] == offer_id for s in clears)
        assert all(attrs(s)["sja.offer_id"] == offer_id for s in t if s["name"] == "sja.reply")

    for in_trace in batched:
        root = next(s for s in in_trace if s["name"] == "sja.round")
        assert render_tree(in_trace, str(root["span_id"])) == EXPECTED_ROUND

    for in_trace in done:
        root = next(s for s in in_trace if s["name"] == "sja.round")
        assert render_tree(in_trace, str(root["span_id"])) == EXPECTED_ROUND
        services = {str(s["service"]) for s in in_trace}
        assert {"sja-advertiser", "sja-clearer", "sja-agent", "sja-executor-actor"} <= services
        clear = next(s for s in in_trace if s["name"] == "sja.clear")
        a = attrs(clear)
        assert a["sja.policy"] == "fair" and a["sja.job_id"] == job_id
        assert str(a["sja.reason"]).startswith("won") and isinstance(a["sja.score"], float)
        reply = next(s for s in in_trace if s["name"] == "sja.reply")
        assert job_id in list(attrs(reply)["sja.job_ids"])  # type: ignore[call-overload]

    # The job's span is a trace of its own, linked to the sja.grant span of every round it won.
    assert len(job_spans) == 1
    job = job_spans[0]
    assert job["parent_id"] is None and len(traces[job["trace_id"]]) == 1
    granted = {
        s["span_id"]
        for t in won
        for s in t
        if s["name"] == "sja.grant" and attrs(s).get("sja.job_id") == job_id and "sja.fence" in attrs(s)
    }
    assert set(links) == granted and len(links) == len(granted)
    a = attrs(job)
    assert a["sja.status"] == "done" and a["sja.grants"] == len(granted) and a["sja.links_dropped"] == 0
    assert a["sja.subjobs"] == len(state.history)
    first_round = min(int(str(s["start_ns"])) for t in won for s in t if s["name"] == "sja.round")
    assert int(str(job["start_ns"])) <= first_round


def sja(*args: str, nats_url: str, credentials: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, SJA_NATS_URL=nats_url, SJA_NATS_CREDENTIALS=str(credentials), COLUMNS="200")
    return subprocess.run(
        [sys.executable, "-m", "sja.cli.main", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_cli_submit_status_trace_cancel(stack: LocalStack, tmp_path: Path) -> None:
    url = stack.nats_url
    creds = stack.credentials()  # the operator's, as `sja up` writes it
    spec = tmp_path / "job.yaml"
    spec.write_text(
        "name: cli-job\ntenant: alpha\nworkload: montecarlo\n"
        "params: {units: 60, samples_per_unit: 50000, seed: 5}\n"
    )
    r = sja("submit", str(spec), nats_url=url, credentials=creds)
    assert r.returncode == 0, r.stderr
    job_id = r.stdout.strip()

    bad = tmp_path / "bad.yaml"
    bad.write_text("name: bad\ntenant: alpha\nworkload: matmul\nparams: {rows: many}\n")
    r = sja("submit", str(bad), nats_url=url, credentials=creds)
    assert r.returncode == 2 and "params.rows" in r.stderr
    bad.write_text("name: bad\ntenant: alpha\nworkload: matmul\neps_mem: 2\n")
    r = sja("submit", str(bad), nats_url=url, credentials=creds)
    assert r.returncode == 2 and "eps_mem" in r.stderr

    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        r = sja("status", job_id, nats_url=url, credentials=creds)
        assert r.returncode == 0, r.stderr
        if "status=done" in r.stdout:
            break
        time.sleep(0.5)
    assert "status=done" in r.stdout and "pi" in r.stdout

    r = sja("trace", job_id, nats_url=url, credentials=creds)
    assert r.returncode == 0, r.stderr
    assert "won" in r.stdout and "replies from: agent-0" in r.stdout

    r = sja("jobs", nats_url=url, credentials=creds)
    assert r.returncode == 0 and job_id in r.stdout

    r = sja("status", "no-such-job", nats_url=url, credentials=creds)
    assert r.returncode == 2 and "not_found" in r.stderr

    big = tmp_path / "big.yaml"
    big.write_text(
        "name: long-job\ntenant: beta\nworkload: matmul\nparams: {rows: 400000, inner: 1024, cols: 1024}\n"
    )
    r = sja("submit", str(big), nats_url=url, credentials=creds)
    big_id = r.stdout.strip()
    r = sja("cancel", big_id, nats_url=url, credentials=creds)
    assert r.returncode == 0, r.stderr
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        r = sja("status", big_id, nats_url=url, credentials=creds)
        if "status=cancelled" in r.stdout:
            break
        time.sleep(0.5)
    assert "status=cancelled" in r.stdout
