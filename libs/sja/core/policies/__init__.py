"""Clearing policies: ``(offer, bids, ledger) -> decision`` with a reason for every bid.

One module per policy, each a ``ClearingPolicy`` (``base``) with its ranking, its batch clearing
and its explanation, registered once, below (``registry.register``); ``clear`` and ``clear_batch``
(``clearing``) and the agents' shortlists (``shortlist``) find a policy by its name there.

- ``efficiency`` — most useful work per slice-second, best fit (time and memory fill of the window,
  weighted by the odds of fitting).
- ``fair`` — least attained service normalized by the tenant's share; within a tenant, least
  attained job, each forgiven ``continuation.AGEING`` GPU-seconds per second since its submission.
- ``sla`` — least slack to deadline (deadline minus now minus expected remaining work); jobs without
  a deadline come after, by submission time.
- ``auction`` — sealed-bid second price with per-tenant budgets: the highest affordable bid wins and
  pays the second-highest bid (or the reserve); budgets never go negative.
- ``token`` — fair-share tokens in the style of GPU time-sharing quota schedulers: the tenant furthest
  below its target share holds the token and wins; a tenant above its target by more than the
  overuse tolerance has its token revoked (it can win only when no tenant within its share bids).
- ``jasda`` — a weighted score of utilization (efficiency), fairness (share deficit) and
  responsiveness (waiting time, deadline urgency), with configurable weights.

Pure and deterministic. What every policy shares: the words of a round and the ``ClearingPolicy``
protocol (``base``), the ledger (``ledger``), the rules applied before a policy ranks (``rules``:
canonical order, capacity, agents without a bid), ranking and its explanation (``ranking``), the
defaults a policy inherits (``defaults``), and the batch engine behind ``clear_batch`` (``batch``).
"""

from __future__ import annotations

from sja.core.policies.auction import Auction
from sja.core.policies.base import (
    Bid,
    BidOrder,
    ClearingPolicy,
    Decision,
    Keyed,
    PolicyConfig,
    PolicyFn,
    VerdictKind,
    losing_verdict,
    verdict_kind,
)
from sja.core.policies.batch import Group, clear_full
from sja.core.policies.clearing import clear, clear_batch
from sja.core.policies.defaults import MonotonePolicy, Policy
from sja.core.policies.efficiency import Efficiency
from sja.core.policies.fair import Fair
from sja.core.policies.jasda import Jasda
from sja.core.policies.ledger import Ledger, grant_cost, window_cost
from sja.core.policies.ranking import best_candidate, efficiency_value, rank
from sja.core.policies.registry import BID_ORDERS, POLICIES, REGISTRY, get, policy, register, unregister
from sja.core.policies.rules import (
    NO_BID,
    canonical,
    canonical_split,
    capacity_reason,
    no_bid_verdicts,
    split_by_capacity,
)
from sja.core.policies.shortlist import bid_for, likely_per_tenant, likely_winners, shortlist, shortlist_size
from sja.core.policies.sla import Sla
from sja.core.policies.token import Token

for _policy in (Efficiency(), Fair(), Sla(), Auction(), Token(), Jasda()):
    register(_policy)

__all__ = [
    "BID_ORDERS",
    "NO_BID",
    "POLICIES",
    "REGISTRY",
    "Bid",
    "BidOrder",
    "ClearingPolicy",
    "Decision",
    "Group",
    "Keyed",
    "Ledger",
    "MonotonePolicy",
    "Policy",
    "PolicyConfig",
    "PolicyFn",
    "VerdictKind",
    "best_candidate",
    "bid_for",
    "canonical",
    "canonical_split",
    "capacity_reason",
    "clear",
    "clear_batch",
    "clear_full",
    "efficiency_value",
    "get",
    "grant_cost",
    "likely_per_tenant",
    "likely_winners",
    "losing_verdict",
    "no_bid_verdicts",
    "policy",
    "rank",
    "register",
    "shortlist",
    "shortlist_size",
    "split_by_capacity",
    "unregister",
    "verdict_kind",
    "window_cost",
]
