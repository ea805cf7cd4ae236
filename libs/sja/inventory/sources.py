"""Inventory sources by name: ``declared[:FILE]``, ``nvml``, ``fake-nvml:SCENARIO``."""

from __future__ import annotations

from typing import Any

from sja.inventory.declared import InventoryError, load_declared
from sja.inventory.nvml import Discovery, SoftSlices, discover, nvml_for

SOURCE_KINDS = ("declared", "nvml", "fake-nvml")


def is_nvml(source: str) -> bool:
    return source == "nvml" or source.startswith("fake-nvml:")


def check_source(source: str) -> str:
    """Normalize a source name (empty: ``declared``), or raise ``InventoryError``."""
    source = source.strip()
    if not source or source == "declared" or source.startswith("declared:") or is_nvml(source):
        return source or "declared"
    raise InventoryError(
        f"unknown inventory source {source!r} (expected declared[:FILE], nvml or fake-nvml:SCENARIO)"
    )


def read_source(
    source: str,
    *,
    node: str = "local",
    pool: str = "",
    soft_slices: SoftSlices | str = "",
    nvml: Any = None,
    declared_file: str = "",
) -> Discovery:
    """Slices a source sees now.

    Args:
        source: ``declared`` (the file ``declared_file``, or the built-in default), ``declared:FILE``,
            ``nvml`` or ``fake-nvml:SCENARIO``.
        node: the node NVML-discovered slices belong to (a declared file names its own nodes).
        nvml: an NVML module to read instead of the one the source names (a fake kept by a test).
    """
    source = check_source(source)
    if source == "declared" or source.startswith("declared:"):
        path = source.split(":", 1)[1] if ":" in source else declared_file
        return Discovery(slices=load_declared(path))
    module = nvml if nvml is not None else nvml_for(source)
    return discover(module, node=node, pool=pool, soft_slices=soft_slices)
