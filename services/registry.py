"""Service name -> (service class, settings class): what ``sja service NAME`` runs.

Each service's module is imported only when that service is run: the executor's imports Ray, whose
import (and its shutdown at exit, which imports more of Ray) costs every other service seconds of
CPU and a hundred MiB it never uses."""

from __future__ import annotations

import importlib
from collections.abc import Iterable

from sja.bus.service import Service
from sja.bus.settings import BaseSettings

SERVICES: dict[str, tuple[str, str, str]] = {
    "inventory": ("services.inventory.service", "InventoryService", "InventorySettings"),
    "advertiser": ("services.advertiser.service", "AdvertiserService", "AdvertiserSettings"),
    "clearer": ("services.clearer.service", "ClearerService", "ClearerSettings"),
    "agent": ("services.agent.service", "AgentService", "AgentSettings"),
    "executor": ("services.executor.service", "ExecutorService", "ExecutorSettings"),
    "gateway": ("services.gateway.service", "GatewayService", "GatewaySettings"),
    "ui": ("services.ui.service", "UiService", "UiSettings"),
}
"""Name -> (module, service class, settings class)."""

START_ORDER = ("inventory", "gateway", "clearer", "agent", "executor", "advertiser", "ui")


def load(name: str) -> tuple[type[Service], type[BaseSettings]]:
    """The service and settings classes of ``name`` (a key of ``SERVICES``), importing its module."""
    module, service, settings = SERVICES[name]
    mod = importlib.import_module(module)
    return getattr(mod, service), getattr(mod, settings)


def parse_names(spec: str) -> list[str]:
    """The services one process runs, from ``sja service``'s argument: one name, or several
    separated by commas (co-hosted: ``sja.bus.service.run_services``), each known and named once;
    returned in ``START_ORDER`` (the inventory first: the others read its slices)."""
    names = [n.strip() for n in spec.split(",")]
    if not spec.strip() or any(not n for n in names):
        raise ValueError(f"no service named in {spec!r} (known: {', '.join(SERVICES)})")
    unknown = [n for n in names if n not in SERVICES]
    if unknown:
        raise ValueError(f"unknown service {unknown[0]!r} (known: {', '.join(SERVICES)})")
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"service {twice[0]!r} named twice in {spec!r}")
    return sorted(names, key=START_ORDER.index)


def cohosted_instance(name: str, base: str) -> str:
    """The instance id of service ``name`` in a process running several (``SJA_INSTANCE`` = ``base``,
    or the host and pid when unset): ``<name>-<base>``, so that ``SJA_INSTANCE=0`` gives each the
    id it would have alone as replica 0 (``clearer-0``, ``advertiser-0``)."""
    return f"{name}-{base}"


def parse_cohost(spec: str, allowed: Iterable[str] = START_ORDER) -> list[str]:
    """A ``--cohost`` list (``parse_names``): two or more services, each one of ``allowed``."""
    names = parse_names(spec)
    allowed = tuple(allowed)
    if len(names) < 2 or not set(names) <= set(allowed):
        raise ValueError(f"takes two or more of {', '.join(allowed)}")
    return names
