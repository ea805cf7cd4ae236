"""Service name -> (service class, settings class): what ``sja service NAME`` runs."""

from __future__ import annotations

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.executor.service import ExecutorService, ExecutorSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from sja.bus.service import Service
from sja.bus.settings import BaseSettings

SERVICES: dict[str, tuple[type[Service], type[BaseSettings]]] = {
    "inventory": (InventoryService, InventorySettings),
    "advertiser": (AdvertiserService, AdvertiserSettings),
    "clearer": (ClearerService, ClearerSettings),
    "agent": (AgentService, AgentSettings),
    "executor": (ExecutorService, ExecutorSettings),
    "gateway": (GatewayService, GatewaySettings),
}

START_ORDER = ("inventory", "gateway", "clearer", "agent", "executor", "advertiser")
