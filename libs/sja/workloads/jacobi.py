"""Jacobi sweeps for the Poisson equation: a sequential CPU workload whose state is a checkpoint.

The job solves ``-Δu = f`` on the unit square with ``u = 0`` on the boundary, discretized on a
``grid x grid`` interior mesh (five-point stencil, ``h = 1 / (grid + 1)``), by Jacobi iteration
from ``u = 0``. ``f`` holds seeded standard normal values, so every subjob regenerates it. Unit
``t`` is sweep ``t``: sweep ``t + 1`` needs the grid left by sweep ``t``, so the work cannot be
cut into independent ranges. The workload is sequential: each subjob continues from the previous
subjob's checkpoint (the grid, ``grid**2`` float64 values, as a blob the executor keeps in the
object store ``sja-checkpoints``) and returns the grid after its last sweep. Jacobi converges
slowly on this problem (the error shrinks by about ``1 - π²h²/2`` per sweep), so the grid after
``t`` sweeps differs from the grid after ``t + 1`` in its bits: a lost or repeated sweep shows in
the result.

A sweep is elementwise arithmetic in a fixed order (no BLAS, no threads) on float64 values that
the checkpoint stores exactly, so the job cut at any sweeps ends with exactly the grid of the job
in one piece; the result carries its SHA-256.

Memory is flat in the subjob's size: sweeps overwrite the same two grids, and nothing is kept per
sweep. The declaration is ``base = a few grids`` (``GRIDS_AT_PEAK``) and ``per_unit = 0``; the
profile learns the real base from the first completions.
"""

from __future__ import annotations

import hashlib
from typing import Any, ClassVar

import msgspec
import numpy as np

from sja.protocol.messages import MemoryDecl, TimeDecl
from sja.workloads.base import check_known, int_param
from sja.workloads.checkpoint import is_ref, pack_blob, summary_of, unpack_blob

_MIB = 1024 * 1024

GRIDS_AT_PEAK = 6.0
"""Grid-sized float64 arrays alive at the peak of a subjob, the input checkpoint aside (measured:
about 5: the two padded grids, ``h²f``, a temporary, the output grid's bytes)."""


class JacobiSummary(msgspec.Struct, frozen=True, kw_only=True):
    """What the job's state keeps of a checkpoint; the grid itself is the blob's data."""

    sweep: int = 0
    grid: int = 0
    residual_rms: float = 0.0
    """Root mean square of ``f + Δu`` after the last sweep."""
    update_max: float = 0.0
    """Largest change of one value in the last sweep."""
    solution_norm: float = 0.0
    """Discrete L2 norm of ``u`` (``h * ||u||``)."""
    solution_sha256: str = ""
    """Digest of the grid's float64 values: equal only for the very same iterate."""


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(JacobiSummary)


def source(grid: int, seed: int) -> np.ndarray:
    """The right-hand side ``f``: seeded standard normal values on the interior mesh."""
    return np.random.default_rng([seed, grid]).standard_normal((grid, grid))


def _neighbours(u: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Sum of the four neighbours of every interior point of the padded grid ``u``, into ``out``."""
    np.add(u[:-2, 1:-1], u[2:, 1:-1], out=out)
    out += u[1:-1, :-2]
    out += u[1:-1, 2:]
    return out


class Jacobi:
    name: ClassVar[str] = "jacobi"
    sequential: ClassVar[bool] = True

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(params, {"grid", "sweeps", "seed"})
        return {
            "sweeps": int_param(params, "sweeps", 2000, 1, 10_000_000),
            "grid": int_param(params, "grid", 256, 1, 4096),
            "seed": int_param(params, "seed", 0, 0, 2**31 - 1),
        }

    def total_units(self, params: dict[str, Any]) -> int:
        return int(params["sweeps"])

    def declared_memory(self, params: dict[str, Any]) -> MemoryDecl:
        grid_mib = (params["grid"] + 2) ** 2 * 8 / _MIB
        return MemoryDecl(base_mib=1.0 + GRIDS_AT_PEAK * grid_mib, per_unit_mib=0.0, rel_sd=0.2)

    def declared_time(self, params: dict[str, Any]) -> TimeDecl:
        points = params["grid"] ** 2
        # Start: f drawn, the checkpoint decoded and hashed, the residual, the output hashed (~50 ns a
        # value). A sweep: five passes over the grid (~2.5 ns a value in all).
        return TimeDecl(warmup_s=0.01 + points * 5e-8, per_unit_s=max(points * 2.5e-9, 1e-6), rel_sd=0.5)

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        n, seed = params["grid"], params["seed"]
        if is_ref(checkpoint):
            raise RuntimeError(
                "checkpoint reference was not resolved: the executor fetches it from the store"
            )
        u = np.zeros((n + 2, n + 2))
        sweep = 0
        if checkpoint:
            blob = unpack_blob(checkpoint)
            s = _dec.decode(blob.summary)
            if s.grid != n or len(blob.data) != n * n * 8:
                raise ValueError(f"checkpoint holds a {s.grid}x{s.grid} grid, the job's is {n}x{n}")
            if hashlib.sha256(blob.data).hexdigest() != s.solution_sha256:
                raise ValueError(f"checkpoint of sweep {s.sweep} does not match its digest")
            sweep = s.sweep
            u[1:-1, 1:-1] = np.frombuffer(blob.data, dtype=np.float64).reshape(n, n)
            del blob
        if sweep != unit_start:
            raise ValueError(f"checkpoint is at sweep {sweep}, the subjob starts at sweep {unit_start}")
        h2 = 1.0 / (n + 1) ** 2
        h2f = source(n, seed)
        h2f *= h2
        v = np.zeros_like(u)
        tmp = np.empty((n, n))
        for _ in range(units):
            _neighbours(u, tmp)
            tmp += h2f
            np.multiply(tmp, 0.25, out=v[1:-1, 1:-1])
            u, v = v, u
        # v now holds the grid before the last sweep
        np.subtract(u[1:-1, 1:-1], v[1:-1, 1:-1], out=tmp)
        update_max = float(np.abs(tmp, out=tmp).max())
        # f + Δu = (h²f + neighbours - 4u) / h²
        _neighbours(u, tmp)
        tmp += h2f
        tmp -= 4.0 * u[1:-1, 1:-1]
        residual_rms = float(np.sqrt(np.mean(tmp * tmp))) / h2
        del tmp, h2f, v
        data = np.ascontiguousarray(u[1:-1, 1:-1]).tobytes()
        summary = JacobiSummary(
            sweep=unit_start + units,
            grid=n,
            residual_rms=residual_rms,
            update_max=update_max,
            solution_norm=float(np.sqrt(np.sum(u * u))) / (n + 1),
            solution_sha256=hashlib.sha256(data).hexdigest(),
        )
        return pack_blob(_enc.encode(summary), data)

    def merge(self, acc: bytes, partial: bytes) -> bytes:
        return partial

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
        raw = summary_of(acc)
        s = _dec.decode(raw) if raw else JacobiSummary()
        # Where the checkpoint is kept is left out: the result of a cut job equals the one-piece one.
        return {
            "sweeps": s.sweep,
            "residual_rms": s.residual_rms,
            "update_max": s.update_max,
            "solution_norm": s.solution_norm,
            "solution_sha256": s.solution_sha256,
        }
