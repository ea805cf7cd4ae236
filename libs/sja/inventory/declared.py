"""Declared inventories: a file describing nodes, their GPUs (by catalogue model) and MIG layouts.

```yaml
nodes:
  - name: local
    pool: local          # optional, defaults to the node name
    gpus:
      - model: A100-40GB
        layout: [3g.20gb, 2g.10gb, 1g.5gb, 1g.5gb]
      - model: H100-80GB
        layout: [4g.40gb, 3g.40gb]
      - model: A30-24GB
        layout: [2g.12gb, 1g.6gb+me, 1g.6gb]   # at most one +me instance per GPU
```
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import yaml

from sja.core.mig import LayoutError, gpu_model, id_token, place_layout
from sja.protocol.messages import SliceState

DEFAULT_INVENTORY: dict[str, Any] = {
    "nodes": [
        {
            "name": "local",
            "gpus": [
                {"model": "A100-40GB", "layout": ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]},
                {"model": "H100-80GB", "layout": ["4g.40gb", "3g.40gb"]},
            ],
        }
    ]
}

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


class InventoryError(ValueError):
    pass


class GpuDecl(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    model: str
    layout: list[str]


class NodeDecl(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    gpus: list[GpuDecl]
    pool: str = ""


class InventoryDecl(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    nodes: list[NodeDecl]


def slice_id(node: str, gpu_index: int, profile: str, start: int) -> str:
    """``<node>-g<gpu>-<profile>-<start>``; a ``+me`` profile appears as ``_me`` (ids hold no ``+``)."""
    return f"{node}-g{gpu_index}-{id_token(profile)}-{start}"


def slices_from_decl(raw: dict[str, Any]) -> list[SliceState]:
    """Expand a declaration into slice states (all free, fence 0)."""
    try:
        decl = msgspec.convert(raw, InventoryDecl)
    except msgspec.ValidationError as e:
        raise InventoryError(f"invalid inventory: {e}") from None
    out: list[SliceState] = []
    seen_nodes: set[str] = set()
    for node in decl.nodes:
        if not _NAME.match(node.name):
            raise InventoryError(f"invalid node name {node.name!r}")
        if node.name in seen_nodes:
            raise InventoryError(f"node {node.name!r} declared twice")
        seen_nodes.add(node.name)
        pool = node.pool or node.name
        if not _NAME.match(pool):
            raise InventoryError(f"invalid pool name {pool!r}")
        for idx, gpu in enumerate(node.gpus):
            try:
                model = gpu_model(gpu.model)
                placements = place_layout(model, gpu.layout)
            except (LayoutError, ValueError) as e:
                raise InventoryError(f"node {node.name} gpu {idx}: {e}") from None
            for pl in placements:
                p = model.profile(pl.profile)
                out.append(
                    SliceState(
                        slice_id=slice_id(node.name, idx, p.name, pl.start),
                        node=node.name,
                        pool=pool,
                        gpu_index=idx,
                        gpu_model=model.name,
                        gpu_uuid=f"MIG-emulated-{node.name}-{idx}-{pl.start}",
                        profile=p.name,
                        mem_mib=p.mem_mib,
                        compute_slots=p.compute_slots,
                        compute_share=p.compute_slots / model.compute_slots,
                        placement_start=pl.start,
                        source="declared",
                    )
                )
    return out


def load_declared(path: str | Path | None) -> list[SliceState]:
    """Slices of a declared inventory file (YAML or JSON); the default layout when ``path`` is empty."""
    if not path:
        return slices_from_decl(DEFAULT_INVENTORY)
    p = Path(path)
    if not p.exists():
        raise InventoryError(f"inventory file not found: {p}")
    try:
        raw = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise InventoryError(f"{p}: not valid YAML/JSON: {e}") from None
    if not isinstance(raw, dict):
        raise InventoryError(f"{p}: expected a mapping with 'nodes'")
    return slices_from_decl(raw)
