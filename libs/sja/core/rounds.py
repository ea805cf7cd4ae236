"""Rounds: which offers open one, when it may close (at its deadline, or as soon as every live agent
answered), and its records: the verdicts of a batch's offers written once per group of like offers
(``RoundBatch.shared``) and read back whole."""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping, Sequence

import msgspec

from sja.protocol.messages import Offer, RoundBatch, RoundRecord, Verdict


def fresh_offers(offers: Iterable[Offer], open_slices: Container[str]) -> list[Offer]:
    """The offers that may open a round: none for a slice already in an open round (it waits for
    that round: two rounds for one slice clear it twice for at most one grant), and one per slice
    (the first) in ``offers``."""
    seen: set[str] = set()
    out: list[Offer] = []
    for o in offers:
        slice_id = o.window.slice_id
        if slice_id in open_slices or slice_id in seen:
            continue
        seen.add(slice_id)
        out.append(o)
    return out


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


Shared = tuple[tuple[Verdict, ...], int]
"""An offer's shared verdicts and the entry its own verdicts replace (``Decision.shared``, ``.skip``)."""


def whole(verdicts: Sequence[Verdict], shared: Sequence[Verdict], skip: int) -> list[Verdict]:
    """An offer's own verdicts and its shared ones but the ``skip``-th: every verdict of the offer."""
    if skip < 0:
        return [*verdicts, *shared]
    return [*verdicts, *shared[:skip], *shared[skip + 1 :]]


def whole_record(record: RoundRecord, shared: Shared) -> RoundRecord:
    """The record with every verdict of its offer in ``verdicts`` (a lone offer's record)."""
    if not shared[0]:
        return record
    return msgspec.structs.replace(record, verdicts=whole(record.verdicts, *shared))


RECORD_ITEMS = 2
"""What a record weighs against a shared verdict when a batch's records are cut into messages (a
record, with its window and its winner's verdict, is about twice a verdict's size)."""


def pack_records(
    batch_id: str, records: Sequence[RoundRecord], shared: Sequence[Shared], max_items: int
) -> list[tuple[int, RoundBatch]]:
    """The records of a batch in messages of at most ``max_items`` (a record weighs
    ``RECORD_ITEMS``, a shared verdict 1; a message has at least one record), each message
    carrying once the shared verdicts its records refer to (``shared[i]`` is ``records[i]``'s).
    Returns each message with the index of its first record."""
    out: list[tuple[int, RoundBatch]] = []
    lists: list[list[Verdict]] = []
    index: dict[int, int] = {}
    part: list[RoundRecord] = []
    first = items = 0
    for n, (rec, (verdicts, skip)) in enumerate(zip(records, shared, strict=True)):
        cost = RECORD_ITEMS + (len(verdicts) if verdicts and id(verdicts) not in index else 0)
        if part and items + cost > max_items:
            out.append((first, RoundBatch(batch_id=batch_id, records=part, shared=lists)))
            lists, index, part, first, items = [], {}, [], n, 0
            cost = RECORD_ITEMS + len(verdicts)
        items += cost
        if not verdicts:
            part.append(rec)
            continue
        i = index.get(id(verdicts))
        if i is None:
            i = index[id(verdicts)] = len(lists)
            lists.append(list(verdicts))
        part.append(msgspec.structs.replace(rec, shared=i, shared_skip=skip))
    if part:
        out.append((first, RoundBatch(batch_id=batch_id, records=part, shared=lists)))
    return out


def unpack_records(batch: RoundBatch) -> list[RoundRecord]:
    """The records of a ``RoundBatch``, each with every verdict of its offer in ``verdicts``. A
    record that names no (or no such) shared list is taken as it is."""
    lists = batch.shared
    out: list[RoundRecord] = []
    for rec in batch.records:
        if 0 <= rec.shared < len(lists):
            verdicts = whole(rec.verdicts, lists[rec.shared], rec.shared_skip)
            rec = msgspec.structs.replace(rec, verdicts=verdicts, shared=-1, shared_skip=-1)
        out.append(rec)
    return out


def outcome_verdicts(own: Iterable[Sequence[Verdict]], shared: Iterable[Shared]) -> dict[str, list[Verdict]]:
    """Agent -> the verdicts to send it for a batch: its own verdicts on every offer (a win, or
    why a win was not granted), and every other shared verdict of its bids once per group, not once
    per offer: the reason stands for every offer of the group. (A winner's shared entry only says
    which offers it took: its wins say that.)"""
    by_agent: dict[str, list[Verdict]] = {}
    for verdicts in own:
        for v in verdicts:
            by_agent.setdefault(v.agent_id, []).append(v)
    groups: dict[int, tuple[tuple[Verdict, ...], set[int]]] = {}
    for verdicts, skip in shared:
        groups.setdefault(id(verdicts), (verdicts, set()))[1].add(skip)
    for verdicts, skips in groups.values():
        for i, v in enumerate(verdicts):
            if i not in skips:
                by_agent.setdefault(v.agent_id, []).append(v)
    return by_agent
