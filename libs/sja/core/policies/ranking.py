"""Ranking bids: the numbers several policies rank by (a candidate's efficiency in a window, a
job's best candidate, ``efficiency``'s order), and ``rank``, which picks the bid with the smallest
key and explains every other bid against it.

Pure and deterministic: every tie is broken by submission time, then the job id.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sja.core.policies.base import Bid, Decision, Keyed, PolicyConfig
from sja.protocol.messages import Candidate, Offer, Proposal, Verdict


def window_len(offer: Offer, horizon_s: float) -> float:
    w = offer.window
    return (w.end_s - w.start_s) if w.end_s is not None else horizon_s


def efficiency_value(offer: Offer, cand: Candidate, horizon_s: float) -> float:
    """Useful work per slice-second with a best-fit term: how much of the window's time and memory
    the subjob is expected to use, weighted by its odds of fitting. An open-ended window (a free
    slice nothing reserves) is held only as long as the subjob runs, then offered again: no part of
    it is left idle, so every subjob fills its time (a short one, such as the last units of a job,
    is not ranked below a long one for being short)."""
    length = window_len(offer, horizon_s)
    if offer.window.end_s is None:
        fill_time = 1.0
    else:
        fill_time = min(cand.duration_mean_s / length, 1.0) if length > 0 else 0.0
    fill_mem = min(cand.mem_q_mib / offer.window.mem_mib, 1.0)
    return (0.7 * fill_time + 0.3 * fill_mem) * cand.p_fit_mem * cand.p_fit_time


def best_candidate(offer: Offer, p: Proposal, horizon_s: float) -> Candidate:
    """The job's most efficient candidate for ``offer`` (then the largest, then the least memory)."""
    return max(p.candidates, key=lambda c: (efficiency_value(offer, c, horizon_s), c.size, -c.mem_q_mib))


SUBMISSION_TIME = "submission time"


def ranked_verdicts(
    keyed: Sequence[tuple[Keyed, Bid]],
    winner: Bid | None,
    win_why: str,
    score_of: Callable[[Keyed], float],
    tie_break: str = SUBMISSION_TIME,
) -> tuple[Verdict, ...]:
    """A verdict for every keyed bid: the winner's, and every other's reason against it."""
    out = []
    for k, b in keyed:
        (_, cand, why) = k
        p = b.proposal
        won = b is winner
        if won:
            reason = f"won: {win_why}"
        elif winner is None:
            reason = f"no winner: {why}"
        elif why == win_why:
            # Equal on what the policy explains (two jobs of one tenant under ``fair``): the rest of
            # the key decided, never a comparison of a thing with itself.
            reason = f"lost to {winner.proposal.job_id}: equal on {why}; ranked after it on {tie_break}"
        else:
            reason = f"lost to {winner.proposal.job_id}: {why} vs {win_why}"
        out.append(
            Verdict(
                job_id=p.job_id,
                tenant=p.tenant,
                agent_id=b.agent_id,
                won=won,
                reason=reason,
                score=round(score_of(k), 6),
                size=cand.size,
            )
        )
    return tuple(out)


def rank(
    name: str,
    bids: Sequence[Bid],
    key_of: Callable[[Bid], Keyed],
    score_of: Callable[[Keyed], float],
    tie_break: str = SUBMISSION_TIME,
) -> Decision:
    """The bid with the smallest key wins; every bid is explained against it."""
    if not bids:
        return Decision(name, None, None, ())
    keyed = [(key_of(b), b) for b in bids]
    (_k, best_cand, best_why), winner = min(keyed, key=lambda kb: kb[0][0])
    return Decision(name, winner, best_cand, ranked_verdicts(keyed, winner, best_why, score_of, tie_break))


def efficiency_order(offer: Offer, p: Proposal, cfg: PolicyConfig) -> tuple[object, ...]:
    """Most efficient best candidate first, then the oldest job (``efficiency``, and ``token``
    within a tenant)."""
    cand = best_candidate(offer, p, cfg.horizon_s)
    return (-efficiency_value(offer, cand, cfg.horizon_s), p.submitted_at, p.job_id)
