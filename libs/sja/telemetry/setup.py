"""Tracer provider set-up: OTLP when ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set, otherwise JSON lines.

Each process writes its spans to ``<out_dir>/traces/<service>-<pid>.jsonl`` when no collector is
configured, so the one-machine stack keeps every negotiation without any other service running.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_provider: TracerProvider | None = None


class JsonLinesSpanExporter(SpanExporter):
    """Appends one JSON object per finished span to a file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        lines = [json.dumps(span_to_dict(s), separators=(",", ":")) for s in spans]
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def span_to_dict(s: ReadableSpan) -> dict[str, object]:
    ctx = s.get_span_context()
    assert ctx is not None
    return {
        "name": s.name,
        "trace_id": format(ctx.trace_id, "032x"),
        "span_id": format(ctx.span_id, "016x"),
        "parent_id": format(s.parent.span_id, "016x") if s.parent else None,
        "kind": s.kind.name,
        "start_ns": s.start_time,
        "end_ns": s.end_time,
        "status": s.status.status_code.name,
        "service": s.resource.attributes.get("service.name"),
        "attributes": dict(s.attributes or {}),
        "links": [format(link.context.span_id, "016x") for link in s.links],
    }


def setup_tracing(
    service_name: str,
    *,
    out_dir: str = "out",
    env: Mapping[str, str] | None = None,
    exporter: SpanExporter | None = None,
    simple: bool = False,
) -> TracerProvider:
    """Install the global tracer provider once per process and return it."""
    global _provider
    if _provider is not None:
        return _provider
    env = os.environ if env is None else env
    resource = Resource.create(
        {"service.name": service_name, "service.namespace": "sja", "process.pid": os.getpid()}
    )
    provider = TracerProvider(resource=resource)
    if exporter is None:
        if env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            exporter = OTLPSpanExporter()
        else:
            exporter = JsonLinesSpanExporter(Path(out_dir) / "traces" / f"{service_name}-{os.getpid()}.jsonl")
    processor = (
        SimpleSpanProcessor(exporter) if simple else BatchSpanProcessor(exporter, schedule_delay_millis=500)
    )
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    if not env.get("OTEL_PROPAGATORS"):
        # W3C trace context only: SJA carries no baggage, and the SDK's default (trace context
        # and baggage) parses and writes both on every message.
        propagate.set_global_textmap(TraceContextTextMapPropagator())
    _provider = provider
    return provider


def flush_tracing(timeout_ms: int = 5000) -> None:
    if _provider is not None:
        _provider.force_flush(timeout_ms)


def shutdown_tracing() -> None:
    global _provider
    if _provider is not None:
        _provider.shutdown()


def read_spans(out_dir: str | Path) -> list[dict[str, object]]:
    """All spans written as JSON lines under ``<out_dir>/traces``."""
    spans: list[dict[str, object]] = []
    for f in sorted((Path(out_dir) / "traces").glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if line.strip():
                spans.append(json.loads(line))
    return spans
