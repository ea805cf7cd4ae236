"""MIG catalogue: which layouts a GPU can hold, and where their instances sit."""

from __future__ import annotations

import pytest

from sja.core.mig import (
    A30_24GB,
    A100_40GB,
    CATALOGUE,
    H100_80GB,
    GpuModel,
    LayoutError,
    Placement,
    enumerate_layouts,
    gpu_model,
    place_layout,
    validate_placements,
)


def _occupied(gpu: GpuModel, placements: tuple[Placement, ...]) -> list[int]:
    slots: list[int] = []
    for pl in placements:
        p = gpu.profile(pl.profile)
        slots.extend(range(pl.start, pl.start + p.mem_slots))
    return slots


def test_default_a100_layout_places() -> None:
    layout = ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"]
    placements = place_layout(A100_40GB, layout)
    assert sorted(pl.profile for pl in placements) == sorted(layout)
    assert [pl.start for pl in placements] == sorted(pl.start for pl in placements)
    validate_placements(A100_40GB, placements)
    slots = _occupied(A100_40GB, placements)
    assert len(slots) == len(set(slots))
    assert placements == (
        Placement("2g.10gb", 0),
        Placement("1g.5gb", 2),
        Placement("1g.5gb", 3),
        Placement("3g.20gb", 4),
    )


def test_default_h100_layout_places() -> None:
    placements = place_layout(H100_80GB, ["4g.40gb", "3g.40gb"])
    assert placements == (Placement("4g.40gb", 0), Placement("3g.40gb", 4))
    validate_placements(H100_80GB, placements)


def test_input_order_does_not_change_placement() -> None:
    a = place_layout(A100_40GB, ["1g.5gb", "3g.20gb", "1g.5gb", "2g.10gb"])
    b = place_layout(A100_40GB, ["3g.20gb", "2g.10gb", "1g.5gb", "1g.5gb"])
    assert a == b


@pytest.mark.parametrize(
    ("gpu", "layout"),
    [
        (A100_40GB, ["7g.40gb"]),
        (A100_40GB, ["1g.5gb"] * 7),
        (A100_40GB, ["3g.20gb", "3g.20gb"]),
        (A100_40GB, ["4g.20gb", "3g.20gb"]),
        (A100_40GB, ["2g.10gb", "2g.10gb", "2g.10gb", "1g.5gb"]),
        (A100_40GB, ["1g.10gb"] * 3 + ["1g.5gb"]),
        (H100_80GB, ["7g.80gb"]),
        (A30_24GB, ["2g.12gb", "1g.6gb", "1g.6gb"]),
        (A100_40GB, []),
    ],
)
def test_valid_layouts_place(gpu: GpuModel, layout: list[str]) -> None:
    placements = place_layout(gpu, layout)
    assert len(placements) == len(layout)
    validate_placements(gpu, placements)


@pytest.mark.parametrize(
    ("gpu", "layout", "match"),
    [
        (A100_40GB, ["1g.5gb"] * 8, "at most 7"),
        (A100_40GB, ["4g.20gb", "4g.20gb"], "at most 1"),
        (A100_40GB, ["3g.20gb"] * 3, "at most 2"),
        (A100_40GB, ["7g.40gb", "1g.5gb"], "compute"),
        (A100_40GB, ["4g.20gb", "2g.10gb", "2g.10gb"], "compute"),
        # compute fits (6 slices) but memory does not: 4 + 2 + 2 + ... slots, 1g.10gb x3 needs 6
        (A100_40GB, ["3g.20gb", "1g.10gb", "1g.10gb", "1g.10gb"], "no valid placement"),
        (H100_80GB, ["4g.40gb", "4g.40gb"], "at most 1"),
        (A30_24GB, ["4g.24gb", "1g.6gb"], "compute"),
    ],
)
def test_invalid_layouts_raise(gpu: GpuModel, layout: list[str], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        place_layout(gpu, layout)


def test_unknown_profile_is_a_value_error_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"no MIG profile '5g.30gb'.*3g\.20gb"):
        place_layout(A100_40GB, ["5g.30gb"])


def test_unknown_model() -> None:
    with pytest.raises(ValueError, match="unknown GPU model 'V100'"):
        gpu_model("V100")
    assert gpu_model("H100-80GB") is H100_80GB


@pytest.mark.parametrize(
    ("placements", "match"),
    [
        ([Placement("3g.20gb", 0), Placement("2g.10gb", 2)], "overlaps"),
        ([Placement("1g.5gb", 3), Placement("1g.5gb", 3)], "overlaps"),
        ([Placement("4g.20gb", 0), Placement("1g.10gb", 2)], "overlaps"),
        ([Placement("3g.20gb", 2)], "cannot start at 2"),
        ([Placement("1g.5gb", 7)], "cannot start at 7"),
        ([Placement("2g.10gb", 6)], "cannot start at 6"),
        ([Placement("4g.20gb", 4)], "cannot start at 4"),
        ([Placement("2g.10gb", 1)], "cannot start at 1"),
    ],
)
def test_validate_placements_rejects(placements: list[Placement], match: str) -> None:
    with pytest.raises(LayoutError, match=match):
        validate_placements(A100_40GB, placements)


def test_validate_placements_accepts_nvml_style_layout() -> None:
    validate_placements(
        A100_40GB,
        [Placement("2g.10gb", 0), Placement("2g.10gb", 2), Placement("2g.10gb", 4), Placement("1g.10gb", 6)],
    )
    validate_placements(
        A100_40GB,
        [Placement("3g.20gb", 4), Placement("2g.10gb", 0), Placement("1g.5gb", 2), Placement("1g.5gb", 3)],
    )
    validate_placements(A100_40GB, [])


@pytest.mark.parametrize("gpu", list(CATALOGUE.values()), ids=list(CATALOGUE))
def test_enumerated_layouts_are_valid_and_maximal(gpu: GpuModel) -> None:
    layouts = list(enumerate_layouts(gpu))
    assert layouts, f"{gpu.name} has no layout"
    assert len(layouts) == len(set(layouts))
    all_options = [Placement(p.name, s) for p in gpu.profiles for s in p.starts]
    for layout in layouts:
        validate_placements(gpu, layout)
        assert sum(gpu.profile(pl.profile).compute_slots for pl in layout) <= gpu.compute_slots
        assert sum(gpu.profile(pl.profile).mem_slots for pl in layout) <= gpu.mem_slots
        assert list(layout) == sorted(layout, key=lambda pl: (pl.start, pl.profile))
        # maximal: no further instance can be added
        for extra in all_options:
            with pytest.raises(LayoutError):
                validate_placements(gpu, [*layout, extra])
    # the whole GPU as one instance is always among the maximal layouts
    whole = max(gpu.profiles, key=lambda p: p.compute_slots)
    assert (Placement(whole.name, 0),) in layouts


@pytest.mark.parametrize("gpu", list(CATALOGUE.values()), ids=list(CATALOGUE))
def test_every_maximal_layout_can_be_placed_by_name(gpu: GpuModel) -> None:
    for layout in enumerate_layouts(gpu):
        placed = place_layout(gpu, [pl.profile for pl in layout])
        assert sorted(pl.profile for pl in placed) == sorted(pl.profile for pl in layout)


def test_all_layouts_include_the_maximal_ones() -> None:
    maximal = set(enumerate_layouts(A30_24GB))
    everything = list(enumerate_layouts(A30_24GB, maximal_only=False))
    assert maximal < set(everything)
    assert len(everything) == len(set(everything))
    for layout in everything:
        validate_placements(A30_24GB, layout)
    # every single instance is a (non-maximal unless whole-GPU) layout of its own
    singles = {layout for layout in everything if len(layout) == 1}
    assert singles == {(Placement(p.name, s),) for p in A30_24GB.profiles for s in p.starts}


def test_a30_maximal_layouts_exactly() -> None:
    got = set(enumerate_layouts(A30_24GB))
    p = Placement
    assert got == {
        (p("4g.24gb", 0),),
        (p("2g.12gb", 0), p("2g.12gb", 2)),
        (p("2g.12gb", 0), p("1g.6gb", 2), p("1g.6gb", 3)),
        (p("1g.6gb", 0), p("1g.6gb", 1), p("2g.12gb", 2)),
        (p("1g.6gb", 0), p("1g.6gb", 1), p("1g.6gb", 2), p("1g.6gb", 3)),
    }


@pytest.mark.parametrize("gpu", [A100_40GB, H100_80GB], ids=lambda g: g.name)
def test_enumeration_is_deterministic(gpu: GpuModel) -> None:
    assert list(enumerate_layouts(gpu)) == list(enumerate_layouts(gpu))
    assert list(enumerate_layouts(gpu, maximal_only=False)) == list(
        enumerate_layouts(gpu, maximal_only=False)
    )


def test_catalogue_is_consistent() -> None:
    for name, gpu in CATALOGUE.items():
        assert name == gpu.name
        names = [p.name for p in gpu.profiles]
        assert len(names) == len(set(names))
        for p in gpu.profiles:
            assert p.name.startswith(f"{p.compute_slots}g.")
            assert p.compute_slots <= gpu.compute_slots
            assert p.mem_mib <= gpu.total_mem_mib
            assert 1 <= p.max_count <= len(p.starts)
            for s in p.starts:
                assert s >= 0 and s + p.mem_slots <= gpu.mem_slots
