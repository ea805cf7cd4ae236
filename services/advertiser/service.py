"""Advertiser: turns free slices into offers, at once when a slice frees and again while unclaimed,
and frees the slices whose lease ran out.

The windows due in one pass are published per pool as one ``OfferBatch`` (one message, one reply
per agent, one clearing), so a burst of freed slices costs one round trip, not one per slice. Each
offer is still a round of its own, with its own ``sja.round`` trace."""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import logging
import math
import time

from nats.aio.msg import Msg
from opentelemetry import trace

from sja.bus.codec import decode, encode
from sja.bus.service import Service
from sja.bus.settings import BaseSettings, Pools
from sja.bus.tracing import start_roots
from sja.bus.watch import View
from sja.core import defaults, leases
from sja.core.windows import OfferPacer, WindowRequest, find_windows, largest_by_pool
from sja.protocol import subjects
from sja.protocol.ids import new_id
from sja.protocol.messages import MAX_BATCH_OFFERS, DemandChanged, Offer, OfferBatch, SliceState, Window

log = logging.getLogger(__name__)
tracer = trace.get_tracer("sja.advertiser")


class AdvertiserSettings(BaseSettings, frozen=True, kw_only=True):
    pools: Pools = ()
    """Pools this replica advertises (``SJA_POOLS``, comma-separated); empty: all."""
    horizon_s: float = defaults.HORIZON_S
    """Length of an offered window when nothing bounds it (the planning horizon)."""
    reply_window_s: float = 0.05
    """How long the clearer waits for replies to one offer."""
    reoffer_min_s: float = 0.5
    reoffer_max_s: float = 2.0
    """A free slice nobody took is offered again, backing off from min to max. The minimum is
    longer than a round may stay open (reply window and grace), so that a slice is not in two
    rounds at once."""
    hold_new_s: float = 0.1
    """A newly free window waits up to this long for a job able to take it (counted demand from the
    agents) before it is offered anyway; 0: offer at once (see ``OfferPacer``)."""
    tick_s: float = 0.05
    coalesce_s: float = 0.005
    """After a slice frees, wait this long for others before advertising, so that a burst of
    frees becomes one batch (0: advertise at once)."""
    max_batch: int = 512
    """Most offers in one batch (a pool with more due windows publishes several batches)."""
    sweep_interval_s: float = 0.25
    """How often leases that ran out are looked for: such a slice is freed (compare-and-set on the
    revision the watch saw) and offered again."""


class AdvertiserService(Service):
    name = "advertiser"

    def __init__(self, settings: AdvertiserSettings) -> None:
        super().__init__(settings)
        self.cfg = settings
        self.pools = set(settings.pools)
        self.view: View[SliceState] | None = None
        self._largest: tuple[float, dict[str, int]] = (-math.inf, {})
        self.round = 0
        self.offers_published = 0
        self.pacer = OfferPacer(
            settings.reoffer_min_s,
            settings.reoffer_max_s,
            floor_s=settings.reply_window_s,
            hold_s=settings.hold_new_s,
        )
        self._wake = asyncio.Event()
        self.free: dict[str, SliceState] = {}
        """Slices (of this replica's pools) whose last known state is free: that state."""
        # The free slices in slice-id order (the order windows are offered in) and their fences,
        # kept as the watch reports changes: a pass walks them instead of sorting the free slices
        # and collecting their fences again.
        self._free_order: list[str] = []
        self._free_fence: dict[str, int] = {}
        self.leased: dict[str, float] = {}
        """Slices (of this replica's pools) under a lease: when it runs out."""
        self.held_open: dict[str, SliceState] = {}
        """Busy slices whose holder may go on past its window (``core.continuation``): offered as
        free ones from their ``contestable_at``."""
        self.lapsed = 0
        """Leases this replica found run out and freed."""
        self.m_offers = self.metrics.counter(
            "sja_offers", "Offers published (each opens one round).", unit="{offer}"
        )

    async def on_start(self) -> None:
        assert self.js is not None
        self.view = await self.watch(subjects.BUCKET_SLICES, SliceState, self._changed)
        await self.subscribe(subjects.DEMAND_CHANGED, self._demand_changed)
        self.loop(self._advertise_forever())
        self.loop(self._sweep_forever())

    async def on_stop(self) -> None:
        if self.view is not None:
            await self.view.stop()

    async def _demand_changed(self, msg: Msg) -> None:
        """Jobs can take more work: as many waiting windows as they can take are offered again at
        once (see ``OfferPacer``)."""
        demand = decode(msg.data, DemandChanged)
        self.pacer.demand_changed(demand.ready)
        self._wake.set()

    async def _changed(self, key: str, value: SliceState | None, revision: int) -> None:
        mine = value is not None and self._mine(value)
        if mine and value is not None and value.status == "free":
            if key not in self.free:
                bisect.insort(self._free_order, key)
            self.free[key] = value
            self._free_fence[key] = value.fence
            self._wake.set()
        elif self.free.pop(key, None) is not None:
            del self._free_order[bisect.bisect_left(self._free_order, key)]
            del self._free_fence[key]
        if mine and value is not None and value.status in leases.LEASED:
            self.leased[key] = value.lease_until
        else:
            self.leased.pop(key, None)
        if mine and value is not None and value.status == "busy" and value.contestable_at > 0:
            self.held_open[key] = value
        else:
            self.held_open.pop(key, None)

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
                if self.cfg.coalesce_s > 0:
                    await asyncio.sleep(self.cfg.coalesce_s)

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.sweep_interval_s)
            try:
                await self.sweep(time.time())
            except Exception:
                log.exception("lease sweep failed")

    async def sweep(self, now: float) -> int:
        """Free every slice (of this replica's pools) whose lease ran out; returns how many.

        The watch already holds every slice's state for advertising, so the lapsed leases are found
        here rather than by a second watcher of the bucket. Each is freed by compare-and-set on the
        revision the watch saw: a slice its holder started, extended or freed meanwhile is left as it
        now is (a grant is never freed under a newer lease), and replicas sweeping the same slices
        free it once."""
        assert self.view is not None and self.slices is not None
        freed = 0
        for key in [k for k, until in self.leased.items() if until < now]:
            got = self.view.entries.get(key)
            if got is None:
                self.leased.pop(key, None)
                continue
            current, rev = got
            new = leases.expire(current, now)
            if new is not None and await self.slices.cas(key, new, rev) is not None:
                log.warning(
                    "lease of %s (grant %s, %s) expired: slice freed", key, current.grant_id, current.status
                )
                freed += 1
        self.lapsed += freed
        return freed

    def _largest_by_pool(self, now: float) -> dict[str, int]:
        """Each pool's largest slice (what windows carry as ``largest_mib``), read again once a
        second: slices change memory only when a GPU is re-cut."""
        assert self.view is not None
        at, largest = self._largest
        if now - at >= 1.0 or not largest:
            largest = largest_by_pool(st for st, _ in self.view.entries.values())
            self._largest = (now, largest)
        return largest

    async def advertise_due(self, now: float) -> int:
        """Offer every free window that is new (slice just freed: its fence changed) or due again,
        one batch per pool."""
        assert self.view is not None
        # Only free slices give windows now (kept by the watch: a pass costs the free slices, not
        # all of them), and the held ones whose holder is past its window (core.continuation).
        slices = self.free
        order_keys: list[str] = self._free_order
        fences: dict[str, int] = self._free_fence
        contested = [
            s for s in self.held_open.values() if leases.preempts(s, now) and s.slice_id not in slices
        ]
        if contested:
            slices = {**slices, **{s.slice_id: s for s in contested}}
            order_keys = sorted(slices)
            fences = {**fences, **{s.slice_id: s.fence for s in contested}}
        # The pacer picks the slices due (in the order of their windows: all start now, so by
        # slice id); windows are built for those only, not for every free slice on every pass.
        due_slices = self.pacer.due([slices[k] for k in order_keys], fences, now)
        order = {s.slice_id: i for i, s in enumerate(due_slices)}
        largest = self._largest_by_pool(now)
        due = find_windows(
            due_slices,
            WindowRequest(now=now, horizon_s=self.cfg.horizon_s, open_ended=True, largest_mib=largest),
        )
        due.sort(key=lambda w: order[w.slice_id])
        by_pool: dict[str, list[Window]] = {}
        for w in due:
            by_pool.setdefault(w.pool, []).append(w)
        size = max(1, min(self.cfg.max_batch, MAX_BATCH_OFFERS))
        for pool, ws in sorted(by_pool.items()):
            for i in range(0, len(ws), size):
                await self._offer_batch(pool, ws[i : i + size], slices, now)
        # The round's clock runs from here: the pass's batches go out at once, in one write (a
        # write per batch cost a system call each, here and in the server, for a few pools a pass).
        self.bus.flush_now()
        return len(due)

    async def _offer_batch(
        self, pool: str, windows: list[Window], slices: dict[str, SliceState], now: float
    ) -> None:
        assert self.view is not None
        batch_id = new_id("b")
        reply_by = now + self.cfg.reply_window_s
        reply_to = subjects.offer_replied(pool)
        offers = []
        for w in windows:
            self.round += 1
            s = slices[w.slice_id]
            offers.append(
                Offer(
                    offer_id=new_id("o"),
                    round=self.round,
                    window=w,
                    slice_fence=s.fence,
                    slice_revision=self.view.entries[w.slice_id][1],
                    issued_at=now,
                    reply_by=reply_by,
                    reply_to=reply_to,
                    slice_state=s,
                )
            )
        # One trace per round: each offer gets a root span of its own (the sampler decides each),
        # and the batch carries the trace context of every sampled one.
        spans, carriers, headers = start_roots(tracer, "sja.round", len(offers), trace.SpanKind.PRODUCER)
        subject = subjects.offer_opened(pool)
        for o, span in zip(offers, spans, strict=True):
            if span.is_recording():
                span.set_attributes(
                    {
                        "sja.offer_id": o.offer_id,
                        "sja.round": o.round,
                        "sja.slice": o.window.slice_id,
                        "sja.pool": pool,
                        "sja.batch_id": batch_id,
                        "sja.offers": len(offers),
                        "messaging.system": "nats",
                        "messaging.destination.name": subject,
                    }
                )
        batch = OfferBatch(
            batch_id=batch_id,
            offers=offers,
            issued_at=now,
            reply_by=reply_by,
            reply_to=reply_to,
            # A lone offer's context is the message's; so is every unsampled one's.
            trace_contexts=carriers if len(offers) > 1 and any(carriers) else [],
        )
        try:
            await self.bus.publish(subject, encode(batch), headers=headers)
        finally:
            for span in spans:
                span.end()
        self.offers_published += len(offers)
        self.m_offers.add(len(offers), pool=pool)
