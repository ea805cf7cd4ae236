"""Cluster specs: the grammar, slices and ids it produces, and how invalid specs are reported."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sja.core.mig import A100_40GB, H100_80GB
from sja.sim.cluster import GPUS_PER_NODE, load_openb_nodes, parse_cluster
from sja.sim.model import SimGpu, SimSlice
from sja.sim.trace import OPENB_GPU_MEM_MIB


def _traces() -> Path:
    return Path(os.environ.get("SJA_TRACES_DIR", Path(__file__).resolve().parents[4] / "shared" / "traces"))


def test_default_layout_is_one_whole_slice() -> None:
    cluster = parse_cluster("8xA100-40GB")
    assert len(cluster.gpus) == 8 and {g.node for g in cluster.gpus} == {"n0"}
    assert cluster.gpus[3] == SimGpu("n0-g3", "n0", "A100-40GB", None, False)
    assert cluster.slices[3] == SimSlice("n0-g3-7g.40gb-0", "n0-g3", "n0", "A100-40GB", "7g.40gb", 40192, 1.0)
    assert parse_cluster("8xA100-40GB:whole") == cluster
    assert parse_cluster("1xA30-24GB").slices[0].profile == "4g.24gb"


def test_layout_gives_each_gpu_its_instances() -> None:
    cluster = parse_cluster("4xH100-80GB:3g.40gb+4g.40gb")
    assert all(g.layout == ("4g.40gb", "3g.40gb") for g in cluster.gpus), "canonical order: by placement"
    first = [s for s in cluster.slices if s.gpu_id == "n0-g0"]
    assert [(s.slice_id, s.mem_mib) for s in first] == [
        ("n0-g0-4g.40gb-0", 40448),
        ("n0-g0-3g.40gb-4", 40448),
    ]
    assert [s.compute_share for s in first] == [4 / H100_80GB.compute_slots, 3 / 7]
    mixed = parse_cluster("A100-40GB:3g.20gb+2g.10gb+1g.5gb+1g.5gb")
    assert [s.slice_id for s in mixed.slices] == [
        "n0-g0-2g.10gb-0",
        "n0-g0-1g.5gb-2",
        "n0-g0-1g.5gb-3",
        "n0-g0-3g.20gb-4",
    ]
    assert sum(s.compute_share for s in mixed.slices) == pytest.approx(1.0)


def test_layout_with_a_media_extension_profile() -> None:
    cluster = parse_cluster("A100-40GB:3g.20gb+1g.5gb+me+2g.10gb+1g.5gb")
    assert [(s.slice_id, s.profile) for s in cluster.slices] == [
        ("n0-g0-2g.10gb-0", "2g.10gb"),
        ("n0-g0-1g.5gb_me-2", "1g.5gb+me"),
        ("n0-g0-1g.5gb-3", "1g.5gb"),
        ("n0-g0-3g.20gb-4", "3g.20gb"),
    ]
    with pytest.raises(ValueError, match=r"one media-extension"):
        parse_cluster("A30-24GB:2g.12gb+me+1g.6gb+me")


def test_repartitionable_marks() -> None:
    for spec in ("2xA100-40GB~repart", "2xA100-40GB:repartitionable", "2xA100-40GB:whole:repartitionable"):
        assert all(g.repartitionable and g.layout is None for g in parse_cluster(spec).gpus), spec
    layered = parse_cluster("2xA100-40GB:3g.20gb+3g.20gb~repart")
    assert all(g.repartitionable and g.layout == ("3g.20gb", "3g.20gb") for g in layered.gpus)
    assert not any(g.repartitionable for g in parse_cluster("2xA100-40GB").gpus)


def test_reconfiguration_time_per_group() -> None:
    assert parse_cluster("2xA100-40GB~repart").gpus[0].reconfig_s is None  # the simulation's default
    for spec in (
        "2xA100-40GB~repart=12",
        "2xA100-40GB:repartitionable=12",
        "A100-40GB:whole:repartitionable=12",
    ):
        assert all(g.repartitionable and g.reconfig_s == 12.0 for g in parse_cluster(spec).gpus), spec
    for bad, message in (
        ("2xA100-40GB~repart=x", "must be a number of seconds"),
        ("2xA100-40GB:repartitionable=-1", "must be >= 0 seconds"),
    ):
        with pytest.raises(ValueError, match=message):
            parse_cluster(bad)


def test_reconfiguration_time_in_a_cluster_file(tmp_path: Path) -> None:
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps([{"count": 2, "model": "A100-80GB", "repartitionable": True, "reconfig_s": 7}])
    )
    assert all(g.repartitionable and g.reconfig_s == 7.0 for g in parse_cluster(str(path)).gpus)
    path.write_text(json.dumps([{"model": "A100-80GB", "reconfig_s": 7}]))
    with pytest.raises(ValueError, match="reconfig_s needs repartitionable"):
        parse_cluster(str(path))


def test_groups_fill_nodes_of_eight_and_start_new_nodes() -> None:
    cluster = parse_cluster("10xA100-40GB, 2xh100-80gb, T4")
    per_node = Counter(g.node for g in cluster.gpus)
    assert per_node == {"n0": 8, "n1": 2, "n2": 2, "n3": 1}
    assert [g.gpu_id for g in cluster.gpus[8:11]] == ["n1-g0", "n1-g1", "n2-g0"]
    assert cluster.gpus[10].model == "H100-80GB", "model names are case-insensitive"
    t4 = cluster.slices[-1]
    assert (t4.profile, t4.mem_mib, t4.gpu_model) == ("whole", OPENB_GPU_MEM_MIB["T4"], "T4")
    assert Counter(g.node for g in parse_cluster("5xA100-40GB", gpus_per_node=2).gpus) == {
        "n0": 2,
        "n1": 2,
        "n2": 1,
    }


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("", "empty cluster spec"),
        ("0xA100-40GB", r"cluster group 1 '0xA100-40GB': count must be >= 1"),
        ("8xA100-40GB,8xB200", r"cluster group 2 '8xB200': unknown GPU model 'B200'"),
        ("8xA100-40GB:7g.40gb+1g.5gb", r"group 1 .*A100-40GB: layout needs more than 7 compute"),
        ("8xA100-40GB:9g.99gb", r"group 1 .*no MIG profile '9g.99gb'"),
        ("2xA100-40GB:1g.5gb:2g.10gb", r"more than one layout"),
        ("2xA100-40GB:", r"empty option"),
        ("2xA100-40GB:1g.5gb+", r"empty profile"),
        ("2xA100-40GB nodes", r"unexpected 'nodes'"),
        ("8x", r"cluster group 1 '8x': unknown GPU model"),
        ("8xA100-40GB,,", r"cluster group 2 '': expected"),
        ("4xT4:1g.5gb", r"T4 has no MIG: it takes no layout"),
        ("4xT4~repart", r"T4 has no MIG: it cannot be repartitioned"),
        ("missing.yaml", r"missing\.yaml: cluster file not found"),
    ],
)
def test_invalid_specs_name_the_group(spec: str, expected: str) -> None:
    with pytest.raises(ValueError, match=expected):
        parse_cluster(spec)


def test_spec_file_yaml_and_json(tmp_path: Path) -> None:
    yml = tmp_path / "cluster.yaml"
    yml.write_text(
        "- 2xA100-40GB:3g.20gb+3g.20gb\n"
        "- {count: 3, model: H100-80GB, layout: [4g.40gb, 3g.40gb], repartitionable: true}\n"
        "- {model: A30-24GB}\n"
    )
    from_file = parse_cluster(str(yml))
    assert from_file == parse_cluster(
        "2xA100-40GB:3g.20gb+3g.20gb,3xH100-80GB:4g.40gb+3g.40gb~repart,A30-24GB"
    )
    js = tmp_path / "cluster.json"
    js.write_text(json.dumps({"groups": ["4xA100-40GB"], "gpus_per_node": 2}))
    assert Counter(g.node for g in parse_cluster(str(js)).gpus) == {"n0": 2, "n1": 2}


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ("- 2xA100-40GB\n- {model: A100-40GB, layout: 9g.9gb}\n", r"cluster\.yaml: group 2 .*9g\.9gb"),
        ("- {model: A100-40GB, count: two}\n", r"group 1 .*count must be an integer"),
        ("- {model: A100-40GB, colour: red}\n", r"group 1 .*unknown key\(s\) colour"),
        ("- 42\n", r"group 1 42: expected a spec string or a mapping"),
        ("groups: []\n", r"expected a non-empty list of groups"),
        ("[unclosed\n", r"cluster\.yaml: not valid YAML"),
    ],
)
def test_invalid_spec_files(tmp_path: Path, content: str, expected: str) -> None:
    path = tmp_path / "cluster.yaml"
    path.write_text(content)
    with pytest.raises(ValueError, match=expected):
        parse_cluster(str(path))


@given(
    counts=st.lists(st.integers(min_value=1, max_value=20), min_size=1, max_size=5),
    per_node=st.integers(min_value=1, max_value=GPUS_PER_NODE),
)
def test_ids_are_unique_and_nodes_respect_their_size(counts: list[int], per_node: int) -> None:
    spec = ",".join(f"{c}xA100-40GB:3g.20gb+2g.10gb+1g.5gb+1g.5gb" for c in counts)
    cluster = parse_cluster(spec, gpus_per_node=per_node)
    assert len(cluster.gpus) == sum(counts)
    assert len({g.gpu_id for g in cluster.gpus}) == len(cluster.gpus)
    assert len({s.slice_id for s in cluster.slices}) == len(cluster.slices) == 4 * sum(counts)
    assert max(Counter(g.node for g in cluster.gpus).values()) <= per_node
    assert all(s.mem_mib == A100_40GB.profile(s.profile).mem_mib for s in cluster.slices)


def test_openb_nodes_snippet(tmp_path: Path) -> None:
    path = tmp_path / "nodes.csv"
    path.write_text(
        "sn,cpu_milli,memory_mib,gpu,model\nna,64000,262144,2,P100\nnb,32000,1000,0,\nnc,96000,1,1,G2\n"
    )
    cluster = load_openb_nodes(path)
    assert [g.gpu_id for g in cluster.gpus] == ["na-g0", "na-g1", "nc-g0"], "GPU-less nodes are skipped"
    assert cluster.slices[0] == SimSlice("na-g0-whole-0", "na-g0", "na", "P100", "whole", 16280, 1.0)
    path.write_text("sn,cpu_milli,memory_mib,gpu,model\nna,64000,262144,2,Z9\n")
    with pytest.raises(ValueError, match=r"nodes\.csv:2: column 'model': unknown GPU model 'Z9'"):
        load_openb_nodes(path)


def test_real_openb_nodes() -> None:
    path = _traces() / "alibaba-openb" / "openb_node_list_gpu_node.csv"
    if not path.is_file():
        pytest.skip(f"real trace {path} not available")
    cluster = load_openb_nodes(path)
    assert len(cluster.gpus) == len(cluster.slices) == 6212
    assert len({g.node for g in cluster.gpus}) == 1213
    assert {g.model for g in cluster.gpus} == {"P100", "T4", "V100M16", "V100M32", "G2", "G3", "A10"}
