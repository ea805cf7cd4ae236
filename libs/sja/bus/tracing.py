"""W3C trace context in NATS headers, and typed publishing that carries it."""

from __future__ import annotations

from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace

from sja.bus.codec import encode

tracer = trace.get_tracer("sja")


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    carrier: dict[str, str] = dict(headers or {})
    propagate.inject(carrier)
    return carrier


def extract(msg: Msg | None = None, carrier: dict[str, str] | None = None) -> otel_context.Context:
    if carrier is None:
        carrier = dict(msg.headers or {}) if msg is not None else {}
    return propagate.extract(carrier)


async def publish(nc: Client, subject: str, message: Any, headers: dict[str, str] | None = None) -> None:
    """Publish a message on core NATS with the current trace context in its headers."""
    await nc.publish(subject, encode(message), headers=inject(headers))


def trace_id_hex() -> str:
    ctx = trace.get_current_span().get_span_context()
    return format(ctx.trace_id, "032x") if ctx.is_valid else ""
