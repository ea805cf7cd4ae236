"""Metrics: one OpenTelemetry ``MeterProvider`` per process, read by Prometheus and pushed over OTLP.

What a service sees is ``ServiceMetrics``: counters, histograms and gauges whose every point carries
the label ``service=<name>``. Several services may run in one process (the in-process integration
tests, a small deployment), so the process-wide parts are shared and set up once:

- the provider (``setup_metrics``), installed as OpenTelemetry's global meter provider the first time
  any service starts. It always has a Prometheus reader (registered with ``prometheus_client``'s
  default registry, so the endpoint also shows ``process_*`` and ``python_*`` metrics) and, when
  ``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``OTEL_EXPORTER_OTLP_METRICS_ENDPOINT``) is set and
  ``OTEL_METRICS_EXPORTER`` is not ``none``, a periodic OTLP/HTTP reader (every
  ``OTEL_METRIC_EXPORT_INTERVAL`` ms, 60 s by default);
- the HTTP endpoints (``serve_metrics``): ``/metrics`` on ``SJA_METRICS_PORT`` (0: none, the default),
  bound to ``OTEL_EXPORTER_PROMETHEUS_HOST`` (default ``0.0.0.0``). Services asking for the same port
  share one server, reference-counted, which closes when the last of them stops;
- the instruments, created once per name through the OpenTelemetry API. An instrument created before
  the provider is installed is a proxy that starts recording once it is.

Recording never raises and never blocks: a failed ``add``/``record`` is logged once at DEBUG and
dropped. Gauges are not read from live service state at scrape time (a scrape runs on the HTTP
server's thread): a service *sets* their values from its own loop (``Gauge.set``/``replace``) and the
scrape reads a snapshot under a lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from opentelemetry import metrics as otel_metrics
from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from sja import __version__

log = logging.getLogger(__name__)

METER_NAME = "sja"

LATENCY_BUCKETS_S: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
"""Histogram boundaries for latencies from a millisecond to ten seconds (a round clears in ~50 ms)."""

LAG_BUCKETS_S: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
)  # fmt: skip
"""Histogram boundaries for an event loop's lateness: half a millisecond (a loop keeping up) to a
second (a loop blocked)."""

RATIO_BUCKETS: tuple[float, ...] = (
    0.1, 0.25, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 1.0, 1.05, 1.1, 1.25, 1.5, 2.0, 4.0,
)  # fmt: skip
"""Histogram boundaries for measured/planned ratios: fine around 1, coarse in the tails."""

DEFAULT_HOST = "0.0.0.0"

Labels = Mapping[str, str | int | float | bool]

_lock = threading.Lock()
_provider: MeterProvider | None = None
_otlp_reader: MetricReader | None = None
_instruments: dict[str, tuple[str, Any]] = {}
_endpoints: dict[int, MetricsEndpoint] = {}


# --- the provider ----------------------------------------------------------------------------------


def setup_metrics(service_name: str, *, env: Mapping[str, str] | None = None) -> MeterProvider:
    """Install the process's meter provider once and return it (later calls return the same one).

    ``service_name`` names the process's resource (``service.name``, shown in Prometheus's
    ``target_info``); with several services in one process the first one names it, and each point
    still says which service recorded it through its ``service`` label.
    """
    global _provider, _otlp_reader
    with _lock:
        if _provider is not None:
            return _provider
        env = os.environ if env is None else env
        from opentelemetry.exporter.prometheus import PrometheusMetricReader

        readers: list[MetricReader] = [PrometheusMetricReader()]
        if _otlp_wanted(env):
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            _otlp_reader = PeriodicExportingMetricReader(OTLPMetricExporter())
            readers.append(_otlp_reader)
        resource = Resource.create(
            {"service.name": service_name, "service.namespace": "sja", "process.pid": os.getpid()}
        )
        provider = MeterProvider(resource=resource, metric_readers=readers)
        otel_metrics.set_meter_provider(provider)
        _provider = provider
        log.debug("metrics: provider installed (otlp=%s)", _otlp_reader is not None)
        return provider


def _otlp_wanted(env: Mapping[str, str]) -> bool:
    exporters = {e.strip().lower() for e in env.get("OTEL_METRICS_EXPORTER", "otlp").split(",")}
    if "otlp" not in exporters:
        return False
    return bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT"))


def meter(name: str = METER_NAME) -> Meter:
    """A meter of the global provider (a proxy until ``setup_metrics`` installs the provider)."""
    return otel_metrics.get_meter(name, __version__)


def flush_metrics(timeout_ms: int = 5000) -> None:
    """Push what the OTLP reader has not sent yet (a service calls this when it stops).

    Only the push reader is flushed: a flush of the Prometheus reader would queue a snapshot that the
    next scrape then reports twice.
    """
    reader = _otlp_reader
    if reader is None:
        return
    try:
        reader.force_flush(timeout_millis=timeout_ms)
    except Exception as e:
        log.warning("metrics: OTLP flush failed: %s", e)


def shutdown_metrics() -> None:
    """At the end of a process: shut the provider down (the last OTLP export, the Prometheus reader
    unregistered) and close every endpoint. Recording afterwards does nothing; the provider is not
    replaced (OpenTelemetry allows one global provider per process). Without this call the provider
    still shuts down at interpreter exit."""
    global _otlp_reader
    with _lock:
        endpoints = list(_endpoints.values())
        _endpoints.clear()
        provider, _otlp_reader = _provider, None
    for ep in endpoints:
        ep._close()
    if provider is not None:
        with contextlib.suppress(Exception):
            provider.shutdown()


# --- the HTTP endpoint -----------------------------------------------------------------------------


@dataclass(eq=False)
class MetricsEndpoint:
    """A ``/metrics`` HTTP server shared by the services of this process that asked for its port."""

    port: int
    host: str
    _server: Any = field(repr=False)
    _thread: threading.Thread | None = field(repr=False)
    _refs: int = 1

    def release(self) -> None:
        """Drop one user; the last one closes the server (blocks up to ~0.5 s: call off the loop)."""
        with _lock:
            self._refs -= 1
            if self._refs > 0 or _endpoints.get(self.port) is not self:
                return
            del _endpoints[self.port]
        self._close()

    def _close(self) -> None:
        with contextlib.suppress(Exception):
            self._server.shutdown()
            self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        log.info("metrics endpoint on port %d closed", self.port)


def serve_metrics(port: int, host: str | None = None) -> MetricsEndpoint | None:
    """Serve Prometheus's ``/metrics`` on ``port`` (shared with other callers of the same port).

    Returns ``None`` when ``port`` is 0 (disabled) or the port cannot be bound; the latter is logged
    at WARNING and the service runs on without an endpoint (metrics must never stop a service).
    """
    if port <= 0:
        return None
    host = host or os.environ.get("OTEL_EXPORTER_PROMETHEUS_HOST") or DEFAULT_HOST
    with _lock:
        existing = _endpoints.get(port)
        if existing is not None:
            existing._refs += 1
            return existing
        from prometheus_client import start_http_server

        try:
            started = start_http_server(port, addr=host)
        except OSError as e:
            log.warning("metrics endpoint not started: cannot bind %s:%d (%s)", host, port, e)
            return None
        server, thread = started if isinstance(started, tuple) else (None, None)
        ep = MetricsEndpoint(port=port, host=host, _server=server, _thread=thread)
        _endpoints[port] = ep
    log.info("metrics: Prometheus endpoint on http://%s:%d/metrics", host, port)
    return ep


# --- instruments -----------------------------------------------------------------------------------


def _instrument(kind: str, name: str, factory: Any) -> Any:
    """One instrument per name and process; asking for a name with another kind is a bug."""
    with _lock:
        got = _instruments.get(name)
        if got is not None:
            if got[0] != kind:
                raise ValueError(f"metric {name!r} is a {got[0]}, not a {kind}")
            return got[1]
        inst = factory()
        _instruments[name] = (kind, inst)
        return inst


_warned: set[str] = set()


def _failed(name: str, e: Exception) -> None:
    if name not in _warned:
        _warned.add(name)
        log.debug("metrics: recording %s failed: %s", name, e)


class _CounterStore:
    """The running totals of one counter, per series, from every owner in the process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.totals: dict[tuple[str, frozenset[tuple[str, Any]]], list[Any]] = {}
        """(service, labels) -> [total, attributes]"""

    def observe(self, _options: CallbackOptions) -> list[Observation]:
        with self.lock:
            return [Observation(total, attrs) for total, attrs in self.totals.values()]


class Counter:
    """A monotonic counter bound to a service: ``add(value, **labels)``.

    The totals are kept here and read by the SDK when metrics are collected (an observable counter,
    cumulative, exported exactly as a synchronous counter's sum): an ``add`` on a hot path is a
    dictionary update, where the SDK's synchronous counter cost about 12 microseconds per call
    (measurement object, attribute cleaning, exemplar filter), several times per grant."""

    def __init__(self, name: str, service: str, description: str, unit: str) -> None:
        self.name = name
        self.service = service

        def make() -> tuple[Any, _CounterStore]:
            store = _CounterStore()
            inst = meter().create_observable_counter(
                name, callbacks=[store.observe], unit=unit, description=description
            )
            return inst, store

        self._inst, self._store = _instrument("counter", name, make)

    def add(self, value: float = 1, **labels: str | int | float | bool) -> None:
        try:
            if not value >= 0:
                raise ValueError(f"a counter only goes up (add {value!r})")
            key = (self.service, frozenset(labels.items()))
            with self._store.lock:
                got = self._store.totals.get(key)
                if got is None:
                    self._store.totals[key] = [value, {"service": self.service, **labels}]
                else:
                    got[0] += value
        except Exception as e:
            _failed(self.name, e)


class Histogram:
    """A histogram bound to a service, with explicit bucket boundaries: ``record(value, **labels)``."""

    def __init__(
        self, name: str, service: str, description: str, unit: str, buckets: Sequence[float] | None
    ) -> None:
        self.name = name
        self.service = service
        advisory = list(buckets) if buckets is not None else None
        self._inst = _instrument(
            "histogram",
            name,
            lambda: meter().create_histogram(
                name, unit=unit, description=description, explicit_bucket_boundaries_advisory=advisory
            ),
        )

    def record(self, value: float, **labels: str | int | float | bool) -> None:
        try:
            self._inst.record(value, {"service": self.service, **labels})
        except Exception as e:
            _failed(self.name, e)


_owners = itertools.count(1)


class _GaugeStore:
    """The current series of one observable gauge, from every owner in the process."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.series: dict[tuple[int, frozenset[tuple[str, Any]]], tuple[float, dict[str, Any]]] = {}

    def observe(self, _options: CallbackOptions) -> list[Observation]:
        with self.lock:
            return [Observation(value, attrs) for value, attrs in self.series.values()]


class Gauge:
    """A gauge bound to a service whose series the service sets (from its own loop, never from a
    scrape); ``clear()`` drops this gauge's series, as a service does when it stops."""

    def __init__(self, name: str, service: str, description: str, unit: str) -> None:
        self.name = name
        self.service = service
        self._owner = next(_owners)

        def make() -> tuple[Any, _GaugeStore]:
            store = _GaugeStore()
            inst = meter().create_observable_gauge(
                name, callbacks=[store.observe], unit=unit, description=description
            )
            return inst, store

        self._inst, self._store = _instrument("gauge", name, make)

    def _key(self, labels: Labels) -> tuple[int, frozenset[tuple[str, Any]]]:
        return (self._owner, frozenset(labels.items()))

    def set(self, value: float, **labels: str | int | float | bool) -> None:
        try:
            point = (float(value), {"service": self.service, **labels})
            with self._store.lock:
                self._store.series[self._key(labels)] = point
        except Exception as e:
            _failed(self.name, e)

    def remove(self, **labels: str | int | float | bool) -> None:
        with self._store.lock:
            self._store.series.pop(self._key(labels), None)

    def replace(self, series: Iterable[tuple[float, Labels]]) -> None:
        """Make ``series`` this gauge's whole set of series (those not in it disappear)."""
        try:
            new = {self._key(lb): (float(v), {"service": self.service, **lb}) for v, lb in series}
        except Exception as e:
            _failed(self.name, e)
            return
        with self._store.lock:
            for key in [k for k in self._store.series if k[0] == self._owner]:
                del self._store.series[key]
            self._store.series.update(new)

    def clear(self) -> None:
        self.replace(())


# --- what a service uses ---------------------------------------------------------------------------


class ServiceMetrics:
    """The instruments of one service: every point is labeled ``service=<name>``.

    Also holds the metrics every service has: rejected (undecodable) messages, NATS permission
    violations and its event loop's lag.
    """

    def __init__(self, service: str) -> None:
        self.service = service
        self._gauges: list[Gauge] = []
        self.rejected_messages = self.counter(
            "sja_rejected_messages",
            "Messages dropped because they could not be decoded as the expected type.",
            unit="{message}",
        )
        self.permission_violations = self.counter(
            "sja_permission_violations",
            "Publishes and subscriptions the NATS server refused for this service's user.",
            unit="{violation}",
        )
        self.loop_lag = self.histogram(
            "sja_event_loop_lag_seconds",
            "How late the service's event loop woke a timer: time every message waits on top of its "
            "handling (a blocked loop, a long callback, the collector, or no core free).",
            unit="s",
            buckets=LAG_BUCKETS_S,
        )

    def counter(self, name: str, description: str, unit: str = "") -> Counter:
        return Counter(name, self.service, description, unit)

    def histogram(
        self, name: str, description: str, unit: str = "", buckets: Sequence[float] | None = None
    ) -> Histogram:
        return Histogram(name, self.service, description, unit, buckets)

    def gauge(self, name: str, description: str, unit: str = "") -> Gauge:
        g = Gauge(name, self.service, description, unit)
        self._gauges.append(g)
        return g

    def rejected(self, subject: str, error: BaseException | str) -> None:
        """Count one dropped message on ``subject`` (a subscription subject, so wildcards keep the
        label's values few) with the reason taken from the error."""
        self.rejected_messages.add(1, subject=subject, reason=rejection_reason(error))

    def close(self) -> None:
        """Drop this service's gauge series (counters and histograms keep their totals)."""
        for g in self._gauges:
            g.clear()


def rejection_reason(error: BaseException | str) -> str:
    """A short, bounded reason for a rejected message: ``too_large``, ``malformed`` (not MessagePack)
    or ``invalid`` (MessagePack, but not the expected message); a string is taken as is."""
    if isinstance(error, str):
        return error
    detail = str(getattr(error, "detail", error))
    if detail.startswith("message of ") and "exceeds" in detail:
        return "too_large"
    if detail.startswith("malformed payload"):
        return "malformed"
    return "invalid"


# --- JetStream queue depths ------------------------------------------------------------------------


class ConsumerInfoSource(Protocol):
    """What ``watch_consumers`` needs of a JetStream context."""

    # nats-py's signature (its own timeout, not asyncio.timeout).
    async def consumer_info(self, stream: str, consumer: str, timeout: float | None = None) -> Any: ...  # noqa: ASYNC109


QUEUE_POLL_S = 5.0


async def watch_consumers(
    js: ConsumerInfoSource,
    consumers: Sequence[tuple[str, str]],
    metrics: ServiceMetrics,
    *,
    interval_s: float = QUEUE_POLL_S,
    timeout_s: float = 2.0,
) -> None:
    """Keep ``sja_queue_pending`` and ``sja_queue_ack_pending`` for each ``(stream, durable)`` up to
    date: one ``consumer_info`` per consumer every ``interval_s`` (a scrape reads the cached value).

    Runs until cancelled (a service loop); a consumer that cannot be read loses its series until it
    can be again, and the series go when the loop ends.
    """
    pending = metrics.gauge(
        "sja_queue_pending",
        "Messages of a JetStream consumer not yet delivered (its backlog).",
        unit="{message}",
    )
    ack_pending = metrics.gauge(
        "sja_queue_ack_pending",
        "Messages of a JetStream consumer delivered and not yet acknowledged (in progress).",
        unit="{message}",
    )
    try:
        while True:
            for stream, consumer in consumers:
                labels = {"stream": stream, "consumer": consumer}
                try:
                    info = await js.consumer_info(stream, consumer, timeout=timeout_s)
                    pending.set(info.num_pending or 0, **labels)
                    ack_pending.set(info.num_ack_pending or 0, **labels)
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    log.debug("metrics: consumer %s/%s not readable: %s", stream, consumer, e)
                    pending.remove(**labels)
                    ack_pending.remove(**labels)
            await asyncio.sleep(interval_s)
    finally:
        pending.clear()
        ack_pending.clear()
