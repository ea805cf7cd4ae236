"""Metrics, scraped from the Prometheus endpoint of services running in-process against a real
nats-server: a negotiation round shows up in the clearer's, agent's, advertiser's, gateway's and
inventory's metric families; a malformed offer is counted as rejected and does not stop anything; the
endpoint (shared by the services of one process) closes with the last of them; metrics also leave a
process over OTLP/HTTP when a collector is configured. A service process serves its endpoint on a
fixed ``SJA_METRICS_PORT``; the executor counts each slice's busy seconds and the agent an OOM
subjob."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import JOBS_CONSUMER, AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.executor.service import ExecutorService, ExecutorSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from sja.bus.natsd import free_port
from sja.bus.settings import BaseSettings, SettingsError
from sja.client import SjaClient
from sja.core import jobs as J
from sja.core.policies import POLICIES
from sja.protocol import subjects
from sja.protocol.messages import JobSpec, MemoryDecl, TimeDecl
from sja.telemetry.metrics import serve_metrics
from sja.workloads import run_in_one_piece
from tests.integration.waits import until_state, wait_until, wait_until_sync

Samples = list[tuple[str, dict[str, str], float]]


@contextlib.asynccontextmanager
async def running(*services: object) -> AsyncIterator[None]:
    async with contextlib.AsyncExitStack() as stack:
        for s in services:
            await stack.enter_async_context(s)  # type: ignore[arg-type]
        yield


def common(nats_url: str, tmp_path: Path, name: str, port: int) -> dict[str, object]:
    return {"nats_url": nats_url, "out_dir": str(tmp_path / "out"), "instance": name, "metrics_port": port}


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200
        return bytes(r.read()).decode()


async def scrape(port: int) -> Samples:
    """Every sample of the endpoint as (sample name, labels, value)."""
    text = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
    families = text_string_to_metric_families(text)
    return [(s.name, dict(s.labels), s.value) for f in families for s in f.samples]


def total(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    return sum(v for n, lb, v in samples if n == name and all(lb.get(k) == x for k, x in labels.items()))


def series(samples: Samples, name: str, **labels: str) -> list[dict[str, str]]:
    return [lb for n, lb, _ in samples if n == name and all(lb.get(k) == x for k, x in labels.items())]


async def eventually(port: int, ok: Callable[[Samples], bool], what: str, timeout_s: float = 20.0) -> Samples:
    """The endpoint's samples once ``ok`` holds for them."""

    async def seen() -> tuple[Samples] | None:
        samples = await scrape(port)
        return (samples,) if ok(samples) else None  # a tuple: true even where no sample is needed

    (samples,) = await wait_until(seen, f"{what} in the metrics", timeout_s, every_s=0.2)
    return samples


async def test_a_negotiation_round_shows_in_every_services_metrics(
    nats_url: str, tmp_path: Path, nc, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
    port = free_port()
    c = lambda name: common(nats_url, tmp_path, name, port)  # noqa: E731
    inventory = InventoryService(InventorySettings(**c("inventory-m"), slice_export_s=0.5))
    gateway = GatewayService(GatewaySettings(**c("gateway-m")))
    # Short leases: with no executor, granted slices return to the pool (and are offered again) soon.
    clearer = ClearerService(ClearerSettings(**c("clearer-m"), policy="fair", lease_s=2.0))
    agent = AgentService(AgentSettings(**c("agent-m"), horizon_s=4.0))
    advertiser = AdvertiserService(AdvertiserSettings(**c("advertiser-m"), horizon_s=4.0))

    async with running(inventory, gateway, clearer, agent, advertiser):
        client = SjaClient(nc)
        spec = JobSpec(
            name="metered",
            tenant="tm",
            workload="montecarlo",
            max_parallel=2,
            params={"units": 2000, "samples_per_unit": 100_000, "seed": 1},
        )
        await client.submit(spec)

        s = await eventually(
            port,
            # The provider is per process: earlier tests' clearers counted too, so wait for this
            # test's own tenant to show up.
            lambda s: (
                total(s, "sja_grants_total", service="clearer", tenant="tm") > 0
                and total(s, "sja_rounds_total", service="clearer", outcome="granted") > 0
                and total(s, "sja_offer_to_grant_seconds_count", service="clearer") > 0
                and len(series(s, "sja_slice_state", service="inventory")) == 6
            ),
            "a granted round and the slice gauges",
        )
        # Clearer: rounds by outcome, grants, offer-to-grant latency with its buckets.
        for lb in series(s, "sja_rounds_total", service="clearer"):
            assert lb["outcome"] in ("granted", "no_bids", "no_winner", "lost_cas", "duplicate"), lb
            # Earlier tests' clearers (other policies) share this process's provider.
            assert lb["policy"] in POLICIES and lb["pool"], lb
        assert total(s, "sja_rounds_total", service="clearer", policy="fair", outcome="granted") > 0
        assert total(s, "sja_grants_total", service="clearer", tenant="tm") > 0
        count = total(s, "sja_offer_to_grant_seconds_count", service="clearer")
        assert total(s, "sja_offer_to_grant_seconds_bucket", service="clearer", le="+Inf") == count
        assert 0 < total(s, "sja_offer_to_grant_seconds_sum", service="clearer") / count < 10
        les = {lb["le"] for lb in series(s, "sja_offer_to_grant_seconds_bucket", service="clearer")}
        assert {"0.001", "0.05", "1.0", "10.0"} <= les, "buckets from a millisecond to seconds"
        # Advertiser and gateway.
        assert total(s, "sja_offers_total", service="advertiser") > 0
        assert total(s, "sja_jobs_submitted_total", service="gateway", tenant="tm") >= 1
        # Inventory: one state series per slice, and the per-status counts add up to the six slices.
        states = series(s, "sja_slice_state", service="inventory")
        assert len({lb["slice"] for lb in states}) == 6
        assert all(lb["status"] in ("free", "leased", "busy", "offline") and lb["profile"] for lb in states)
        assert total(s, "sja_slices", service="inventory") == 6
        assert {lb["status"] for lb in series(s, "sja_slices", service="inventory")} == {
            "free",
            "leased",
            "busy",
            "offline",
        }, "every status has a series, zero or not"
        # The gauges follow the bucket (refreshed every half second here): granted slices show as leased.
        s = await eventually(
            port,
            lambda s: total(s, "sja_slices", service="inventory", status="leased") > 0,
            "a leased slice in the gauges",
        )
        assert total(s, "sja_slices", service="inventory") == 6
        leased = series(s, "sja_slice_state", service="inventory", status="leased")
        assert len(leased) == total(s, "sja_slices", service="inventory", status="leased")
        # Agent: its JetStream consumers' depths (read periodically, cached).
        assert series(s, "sja_queue_pending", service="agent", stream="SJA_JOBS", consumer=JOBS_CONSUMER)
        assert series(
            s, "sja_queue_ack_pending", service="agent", stream="SJA_COMPLETIONS", consumer="agent-agent-m"
        )
        # Every service has its permission-violation series from the start.
        for name in ("inventory", "gateway", "clearer", "agent", "advertiser"):
            assert series(s, "sja_permission_violations_total", service=name), name
        # Every service times its event loop: a lag histogram with buckets from half a millisecond.
        s = await eventually(
            port,
            lambda s: all(
                total(s, "sja_event_loop_lag_seconds_count", service=name) > 0
                for name in ("inventory", "gateway", "clearer", "agent", "advertiser")
            ),
            "every service's event loop lag",
        )
        for name in ("inventory", "gateway", "clearer", "agent", "advertiser"):
            count = total(s, "sja_event_loop_lag_seconds_count", service=name)
            assert total(s, "sja_event_loop_lag_seconds_bucket", service=name, le="+Inf") == count
            sums = [v for n, lb, v in s if n == "sja_event_loop_lag_seconds_sum" and lb["service"] == name]
            assert len(sums) == 1, f"{name} exports one lag sum"
            # Every probe wakes its timer a little late, never later than the smallest bucket that
            # holds all of them: the sum lies between zero (exclusive) and count times that bound.
            bound = min(
                float(lb["le"])
                for n, lb, v in s
                if n == "sja_event_loop_lag_seconds_bucket" and lb.get("service") == name and v == count
            )
            assert 0 < sums[0] <= count * bound, (name, sums[0], count, bound)
        les = {lb["le"] for lb in series(s, "sja_event_loop_lag_seconds_bucket", service="agent")}
        assert {"0.0005", "0.01", "1.0"} <= les

        # A malformed offer: counted by both subscribers of the offer subject, logged without a
        # traceback, and the round keeps going.
        offer_sub = subjects.offer_opened("*")
        before_clearer = total(s, "sja_rejected_messages_total", service="clearer", subject=offer_sub)
        before_agent = total(s, "sja_rejected_messages_total", service="agent", subject=offer_sub)
        rounds_before = total(s, "sja_rounds_total", service="clearer")
        caplog.set_level(logging.WARNING, logger="sja.bus.service")
        await nc.publish(subjects.offer_opened("pool-m"), b"\xc1 not msgpack")
        await nc.flush()
        s = await eventually(
            port,
            lambda s: (
                total(s, "sja_rejected_messages_total", service="clearer", subject=offer_sub) > before_clearer
                and total(s, "sja_rejected_messages_total", service="agent", subject=offer_sub) > before_agent
            ),
            "the rejected offer counted",
        )
        assert series(
            s, "sja_rejected_messages_total", service="clearer", subject=offer_sub, reason="malformed"
        )
        dropped = [r for r in caplog.records if "dropped a message" in r.getMessage()]
        assert dropped and all(r.levelno == logging.WARNING and r.exc_info is None for r in dropped)
        assert any("sja.v1.offer.opened.pool-m" in r.getMessage() for r in dropped)
        # The gateway counts a request it cannot decode (and answers it with a typed error).
        gw_before = total(s, "sja_rejected_messages_total", service="gateway", subject=subjects.JOB_SUBMIT)
        await nc.request(subjects.JOB_SUBMIT, b"\xc1garbage", timeout=5)
        s = await scrape(port)
        assert (
            total(s, "sja_rejected_messages_total", service="gateway", subject=subjects.JOB_SUBMIT)
            == gw_before + 1
        )
        # Still clearing: the unclaimed windows are offered again and cleared.
        await eventually(
            port,
            lambda s: total(s, "sja_rounds_total", service="clearer") > rounds_before,
            "a round after the malformed offer",
        )

    # The last service of the process closed the shared endpoint; the gauges it fed are gone.
    with pytest.raises(urllib.error.URLError):
        await scrape(port)


def test_the_endpoint_is_shared_per_port_and_a_busy_port_does_not_fail(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
    assert serve_metrics(0) is None, "0 disables the endpoint"
    port = free_port()
    first = serve_metrics(port)
    second = serve_metrics(port)
    assert first is not None and second is first
    assert "# TYPE" in _get(f"http://127.0.0.1:{port}/metrics")
    first.release()
    assert "# TYPE" in _get(f"http://127.0.0.1:{port}/metrics"), "one user left: still serving"
    second.release()
    with pytest.raises(urllib.error.URLError):
        _get(f"http://127.0.0.1:{port}/metrics")

    # A port someone else holds: a warning, no endpoint, no exception.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with caplog.at_level(logging.WARNING, logger="sja.telemetry.metrics"):
            assert serve_metrics(taken.getsockname()[1]) is None
        assert any("cannot bind" in r.getMessage() for r in caplog.records)


def test_the_metrics_port_setting_is_validated() -> None:
    assert BaseSettings.from_env({"SJA_METRICS_PORT": "9464"}).metrics_port == 9464
    assert BaseSettings.from_env({}).metrics_port == 0
    with pytest.raises(SettingsError, match="metrics_port"):
        BaseSettings.from_env({"SJA_METRICS_PORT": "70000"})


class MetricsCollector(BaseHTTPRequestHandler):
    """An OTLP/HTTP metrics receiver: keeps (path, request) for every POST."""

    received: ClassVar[list[tuple[str, bytes]]] = []

    def do_POST(self) -> None:
        MetricsCollector.received.append((self.path, self.rfile.read(int(self.headers["Content-Length"]))))
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def collector() -> Iterator[str]:
    MetricsCollector.received = []
    server = HTTPServer(("127.0.0.1", 0), MetricsCollector)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


EMIT = """
from sja.telemetry.metrics import ServiceMetrics, flush_metrics, setup_metrics
setup_metrics("sja-test")
m = ServiceMetrics("clearer")
rounds = m.counter("sja_rounds", "rounds")
rounds.add(3, pool="p", policy="fair", outcome="granted")
rounds.add(2, outcome="granted", policy="fair", pool="p")  # the same series, labels in another order
rounds.add(-1, pool="p", policy="fair", outcome="granted")  # a counter never goes down: dropped
m.gauge("sja_slices", "slices").set(6, status="free")
flush_metrics()  # what Service.stop does
"""


def test_metrics_are_pushed_over_otlp_http_when_a_collector_is_set(collector: str) -> None:
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import ExportMetricsServiceRequest

    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env["OTEL_EXPORTER_OTLP_ENDPOINT"] = collector
    r = subprocess.run([sys.executable, "-c", EMIT], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert MetricsCollector.received, "nothing was pushed"
    points: dict[str, tuple[float, dict[str, str]]] = {}
    for path, body in MetricsCollector.received:
        assert path == "/v1/metrics"
        req = ExportMetricsServiceRequest()
        req.ParseFromString(body)
        for rm in req.resource_metrics:
            service = {a.key: a.value.string_value for a in rm.resource.attributes}["service.name"]
            assert service == "sja-test"
            for sm in rm.scope_metrics:
                for metric in sm.metrics:
                    data = metric.sum if metric.HasField("sum") else metric.gauge
                    if metric.name == "sja_rounds":
                        assert metric.sum.is_monotonic, "exported as a counter"
                    for dp in data.data_points:
                        labels = {a.key: a.value.string_value for a in dp.attributes}
                        points[metric.name] = (dp.as_double or float(dp.as_int), labels)
    assert points["sja_rounds"] == (
        5.0,
        {"service": "clearer", "pool": "p", "policy": "fair", "outcome": "granted"},
    )
    assert points["sja_slices"] == (6.0, {"service": "clearer", "status": "free"})

    # OTEL_METRICS_EXPORTER=none: no push, even with the endpoint set.
    MetricsCollector.received = []
    env["OTEL_METRICS_EXPORTER"] = "none"
    r = subprocess.run([sys.executable, "-c", EMIT], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert MetricsCollector.received == []


def test_a_service_process_serves_metrics_on_its_fixed_port(nats_url: str, tmp_path: Path) -> None:
    """``sja service gateway`` with ``SJA_METRICS_PORT`` set serves ``/metrics`` there once it is
    serving, with its own series, and frees the port when it stops."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SJA_", "OTEL_"))}
    env.update(
        SJA_NATS_URL=nats_url,
        SJA_OUT_DIR=str(tmp_path / "out"),
        SJA_INSTANCE="gateway-port",
        SJA_METRICS_PORT=str(port),
        OTEL_EXPORTER_PROMETHEUS_HOST="127.0.0.1",
    )
    log = tmp_path / "gateway.log"
    with log.open("ab") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "sja.cli.main", "service", "gateway"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:

        def serving() -> tuple[str] | None:
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            try:
                return (_get(f"http://127.0.0.1:{port}/metrics"),)
            except urllib.error.URLError:
                return None

        (text,) = wait_until_sync(serving, "the endpoint serving", 60.0, every_s=0.2)
        samples = [
            (s.name, dict(s.labels), s.value) for f in text_string_to_metric_families(text) for s in f.samples
        ]
        assert series(samples, "sja_permission_violations_total", service="gateway")
        assert total(samples, "sja_permission_violations_total", service="gateway") == 0
        info = series(samples, "target_info")
        assert info and info[0]["service_name"] == "sja-gateway", info
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert proc.returncode == 0, log.read_text(errors="replace")[-3000:]
    with pytest.raises(urllib.error.URLError):
        _get(f"http://127.0.0.1:{port}/metrics")


async def test_executor_busy_seconds_and_an_oom_in_the_agents_subjob_counts(
    nats_url: str, tmp_path: Path, nc, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A job whose declared memory profile is far below its real use, on memory-capped soft slices
    (a GPU without MIG, emulated): its first subjob goes past the slice's memory and is reported
    ``oom``, which the agent counts in ``sja_subjobs_total{status="oom"}``; the job re-plans smaller
    subjobs and completes with the right result; the executor adds each slice's running time to
    ``sja_slice_busy_seconds_total``."""
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
    port = free_port()
    c = lambda name: common(nats_url, tmp_path, name, port)  # noqa: E731
    inventory = InventoryService(
        InventorySettings(
            **c("inventory-oom"), inventory_source="fake-nvml:h100-nomig", node="local", soft_slices="96,96"
        )
    )
    agent = AgentService(AgentSettings(**c("agent-oom"), horizon_s=4.0, mem_reserve_mib=0.0))
    executor = ExecutorService(ExecutorSettings(**c("executor-oom"), node="local", ray_num_cpus=2))
    services = [
        inventory,
        GatewayService(GatewaySettings(**c("gateway-oom"), mem_reserve_mib=0.0)),
        ClearerService(ClearerSettings(**c("clearer-oom"))),
        agent,
        executor,
        AdvertiserService(AdvertiserSettings(**c("advertiser-oom"), horizon_s=4.0)),
    ]
    params = {"rows": 12_000, "inner": 512, "cols": 256, "seed": 8}
    spec = JobSpec(
        name="underdeclared",
        tenant="toom",
        workload="matmul",
        params=params,
        # Tens of MiB per 1000 rows in truth; declared as if it took almost nothing. The time is
        # declared small too: a soft slice's compute share is its share of the GPU's memory, tiny here.
        memory=MemoryDecl(base_mib=1.0, per_unit_mib=0.0001, rel_sd=0.0),
        time=TimeDecl(warmup_s=0.0, per_unit_s=1e-9, rel_sd=0.0),
    )
    async with running(*services):
        slices = {s.slice_id: s for s, _ in await inventory.slices.all()}  # type: ignore[union-attr]
        assert {s.source for s in slices.values()} == {"soft"} and len(slices) == 2
        before = await scrape(port)
        oom_before = total(before, "sja_subjobs_total", service="agent", status="oom")
        ok_before = total(before, "sja_subjobs_total", service="agent", status="ok")
        client = SjaClient(nc)
        job = await client.submit(spec)
        state = await until_state(client, job.job_id, J.is_terminal, 150, "the job to end", every_s=0.3)
        # The provider is per process: earlier tests' agents counted too, so wait for this job's
        # completions to be added.
        s = await eventually(
            port,
            lambda s: total(s, "sja_subjobs_total", service="agent", status="ok") > ok_before,
            "the completions counted",
        )

    assert state.status == "done", (state.status, state.error)
    assert state.result == run_in_one_piece("matmul", params)
    ooms = [h for h in state.history if h.status == "oom"]
    assert ooms, [(h.status, h.units, h.peak_mem_mib) for h in state.history]
    # The OOM was observed by the agent, and counted once per OOM subjob.
    assert total(s, "sja_subjobs_total", service="agent", status="oom") - oom_before == len(ooms)
    # Busy seconds: one series per slice that ran a subjob, labelled with its profile and node,
    # adding up to at least the running time of this job's subjobs.
    ran = {h.slice_id for h in state.history}
    busy = {lb["slice"]: lb for lb in series(s, "sja_slice_busy_seconds_total", service="executor")}
    assert ran <= set(busy), (ran, busy)
    for sid in ran:
        assert busy[sid]["node"] == "local" and busy[sid]["profile"] == slices[sid].profile
        assert total(s, "sja_slice_busy_seconds_total", service="executor", slice=sid) > 0
    # The executor's time per subjob includes the run the subjob measured itself.
    ran_s = sum(h.duration_s for h in state.history)
    assert total(s, "sja_slice_busy_seconds_total", service="executor") >= 0.99 * ran_s > 0
