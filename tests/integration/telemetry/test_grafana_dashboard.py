"""The Prometheus and Grafana wiring of the compose stack (``infra/prometheus``, ``infra/grafana``):

- the Grafana dashboard is well formed, every panel's queries use the provisioned Prometheus data
  source, and the scrape configuration finds every SJA service the compose file runs, on the port
  the compose file gives its metrics;
- every metric the dashboard queries, and every label it selects or groups by, is exported by the
  services' ``/metrics``: all seven run in-process against a real nats-server (the executor on a
  local Ray) and share one endpoint, a job runs to completion and a malformed message is sent, so
  that every series the dashboard reads has a sample.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.executor.service import ExecutorService, ExecutorSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from services.registry import SERVICES
from services.ui.service import UiService, UiSettings
from sja.bus.natsd import free_port
from sja.client import SjaClient
from sja.protocol import subjects
from sja.protocol.messages import JobSpec
from tests.integration.telemetry.test_metrics import Samples, common, running, scrape
from tests.integration.waits import wait_until

ROOT = Path(__file__).resolve().parents[3]
DASHBOARD = ROOT / "infra" / "grafana" / "dashboards" / "sja.json"
DATASOURCES = ROOT / "infra" / "grafana" / "provisioning" / "datasources" / "prometheus.yml"
DASHBOARD_PROVIDERS = ROOT / "infra" / "grafana" / "provisioning" / "dashboards" / "sja.yml"
PROMETHEUS = ROOT / "infra" / "prometheus" / "prometheus.yml"
COMPOSE = ROOT / "docker-compose.yml"

PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool"}
PROMQL_WORDS |= {"offset", "inf", "nan"}
PROMETHEUS_OWN = {"up"}
"""Series Prometheus makes itself for each target, not exported by the services."""
PROMETHEUS_LABELS = {"job", "instance", "compose_service", "le"}
"""Labels a scrape adds (``job``, ``instance``, the relabelled ``compose_service``) or a histogram has."""


def dashboard() -> dict[str, Any]:
    doc = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every query of every panel."""
    out = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """The metric names an expression reads, each with the labels its matchers name."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range and subquery durations ($__rate_interval too)
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    found = []
    for m in re.finditer(r"(?<![\w:$])([a-zA-Z_:][\w:]*)\s*(\{[^}]*\})?", expr):
        name, matchers = m.group(1), m.group(2) or ""
        after = expr[m.end() :].lstrip()
        if name.lower() in PROMQL_WORDS or (not matchers and after.startswith("(")):
            continue  # a keyword, or a function call
        before = expr[: m.start()].rstrip()
        if re.search(r"\{[^}]*$", before):
            continue  # a label inside a matcher
        found.append((name, set(re.findall(r"([a-zA-Z_]\w*)\s*(?:=~|!=|!~|=)", matchers))))
    return found


def grouping_labels(expr: str) -> set[str]:
    labels: set[str] = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {g.strip() for g in group.split(",") if g.strip()}
    return labels


def test_the_selector_parser_finds_metrics_not_functions_or_labels() -> None:
    expr = 'histogram_quantile(0.99, sum by (service, le) (rate(sja_x_bucket{status="oom"}[5m])))'
    assert selectors(expr) == [("sja_x_bucket", {"status"})]
    assert grouping_labels(expr) == {"service", "le"}
    assert selectors("sum(rate(a_total[5m])) / sum(rate(b_total[5m])) or vector(0)") == [
        ("a_total", set()),
        ("b_total", set()),
    ]


def test_the_dashboard_is_provisioned_with_its_prometheus_data_source() -> None:
    doc = dashboard()
    assert doc["uid"] and doc["title"] and doc["schemaVersion"] >= 30
    sources = yaml.safe_load(DATASOURCES.read_text(encoding="utf-8"))["datasources"]
    prom = next(s for s in sources if s["type"] == "prometheus")
    assert prom["url"] == "http://prometheus:9090"
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    shown = [p for p in doc["panels"] if p["type"] != "row"]
    assert len(shown) >= 10
    for panel in shown:
        assert panel["targets"], panel["title"]
        for t in panel["targets"]:
            assert t["datasource"] == {"type": "prometheus", "uid": prom["uid"]}, panel["title"]
            assert selectors(t["expr"]), (panel["title"], t["expr"])
    providers = yaml.safe_load(DASHBOARD_PROVIDERS.read_text(encoding="utf-8"))["providers"]
    compose = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]
    mounts = compose["grafana"]["volumes"]
    assert f"./infra/grafana/dashboards:{providers[0]['options']['path']}:ro" in mounts
    assert "./infra/grafana/provisioning:/etc/grafana/provisioning:ro" in mounts
    assert "./infra/prometheus:/etc/prometheus:ro" in compose["prometheus"]["volumes"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in compose["prometheus"]["command"]


def test_prometheus_scrapes_every_sja_service_on_its_metrics_port() -> None:
    config = yaml.safe_load(PROMETHEUS.read_text(encoding="utf-8"))
    compose = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))["services"]
    job = next(j for j in config["scrape_configs"] if j["job_name"] == "sja")
    (dns,) = job["dns_sd_configs"]
    assert set(dns["names"]) == set(SERVICES) <= set(compose)
    for name in SERVICES:
        env = compose[name]["environment"]
        assert str(env["SJA_METRICS_PORT"]) == str(dns["port"]), name
    # The dashboard's `up` panel groups by the label this relabelling makes.
    assert any(r["target_label"] == "compose_service" for r in job["relabel_configs"])


def missing(samples: Samples) -> list[str]:
    """What the dashboard reads that ``samples`` do not have: metrics, or labels on them."""
    labels: dict[str, set[str]] = {}
    for name, lb, _ in samples:
        labels.setdefault(name, set()).update(lb)
    out = []
    for title, expr in queries():
        read = selectors(expr)
        for name, matched in read:
            if name in PROMETHEUS_OWN:
                continue
            if name not in labels:
                out.append(f"{title}: {name}")
            elif matched - labels[name] - PROMETHEUS_LABELS:
                out.append(f"{title}: {name} has no label {sorted(matched - labels[name])}")
        available = set().union(*(labels.get(n, set()) for n, _ in read)) | PROMETHEUS_LABELS
        if grouping_labels(expr) - available:
            out.append(f"{title}: no metric of {expr!r} has {sorted(grouping_labels(expr) - available)}")
    return out


async def test_every_metric_the_dashboard_queries_is_exported_by_the_services(
    nats_url: str, tmp_path: Path, nc, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_PROMETHEUS_HOST", "127.0.0.1")
    port = free_port()
    c = lambda name: common(nats_url, tmp_path, name, port)  # noqa: E731
    services = [
        InventoryService(InventorySettings(**c("inventory-g"), slice_export_s=0.5)),
        GatewayService(GatewaySettings(**c("gateway-g"))),
        ClearerService(ClearerSettings(**c("clearer-g"))),
        AgentService(AgentSettings(**c("agent-g"), horizon_s=4.0)),
        ExecutorService(ExecutorSettings(**c("executor-g"), node="local", ray_num_cpus=2)),
        AdvertiserService(AdvertiserSettings(**c("advertiser-g"), horizon_s=4.0)),
        UiService(UiSettings(**c("ui-g"), ui_port=0, ui_host="127.0.0.1")),
    ]
    assert {s.name for s in services} == set(SERVICES)
    spec = JobSpec(
        name="graphed",
        tenant="tg",
        workload="montecarlo",
        max_parallel=2,
        params={"units": 40, "samples_per_unit": 20_000, "seed": 2},
    )
    async with running(*services):
        client = SjaClient(nc)
        job = await client.submit(spec)

        async def ended() -> Any:
            state = await client.status(job.job_id)
            return state if state.status in ("done", "failed", "cancelled") else None

        state = await wait_until(ended, "the job to end", timeout_s=120.0, every_s=0.3)
        assert state.status == "done", state.error
        # A message no service can decode: counted in sja_rejected_messages_total.
        await nc.publish(subjects.offer_opened("local"), b"\xc1 not msgpack")
        await nc.flush()
        # Wait until the endpoint shows it all (gauges are refreshed by the services' own loops).
        last: dict[str, Any] = {}

        async def exported() -> bool:
            last["samples"] = await scrape(port)
            return not missing(last["samples"])

        try:
            await wait_until(exported, "every series the dashboard queries", timeout_s=60.0, every_s=0.5)
        except AssertionError as e:
            raise AssertionError(f"{e}; not exported: {missing(last['samples'])}") from None
