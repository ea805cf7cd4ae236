"""When a negotiation round may close: at its deadline, or as soon as every live agent answered."""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def live_agents(last_seen: Mapping[str, float], now: float, liveness_s: float) -> set[str]:
    """Agents whose last heartbeat is at most ``liveness_s`` old."""
    return {agent for agent, seen in last_seen.items() if now - seen <= liveness_s}


def all_replied(replied: Iterable[str], live: set[str]) -> bool:
    """Every live agent answered (an agent answers every offer, with or without proposals). With no
    live agent known, a round waits for its deadline."""
    return bool(live) and live.issubset(set(replied))


def close_by(
    reply_by: float,
    grace_s: float,
    live: set[str],
    *,
    issued_at: float | None = None,
    received_at: float | None = None,
) -> float:
    """When a round closes if not every live agent has answered: at its reply deadline, or up to
    ``grace_s`` later while some live agent is still to answer (a loaded agent or clearer answers a
    few milliseconds late; closing without its bids would waste every window of the batch). With no
    live agent known there is nobody to wait for.

    A clearer that took the offer late (``received_at`` past ``issued_at``: it was busy) still gives
    the agents the offer's whole reply window from then: their replies, sent on time, are likely
    waiting in its queue behind the offer, and closing at once would drop them."""
    deadline = reply_by
    if issued_at is not None and received_at is not None:
        deadline = max(deadline, received_at + (reply_by - issued_at))
    return deadline + (grace_s if live else 0.0)
