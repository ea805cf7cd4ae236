"""The gateway's settings (``SJA_<FIELD>``, see ``docs/operations.md``)."""

from __future__ import annotations

from sja.bus.settings import BaseSettings
from sja.core import defaults


class GatewaySettings(BaseSettings, frozen=True, kw_only=True):
    horizon_s: float = defaults.HORIZON_S
    """The planning window the advertiser offers (same ``SJA_HORIZON_S``): new jobs' priors are
    scaled to what fits one window."""
    start_overhead_s: float = defaults.START_OVERHEAD_S
    mem_reserve_mib: float = 256.0
    """Driver/context memory of every slice (same ``SJA_MEM_RESERVE_MIB`` as the agents): a job whose
    smallest subjob declares more than the largest slice less this is refused at submission, and
    ``explain`` plans with it to say why a job sent no bid."""
    code_max_mib: float = 64.0
    """The largest code archive a job may upload (``sja submit --code DIR``, packed)."""
    code_unpacked_max_mib: float = 512.0
    """The most a code archive may hold once unpacked (what each node's disk gets)."""
    code_store_max_mib: float = 8192.0
    """The object store ``sja-code`` is created with this size limit (its ``max_bytes``); 0: none."""


__all__ = ["GatewaySettings"]
