"""MIG catalogue: which layouts a GPU can hold, and where their instances sit."""

from __future__ import annotations

import pytest

from sja.core.mig import (
    A30_24GB,
    A100_40GB,
    CATALOGUE,
    H100_80GB,
    H100_94GB,
    H200_141GB,
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
    plain = {
        (p("4g.24gb", 0),),
        (p("2g.12gb", 0), p("2g.12gb", 2)),
        (p("2g.12gb", 0), p("1g.6gb", 2), p("1g.6gb", 3)),
        (p("1g.6gb", 0), p("1g.6gb", 1), p("2g.12gb", 2)),
        (p("1g.6gb", 0), p("1g.6gb", 1), p("1g.6gb", 2), p("1g.6gb", 3)),
    }
    # Each plain layout again with exactly one of its instances taking the media extensions.
    with_media = {
        tuple(Placement(pl.profile + "+me", pl.start) if i == k else pl for i, pl in enumerate(layout))
        for layout in plain
        for k in range(len(layout))
        if layout[k].profile != "4g.24gb"
    }
    assert len(with_media) == 12
    assert got == plain | with_media


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


# Every GPU's catalogue against the published figures: (compute slices, memory slices, MiB, maximum
# count, placement starts). Profiles and counts: NVIDIA MIG user guide, "Supported MIG Profiles".
# Memory (GiB * 1024 of ``nvidia-smi mig -lgip``) and placements (``-lgipp``): the sources named in
# ``sja.core.mig`` beside each model.
_SEVEN = (0, 1, 2, 3, 4, 5, 6)
PUBLISHED: dict[str, dict[str, tuple[int, int, int, int, tuple[int, ...]]]] = {
    # -lgip/-lgipp on an A30, driver 535.183.01 (5.81, 11.69 GiB); 4g.24gb 23.50 GiB in two others.
    "A30-24GB": {
        "1g.6gb": (1, 1, 5952, 4, (0, 1, 2, 3)),
        "1g.6gb+me": (1, 1, 5952, 1, (0, 1, 2, 3)),
        "2g.12gb": (2, 2, 11968, 2, (0, 2)),
        "2g.12gb+me": (2, 2, 11968, 1, (0, 2)),
        "4g.24gb": (4, 4, 24064, 1, (0,)),
    },
    # -lgip on A100-SXM4-40GB: 4.75, 9.62, 9.62, 19.50, 19.50, 39.25 GiB.
    "A100-40GB": {
        "1g.5gb": (1, 1, 4864, 7, _SEVEN),
        "1g.5gb+me": (1, 1, 4864, 1, _SEVEN),
        "1g.10gb": (1, 2, 9856, 4, (0, 2, 4, 6)),
        "2g.10gb": (2, 2, 9856, 3, (0, 2, 4)),
        "3g.20gb": (3, 4, 19968, 2, (0, 4)),
        "4g.20gb": (4, 4, 19968, 1, (0,)),
        "7g.40gb": (7, 8, 40192, 1, (0,)),
    },
    # -lgip on an A100 80GB PCIe, driver 515.86.01: 9.50, 19.50, 39.25, 79.00 GiB.
    "A100-80GB": {
        "1g.10gb": (1, 1, 9728, 7, _SEVEN),
        "1g.10gb+me": (1, 1, 9728, 1, _SEVEN),
        "1g.20gb": (1, 2, 19968, 4, (0, 2, 4, 6)),
        "2g.20gb": (2, 2, 19968, 3, (0, 2, 4)),
        "3g.40gb": (3, 4, 40192, 2, (0, 4)),
        "4g.40gb": (4, 4, 40192, 1, (0,)),
        "7g.80gb": (7, 8, 80896, 1, (0,)),
    },
    # -lgip on H100 SXM5 80GB: 9.75, 19.62, 39.50, 79.25 GiB.
    "H100-80GB": {
        "1g.10gb": (1, 1, 9984, 7, _SEVEN),
        "1g.10gb+me": (1, 1, 9984, 1, _SEVEN),
        "1g.20gb": (1, 2, 20096, 4, (0, 2, 4, 6)),
        "2g.20gb": (2, 2, 20096, 3, (0, 2, 4)),
        "3g.40gb": (3, 4, 40448, 2, (0, 4)),
        "4g.40gb": (4, 4, 40448, 1, (0,)),
        "7g.80gb": (7, 8, 81152, 1, (0,)),
    },
    # -lgip/-lgipp on an H100 NVL, driver 560.35.03: 10.75, 21.62, 46.38, 93.12 GiB.
    "H100-94GB": {
        "1g.12gb": (1, 1, 11008, 7, _SEVEN),
        "1g.12gb+me": (1, 1, 11008, 1, _SEVEN),
        "1g.24gb": (1, 2, 22144, 4, (0, 2, 4, 6)),
        "2g.24gb": (2, 2, 22144, 3, (0, 2, 4)),
        "3g.47gb": (3, 4, 47488, 2, (0, 4)),
        "4g.47gb": (4, 4, 47488, 1, (0,)),
        "7g.94gb": (7, 8, 95360, 1, (0,)),
    },
    # -lgip of an H200 node (NVIDIA/mig-parted#120): 16.00, 32.25, 69.50, 139.75 GiB.
    "H200-141GB": {
        "1g.18gb": (1, 1, 16384, 7, _SEVEN),
        "1g.18gb+me": (1, 1, 16384, 1, _SEVEN),
        "1g.35gb": (1, 2, 33024, 4, (0, 2, 4, 6)),
        "2g.35gb": (2, 2, 33024, 3, (0, 2, 4)),
        "3g.71gb": (3, 4, 71168, 2, (0, 4)),
        "4g.71gb": (4, 4, 71168, 1, (0,)),
        "7g.141gb": (7, 8, 143104, 1, (0,)),
    },
}


@pytest.mark.parametrize("model", list(PUBLISHED))
def test_catalogue_matches_the_published_figures(model: str) -> None:
    gpu = gpu_model(model)
    got = {p.name: (p.compute_slots, p.mem_slots, p.mem_mib, p.max_count, p.starts) for p in gpu.profiles}
    assert got == PUBLISHED[model]
    # Profile memory comes in 64 MiB units, which two decimals of GiB tell apart exactly.
    assert all(p.mem_mib % 64 == 0 for p in gpu.profiles)


def test_catalogue_covers_every_model() -> None:
    assert set(PUBLISHED) == set(CATALOGUE)


@pytest.mark.parametrize("gpu", list(CATALOGUE.values()), ids=list(CATALOGUE))
def test_every_gpu_has_one_media_extension_profile_per_small_instance(gpu: GpuModel) -> None:
    media = [p for p in gpu.profiles if p.media_extension]
    assert media, f"{gpu.name} lists no +me profile"
    for p in media:
        plain = gpu.profile(p.name.removesuffix("+me"))
        assert (p.compute_slots, p.mem_slots, p.mem_mib, p.starts) == (
            plain.compute_slots,
            plain.mem_slots,
            plain.mem_mib,
            plain.starts,
        )
        assert p.max_count == 1


@pytest.mark.parametrize(
    ("gpu", "layout", "match"),
    [
        (A100_40GB, ["1g.5gb+me", "1g.5gb+me"], r"at most 1 x 1g\.5gb\+me"),
        (H100_80GB, ["1g.10gb+me", "1g.10gb+me", "3g.40gb"], r"at most 1 x 1g\.10gb\+me"),
        # the A30's two +me profiles fit by memory and compute, but share the one set of engines
        (A30_24GB, ["1g.6gb+me", "2g.12gb+me"], r"one media-extension \(\+me\) instance"),
        (A30_24GB, ["2g.12gb+me", "1g.6gb", "1g.6gb+me"], r"one media-extension \(\+me\) instance"),
    ],
)
def test_two_media_extension_instances_on_one_gpu_are_invalid(
    gpu: GpuModel, layout: list[str], match: str
) -> None:
    with pytest.raises(LayoutError, match=match):
        place_layout(gpu, layout)


def test_validate_placements_rejects_a_second_media_extension() -> None:
    with pytest.raises(LayoutError, match=r"one media-extension"):
        validate_placements(A30_24GB, [Placement("1g.6gb+me", 0), Placement("2g.12gb+me", 2)])
    with pytest.raises(LayoutError, match=r"at most 1 x 1g\.5gb\+me"):
        validate_placements(A100_40GB, [Placement("1g.5gb+me", 0), Placement("1g.5gb+me", 1)])


@pytest.mark.parametrize(
    ("gpu", "layout", "expected"),
    [
        (
            A100_40GB,
            ["3g.20gb", "2g.10gb", "1g.5gb+me", "1g.5gb"],
            (
                Placement("2g.10gb", 0),
                Placement("1g.5gb+me", 2),
                Placement("1g.5gb", 3),
                Placement("3g.20gb", 4),
            ),
        ),
        (A30_24GB, ["2g.12gb+me", "1g.6gb", "1g.6gb"], None),
        (H200_141GB, ["1g.18gb+me"] + ["1g.18gb"] * 6, None),
        (H100_94GB, ["4g.47gb", "2g.24gb", "1g.12gb+me"], None),
    ],
)
def test_a_layout_with_one_media_extension_places(
    gpu: GpuModel, layout: list[str], expected: tuple[Placement, ...] | None
) -> None:
    placements = place_layout(gpu, layout)
    validate_placements(gpu, placements)
    assert sorted(pl.profile for pl in placements) == sorted(layout)
    if expected is not None:
        assert placements == expected


@pytest.mark.parametrize("gpu", list(CATALOGUE.values()), ids=list(CATALOGUE))
def test_enumerated_layouts_include_media_extensions_once_at_most(gpu: GpuModel) -> None:
    layouts = list(enumerate_layouts(gpu, maximal_only=False))
    counts = [sum(gpu.profile(pl.profile).media_extension for pl in layout) for layout in layouts]
    assert max(counts) == 1
    maximal = list(enumerate_layouts(gpu))
    # every +me profile appears in some maximal layout, at every start it may take
    for p in gpu.profiles:
        if p.media_extension:
            starts = {pl.start for layout in maximal for pl in layout if pl.profile == p.name}
            assert starts == set(p.starts)
