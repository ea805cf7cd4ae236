"""Spans leave a process over real OTLP/HTTP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class Collector(BaseHTTPRequestHandler):
    received: ClassVar[list[ExportTraceServiceRequest]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        req = ExportTraceServiceRequest()
        req.ParseFromString(body)
        Collector.received.append(req)
        assert self.path == "/v1/traces"
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def collector() -> Iterator[str]:
    Collector.received = []
    server = HTTPServer(("127.0.0.1", 0), Collector)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}"
    finally:
        server.shutdown()
        server.server_close()


EMIT = """
from opentelemetry import trace
from sja.telemetry.setup import setup_tracing, shutdown_tracing
setup_tracing("sja-test", out_dir={out!r})
with trace.get_tracer("t").start_as_current_span("sja.round", attributes={{"sja.offer_id": "o-1"}}):
    with trace.get_tracer("t").start_as_current_span("sja.clear"):
        pass
shutdown_tracing()
"""


def test_spans_are_exported_over_otlp_http(collector: str, tmp_path: Path) -> None:
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=collector)
    r = subprocess.run(
        [sys.executable, "-c", EMIT.format(out=str(tmp_path))],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    spans = [
        (span.name, {a.key: a.value.string_value for a in span.attributes})
        for req in Collector.received
        for rs in req.resource_spans
        for ss in rs.scope_spans
        for span in ss.spans
    ]
    names = [n for n, _ in spans]
    assert sorted(names) == ["sja.clear", "sja.round"]
    assert dict(spans)["sja.round"]["sja.offer_id"] == "o-1"
    services = {
        a.value.string_value
        for req in Collector.received
        for rs in req.resource_spans
        for a in rs.resource.attributes
        if a.key == "service.name"
    }
    assert services == {"sja-test"}
    assert not list((tmp_path / "traces").glob("*.jsonl")), "no file export when a collector is set"
