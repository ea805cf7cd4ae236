"""Scaling out, every service its own process against a real nats-server: clearers sharded by pool
(``SJA_POOLS``) with two replicas sharing one pool through the offer queue group, two agents sharing
the jobs, one executor per node (``examples/inventory/two-pools.yaml``). Every job completes with
the result of the job computed in one piece, no slice is granted twice, each clearer clears only its
own pools (its Prometheus series say so), and both agents take part."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from sja.audit import Mix, audit, call, mixed_specs, read_rounds, statuses
from sja.bus.natsd import die_with_parent, free_ports
from sja.inventory.declared import load_declared
from sja.stack import LocalStack, ServiceProc

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parents[2]
INVENTORY = ROOT / "examples" / "inventory" / "two-pools.yaml"
CLEARERS = {"clearer-a0": "pool-a", "clearer-a1": "pool-a", "clearer-b0": "pool-b"}
"""Clearer replica -> its ``SJA_POOLS``: pool-a has two replicas (one queue group), pool-b one."""
AGENTS = ("agent-0", "agent-1")
JOBS = 8
MAX_JOBS = 4
"""Per agent (``SJA_MAX_JOBS``): fewer than the jobs, so neither agent can take them all at once."""


def spawn(stack: LocalStack, name: str, instance: str, **env: str) -> ServiceProc:
    """``sja service <name>`` as its own process, with the stack's settings plus ``env``."""
    log_path = stack.out_dir / "logs" / f"{instance}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("ab") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sja.cli.main", "service", name],
            env={**stack.service_environment(name, instance), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
    sp = ServiceProc(name, instance, proc, log_path)
    stack.procs.append(sp)
    return sp


def rounds_by_pool(port: int) -> dict[tuple[str, str], float]:
    """``sja_rounds_total`` of one clearer process, summed by (pool, outcome)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "sja_rounds_total" and s.labels.get("service") == "clearer":
                key = (s.labels["pool"], s.labels["outcome"])
                out[key] = out.get(key, 0.0) + s.value
    return out


def test_sharded_clearers_and_two_agents_complete_every_job_once(tmp_path: Path) -> None:
    pools = {s.pool for s in load_declared(INVENTORY)}
    assert pools == set(CLEARERS.values()), "the example inventory declares the two pools"
    stack = LocalStack(
        out_dir=tmp_path,
        env={
            "SJA_INVENTORY": str(INVENTORY),
            "SJA_HORIZON_S": "2.0",
            "SJA_LEASE_S": "3.0",
            "SJA_RAY_NUM_CPUS": "1",
            "SJA_MAX_JOBS": str(MAX_JOBS),
            "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1",
        },
    )
    metrics_ports = dict(zip(CLEARERS, free_ports(len(CLEARERS)), strict=True))
    with stack:
        url = stack.start_nats()
        spawn(stack, "inventory", "inventory-0")
        asyncio.run(stack.wait_ready())
        spawn(stack, "gateway", "gateway-0")
        for instance, pool in CLEARERS.items():
            # The default offer queue group (SJA_OFFER_QUEUE=sja-clearers) for all three.
            spawn(stack, "clearer", instance, SJA_POOLS=pool, SJA_METRICS_PORT=str(metrics_ports[instance]))
        for instance in AGENTS:
            spawn(stack, "agent", instance)
        for node in ("node-a", "node-b"):
            spawn(stack, "executor", f"executor-{node}", SJA_NODE=node)
        spawn(stack, "advertiser", "advertiser-0")
        asyncio.run(stack.wait_ready(timeout_s=240))

        # Work enough that one pool's two slices cannot do it all between the other pool's offers
        # (a Monte Carlo job needs more than one window): tiny jobs could all land on one pool,
        # and "both pools did work" would hang on timing rather than on the sharding.
        specs = mixed_specs(JOBS, Mix(mc_units=40, mc_samples_per_unit=1_000_000, mm_rows=600, mm_inner=256))
        ids = [asyncio.run(call(url, "submit", s)).job_id for s in specs]
        deadline = time.monotonic() + 240
        while True:
            states = asyncio.run(statuses(url, ids))
            if all(s.status in ("done", "failed", "cancelled") for s in states):
                break
            assert time.monotonic() < deadline, [(s.job_id, s.status, s.units_done) for s in states]
            time.sleep(1.0)
        rounds = asyncio.run(read_rounds(url))
        cleared = {instance: rounds_by_pool(port) for instance, port in metrics_ports.items()}

    for s in states:
        assert s.status == "done", (s.job_id, s.status, s.error)
    # Correct results, each unit applied once, no (slice, fence) granted twice, no two subjobs on
    # one slice at once.
    report = audit(states, rounds, len(ids))
    assert report.clean, report
    # Each offer was cleared by one clearer: one round record per offer.
    offer_ids = [r.offer_id for r in rounds]
    assert len(offer_ids) == len(set(offer_ids))
    # Both pools' slices did work.
    assert {r.window.pool for r in rounds if r.grant_id} == pools
    # Each clearer cleared rounds of its own pool only; the two replicas of pool-a both cleared some
    # of its rounds (the queue group shares them) and each pool had grants.
    for instance, pool in CLEARERS.items():
        seen = cleared[instance]
        assert {p for p, _ in seen} == {pool}, (instance, seen)
        assert sum(seen.values()) > 0, instance
    for pool in pools:
        granted = sum(v for c in cleared.values() for (p, o), v in c.items() if p == pool and o == "granted")
        assert granted > 0, pool
    # Both agents claimed jobs.
    owners = [s.owner_agent for s in states]
    assert set(owners) == set(AGENTS), owners
