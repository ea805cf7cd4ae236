"""Log lines carry the trace and span ids of the span current where they were logged (empty
outside any span), through the filter and format a service process installs."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from sja.telemetry.logs import FORMAT, TraceContextFilter, configure_logging


@pytest.fixture
def logged() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger writing through a handler set up as a service's is (the filter, the format)."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter(FORMAT))
    handler.addFilter(TraceContextFilter())
    logger = logging.getLogger("sja.test.logs")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    try:
        yield logger, out
    finally:
        logger.removeHandler(handler)
        logger.propagate = True


def test_a_line_logged_in_a_span_names_its_trace_and_span(logged: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = logged
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("sja.round") as span:
        logger.info("round cleared")
        ctx = span.get_span_context()
    line = out.getvalue().strip()
    trace_id, span_id = format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")
    assert f"[trace={trace_id} span={span_id}]: round cleared" in line, line
    assert " INFO sja.test.logs " in line


def test_a_line_logged_outside_any_span_has_empty_ids(logged: tuple[logging.Logger, io.StringIO]) -> None:
    logger, out = logged
    logger.warning("no span here")
    assert out.getvalue().strip().endswith("WARNING sja.test.logs [trace= span=]: no span here")


def test_configure_logging_puts_the_filter_on_the_root_handlers_once() -> None:
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    root.handlers = []
    try:
        configure_logging("warning")
        configure_logging("warning")
        assert root.level == logging.WARNING
        assert root.handlers, "a handler to stderr"
        for handler in root.handlers:
            assert sum(isinstance(f, TraceContextFilter) for f in handler.filters) == 1
            record = logging.LogRecord("sja.x", logging.ERROR, __file__, 1, "lost", None, None)
            assert handler.filter(record)
            assert handler.format(record).endswith("ERROR sja.x [trace= span=]: lost")
    finally:
        root.handlers = saved_handlers
        root.setLevel(saved_level)
