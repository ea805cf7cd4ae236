"""Log lines that name their trace: every record carries the trace and span ids of the
OpenTelemetry span current where it was logged (``trace_id``, ``span_id``; empty outside a span),
and a service's log format shows them, so a line in a service's log leads to its round or job in
the trace viewer (``sja trace``, Jaeger) and back."""

from __future__ import annotations

import logging

from opentelemetry import trace

FORMAT = "%(asctime)s %(levelname)s %(name)s [trace=%(trace_id)s span=%(span_id)s]: %(message)s"
"""A service's log line: time, level, logger, the current trace and span ids, the message."""


class TraceContextFilter(logging.Filter):
    """Adds ``trace_id`` (32 hex digits) and ``span_id`` (16) of the current span to each record it
    sees, empty when no span is current. Installed on a handler, it sees every record the handler
    writes, whichever logger made it."""

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            record.trace_id = format(ctx.trace_id, "032x")
            record.span_id = format(ctx.span_id, "016x")
        else:
            record.trace_id = record.span_id = ""
        return True


def configure_logging(level: str, fmt: str = FORMAT) -> None:
    """A process's logging: records at ``level`` and above to stderr in ``fmt``, each carrying its
    trace and span ids (``TraceContextFilter`` on every handler of the root logger)."""
    logging.basicConfig(level=level.upper(), format=fmt)
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, TraceContextFilter) for f in handler.filters):
            handler.addFilter(TraceContextFilter())
    logging.getLogger("nats").setLevel(logging.WARNING)
