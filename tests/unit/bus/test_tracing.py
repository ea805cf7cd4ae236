"""``child_span``: a span under a sampled parent is recorded as the parent's child; under an
unsampled parent nothing is made, and the unsampled decision still reaches what is published.
``start_roots`` / ``item_contexts``: each offer of a batch is a trace of its own, and an unsampled
one costs nothing on the wire yet is still not traced downstream."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import pytest
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import Attributes

from sja.bus.codec import decode, encode
from sja.bus.tracing import ROOT, child_span, extract, inject, is_sampled, item_contexts, start_roots
from sja.protocol.messages import Offer, OfferBatch, Window


def _tracer(ratio: float, root: Sampler | None = None) -> tuple[trace.Tracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider(sampler=ParentBased(root or TraceIdRatioBased(ratio)))
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider.get_tracer("test"), exporter


def test_child_of_a_sampled_parent_is_recorded_under_it() -> None:
    tracer, exporter = _tracer(1.0)
    with tracer.start_as_current_span("sja.round") as root:
        carrier = inject()
    with child_span(tracer, "sja.clear", context=extract(carrier=carrier), attributes={"sja.bids": 3}) as s:
        assert s.is_recording()
        s.set_attribute("sja.job_id", "j-1")
    spans = {sp.name: sp for sp in exporter.get_finished_spans()}
    clear = spans["sja.clear"]
    assert clear.parent is not None
    assert clear.parent.span_id == root.get_span_context().span_id
    assert clear.context.trace_id == root.get_span_context().trace_id
    assert clear.attributes == {"sja.bids": 3, "sja.job_id": "j-1"}


def test_child_of_an_unsampled_parent_makes_no_span_and_propagates_the_decision() -> None:
    tracer, exporter = _tracer(0.0)
    with tracer.start_as_current_span("sja.round") as root:
        carrier = inject()
    assert not root.get_span_context().trace_flags.sampled
    with child_span(tracer, "sja.clear", context=extract(carrier=carrier)) as s:
        assert not s.is_recording()
        s.set_attribute("sja.job_id", "j-1")  # a no-op, not an error
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


class EveryOther(Sampler):
    """Samples the first root span, not the second, the third... (a 50 % ratio, made certain)."""

    def __init__(self) -> None:
        self.n = 0

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: trace.SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[trace.Link] | None = None,
        trace_state: trace.TraceState | None = None,
    ) -> SamplingResult:
        self.n += 1
        return SamplingResult(Decision.RECORD_AND_SAMPLE if self.n % 2 else Decision.DROP, attributes)

    def get_description(self) -> str:
        return "EveryOther"


def _batch(n: int, carriers: list[dict[str, str]]) -> OfferBatch:
    offers = [
        Offer(
            offer_id=f"o-{i}",
            round=i + 1,
            window=Window(
                slice_id=f"s-{i}",
                node="n0",
                pool="p0",
                gpu_model="A100",
                profile="1g.10gb",
                mem_mib=10_000,
                compute_share=1 / 7,
                start_s=0.0,
            ),
            slice_fence=0,
            slice_revision=1,
            issued_at=0.0,
            reply_by=0.05,
            reply_to="sja.v1.offer.replied.p0",
        )
        for i in range(n)
    ]
    batch = OfferBatch(
        batch_id="b-1",
        offers=offers,
        issued_at=0.0,
        reply_by=0.05,
        reply_to=offers[0].reply_to,
        trace_contexts=carriers,
    )
    got = decode(encode(batch), OfferBatch)
    assert got == batch  # the contexts survive the wire
    return got


def _clear_each(tracer: trace.Tracer, batch: OfferBatch, headers: dict[str, str]) -> None:
    """What the clearer does: one sja.clear per offer, under that offer's context."""
    contexts = item_contexts(batch.trace_contexts, len(batch.offers), extract(carrier=headers))
    for offer, ctx in zip(batch.offers, contexts, strict=True):
        with child_span(tracer, "sja.clear", context=ctx, attributes={"sja.offer_id": offer.offer_id}):
            pass


def test_each_offer_of_a_batch_is_a_trace_of_its_own() -> None:
    tracer, exporter = _tracer(1.0)
    spans, carriers, headers = start_roots(tracer, "sja.round", 3)
    for i, s in enumerate(spans):
        s.set_attribute("sja.offer_id", f"o-{i}")
        s.end()
    assert all(c.get("traceparent") for c in carriers)
    assert headers == carriers[0]
    _clear_each(tracer, _batch(3, carriers), headers)
    finished = exporter.get_finished_spans()
    rounds = {sp.attributes["sja.offer_id"]: sp for sp in finished if sp.name == "sja.round"}
    clears = {sp.attributes["sja.offer_id"]: sp for sp in finished if sp.name == "sja.clear"}
    assert sorted(rounds) == sorted(clears) == ["o-0", "o-1", "o-2"]
    assert len({sp.context.trace_id for sp in rounds.values()}) == 3
    for offer_id, clear in clears.items():
        assert rounds[offer_id].parent is None
        assert clear.parent is not None
        assert clear.parent.span_id == rounds[offer_id].context.span_id
        assert clear.context.trace_id == rounds[offer_id].context.trace_id


def test_an_unsampled_offer_carries_nothing_and_stays_untraced_downstream() -> None:
    tracer, exporter = _tracer(0.0, root=EveryOther())
    spans, carriers, headers = start_roots(tracer, "sja.round", 4)
    for s in spans:
        s.end()
    assert [bool(c) for c in carriers] == [True, False, True, False]
    # The headers carry the first unsampled round: the offers without a context inherit its
    # decision (not its trace: the clearer makes nothing under it).
    assert not is_sampled(extract(carrier=headers))
    unsampled = spans[1].get_span_context()
    assert trace.get_current_span(extract(carrier=headers)).get_span_context().trace_id == unsampled.trace_id
    _clear_each(tracer, _batch(4, carriers), headers)
    finished = exporter.get_finished_spans()
    assert sorted((sp.name, sp.context.trace_id) for sp in finished) == sorted(
        (name, spans[i].get_span_context().trace_id) for i in (0, 2) for name in ("sja.round", "sja.clear")
    )
    assert sorted(sp.attributes["sja.offer_id"] for sp in finished if sp.name == "sja.clear") == [
        "o-0",
        "o-2",
    ]


def test_with_nothing_sampled_no_offer_carries_a_context() -> None:
    tracer, exporter = _tracer(0.0)
    spans, carriers, headers = start_roots(tracer, "sja.round", 3)
    assert carriers == [{}, {}, {}]
    assert headers.get("traceparent") and not is_sampled(extract(carrier=headers))
    assert not any(s.is_recording() for s in spans)
    _clear_each(tracer, _batch(3, []), headers)
    assert exporter.get_finished_spans() == ()


def test_a_batch_without_contexts_gives_every_offer_the_message_context() -> None:
    tracer, _ = _tracer(1.0)
    with tracer.start_as_current_span("sja.round"):
        default = extract(carrier=inject())
    assert item_contexts([], 2, default) == [default, default]
    own = {"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}
    got = item_contexts([own, {}], 3, default)
    assert got[1] is default and got[2] is default
    assert trace.get_current_span(got[0]).get_span_context().trace_id == int("1" * 32, 16)
    assert is_sampled(got[0]) and not is_sampled(ROOT)


TRACEPARENTS = [
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00",
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",  # invalid trace id
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",  # invalid span id
    "00-0AF7651916CD43DD8448EB211C80319C-B7AD6B7169203331-01",  # upper case: not W3C
    "ff-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",  # forbidden version
    "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-future",  # a later version
    " 00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01 ",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
    "garbage",
    "",
]


@pytest.mark.parametrize("traceparent", TRACEPARENTS)
@pytest.mark.parametrize("tracestate", [None, "vendor=x,other=y"])
def test_extract_reads_what_the_sdk_reads(traceparent: str, tracestate: str | None) -> None:
    """The short path for the common header gives the SDK's context; everything else is the SDK's."""
    headers = {"traceparent": traceparent, "Nats-Msg-Id": "m-1"}
    if tracestate is not None:
        headers["tracestate"] = tracestate
    want = trace.get_current_span(TraceContextTextMapPropagator().extract(dict(headers))).get_span_context()
    with w3c_only():
        got = trace.get_current_span(extract(carrier=headers)).get_span_context()
    assert got == want
    assert got.trace_state == want.trace_state
    assert got.is_remote == want.is_remote


def test_extract_without_a_context_is_the_root() -> None:
    with w3c_only():
        for headers in (None, {}, {"Nats-Msg-Id": "m-1"}):
            assert not trace.get_current_span(extract(carrier=headers)).get_span_context().is_valid


@contextmanager
def w3c_only() -> Iterator[None]:
    """The services' propagator (``sja.telemetry.setup``): W3C trace context alone."""
    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(TraceContextTextMapPropagator())
    try:
        yield
    finally:
        propagate.set_global_textmap(previous)


def test_extract_goes_through_another_configured_propagator() -> None:
    """With ``OTEL_PROPAGATORS`` naming another format, the headers are read by it."""
    from opentelemetry.propagators.textmap import TextMapPropagator

    class Fixed(TextMapPropagator):
        def extract(self, carrier: Any, context: Context | None = None, getter: Any = None) -> Context:
            sc = trace.SpanContext(7, 9, True, trace.TraceFlags(1))
            return trace.set_span_in_context(trace.NonRecordingSpan(sc), context)

        def inject(self, carrier: Any, context: Context | None = None, setter: Any = None) -> None:
            return None

        @property
        def fields(self) -> set[str]:
            return set()

    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(Fixed())
    try:
        sc = trace.get_current_span(extract(carrier={"traceparent": TRACEPARENTS[0]})).get_span_context()
        assert (sc.trace_id, sc.span_id) == (7, 9)
    finally:
        propagate.set_global_textmap(previous)


def test_child_span_under_a_sampled_parent_records_an_error_and_reraises() -> None:
    tracer, exporter = _tracer(1.0)
    with pytest.raises(RuntimeError), child_span(tracer, "sja.clear"):
        raise RuntimeError("boom")
    (span,) = exporter.get_finished_spans()
    assert span.status.status_code == trace.StatusCode.ERROR
    assert any(e.name == "exception" for e in span.events)


def test_child_span_under_an_unsampled_parent_detaches_on_error() -> None:
    tracer, _ = _tracer(0.0)
    with tracer.start_as_current_span("sja.round"):
        carrier = inject()
    with pytest.raises(RuntimeError), child_span(tracer, "sja.clear", context=extract(carrier=carrier)):
        raise RuntimeError("boom")
    assert trace.get_current_span() is trace.INVALID_SPAN
