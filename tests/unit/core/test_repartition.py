"""Repartitionable MIG layouts (``sja.core.repartition``): the pure choice of a GPU's layout for the
demand that waits, and the plan that spreads demand over GPUs."""

from __future__ import annotations

from sja.core.mig import A100_40GB, A100_80GB, place_layout
from sja.core.repartition import (
    BusyGpu,
    HeldSlice,
    SliceDemand,
    canonical_layout,
    choose_layout,
    demand_of,
    held_demand,
    layout_value,
    maximal_layouts,
    plan_drains,
    plan_repartitions,
    served_value,
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


# --- draining busy GPUs --------------------------------------------------------------------------

CUT = ("4g.40gb", "3g.40gb")
WHOLE_MEM = SliceDemand(60_000.0, 1.0, "big")
"""Needs more memory than a 4g.40gb holds: only a whole A100-80GB serves it."""


def busy(gpu_id: str, frees_in_s: float, rate: float = 4 / 7, *, since: float = 1e9) -> BusyGpu:
    held = (HeldSlice("4g.40gb", 4 / 7, rate, frees_in_s, 10.0), HeldSlice("3g.40gb", 3 / 7, 0.0, 0.0))
    return BusyGpu(gpu_id, A100_80GB, CUT, held, since)


def test_a_job_too_large_for_every_layout_in_place_drains_the_cheapest_gpu() -> None:
    gpus = [busy("slow", frees_in_s=3000.0), busy("soon", frees_in_s=60.0)]
    plan = plan_drains(gpus, [WHOLE_MEM], in_place=[CUT], reconfig_s=5.0, payoff_s=600.0)
    assert [(r.gpu_id, r.new) for r in plan] == [("soon", ("7g.80gb",))]
    # two such jobs: two GPUs, never more than the starving demand needs
    two = [WHOLE_MEM, SliceDemand(60_000.0, 1.0, "big2")]
    plan = plan_drains(gpus, two, in_place=[CUT], reconfig_s=5.0, payoff_s=600.0)
    assert sorted(r.gpu_id for r in plan) == ["slow", "soon"]
    # a layout in place (or coming: a GPU being re-cut) that holds it: no drain for it
    assert plan_drains(gpus, [WHOLE_MEM], in_place=[("7g.80gb",)], reconfig_s=5.0, payoff_s=0.0) == []


def test_a_drain_for_demand_a_layout_in_place_holds_must_pay_within_the_payoff_span() -> None:
    small = [SliceDemand(9000.0, 1 / 7, f"s{i}") for i in range(7)]
    # a whole GPU held by a job that uses a seventh of it, seven such jobs waiting: re-cut it
    whole = BusyGpu("w", A100_80GB, ("7g.80gb",), (HeldSlice("7g.80gb", 1.0, 1 / 7, 30.0, 10.0, small[0]),))
    plan = plan_drains([whole], small, in_place=[("7g.80gb",)], reconfig_s=5.0, payoff_s=600.0)
    assert [r.new for r in plan] == [("1g.10gb",) * 7]
    # not when the payoff span is too short to win back the drain, nor right after a re-cut
    assert plan_drains([whole], small, in_place=[("7g.80gb",)], reconfig_s=5.0, payoff_s=1.0) == []
    young = BusyGpu("w", A100_80GB, ("7g.80gb",), whole.slices, since_recut_s=100.0)
    assert plan_drains([young], small, in_place=[("7g.80gb",)], reconfig_s=5.0, payoff_s=600.0) == []
    # a GPU whose slices are all well used is not drained
    full = BusyGpu("f", A100_80GB, ("7g.80gb",), (HeldSlice("7g.80gb", 1.0, 1.0, 30.0, 10.0, WHOLE_MEM),))
    assert plan_drains([full], small, in_place=[("7g.80gb",)], reconfig_s=5.0, payoff_s=600.0) == []


def test_whole_when_jobs_want_whole_gpus_cut_when_small_jobs_wait() -> None:
    assert served_value(1.0, 1.0) == 1.0
    assert served_value(3 / 7, 1.0) < 3 / 7  # a whole-GPU job on a 3g runs at 3/7 of its speed
    assert abs(served_value(1 / 7, 1 / 7) * 7 - 1.0) < 1e-9
    # two whole-GPU jobs: one on a whole GPU beats both on 4g+3g
    assert choose_layout(A100_80GB, CUT, [SliceDemand(9000.0, 1.0)] * 2) == ("7g.80gb",)


def test_demand_follows_queue_order_one_item_per_startable_subjob() -> None:
    profiles = {"a": ["1g.10gb"], "b": [], "c": ["7g.80gb", "4g.40gb"]}
    items = demand_of([("a", 0.1, 2), ("b", 1.0, 3), ("c", 1.0, 9)], lambda j: profiles[j])
    assert [d.key for d in items] == ["a", "a"] + ["c"] * 7
    assert items[2].profiles == frozenset({"7g.80gb", "4g.40gb"})
    assert len(demand_of([("c", 1.0, 9)], lambda j: profiles[j], limit=3)) == 3


def test_a_whole_gpu_job_stuck_on_a_3g_gets_its_gpu_made_whole_with_nobody_waiting() -> None:
    # Two jobs that can use a whole GPU each, on the 4g and the 3g of one GPU, past their windows:
    # one of them on a whole GPU is worth more than both on the pieces (the other finds another slice).
    held = (
        HeldSlice("4g.40gb", 4 / 7, served_value(4 / 7, 1.0), 0.0, 10.0, held_demand("a", 40_448, 1.0)),
        HeldSlice("3g.40gb", 3 / 7, served_value(3 / 7, 1.0), 0.0, 10.0, held_demand("b", 40_448, 1.0)),
    )
    gpu = BusyGpu("g", A100_80GB, CUT, held)
    plan = plan_drains([gpu], [], in_place=[], reconfig_s=5.0, payoff_s=600.0)
    assert [r.new for r in plan] == [("7g.80gb",)]
    # a holder only ever moves to an instance at least as large as the one it runs in
    small = (HeldSlice("7g.80gb", 1.0, served_value(1.0, 1 / 7), 0.0, 10.0, held_demand("s", 80_640, 1 / 7)),)
    assert (
        plan_drains(
            [BusyGpu("w", A100_80GB, ("7g.80gb",), small)], [], in_place=[], reconfig_s=5.0, payoff_s=600.0
        )
        == []
    )
