"""The one registry of clearing policies: a policy module defines its ``ClearingPolicy`` and the
package registers it here, once (``sja.core.policies``). ``POLICIES`` (name -> its ``clear``) and
``BID_ORDERS`` (name -> its order, for the policies an agent can foresee) follow the registry."""

from __future__ import annotations

from sja.core.policies.base import BidOrder, ClearingPolicy, PolicyFn

REGISTRY: dict[str, ClearingPolicy] = {}
"""Every registered policy by name, in registration order."""

POLICIES: dict[str, PolicyFn] = {}
"""Every registered policy's ``clear`` by name."""

BID_ORDERS: dict[str, BidOrder] = {}
"""The order of each policy whose winners an agent can foresee within a tenant (``bid_order``)."""


def register(pol: ClearingPolicy) -> ClearingPolicy:
    """Make ``pol`` known by its name to ``clear``, ``clear_batch``, the bidders and the services."""
    if pol.name in REGISTRY:
        raise ValueError(f"policy {pol.name!r} is registered already")
    REGISTRY[pol.name] = pol
    POLICIES[pol.name] = pol.clear
    if pol.bid_order is not None:
        BID_ORDERS[pol.name] = pol.bid_order
    return pol


def unregister(name: str) -> None:
    """Forget a registered policy (a test's own, when it is done)."""
    del REGISTRY[name]
    del POLICIES[name]
    BID_ORDERS.pop(name, None)


def get(name: str) -> ClearingPolicy:
    """The registered policy named ``name``."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(sorted(REGISTRY))})") from None


def policy(name: str) -> PolicyFn:
    """The ``clear`` of the policy named ``name``."""
    return get(name).clear
