"""Chunked matrix product: ``C = A @ B`` computed in row blocks.

``A`` (rows x inner) and ``B`` (inner x cols) hold small integers generated from the row/column
index and a seed, so any row range can be produced on its own and float64 products are exact. A
subjob over rows ``[s, s + k)`` needs ``B`` plus ``k`` rows of ``A`` and ``C``: memory grows linearly
with the chunk size. The result is an exact checksum of ``C``: the sum of its entries, the sum of their
squares, and the sum of row sums weighted by row index (so a misplaced row changes it), each modulo the
Mersenne prime ``2**61 - 1`` so that any job size fits a 64-bit accumulator.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
import numpy as np

from sja.protocol.messages import MemoryDecl, TimeDecl
from sja.workloads.base import check_known, int_param

_MIB = 1024 * 1024
MOD = 2**61 - 1
"""Checksums are kept modulo this prime."""


def _entries(rows: np.ndarray, cols: np.ndarray, seed: int, salt: int) -> np.ndarray:
    """Deterministic 0..9 integers for every (row, col) pair, as float64."""
    r = rows.astype(np.uint64)[:, None]
    c = cols.astype(np.uint64)[None, :]
    h = (r * np.uint64(2654435761) + c * np.uint64(40503) + np.uint64(seed * 7919 + salt)) & np.uint64(
        0xFFFFFFFF
    )
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(1274126177)) & np.uint64(0xFFFFFFFF)
    return ((h >> np.uint64(7)) % np.uint64(10)).astype(np.float64)


class _Acc(msgspec.Struct, array_like=True):
    total: int = 0
    sumsq: int = 0
    weighted: int = 0
    rows: int = 0


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(_Acc)


class MatMul:
    name: ClassVar[str] = "matmul"
    sequential: ClassVar[bool] = False

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(params, {"rows", "inner", "cols", "seed"})
        return {
            "rows": int_param(params, "rows", 4096, 1, 10_000_000),
            "inner": int_param(params, "inner", 1024, 1, 16_384),
            "cols": int_param(params, "cols", 1024, 1, 16_384),
            "seed": int_param(params, "seed", 0, 0, 2**31 - 1),
        }

    def total_units(self, params: dict[str, Any]) -> int:
        return int(params["rows"])

    def declared_memory(self, params: dict[str, Any]) -> MemoryDecl:
        inner, cols = params["inner"], params["cols"]
        base = 1.5 * inner * cols * 8 / _MIB + 8.0  # B plus its generation temporaries
        per_row = (2 * inner + 3 * cols) * 8 / _MIB  # A row + temporaries, C row + int copies
        return MemoryDecl(base_mib=base, per_unit_mib=per_row, rel_sd=0.3)

    def declared_time(self, params: dict[str, Any]) -> TimeDecl:
        inner, cols = params["inner"], params["cols"]
        flops_per_row = 2.0 * inner * cols
        return TimeDecl(warmup_s=0.05 + inner * cols * 4e-8, per_unit_s=flops_per_row / 1e10, rel_sd=0.5)

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        inner, cols, seed = params["inner"], params["cols"], params["seed"]
        rows = np.arange(unit_start, unit_start + units, dtype=np.int64)
        a = _entries(rows, np.arange(inner), seed, 1)
        b = _entries(np.arange(inner), np.arange(cols), seed, 2)
        c = (a @ b).astype(np.int64)
        # Per row in int64 (entries <= 81 * inner, a row of squares < 2**63); across rows in Python
        # integers, reduced modulo MOD: no wrap-around whatever the job's size.
        row_sums = c.sum(axis=1).tolist()
        row_sq = (c * c).sum(axis=1).tolist()
        acc = _Acc(
            total=sum(row_sums) % MOD,
            sumsq=sum(row_sq) % MOD,
            weighted=sum((r + 1) * s for r, s in zip(rows.tolist(), row_sums, strict=True)) % MOD,
            rows=units,
        )
        return _enc.encode(acc)

    def merge(self, acc: bytes, partial: bytes) -> bytes:
        x = _dec.decode(acc) if acc else _Acc()
        y = _dec.decode(partial)
        return _enc.encode(
            _Acc(
                total=(x.total + y.total) % MOD,
                sumsq=(x.sumsq + y.sumsq) % MOD,
                weighted=(x.weighted + y.weighted) % MOD,
                rows=x.rows + y.rows,
            )
        )

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
        x = _dec.decode(acc) if acc else _Acc()
        return {"sum": x.total, "sumsq": x.sumsq, "weighted": x.weighted, "rows": x.rows}
