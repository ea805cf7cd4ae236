"""The rules every round applies before a policy ranks its bids: a canonical order with one bid per
job (a second bid for a job is ``invalid``), jobs at capacity left out (``excluded``), and a verdict
for every agent that replied with no bid (``no bid``).

Pure and deterministic: which bids survive depends on the bids' contents and the ledger, never on
the order they arrived in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from sja.core.policies.base import Bid, VerdictKind, losing_verdict
from sja.core.policies.ledger import Ledger
from sja.protocol.messages import Verdict

_encode = msgspec.msgpack.Encoder().encode


def canonical(bids: Sequence[Bid]) -> list[Bid]:
    """Bids in a canonical order, one per job. Which duplicate survives depends only on the bids'
    contents (never on arrival order)."""
    return canonical_split(bids)[0]


def canonical_split(bids: Sequence[Bid]) -> tuple[list[Bid], list[Verdict]]:
    """``canonical``, and an ``invalid`` verdict for every bid it leaves out (a second bid for a job
    already bid for, by another agent or the same one)."""
    kept: dict[str, Bid] = {}
    out: list[Bid] = []
    invalid: list[Verdict] = []
    for b in sorted(
        bids,
        key=lambda b: (b.proposal.submitted_at, b.proposal.job_id, b.agent_id, _encode(b.proposal)),
    ):
        p = b.proposal
        first = kept.get(p.job_id)
        if first is None:
            kept[p.job_id] = b
            out.append(b)
            continue
        reason = (
            f"{VerdictKind.INVALID}: a second bid for job {p.job_id} (the bid from {first.agent_id} stands)"
        )
        invalid.append(losing_verdict(b, reason))
    return out, invalid


NO_BID = f"{VerdictKind.NO_BID}: the reply proposed no job for this window"


def no_bid_verdicts(replied: Iterable[str], bids: Sequence[Bid]) -> list[Verdict]:
    """A verdict (with an empty ``job_id``) for each agent in ``replied`` without a bid in ``bids``:
    it answered, with nothing for this window."""
    bidders = {b.agent_id for b in bids}
    return [
        Verdict(job_id="", tenant="", agent_id=a, won=False, reason=NO_BID)
        for a in sorted(set(replied) - bidders)
    ]


def _count(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def capacity_reason(pending: int, capacity: int) -> str:
    """Why a job at capacity is left out of a round: the grants it holds and has not started yet
    already take every subjob it may start now."""
    return (
        f"{VerdictKind.EXCLUDED}: it holds {_count(pending, 'grant')} not yet started and may start only "
        f"{_count(capacity, 'subjob')} more now (its max_parallel less the subjobs it runs)"
    )


def excluded_verdict(b: Bid, pending: int) -> Verdict:
    """The verdict of a bid left out because its job holds ``pending`` grants it has not started."""
    return losing_verdict(b, capacity_reason(pending, b.proposal.capacity))


def split_by_capacity(bids: Sequence[Bid], ledger: Ledger, now: float) -> tuple[list[Bid], list[Verdict]]:
    """Bids whose job can still start a subjob, and a verdict for each that cannot."""
    eligible: list[Bid] = []
    out: list[Verdict] = []
    for b in bids:
        p = b.proposal
        pending = ledger.unseen_grants(p.job_id, p.grants_seen, now)
        if pending >= p.capacity:
            out.append(excluded_verdict(b, pending))
        else:
            eligible.append(b)
    return eligible, sorted(out, key=lambda v: v.job_id)
