"""Declared inventories: a YAML/JSON file of nodes, GPUs and MIG layouts becomes slice states."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest

from sja.bus.codec import decode, encode
from sja.core.mig import CATALOGUE, Placement, validate_placements
from sja.inventory.declared import (
    DEFAULT_INVENTORY,
    InventoryError,
    load_declared,
    slice_id,
    slices_from_decl,
)
from sja.protocol.messages import SliceState


def test_default_inventory_has_six_valid_slices() -> None:
    slices = load_declared(None)
    assert len(slices) == 6
    assert slices == load_declared("") == slices_from_decl(DEFAULT_INVENTORY)
    ids = [s.slice_id for s in slices]
    assert len(set(ids)) == 6
    assert sorted(ids) == sorted(
        [
            "local-g0-2g.10gb-0",
            "local-g0-1g.5gb-2",
            "local-g0-1g.5gb-3",
            "local-g0-3g.20gb-4",
            "local-g1-4g.40gb-0",
            "local-g1-3g.40gb-4",
        ]
    )
    for s in slices:
        # every slice is a valid wire message (ids, names and shares pass the schema)
        assert decode(encode(s), SliceState) == s
        assert s.status == "free" and s.fence == 0 and s.source == "declared"
        assert s.node == "local" and s.pool == "local"
        model = CATALOGUE[s.gpu_model]
        profile = model.profile(s.profile)
        assert s.mem_mib == profile.mem_mib
        assert s.compute_slots == profile.compute_slots
        assert s.compute_share == pytest.approx(profile.compute_slots / model.compute_slots)
        assert 0 < s.compute_share <= 1
        assert s.slice_id == slice_id(s.node, s.gpu_index, s.profile, s.placement_start)
    # per GPU, the shares add up to at most the whole GPU and the placements are valid
    for idx in (0, 1):
        on_gpu = [s for s in slices if s.gpu_index == idx]
        assert sum(s.compute_slots for s in on_gpu) == 7
        validate_placements(
            CATALOGUE[on_gpu[0].gpu_model], [Placement(s.profile, s.placement_start) for s in on_gpu]
        )
    assert {s.gpu_model for s in slices} == {"A100-40GB", "H100-80GB"}


def test_media_extension_profiles_are_declared_by_name(tmp_path: Path) -> None:
    """A ``+me`` instance keeps its profile name; its slice id spells ``+`` as ``_`` (a valid key)."""
    path = _write(
        tmp_path,
        """
nodes:
  - name: media
    gpus:
      - model: A30-24GB
        layout: [2g.12gb, 1g.6gb+me, 1g.6gb]
      - model: H200-141GB
        layout: [3g.71gb, 2g.35gb, 1g.18gb+me, 1g.18gb]
""",
    )
    slices = load_declared(path)
    assert [(s.gpu_index, s.slice_id, s.profile, s.mem_mib) for s in slices] == [
        (0, "media-g0-2g.12gb-0", "2g.12gb", 11968),
        (0, "media-g0-1g.6gb_me-2", "1g.6gb+me", 5952),
        (0, "media-g0-1g.6gb-3", "1g.6gb", 5952),
        (1, "media-g1-2g.35gb-0", "2g.35gb", 33024),
        (1, "media-g1-1g.18gb_me-2", "1g.18gb+me", 16384),
        (1, "media-g1-1g.18gb-3", "1g.18gb", 16384),
        (1, "media-g1-3g.71gb-4", "3g.71gb", 71168),
    ]
    for s in slices:
        assert decode(encode(s), SliceState) == s  # the id passes the wire schema


def test_emulated_uuids_are_distinct() -> None:
    uuids = [s.gpu_uuid for s in load_declared(None)]
    assert len(set(uuids)) == len(uuids)


def _write(tmp_path: Path, content: str, name: str = "inv.yaml") -> Path:
    p = tmp_path / name
    p.write_text(content, encoding="utf-8")
    return p


def test_yaml_file_with_pools_and_several_nodes(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
nodes:
  - name: node-a
    pool: fast
    gpus:
      - model: H100-80GB
        layout: [7g.80gb]
  - name: node-b
    gpus:
      - model: A30-24GB
        layout: [2g.12gb, 1g.6gb, 1g.6gb]
      - model: A100-80GB
        layout: [3g.40gb, 3g.40gb]
""",
    )
    slices = load_declared(path)
    assert [(s.node, s.pool, s.gpu_index, s.profile) for s in slices] == [
        ("node-a", "fast", 0, "7g.80gb"),
        ("node-b", "node-b", 0, "2g.12gb"),
        ("node-b", "node-b", 0, "1g.6gb"),
        ("node-b", "node-b", 0, "1g.6gb"),
        ("node-b", "node-b", 1, "3g.40gb"),
        ("node-b", "node-b", 1, "3g.40gb"),
    ]
    assert slices[0].compute_share == 1.0
    assert slices[1].compute_share == 0.5  # A30: 2 of 4 compute slices
    assert len({s.slice_id for s in slices}) == len(slices)


def test_json_file_is_accepted(tmp_path: Path) -> None:
    path = _write(tmp_path, json.dumps(DEFAULT_INVENTORY), "inv.json")
    assert load_declared(path) == load_declared(None)
    assert load_declared(str(path)) == load_declared(None)


def _gpu(model: str = "A100-40GB", layout: list[str] | None = None) -> dict[str, Any]:
    return {"model": model, "layout": layout or ["7g.40gb"]}


@pytest.mark.parametrize(
    ("raw", "match"),
    [
        (
            {"nodes": [{"name": "n", "gpus": [_gpu("V100-16GB")]}]},
            r"node n gpu 0: unknown GPU model 'V100-16GB'",
        ),
        (
            {"nodes": [{"name": "n", "gpus": [_gpu(), _gpu(layout=["1g.5gb"] * 8)]}]},
            r"node n gpu 1: A100-40GB: at most 7 x 1g.5gb",
        ),
        (
            {"nodes": [{"name": "n", "gpus": [_gpu(layout=["3g.20gb"] * 3)]}]},
            r"node n gpu 0: .*at most 2 x 3g.20gb",
        ),
        (
            {"nodes": [{"name": "n", "gpus": [_gpu(layout=["4g.40gb"])]}]},
            r"node n gpu 0: .*no MIG profile '4g.40gb'",
        ),
        (
            {"nodes": [{"name": "n", "gpus": [_gpu()]}, {"name": "n", "gpus": [_gpu()]}]},
            r"node 'n' declared twice",
        ),
        ({"nodes": [{"name": "bad name", "gpus": []}]}, r"invalid node name 'bad name'"),
        ({"nodes": [{"name": "n", "pool": "a.b", "gpus": []}]}, r"invalid pool name 'a.b'"),
        (
            {"nodes": [{"name": "n", "gpus": [_gpu()], "gpu_count": 2}]},
            r"invalid inventory: .*unknown field `gpu_count`",
        ),
        (
            {"nodes": [{"name": "n", "gpus": [{**_gpu(), "uuid": "x"}]}]},
            r"invalid inventory: .*unknown field `uuid`",
        ),
        (
            {"nodes": [{"name": "n", "gpus": [_gpu("A30-24GB", ["1g.6gb+me", "2g.12gb+me"])]}]},
            r"node n gpu 0: A30-24GB: at most one media-extension \(\+me\) instance per GPU",
        ),
        (
            {"nodes": [{"name": "n", "gpus": [_gpu(layout=["1g.5gb+me", "1g.5gb+me"])]}]},
            r"node n gpu 0: A100-40GB: at most 1 x 1g.5gb\+me",
        ),
        ({"nodes": [], "version": 2}, r"invalid inventory: .*unknown field `version`"),
        ({"node": []}, r"invalid inventory: .*unknown field `node`"),
        ({}, r"invalid inventory: .*missing required field `nodes`"),
        ({"nodes": [{"gpus": []}]}, r"invalid inventory: .*missing required field `name`"),
        (
            {"nodes": [{"name": "n", "gpus": [{"model": "A100-40GB", "layout": "7g.40gb"}]}]},
            r"invalid inventory: Expected `array`",
        ),
    ],
)
def test_bad_declarations_raise_inventory_error(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(InventoryError, match=match):
        slices_from_decl(raw)


def test_bad_file_contents(tmp_path: Path) -> None:
    with pytest.raises(InventoryError, match="not found"):
        load_declared(tmp_path / "missing.yaml")
    with pytest.raises(InventoryError, match="not valid YAML/JSON"):
        load_declared(_write(tmp_path, "nodes: [unclosed", "a.yaml"))
    with pytest.raises(InventoryError, match="expected a mapping with 'nodes'"):
        load_declared(_write(tmp_path, "- just\n- a list\n", "b.yaml"))
    with pytest.raises(InventoryError, match="expected a mapping"):
        load_declared(_write(tmp_path, "", "c.yaml"))
    with pytest.raises(InventoryError, match="unknown field `nodez`"):
        load_declared(_write(tmp_path, "nodez: []\n", "d.yaml"))


def test_inventory_error_is_a_value_error() -> None:
    assert issubclass(InventoryError, ValueError)


def test_declared_slices_are_plain_wire_states() -> None:
    raw = msgspec.to_builtins(load_declared(None)[0])
    assert raw["type"] == "sja.slice_state.v1"
