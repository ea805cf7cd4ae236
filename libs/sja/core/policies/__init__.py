"""Clearing policies: ``(offer, bids, ledger) -> decision`` with a reason for every bid.

One module per policy, each a ``ClearingPolicy`` (``base``) with its ranking, its batch clearing
and its explanation, registered once, below (``registry.register``); ``clear`` and ``clear_batch``
(``clearing``) and the agents' shortlists (``shortlist``) find a policy by its name there.

- ``efficiency`` — most useful work per slice-second, best fit (time and memory fill of the window,
  weighted by the odds of fitting).
- ``fair`` — least attained service normalized by the tenant's share; within a tenant, least
  attained job.
- ``sla`` — least slack to deadline (deadline minus now minus expected remaining work); jobs without
  a deadline come after, by submission time.
- ``auction`` — sealed-bid second price with per-tenant budgets: the highest affordable bid wins and
  pays the second-highest bid (or the reserve); budgets never go negative.
- ``token`` — fair-share tokens in the style of GPU time-sharing quota schedulers: the tenant furthest
  below its target share holds the token and wins; a tenant above its target by more than the
  overuse tolerance has its token revoked (it can win only when no tenant within its share bids).
- ``jasda`` — a weighted score of utilization (efficiency), fairness (share deficit) and
  responsiveness (waiting time, deadline urgency), with configurable weights.

Pure and deterministic; the rules every policy shares (canonical order, capacity, verdicts) are in
``base``.
"""

from __future__ import annotations

from sja.core.policies.auction import Auction
from sja.core.policies.base import (
    NO_BID,
    Bid,
    BidOrder,
    ClearingPolicy,
    Decision,
    Group,
    Keyed,
    Ledger,
    MonotonePolicy,
    Policy,
    PolicyConfig,
    PolicyFn,
    best_candidate,
    canonical,
    canonical_split,
    capacity_reason,
    clear_full,
    efficiency_value,
    grant_cost,
    no_bid_verdicts,
    rank,
    split_by_capacity,
    window_cost,
)
from sja.core.policies.clearing import clear, clear_batch
from sja.core.policies.efficiency import Efficiency
from sja.core.policies.fair import Fair
from sja.core.policies.jasda import Jasda
from sja.core.policies.registry import BID_ORDERS, POLICIES, REGISTRY, get, policy, register, unregister
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
    "no_bid_verdicts",
    "policy",
    "rank",
    "register",
    "shortlist",
    "shortlist_size",
    "split_by_capacity",
    "unregister",
    "window_cost",
]
