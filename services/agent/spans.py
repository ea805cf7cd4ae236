"""The agent's spans of its own: a job's ``sja.job`` span (a trace of its own, from when this process
took the job to its end, linked to the rounds it was granted in) and the attributes of an
``sja.reply`` span (the answer to an offer), one per traced offer of a batch."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.util.types import AttributeValue

from sja.bus.tracing import ROOT
from sja.protocol.messages import JobState, Proposal, ReplyGroup

tracer = trace.get_tracer("sja.agent")

MAX_JOB_LINKS = 128
"""Links to rounds a job's ``sja.job`` span keeps (the rest are counted: ``sja.links_dropped``)."""


@dataclass(slots=True)
class JobTrace:
    """What a job's ``sja.job`` span holds until the job ends."""

    started_ns: int
    recovered: bool
    """Taken back after a restart: links to rounds before it are lost (they lived in memory)."""
    links: list[trace.Link] = field(default_factory=list)
    grants: int = 0
    links_dropped: int = 0


class JobSpans:
    """The ``sja.job`` spans of the jobs an agent holds, until each ends."""

    def __init__(self, agent_id: str) -> None:
        self.agent_id = agent_id
        self.traces: dict[str, JobTrace] = {}
        """job id -> what its ``sja.job`` span will hold (from when this process took the job)."""

    def taken(self, job_id: str, recovered: bool) -> None:
        """This process took the job (claimed it, or took it back after a restart or over from a
        silent agent): its ``sja.job`` span starts now."""
        self.traces.setdefault(job_id, JobTrace(time.time_ns(), recovered))

    def granted(self, job_id: str, ctx: otel_context.Context) -> None:
        """A grant for the job came: its ``sja.job`` span links to the grant's round (if traced)."""
        jt = self.traces.get(job_id)
        if jt is None:
            return
        jt.grants += 1
        sc = trace.get_current_span(ctx).get_span_context()
        if not (sc.is_valid and sc.trace_flags.sampled):
            return  # a round not traced: nothing to link to
        if len(jt.links) < MAX_JOB_LINKS:
            jt.links.append(trace.Link(sc))
        else:
            jt.links_dropped += 1

    def drop(self, job_id: str) -> None:
        """The job is no longer this process's: no span for it."""
        self.traces.pop(job_id, None)

    def ended(self, state: JobState) -> None:
        """The job reached a final state: emit its ``sja.job`` span, a trace of its own that links to
        the rounds it took part in."""
        jt = self.traces.pop(state.job_id, None)
        if jt is None:
            return
        span = tracer.start_span(
            "sja.job",
            context=ROOT,
            links=jt.links,
            start_time=jt.started_ns,
            attributes={
                "sja.job_id": state.job_id,
                "sja.tenant": state.spec.tenant,
                "sja.workload": state.spec.workload,
                "sja.status": state.status,
                "sja.units": state.total_units,
                "sja.units_done": state.units_done,
                "sja.subjobs": state.next_seq,
                "sja.grants": jt.grants,
                "sja.links_dropped": jt.links_dropped,
                "sja.recovered": jt.recovered,
                "sja.agent": self.agent_id,
            },
        )
        if state.status == "failed":
            span.set_status(trace.Status(trace.StatusCode.ERROR, state.error[:200]))
        span.end()


def reply_attributes(proposals: list[Proposal]) -> dict[str, AttributeValue]:
    """A reply span's attributes: the jobs that bid, and the best candidate's job and score."""
    attributes: dict[str, AttributeValue] = {
        "sja.proposals": len(proposals),
        "sja.job_ids": [p.job_id for p in proposals[:64]],
    }
    best = max(
        ((c.score, p.job_id) for p in proposals for c in p.candidates), default=None, key=lambda b: b[0]
    )
    if best is not None:
        attributes["sja.score"] = best[0]
        attributes["sja.job_id"] = best[1]
    return attributes


def batch_reply_spans(
    batch_id: str,
    offers: int,
    agent_id: str,
    groups: Sequence[tuple[ReplyGroup, list[Proposal]]],
    sampled: dict[str, otel_context.Context],
    started_ns: int,
) -> None:
    """One ``sja.reply`` span per sampled offer of a batch (each offer is a round with a trace of
    its own), spanning the whole batch's answer. ``sampled``: offer id -> its round's context."""
    for group, proposals in groups:
        attributes: dict[str, AttributeValue] | None = None
        for offer_id in group.offer_ids:
            parent = sampled.get(offer_id)
            if parent is None:
                continue
            if attributes is None:
                attributes = {
                    "sja.batch_id": batch_id,
                    "sja.offers": offers,
                    "sja.like_offers": len(group.offer_ids),
                    "sja.agent": agent_id,
                    **reply_attributes(proposals),
                }
            span = tracer.start_span(
                "sja.reply",
                context=parent,
                kind=trace.SpanKind.CONSUMER,
                start_time=started_ns,
                attributes={"sja.offer_id": offer_id, **attributes},
            )
            span.end()
