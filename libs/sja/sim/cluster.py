"""Simulated clusters: from a compact spec string (or a YAML/JSON file of groups), or from openb's node list.

Spec grammar (``docs/traces.md`` has examples)::

    spec   := group ("," group)*            or a path to a .yaml/.yml/.json file
    group  := [count "x"] model (":" option)* ["~repart" ["=" seconds]]
    option := "whole" | "repartitionable" ["=" seconds] | profile ("+" profile)*
              (a profile may carry its own suffix: ``1g.10gb+me+3g.40gb`` is 1g.10gb+me and 3g.40gb)

``8xA100-40GB`` is eight A100-40GB GPUs, each one whole slice (the model's largest MIG profile, 7g.40gb);
``4xH100-80GB:4g.40gb+3g.40gb`` gives every GPU that MIG layout (the initial one, for a repartitionable
GPU); ``~repart`` or ``:repartitionable`` marks GPUs whose layout the simulator may change while they are
idle, ``=<seconds>`` sets how long a re-cut takes (default ``SimConfig.reconfig_s``). Models are the MIG
catalogue's (``sja.core.mig``) or the non-MIG cards of the openb trace (``T4``, ``V100M32``, ...), which
are always one whole slice.

GPUs fill nodes of ``gpus_per_node`` (default 8) within a group; every group starts a new node. Node ids
are ``n<i>``, GPU ids ``<node>-g<j>``, slice ids ``<gpu_id>-<profile>-<start>``.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from sja.core.mig import CATALOGUE, GpuModel, MigProfile, gpu_model, id_token, place_layout
from sja.sim.model import SimCluster, SimGpu, SimSlice
from sja.sim.trace import OPENB_GPU_MEM_MIB, read_csv_rows

GPUS_PER_NODE = 8
WHOLE_PROFILE = "whole"
"""Profile name of the single slice of a GPU without MIG (a model outside the MIG catalogue)."""

_REPART_SUFFIX_RE = re.compile(r"~repart(?:=(?P<seconds>[^:~\s]*))?\s*$", re.IGNORECASE)
_REPART_OPTION_RE = re.compile(r"^repartitionable(?:=(?P<seconds>.*))?$", re.IGNORECASE)
_GROUP_RE = re.compile(r"^(?:(?P<count>\d+)\s*[xX]\s*)?(?P<model>[^:~\s]+)(?P<rest>.*)$")
_PROFILE_SEP_RE = re.compile(r"\+(?![A-Za-z])")
"""``+`` between profiles; a ``+`` before a letter belongs to a profile name (``1g.10gb+me``)."""
_CLUSTER_FILE_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class GpuGroup:
    """``count`` GPUs of one model with one layout (``None``: whole GPU)."""

    count: int
    model: str
    layout: tuple[str, ...] | None
    repartitionable: bool
    reconfig_s: float | None = None
    """Seconds one re-cut takes; ``None``: the simulation's default."""


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"reconfiguration time must be a number of seconds, got {text!r}") from None
    if not (value >= 0 and value < float("inf")):
        raise ValueError(f"reconfiguration time must be >= 0 seconds, got {text!r}")
    return value


def _canonical_model(name: str) -> str:
    by_lower = {m.lower(): m for m in (*CATALOGUE, *OPENB_GPU_MEM_MIB)}
    try:
        return by_lower[name.lower()]
    except KeyError:
        known = ", ".join([*sorted(CATALOGUE), *sorted(OPENB_GPU_MEM_MIB)])
        raise ValueError(f"unknown GPU model {name!r} (known: {known})") from None


def largest_profile(gpu: GpuModel) -> MigProfile:
    """The profile that spans the whole GPU (7g.40gb on an A100-40GB, 4g.24gb on an A30)."""
    return max(gpu.profiles, key=lambda p: (p.compute_slots, p.mem_slots))


def parse_group(text: str) -> GpuGroup:
    """Parse one group of the spec grammar; raises ``ValueError`` saying what is wrong."""
    s = text.strip()
    repart = False
    reconfig_s: float | None = None
    suffix = _REPART_SUFFIX_RE.search(s)
    if suffix is not None:
        repart = True
        if suffix["seconds"] is not None:
            reconfig_s = _seconds(suffix["seconds"])
        s = s[: suffix.start()].rstrip()
    m = _GROUP_RE.match(s)
    if not s or m is None:
        raise ValueError("expected [<count>x]<model>[:<layout>][~repart[=<seconds>]]")
    count = int(m["count"]) if m["count"] is not None else 1
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    model = _canonical_model(m["model"])
    rest = m["rest"].strip()
    if rest and not rest.startswith(":"):
        raise ValueError(f"unexpected {rest!r} after the model (options follow ':')")
    layout: tuple[str, ...] | None = None
    layout_given = False
    for option in (o.strip() for o in rest.split(":")[1:]):
        if option == "":
            raise ValueError("empty option after ':'")
        repart_option = _REPART_OPTION_RE.match(option)
        if repart_option is not None:
            repart = True
            if repart_option["seconds"] is not None:
                reconfig_s = _seconds(repart_option["seconds"])
            continue
        if layout_given:
            raise ValueError(f"more than one layout (second: {option!r})")
        layout_given = True
        if option.lower() != "whole":
            layout = tuple(p.strip() for p in _PROFILE_SEP_RE.split(option))
            if any(not p for p in layout):
                raise ValueError(f"empty profile in layout {option!r}")
    if model not in CATALOGUE:
        if layout is not None:
            raise ValueError(f"{model} has no MIG: it takes no layout")
        if repart:
            raise ValueError(f"{model} has no MIG: it cannot be repartitioned")
    elif layout is not None:
        place_layout(gpu_model(model), layout)  # LayoutError (a ValueError) says why it does not fit
    return GpuGroup(count=count, model=model, layout=layout, repartitionable=repart, reconfig_s=reconfig_s)


def _group_from_mapping(item: Mapping[str, object]) -> GpuGroup:
    unknown = set(item) - {"count", "model", "layout", "repartitionable", "reconfig_s"}
    if unknown:
        raise ValueError(f"unknown key(s) {', '.join(sorted(map(str, unknown)))}")
    count = item.get("count", 1)
    model = item.get("model")
    layout = item.get("layout")
    repart = item.get("repartitionable", False)
    reconfig = item.get("reconfig_s")
    if not isinstance(count, int) or isinstance(count, bool):
        raise ValueError(f"count must be an integer, got {count!r}")
    if not isinstance(model, str):
        raise ValueError(f"model must be a string, got {model!r}")
    if not isinstance(repart, bool):
        raise ValueError(f"repartitionable must be true or false, got {repart!r}")
    text = f"{count}x{model}"
    if isinstance(layout, list) and all(isinstance(p, str) for p in layout):
        text += ":" + "+".join(layout)
    elif isinstance(layout, str):
        text += ":" + layout
    elif layout is not None:
        raise ValueError(f"layout must be a string or a list of profiles, got {layout!r}")
    if reconfig is not None and (not isinstance(reconfig, int | float) or isinstance(reconfig, bool)):
        raise ValueError(f"reconfig_s must be a number of seconds, got {reconfig!r}")
    if reconfig is not None and not repart:
        raise ValueError("reconfig_s needs repartitionable: true")
    if repart:
        text += ":repartitionable" if reconfig is None else f":repartitionable={reconfig!r}"
    return parse_group(text)


def _groups_from_file(path: Path) -> tuple[list[tuple[str, GpuGroup]], int | None]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"{path}: cannot read cluster file: {exc.strerror or exc}") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise ValueError(f"{path}: not valid {path.suffix[1:].upper()}: {exc}") from None
    per_node: int | None = None
    if isinstance(data, dict):
        unknown = set(data) - {"groups", "gpus_per_node"}
        if unknown:
            raise ValueError(f"{path}: unknown key(s) {', '.join(sorted(map(str, unknown)))}")
        raw_per_node = data.get("gpus_per_node")
        if raw_per_node is not None:
            if not isinstance(raw_per_node, int) or isinstance(raw_per_node, bool):
                raise ValueError(f"{path}: gpus_per_node must be an integer, got {raw_per_node!r}")
            per_node = raw_per_node
        data = data.get("groups")
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty list of groups (or a mapping with 'groups')")
    groups: list[tuple[str, GpuGroup]] = []
    for i, item in enumerate(data, start=1):
        label = f"{path}: group {i} {item!r}"
        try:
            if isinstance(item, str):
                groups.append((label, parse_group(item)))
            elif isinstance(item, dict):
                groups.append((label, _group_from_mapping(item)))
            else:
                raise ValueError("expected a spec string or a mapping")
        except ValueError as exc:
            raise ValueError(f"{label}: {exc}") from None
    return groups, per_node


def slices_of(gpu: SimGpu, generation: int = 0) -> list[SimSlice]:
    """The slices of a GPU's layout. ``generation`` counts re-cuts: slices of a re-cut GPU get ids
    ending in ``.r<generation>`` so that no id names two different instances in one run."""
    suffix = f".r{generation}" if generation else ""
    if gpu.model not in CATALOGUE:
        mem = OPENB_GPU_MEM_MIB[gpu.model]
        return [
            SimSlice(
                f"{gpu.gpu_id}-{WHOLE_PROFILE}-0{suffix}",
                gpu.gpu_id,
                gpu.node,
                gpu.model,
                WHOLE_PROFILE,
                mem,
                1.0,
            )
        ]
    model = gpu_model(gpu.model)
    if gpu.layout is None:
        placements = [(largest_profile(model), 0)]
    else:
        placements = [(model.profile(pl.profile), pl.start) for pl in place_layout(model, gpu.layout)]
    return [
        SimSlice(
            slice_id=f"{gpu.gpu_id}-{id_token(p.name)}-{start}{suffix}",
            gpu_id=gpu.gpu_id,
            node=gpu.node,
            gpu_model=gpu.model,
            profile=p.name,
            mem_mib=p.mem_mib,
            compute_share=p.compute_slots / model.compute_slots,
        )
        for p, start in placements
    ]


def build_cluster(groups: Sequence[GpuGroup], *, gpus_per_node: int = GPUS_PER_NODE) -> SimCluster:
    """Lay groups out on nodes (each group starts a node; at most ``gpus_per_node`` GPUs per node)."""
    if gpus_per_node < 1:
        raise ValueError(f"gpus_per_node must be >= 1, got {gpus_per_node}")
    cluster = SimCluster()
    node_index = 0
    for group in groups:
        layout = None
        if group.layout is not None and group.model in CATALOGUE:
            # Canonical order: the layout's instances by placement start.
            layout = tuple(pl.profile for pl in place_layout(gpu_model(group.model), group.layout))
        for k in range(group.count):
            node = f"n{node_index + k // gpus_per_node}"
            gpu = SimGpu(
                gpu_id=f"{node}-g{k % gpus_per_node}",
                node=node,
                model=group.model,
                layout=layout,
                repartitionable=group.repartitionable,
                reconfig_s=group.reconfig_s,
            )
            cluster.gpus.append(gpu)
            cluster.slices.extend(slices_of(gpu))
        node_index += -(-group.count // gpus_per_node)
    return cluster


def parse_cluster(spec: str, *, gpus_per_node: int = GPUS_PER_NODE) -> SimCluster:
    """Build a cluster from a spec string or a YAML/JSON file of groups.

    A file holds a list of groups, each a spec string (``"4xH100-80GB:4g.40gb+3g.40gb"``) or a mapping
    ``{count, model, layout, repartitionable, reconfig_s}`` (``layout``: ``"whole"``, a ``+``-joined
    string or a list of profiles); or a mapping ``{groups: [...], gpus_per_node: 8}``.

    Raises:
        ValueError: naming the offending group (its position and text) and what is wrong with it.
    """
    text = spec.strip()
    if not text:
        raise ValueError("empty cluster spec")
    path = Path(text)
    if path.suffix.lower() in _CLUSTER_FILE_SUFFIXES or path.is_file():
        if not path.is_file():
            raise ValueError(f"{path}: cluster file not found")
        labelled, per_node = _groups_from_file(path)
        return build_cluster([g for _, g in labelled], gpus_per_node=per_node or gpus_per_node)
    groups: list[GpuGroup] = []
    for i, part in enumerate(text.split(","), start=1):
        try:
            groups.append(parse_group(part))
        except ValueError as exc:
            raise ValueError(f"cluster group {i} {part.strip()!r}: {exc}") from None
    return build_cluster(groups, gpus_per_node=gpus_per_node)


OPENB_NODE_COLUMNS = ("sn", "cpu_milli", "memory_mib", "gpu", "model")


def load_openb_nodes(path: str | Path) -> SimCluster:
    """openb's node list (``openb_node_list_gpu_node.csv``) as whole GPUs, node ids as in the file (``sn``).

    None of openb's models (P100, T4, V100M16, V100M32, A10, G2, G3) has MIG: every GPU is one slice of
    profile ``whole`` with the memory of ``sja.sim.trace.OPENB_GPU_MEM_MIB``. Nodes without GPUs are skipped.

    Raises:
        ValueError: a malformed file or an unknown model, naming the file, line and column.
    """
    cluster = SimCluster()
    seen: dict[str, int] = {}
    for row in read_csv_rows(path, OPENB_NODE_COLUMNS):
        count = row.integer("gpu", minimum=0)
        if count == 0:
            continue
        node = row.text("sn")
        if not node:
            raise row.error("sn", "missing node name")
        if node in seen:
            raise row.error("sn", f"duplicate node {node!r} (first on line {seen[node]})")
        seen[node] = row.line
        model = row.text("model")
        if model not in OPENB_GPU_MEM_MIB:
            raise row.error(
                "model", f"unknown GPU model {model!r} (known: {', '.join(sorted(OPENB_GPU_MEM_MIB))})"
            )
        for j in range(count):
            gpu = SimGpu(gpu_id=f"{node}-g{j}", node=node, model=model)
            cluster.gpus.append(gpu)
            cluster.slices.extend(slices_of(gpu))
    return cluster
