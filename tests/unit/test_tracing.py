"""``child_span``: a span under a sampled parent is recorded as the parent's child; under an
unsampled parent nothing is made, and the unsampled decision still reaches what is published."""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

from sja.bus.tracing import child_span, extract, inject


def _tracer(ratio: float) -> tuple[trace.Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_child_of_a_sampled_parent_is_recorded_under_it() -> None:
    tracer, exporter = _tracer(1.0)
    with tracer.start_as_current_span("sja.round") as root:
        carrier = inject()
    with child_span(tracer, "sja.clear", context=extract(carrier=carrier), attributes={"sja.bids": 3}) as s:
        assert s.is_recording()
        s.set_attribute("sja.winner", "j-1")
    spans = {sp.name: sp for sp in exporter.get_finished_spans()}
    clear = spans["sja.clear"]
    assert clear.parent is not None
    assert clear.parent.span_id == root.get_span_context().span_id
    assert clear.context.trace_id == root.get_span_context().trace_id
    assert clear.attributes == {"sja.bids": 3, "sja.winner": "j-1"}


def test_child_of_an_unsampled_parent_makes_no_span_and_propagates_the_decision() -> None:
    tracer, exporter = _tracer(0.0)
    with tracer.start_as_current_span("sja.round") as root:
        carrier = inject()
    assert not root.get_span_context().trace_flags.sampled
    with child_span(tracer, "sja.clear", context=extract(carrier=carrier)) as s:
        assert not s.is_recording()
        s.set_attribute("sja.winner", "j-1")  # a no-op, not an error
        inner = inject()
        with child_span(tracer, "sja.grant") as g:
            assert g is s  # still the parent: nothing made below it either
    assert exporter.get_finished_spans() == ()
    # What is published inside carries the round's trace id, still unsampled: the next service
    # does not start (and sample) a trace of its own.
    ctx = trace.get_current_span(extract(carrier=inner)).get_span_context()
    assert ctx.trace_id == root.get_span_context().trace_id
    assert not ctx.trace_flags.sampled
    assert trace.get_current_span() is trace.INVALID_SPAN  # detached on exit


def test_without_a_parent_the_sampler_decides() -> None:
    tracer, exporter = _tracer(1.0)
    with child_span(tracer, "sja.round") as s:
        assert s.is_recording()
    assert [sp.name for sp in exporter.get_finished_spans()] == ["sja.round"]
