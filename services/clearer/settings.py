"""The clearer's settings (``SJA_*`` variables, see the configuration reference in
``docs/operations.md``)."""

from __future__ import annotations

import msgspec

from sja.bus.settings import BaseSettings, Pools, TenantBudgets, TenantShares, Weights3
from sja.core import defaults


class ClearerSettings(BaseSettings, frozen=True, kw_only=True):
    pools: Pools = ()
    """Pools this replica clears (``SJA_POOLS``, comma-separated); empty: all. Pools must not
    overlap between replicas (a slice is still never granted twice: the KV compare-and-set
    decides)."""
    policy: str = defaults.POLICY
    tenant_shares: TenantShares = msgspec.field(default_factory=dict)
    """``tenant=weight,...`` target shares for fairness policies (each weight positive)."""
    tenant_budgets: TenantBudgets = msgspec.field(default_factory=dict)
    """``tenant=credits,...`` budgets for the ``auction`` policy (unlisted tenants: unlimited)."""
    jasda_weights: Weights3 = (0.5, 0.3, 0.2)
    """``jasda`` policy: weights of utilization, fairness, responsiveness (three, non-negative)."""
    token_overuse: float = 0.10
    offer_queue: str = "sja-clearers"
    """NATS queue group for offers: replicas on the same pools share the rounds (each offer is
    cleared by one of them). Empty: every replica clears every offer it sees, and the KV
    compare-and-set picks one grant per slice."""
    lease_s: float = 5.0
    """How long a winner has to start its subjob before the slice returns to the pool."""
    agent_liveness_s: float = 3.0
    reply_grace_s: float = 0.2
    """How long past an offer's reply deadline a round may wait for a live agent that has not
    answered yet (it closes as soon as every live agent has)."""
    horizon_s: float = defaults.HORIZON_S
