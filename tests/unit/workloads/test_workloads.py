"""Atomizable workloads: any cut of the unit range, merged in any order, gives the one-piece result."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sja.workloads import BUILTIN, SpecError, run_in_one_piece, workload
from sja.workloads import checkpoint as ckpt

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
    assert out and all(not v for v in out.values())


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("matmul", {"rows": 4096, "inner": 1024, "cols": 1024, "seed": 0}),
        ("montecarlo", {"units": 200, "samples_per_unit": 100_000, "seed": 0}),
        ("jacobi", {"sweeps": 2000, "grid": 256, "seed": 0}),
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
        ("jacobi", {"sweeps": 0}, "params.sweeps", "between"),
        ("jacobi", {"grid": 4097}, "params.grid", "between"),
        ("jacobi", {"grid": 2.5}, "params.grid", "expected an integer"),
        ("jacobi", {"units": 10}, "params.units", "unknown parameter"),
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


@pytest.mark.parametrize("name", ["matmul", "montecarlo"])
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


# --- jacobi: a sequential workload whose state passes through checkpoints ---------------------------


def through_the_store(out: bytes, name: str) -> tuple[bytes, bytes]:
    """What the executor does with a sequential subjob's output: the job keeps a reference (its
    accumulator), the next subjob gets the blob back from the store. Returns ``(ref, next input)``."""
    blob = ckpt.unpack_blob(out)
    ref = ckpt.make_ref(ckpt.BUCKET, name, blob)
    got = ckpt.unpack_ref(ref)
    assert got.sha256 == ckpt.digest(blob.data)
    return ref, ckpt.pack_blob(got.summary, blob.data)


def run_cut(params: dict[str, Any], ranges: list[tuple[int, int]]) -> dict[str, Any]:
    w = workload("jacobi")
    p = w.validate(params)
    acc, given = b"", b""
    for i, (start, units) in enumerate(ranges):
        acc_ref, given = through_the_store(w.run(p, start, units, given), f"job/s{i}")
        acc = w.merge(acc, acc_ref)
    return w.finalize(p, acc)


@st.composite
def jacobi_cuts(draw: st.DrawFn) -> tuple[dict[str, Any], list[tuple[int, int]]]:
    params = {
        "grid": draw(st.integers(1, 24)),
        "sweeps": draw(st.integers(1, 80)),
        "seed": draw(st.integers(0, 2**31 - 1)),
    }
    points = draw(st.sets(st.integers(1, max(1, params["sweeps"] - 1)), max_size=10))
    return params, cut(params["sweeps"], points)


@PROPERTY
@given(case=jacobi_cuts())
def test_jacobi_any_cut_through_checkpoints_equals_one_piece(
    case: tuple[dict[str, Any], list[tuple[int, int]]],
) -> None:
    params, ranges = case
    assert run_cut(params, ranges) == run_in_one_piece("jacobi", params)


def reference_jacobi(grid: int, sweeps: int, seed: int) -> np.ndarray:
    """The iteration written plainly: a new padded grid per sweep."""
    from sja.workloads.jacobi import source

    h2f = source(grid, seed) * (1.0 / (grid + 1) ** 2)
    u = np.zeros((grid + 2, grid + 2))
    for _ in range(sweeps):
        new = np.zeros_like(u)
        new[1:-1, 1:-1] = (u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:] + h2f) * 0.25
        u = new
    return np.ascontiguousarray(u[1:-1, 1:-1])


def test_jacobi_grid_is_the_plain_iteration_bit_for_bit() -> None:
    import hashlib

    got = run_in_one_piece("jacobi", {"grid": 13, "sweeps": 37, "seed": 5})
    want = reference_jacobi(13, 37, 5)
    assert got["solution_sha256"] == hashlib.sha256(want.tobytes()).hexdigest()
    assert got["sweeps"] == 37
    assert got["solution_norm"] == pytest.approx(float(np.linalg.norm(want)) / 14, rel=1e-12)


def test_jacobi_converges_to_the_solution_of_the_linear_system() -> None:
    from sja.workloads.jacobi import source

    n = 6
    f = source(n, 3)
    lap = np.zeros((n * n, n * n))
    for i in range(n):
        for j in range(n):
            k = i * n + j
            lap[k, k] = 4.0
            for a, b in ((i - 1, j), (i + 1, j), (i, j - 1), (i, j + 1)):
                if 0 <= a < n and 0 <= b < n:
                    lap[k, a * n + b] = -1.0
    exact = np.linalg.solve(lap * (n + 1) ** 2, f.ravel())
    w = workload("jacobi")
    p = w.validate({"grid": n, "sweeps": 400, "seed": 3})
    early = w.finalize(p, w.run(p, 0, 20, b""))
    out = w.run(p, 0, 400, b"")
    late = w.finalize(p, out)
    blob = ckpt.unpack_blob(out)
    u = np.frombuffer(blob.data, dtype=np.float64)
    assert np.max(np.abs(u - exact)) < 1e-9 * np.max(np.abs(exact))
    assert late["residual_rms"] < 1e-6 * early["residual_rms"]
    assert late["update_max"] < early["update_max"]


def test_jacobi_every_sweep_changes_the_grid() -> None:
    """A lost or repeated sweep shows in the result: no two sweep counts give the same grid."""
    w = workload("jacobi")
    p = w.validate({"grid": 64, "sweeps": 300, "seed": 1})
    digests, given = [], b""
    for t in range(0, 300, 30):
        out = w.run(p, t, 30, given)
        digests.append(w.finalize(p, out)["solution_sha256"])
        _, given = through_the_store(out, f"j/s{t}")
    assert len(set(digests)) == len(digests)
    assert w.finalize(p, out) == run_in_one_piece("jacobi", {"grid": 64, "sweeps": 300, "seed": 1})


def test_jacobi_refuses_a_checkpoint_that_is_not_where_the_subjob_starts() -> None:
    w = workload("jacobi")
    p = w.validate({"grid": 8, "sweeps": 30, "seed": 2})
    at_10 = w.run(p, 0, 10, b"")
    with pytest.raises(ValueError, match="at sweep 0, the subjob starts at sweep 10"):
        w.run(p, 10, 5, b"")  # the state was lost: starting from zero would be wrong
    with pytest.raises(ValueError, match="at sweep 10, the subjob starts at sweep 12"):
        w.run(p, 12, 5, at_10)
    blob = ckpt.unpack_blob(at_10)
    half = ckpt.pack_blob(blob.summary, blob.data[: len(blob.data) // 2])
    with pytest.raises(ValueError, match="grid"):
        w.run(p, 10, 5, half)
    flipped = bytearray(blob.data)
    flipped[3] ^= 1
    with pytest.raises(ValueError, match="does not match its digest"):
        w.run(p, 10, 5, ckpt.pack_blob(blob.summary, bytes(flipped)))
    other = w.validate({"grid": 9, "sweeps": 30, "seed": 2})
    with pytest.raises(ValueError, match="9x9"):
        w.run(other, 10, 5, at_10)
    with pytest.raises(RuntimeError, match="not resolved"):
        w.run(p, 10, 5, ckpt.make_ref(ckpt.BUCKET, "j/s0", blob))


def test_jacobi_memory_is_flat_in_the_sweeps_and_grows_with_the_grid() -> None:
    import json
    import subprocess
    import sys

    # Measured in a process of its own: tracemalloc counts every thread's allocations, and threads
    # that other tests leave behind would add theirs.
    script = """
import json, tracemalloc
from sja.workloads import workload
w = workload("jacobi")
p = w.validate({"grid": 400, "sweeps": 100, "seed": 0})
given = w.run(p, 0, 1, b"")
peaks = []
for units in (1, 60):
    tracemalloc.start()
    w.run(p, 1, units, given)
    peaks.append(tracemalloc.get_traced_memory()[1] / 2**20)
    tracemalloc.stop()
print(json.dumps(peaks))
"""
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    peaks = json.loads(out.stdout.strip().splitlines()[-1])
    w = workload("jacobi")
    p = w.validate({"grid": 400, "sweeps": 100, "seed": 0})
    declared = w.declared_memory(p)
    assert declared.per_unit_mib == 0.0
    assert peaks[1] == pytest.approx(peaks[0], rel=0.05)
    assert 0.6 * declared.base_mib < peaks[1] <= declared.base_mib
    big = w.validate({"grid": 800})
    assert w.declared_memory(big).base_mib > 3 * declared.base_mib
    assert w.declared_time(big).per_unit_s > 3 * w.declared_time(p).per_unit_s
    assert w.sequential
