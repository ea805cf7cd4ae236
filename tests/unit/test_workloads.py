"""Atomizable workloads: any cut of the unit range, merged in any order, gives the one-piece result."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sja.workloads import BUILTIN, SpecError, run_in_one_piece, workload

PROPERTY = settings(max_examples=60, deadline=None)


@st.composite
def matmul_params(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "rows": draw(st.integers(1, 64)),
        "inner": draw(st.integers(1, 64)),
        "cols": draw(st.integers(1, 64)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


@st.composite
def montecarlo_params(draw: st.DrawFn) -> dict[str, Any]:
    return {
        "units": draw(st.integers(1, 40)),
        "samples_per_unit": draw(st.integers(1, 1000)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }


PARAMS = {"matmul": matmul_params(), "montecarlo": montecarlo_params()}


def cut(total: int, points: set[int]) -> list[tuple[int, int]]:
    edges = [0, *sorted(p for p in points if 0 < p < total), total]
    return [(a, b - a) for a, b in itertools.pairwise(edges)]


@st.composite
def job_and_cuts(draw: st.DrawFn) -> tuple[str, dict[str, Any], list[tuple[int, int]]]:
    name = draw(st.sampled_from(sorted(PARAMS)))
    params = draw(PARAMS[name])
    total = workload(name).total_units(workload(name).validate(params))
    points = draw(st.sets(st.integers(1, max(1, total - 1)), max_size=8))
    ranges = draw(st.permutations(cut(total, points)))
    return name, params, ranges


@PROPERTY
@given(case=job_and_cuts())
def test_any_cut_merged_in_any_order_equals_one_piece(
    case: tuple[str, dict[str, Any], list[tuple[int, int]]],
) -> None:
    name, params, ranges = case
    w = workload(name)
    p = w.validate(params)
    acc = b""
    for start, units in ranges:
        acc = w.merge(acc, w.run(p, start, units, b""))
    assert w.finalize(p, acc) == run_in_one_piece(name, params)


@PROPERTY
@given(case=job_and_cuts(), data=st.data())
def test_merging_is_associative(
    case: tuple[str, dict[str, Any], list[tuple[int, int]]], data: st.DataObject
) -> None:
    """Partial results merged as a random tree (as parallel agents would) still agree."""
    name, params, ranges = case
    w = workload(name)
    p = w.validate(params)
    parts = [w.run(p, s, k, b"") for s, k in ranges]
    while len(parts) > 1:
        i = data.draw(st.integers(0, len(parts) - 2))
        merged = w.merge(parts[i], parts[i + 1])
        parts[i : i + 2] = [merged]
    assert w.finalize(p, w.merge(b"", parts[0])) == run_in_one_piece(name, params)


def test_matmul_result_matches_numpy() -> None:
    from sja.workloads.matmul import _entries

    params = {"rows": 37, "inner": 19, "cols": 23, "seed": 4}
    a = _entries(np.arange(37), np.arange(19), 4, 1)
    b = _entries(np.arange(19), np.arange(23), 4, 2)
    c = (a @ b).astype(np.int64)
    got = run_in_one_piece("matmul", params)
    assert got == {
        "sum": int(c.sum()),
        "sumsq": int((c * c).sum()),
        "weighted": int(((np.arange(37) + 1) * c.sum(axis=1)).sum()),
        "rows": 37,
    }
    assert a.min() >= 0 and a.max() <= 9


def test_matmul_detects_a_misplaced_range() -> None:
    w = workload("matmul")
    p = w.validate({"rows": 20, "inner": 8, "cols": 8, "seed": 1})
    right = w.merge(w.run(p, 0, 10, b""), w.run(p, 10, 10, b""))
    wrong = w.merge(w.run(p, 0, 10, b""), w.run(p, 0, 10, b""))  # first half twice
    assert w.finalize(p, wrong)["rows"] == 20
    assert w.finalize(p, wrong) != w.finalize(p, right)


def test_matmul_depends_on_the_seed() -> None:
    a = run_in_one_piece("matmul", {"rows": 8, "inner": 8, "cols": 8, "seed": 1})
    b = run_in_one_piece("matmul", {"rows": 8, "inner": 8, "cols": 8, "seed": 2})
    assert a != b


def test_montecarlo_estimates_pi() -> None:
    result = run_in_one_piece("montecarlo", {"units": 40, "samples_per_unit": 1000, "seed": 9})
    assert result["samples"] == 40_000
    assert result["pi"] == 4.0 * result["hits"] / 40_000
    assert abs(result["pi"] - np.pi) < 0.05


def test_montecarlo_units_do_not_depend_on_the_subjob_that_draws_them() -> None:
    w = workload("montecarlo")
    p = w.validate({"units": 6, "samples_per_unit": 500, "seed": 3})
    whole = w.finalize(p, w.run(p, 0, 6, b""))
    singles = b""
    for u in range(6):
        singles = w.merge(singles, w.run(p, u, 1, b""))
    assert w.finalize(p, singles) == whole
    other_seed = w.validate({"units": 6, "samples_per_unit": 500, "seed": 4})
    assert w.finalize(other_seed, w.run(other_seed, 0, 6, b""))["hits"] != whole["hits"]


@pytest.mark.parametrize("name", BUILTIN)
def test_empty_accumulator_finalizes_to_zero_work(name: str) -> None:
    w = workload(name)
    p = w.validate({})
    out = w.finalize(p, b"")
    assert all(v == 0 for v in out.values())


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("matmul", {"rows": 4096, "inner": 1024, "cols": 1024, "seed": 0}),
        ("montecarlo", {"units": 200, "samples_per_unit": 100_000, "seed": 0}),
    ],
)
def test_validate_fills_defaults(name: str, expected: dict[str, Any]) -> None:
    w = workload(name)
    assert w.validate({}) == expected
    assert w.total_units(w.validate({})) == next(iter(expected.values()))


@pytest.mark.parametrize(
    ("name", "params", "field", "match"),
    [
        ("matmul", {"rows": 0}, "params.rows", "between 1 and"),
        ("matmul", {"rows": 10_000_001}, "params.rows", "between 1 and"),
        ("matmul", {"inner": 16_385}, "params.inner", "between"),
        ("matmul", {"cols": -1}, "params.cols", "between"),
        ("matmul", {"seed": 2**31}, "params.seed", "between"),
        ("matmul", {"rows": 3.0}, "params.rows", "expected an integer"),
        ("matmul", {"rows": "12"}, "params.rows", "expected an integer"),
        ("matmul", {"rows": True}, "params.rows", "expected an integer"),
        ("matmul", {"rows": None}, "params.rows", "expected an integer"),
        ("matmul", {"units": 5}, "params.units", "unknown parameter"),
        ("montecarlo", {"units": 0}, "params.units", "between"),
        ("montecarlo", {"samples_per_unit": 0}, "params.samples_per_unit", "between"),
        ("montecarlo", {"samples_per_unit": False}, "params.samples_per_unit", "integer"),
        ("montecarlo", {"seed": -1}, "params.seed", "between"),
        ("montecarlo", {"rows": 5, "zeta": 1}, "params.rows", "unknown parameter"),
    ],
)
def test_validate_rejects_bad_params(name: str, params: dict[str, Any], field: str, match: str) -> None:
    with pytest.raises(SpecError, match=match) as exc:
        workload(name).validate(params)
    assert exc.value.field == field


def test_unknown_workload() -> None:
    with pytest.raises(SpecError) as exc:
        workload("sorting")
    assert exc.value.field == "workload"
    assert "matmul" in exc.value.message and "montecarlo" in exc.value.message
    with pytest.raises(SpecError):
        run_in_one_piece("sorting", {})


@pytest.mark.parametrize("name", BUILTIN)
def test_declared_profiles_grow_with_the_job(name: str) -> None:
    w = workload(name)
    small = w.validate({})
    mem, time = w.declared_memory(small), w.declared_time(small)
    assert mem.base_mib > 0 and mem.per_unit_mib > 0
    assert time.per_unit_s > 0
    key = "samples_per_unit" if name == "montecarlo" else "inner"
    big = w.validate({key: small[key] * 2})
    assert w.declared_memory(big).per_unit_mib > mem.per_unit_mib
    assert w.declared_time(big).per_unit_s > time.per_unit_s


# --- large but valid matmul jobs -----------------------------------------------------------------


def test_matmul_checksum_of_a_subjob_near_the_row_limit_does_not_wrap() -> None:
    w = workload("matmul")
    p = w.validate({"rows": 10_000_000, "inner": 8192, "cols": 2048, "seed": 0})
    k = 2800  # ~2.8k rows of 8k x 2k: a subjob that fits a 3g.20gb slice
    out = w.finalize(p, w.merge(b"", w.run(p, 10_000_000 - k, k, b"")))
    # every entry of C is >= 0 and row weights are positive: no checksum can be negative
    assert out["sum"] >= 0 and out["sumsq"] >= 0
    assert out["weighted"] >= 0


def test_matmul_accumulator_holds_the_checksum_of_a_large_job() -> None:
    from sja.workloads.matmul import _Acc, _enc

    w = workload("matmul")
    p = w.validate({"rows": 2_000_000})
    # A row r of the default 1024 x 1024 product adds about (r + 1) * 2.1e7 to 'weighted': two
    # million rows sum to ~4.2e19 > 2**64, so eight subjobs of 250k rows report ~5.3e18 (~2**62)
    # each on average.
    # Partials are reduced modulo 2**61 - 1; their merge stays reduced and never overflows.
    from sja.workloads.matmul import MOD

    partial = _enc.encode(_Acc(total=1, sumsq=1, weighted=MOD - 5, rows=250_000))
    acc = b""
    for _ in range(8):
        acc = w.merge(acc, partial)
    assert w.finalize(p, acc)["weighted"] == (8 * (MOD - 5)) % MOD
