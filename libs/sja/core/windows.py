"""Gap finding: which windows to offer, from slice states and the expected ends of running subjobs.

Deterministic: windows are returned sorted by (start, slice id).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol, TypeVar

import msgspec

from sja.core.continuation import held_attained as held_attained_now
from sja.core.continuation import is_contestable
from sja.protocol.messages import Offer, SliceState, Window


def leases_preempt(s: SliceState, now: float) -> bool:
    """``leases.preempts`` (kept here so that gap finding needs no lease module)."""
    return s.status == "busy" and is_contestable(s.contestable_at, now)


class HasSlice(Protocol):
    @property
    def slice_id(self) -> str: ...


W = TypeVar("W", bound=HasSlice)


@dataclass(frozen=True)
class WindowRequest:
    now: float
    horizon_s: float
    """Length of a window with no known end (open-ended windows are bounded by it)."""
    include_future: bool = False
    """Also return windows that open when a running subjob is expected to end."""
    reservations: Mapping[str, float] | None = None
    """slice_id -> time a reservation starts: windows end there."""
    largest_mib: Mapping[str, int] | None = None
    """pool -> memory of its largest slice (``Window.largest_mib``); by default the largest among the
    slices given to ``find_windows``."""
    open_ended: bool = False
    """A free slice that no reservation bounds gives an open-ended window (``end_s`` ``None``):
    the planner bounds it by the horizon from the moment it plans, so a window does not shrink
    while its offer, the clearing and the grant are on their way."""


def window_of(
    s: SliceState,
    start: float,
    end: float | None,
    largest_mib: int = 0,
    held_by: str = "",
    held_attained_gpu_s: float = 0.0,
    held_tenant: str = "",
    held_submitted_at: float = 0.0,
    held_due_at: float = 0.0,
) -> Window:
    return Window(
        slice_id=s.slice_id,
        node=s.node,
        pool=s.pool,
        gpu_model=s.gpu_model,
        profile=s.profile,
        mem_mib=s.mem_mib,
        compute_share=s.compute_share,
        start_s=start,
        end_s=end,
        largest_mib=largest_mib,
        held_by=held_by,
        held_attained_gpu_s=round(held_attained_gpu_s, 3),
        held_tenant=held_tenant,
        held_submitted_at=held_submitted_at,
        held_due_at=held_due_at,
    )


def unheld(offer: Offer) -> Offer:
    """``offer`` as if its slice were free: what a job's answer for the window's shape depends on
    (who holds the slice decides only who may bid, ``bidding.may_bid_on``)."""
    if not offer.window.held_by:
        return offer
    return msgspec.structs.replace(offer, window=msgspec.structs.replace(offer.window, held_by=""))


def reachable_mib(s: SliceState) -> int:
    """The most memory a slice's GPU can give one instance: the slice's own, or what a re-cut of
    its GPU would make (``SliceState.recut_mib``)."""
    return max(s.mem_mib, s.recut_mib)


def largest_by_pool(slices: Iterable[SliceState]) -> dict[str, int]:
    """pool -> memory of its largest slice that is not offline (or of the largest instance a re-cut
    of its GPU would make)."""
    out: dict[str, int] = {}
    for s in slices:
        mib = reachable_mib(s)
        if s.status != "offline" and mib > out.get(s.pool, 0):
            out[s.pool] = mib
    return out


def find_windows(slices: Iterable[SliceState], req: WindowRequest) -> list[Window]:
    """Free slices (and held ones whose holder continues past its window) give windows starting
    now; busy ones (optionally) give future windows.

    A window ends at the slice's next reservation, else ``horizon_s`` after it starts (or, with
    ``open_ended``, a free slice's window has no end).
    A leased slice (granted, not yet started) and an offline slice give no window.
    """
    out: list[Window] = []
    reservations = req.reservations or {}
    slices = list(slices)
    largest = dict(req.largest_mib) if req.largest_mib is not None else largest_by_pool(slices)
    for s in slices:
        held_by, held_attained = "", 0.0
        if s.status == "free" or leases_preempt(s, req.now):
            # A held slice whose holder continues past its window is offered as a free one: a
            # winner's grant makes the holder yield (``core.continuation``).
            start = req.now
            if s.status == "busy":
                held_by = s.holder_job
                held_attained = held_attained_now(
                    s.holder_attained_gpu_s, s.contestable_at, s.compute_share, req.now
                )
        elif s.status == "busy" and req.include_future and s.expected_end > 0:
            start = max(s.expected_end, req.now)
        else:
            continue
        end: float | None = start + req.horizon_s
        reserved_at = reservations.get(s.slice_id)
        if reserved_at is not None:
            if reserved_at <= start:
                continue
            end = min(start + req.horizon_s, reserved_at)
        elif req.open_ended and (s.status == "free" or leases_preempt(s, req.now)):
            end = None
        tenant, submitted, due = (
            (s.holder_tenant, s.holder_submitted_at, s.holder_due_at) if held_by else ("", 0.0, 0.0)
        )
        out.append(
            window_of(s, start, end, largest.get(s.pool, 0), held_by, held_attained, tenant, submitted, due)
        )
    out.sort(key=lambda w: (w.start_s, w.slice_id))
    return out


class OfferPacer:
    """When to offer a free window: at once when the slice is newly free (its fence changed), then
    again while nobody takes it, backing off from ``min_s`` to ``max_s``.

    New demand shortens the wait. Counted demand (``demand_changed(n)``: ``n`` jobs became able to
    take a window) offers that many waiting windows again at once besides the new ones, those that
    have waited longest first, but none sooner than ``floor_s`` after its last offer (that offer's
    round may still be open). Uncounted demand (``demand_changed()``) cuts every pending backoff
    back to ``min_s`` from the window's last offer.

    With ``hold_s > 0`` a newly free window waits for a job that can take it: it is offered when
    counted demand not yet met by an offer is there (a *credit*), or after ``hold_s`` at the latest.
    A slice usually frees when a subjob ends, a moment before the job that ran it is able to bid
    again; offered at once, it mostly finds no bid, and the job's demand then re-offers another
    window: two offers (two rounds, two replies from every agent) per grant. Held, the freed window
    and the job's demand meet in one offer. Each offer, new or again, uses one credit; credit left
    over (more jobs ready than windows) stays for windows freed later, until ``max_s`` after the
    last demand. Uncounted demand offers every held window at once."""

    def __init__(self, min_s: float, max_s: float, floor_s: float | None = None, hold_s: float = 0.0) -> None:
        self.min_s = min_s
        self.max_s = max_s
        self.floor_s = min_s if floor_s is None else min(floor_s, min_s)
        self.hold_s = hold_s
        self._last: dict[str, tuple[int, float, float, float]] = {}
        """slice_id -> (fence offered at, earliest next offer, current backoff, when last offered)"""
        self._held: dict[str, tuple[int, float]] = {}
        """slice_id -> (fence, since when) of new windows waiting for demand (``hold_s``)"""
        self._demand = False
        self._ready = 0
        self._ready_at: float | None = None
        """When counted demand last came (stamped by the next ``due``)."""

    def demand_changed(self, ready: int = 0) -> None:
        if ready > 0:
            self._ready = min(self._ready + ready, 1_000_000)
            self._ready_at = None
        else:
            self._demand = True

    def due(self, windows: Iterable[W], fences: Mapping[str, int], now: float) -> list[W]:
        """The windows to offer now (recording that they were offered). Only their ``slice_id``
        is read: a caller may ask with the free slices themselves, in window order, and build
        windows for the few that are due."""
        uncounted = self._demand
        if self._demand:
            self._demand = False
            self._last = {
                k: (fence, min(next_at, at + self.min_s), self.min_s, at)
                for k, (fence, next_at, _backoff, at) in self._last.items()
            }
        holding = self.hold_s > 0
        if self._ready_at is None:
            self._ready_at = now
        if holding and self._ready and now - self._ready_at > self.max_s:
            self._ready = 0  # demand that long unmet is stale (its jobs got windows elsewhere)
        out: list[W] = []
        waiting: list[tuple[float, W]] = []
        held: dict[str, tuple[int, float]] = {}
        for w in windows:
            fence = fences[w.slice_id]
            last = self._last.get(w.slice_id)
            same = last is not None and last[0] == fence
            if same and last is not None and now < last[1]:
                if self._ready and now >= last[3] + self.floor_s:
                    waiting.append((last[3], w))
                continue
            if holding and not same and not uncounted:
                if self._ready > 0:
                    self._ready -= 1
                else:
                    since = self._held.get(w.slice_id)
                    since_at = since[1] if since is not None and since[0] == fence else now
                    if now < since_at + self.hold_s:
                        held[w.slice_id] = (fence, since_at)
                        continue
            backoff = min(last[2] * 2, self.max_s) if same and last is not None else self.min_s
            self._last[w.slice_id] = (fence, now + backoff, backoff, now)
            out.append(w)
        self._held = held
        if self._ready:
            # Without holding: a job that became ready is usually one whose subjob just ended; its
            # slice, freed a moment before the job could bid, was offered at once and has likely
            # gone to another job or unclaimed. So counted demand goes to windows already waiting,
            # over and above the new ones.
            waiting.sort(key=lambda aw: (aw[0], aw[1].slice_id))
            taken = waiting[: self._ready]
            self._ready = self._ready - len(taken) if holding else 0
            for _at, w in taken:
                fence, _next, backoff, _at0 = self._last[w.slice_id]
                self._last[w.slice_id] = (fence, now + backoff, backoff, now)
                out.append(w)
        return out


def probe_offer(window: Window, now: float, *, offer_id: str, reply_to: str, round_no: int = 0) -> Offer:
    """An offer of ``window`` that is no round: what a job is asked, to learn whether (and with
    what) it would bid for a window of that shape (the simulator's probes, the re-cut decisions'
    demand)."""
    return Offer(
        offer_id=offer_id,
        round=round_no,
        window=window,
        slice_fence=0,
        slice_revision=0,
        issued_at=now,
        reply_by=now,
        reply_to=reply_to,
    )
