"""Service name -> (service class, settings class): what ``sja service NAME`` runs.

Each service's module is imported only when that service is run: the executor's imports Ray, whose
import (and its shutdown at exit, which imports more of Ray) costs every other service seconds of
CPU and a hundred MiB it never uses."""

from __future__ import annotations

import importlib

from sja.bus.service import Service
from sja.bus.settings import BaseSettings

SERVICES: dict[str, tuple[str, str, str]] = {
    "inventory": ("services.inventory.service", "InventoryService", "InventorySettings"),
    "advertiser": ("services.advertiser.service", "AdvertiserService", "AdvertiserSettings"),
    "clearer": ("services.clearer.service", "ClearerService", "ClearerSettings"),
    "agent": ("services.agent.service", "AgentService", "AgentSettings"),
    "executor": ("services.executor.service", "ExecutorService", "ExecutorSettings"),
    "gateway": ("services.gateway.service", "GatewayService", "GatewaySettings"),
}
"""Name -> (module, service class, settings class)."""

START_ORDER = ("inventory", "gateway", "clearer", "agent", "executor", "advertiser")


def load(name: str) -> tuple[type[Service], type[BaseSettings]]:
    """The service and settings classes of ``name`` (a key of ``SERVICES``), importing its module."""
    module, service, settings = SERVICES[name]
    mod = importlib.import_module(module)
    return getattr(mod, service), getattr(mod, settings)
