"""Advertiser: turns free slices into offers, at once when a slice frees and again while unclaimed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid

from opentelemetry import trace

from sja.bus.service import Service
from sja.bus.settings import BaseSettings
from sja.bus.tracing import publish
from sja.bus.watch import KvView
from sja.core.windows import OfferPacer, WindowRequest, find_windows
from sja.protocol import subjects
from sja.protocol.messages import Offer, SliceState

log = logging.getLogger(__name__)
tracer = trace.get_tracer("sja.advertiser")


class AdvertiserSettings(BaseSettings, frozen=True, kw_only=True):
    pools: str = ""
    """Comma-separated pools this replica advertises; empty: all."""
    horizon_s: float = 8.0
    """Length of an offered window when nothing bounds it (the planning horizon)."""
    reply_window_s: float = 0.05
    """How long the clearer waits for replies to one offer."""
    reoffer_min_s: float = 0.2
    reoffer_max_s: float = 2.0
    """A free slice nobody took is offered again, backing off from min to max."""
    tick_s: float = 0.05


class AdvertiserService(Service):
    name = "advertiser"

    def __init__(self, settings: AdvertiserSettings) -> None:
        super().__init__(settings)
        self.cfg = settings
        self.pools = {p for p in settings.pools.split(",") if p}
        self.view: KvView[SliceState] | None = None
        self.round = 0
        self.offers_published = 0
        self.pacer = OfferPacer(settings.reoffer_min_s, settings.reoffer_max_s)
        self._wake = asyncio.Event()
        self.m_offers = self.metrics.counter(
            "sja_offers", "Offers published (each opens one round).", unit="{offer}"
        )

    async def on_start(self) -> None:
        assert self.js is not None
        kv = await self.js.key_value(subjects.BUCKET_SLICES)
        self.view = KvView(kv, SliceState, on_change=self._changed)
        await self.view.start()
        await self.subscribe(subjects.DEMAND_CHANGED, self._demand_changed)
        self.loop(self._advertise_forever())

    async def on_stop(self) -> None:
        if self.view is not None:
            await self.view.stop()

    async def _demand_changed(self, msg: object) -> None:
        """New work arrived: unclaimed windows are offered again without waiting for their backoff
        (at most once per ``reoffer_min_s``, so a burst of submissions is one burst of offers)."""
        self.pacer.demand_changed()
        self._wake.set()

    async def _changed(self, key: str, value: SliceState | None, revision: int) -> None:
        if value is not None and value.status == "free":
            self._wake.set()

    def _mine(self, s: SliceState) -> bool:
        return not self.pools or s.pool in self.pools

    async def _advertise_forever(self) -> None:
        while True:
            try:
                await self.advertise_due(time.time())
            except Exception:
                log.exception("advertising failed")
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=self.cfg.tick_s)

    async def advertise_due(self, now: float) -> int:
        """Offer every free window that is new (slice just freed: its fence changed) or due again."""
        assert self.view is not None
        slices = {s.slice_id: s for s in self.view.values() if self._mine(s)}
        windows = find_windows(slices.values(), WindowRequest(now=now, horizon_s=self.cfg.horizon_s))
        due = self.pacer.due(windows, {k: s.fence for k, s in slices.items()}, now)
        for w in due:
            await self._offer(slices[w.slice_id], self.view.entries[w.slice_id][1], w, now)
        return len(due)

    async def _offer(self, s: SliceState, revision: int, window: object, now: float) -> None:
        self.round += 1
        offer_id = f"o-{uuid.uuid4().hex[:20]}"
        with tracer.start_as_current_span(
            "sja.round",
            kind=trace.SpanKind.PRODUCER,
            attributes={
                "sja.offer_id": offer_id,
                "sja.round": self.round,
                "sja.slice": s.slice_id,
                "sja.pool": s.pool,
                "sja.profile": s.profile,
                "sja.mem_mib": s.mem_mib,
                "messaging.system": "nats",
                "messaging.destination.name": subjects.offer_opened(s.pool),
            },
        ):
            offer = Offer(
                offer_id=offer_id,
                round=self.round,
                window=window,  # type: ignore[arg-type]
                slice_fence=s.fence,
                slice_revision=revision,
                issued_at=now,
                reply_by=now + self.cfg.reply_window_s,
                reply_to=subjects.offer_replied(s.pool),
            )
            await publish(self.bus, subjects.offer_opened(s.pool), offer)
        self.offers_published += 1
        self.m_offers.add(1, pool=s.pool)
