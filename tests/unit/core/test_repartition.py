"""Repartitionable MIG layouts (``sja.core.repartition``): the pure choice of a GPU's layout for the
demand that waits, and the plan that spreads demand over GPUs."""

from __future__ import annotations

from sja.core.mig import A100_40GB, A100_80GB, place_layout
from sja.core.repartition import (
    SliceDemand,
    canonical_layout,
    choose_layout,
    layout_value,
    maximal_layouts,
    plan_repartitions,
)

SMALL = SliceDemand(9000.0, 1 / 7)
"""Fits a 1g.10gb slice of an A100-80GB and uses no more than its compute."""
SEVEN_1G = ("1g.10gb",) * 7


def test_every_maximal_layout_is_valid_and_distinct() -> None:
    for gpu in (A100_40GB, A100_80GB):
        layouts = maximal_layouts(gpu)
        assert len(layouts) == len({tuple(sorted(lay)) for lay in layouts}) > 10
        for layout in layouts:
            place_layout(gpu, layout)
        assert maximal_layouts(gpu) == layouts, "deterministic"


def test_small_jobs_get_small_slices_and_whole_gpu_jobs_do_not() -> None:
    assert choose_layout(A100_80GB, None, [SMALL] * 7) == SEVEN_1G
    # seven whole-GPU jobs on seven slices: more jobs served, no more throughput; keep the GPU whole
    assert choose_layout(A100_80GB, None, [SliceDemand(9000.0, 1.0)] * 7) is None
    # one small job: a 1g slice gives it no more than the whole GPU does
    assert choose_layout(A100_80GB, None, [SMALL]) is None
    # a job too large for every slice of the current layout brings the whole GPU back
    assert choose_layout(A100_80GB, SEVEN_1G, [SliceDemand(50_000.0, 1.0)]) == ("7g.80gb",)
    # nothing waits, or nothing fits any layout: keep
    assert choose_layout(A100_80GB, SEVEN_1G, []) is None
    assert choose_layout(A100_80GB, SEVEN_1G, [SliceDemand(90_000.0)]) is None


def test_demand_restricted_to_profiles_is_honoured() -> None:
    # a job whose planner accepts only 3g and larger slices (say, for time) is not served by 1g
    picky = SliceDemand(0.0, 3 / 7, profiles=frozenset({"3g.40gb", "4g.40gb", "7g.80gb"}))
    assert layout_value(A100_80GB, SEVEN_1G, [picky]) == (0.0, 0)
    chosen = choose_layout(A100_80GB, SEVEN_1G, [picky, picky])
    assert chosen is not None and set(chosen) <= {"3g.40gb", "4g.40gb"}
    assert layout_value(A100_80GB, chosen, [picky, picky]) == (round(6 / 7, 9), 2)


def test_plan_spreads_demand_over_gpus_in_order() -> None:
    gpus = [("a", A100_80GB, None), ("b", A100_80GB, None), ("c", A100_80GB, None)]
    plan = plan_repartitions(gpus, [SMALL] * 9)
    assert [r.gpu_id for r in plan] == ["a", "b"], "the third GPU has nothing left to serve"
    assert plan[0].new == SEVEN_1G and len(plan[0].serves) == 7
    assert len(plan[1].serves) == 2
    assert plan[0].old == canonical_layout(A100_80GB, None) == ("7g.80gb",)
    assert plan_repartitions(gpus, [SMALL] * 9) == plan
