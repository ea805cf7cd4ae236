"""Monte Carlo estimate of pi over blocks of samples.

Unit ``i`` is a block of ``samples_per_unit`` points drawn from a generator seeded by ``(seed, i)``,
so a block's points do not depend on which subjob draws it. A subjob draws all its blocks at once
(vectorized): memory grows linearly with the number of units. The hit count is an integer, so the
result of a cut job equals the result of the job in one piece exactly.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
import numpy as np

from sja.protocol.messages import MemoryDecl, TimeDecl
from sja.workloads.base import check_known, int_param

_MIB = 1024 * 1024


class _Acc(msgspec.Struct, array_like=True):
    hits: int = 0
    samples: int = 0


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(_Acc)


class MonteCarloPi:
    name: ClassVar[str] = "montecarlo"
    sequential: ClassVar[bool] = False

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(params, {"units", "samples_per_unit", "seed"})
        return {
            "units": int_param(params, "units", 200, 1, 10_000_000),
            "samples_per_unit": int_param(params, "samples_per_unit", 100_000, 1, 10_000_000),
            "seed": int_param(params, "seed", 0, 0, 2**31 - 1),
        }

    def total_units(self, params: dict[str, Any]) -> int:
        return int(params["units"])

    def declared_memory(self, params: dict[str, Any]) -> MemoryDecl:
        n = params["samples_per_unit"]
        # x and y blocks, their concatenation, squares and the boolean mask
        return MemoryDecl(base_mib=1.0, per_unit_mib=n * 8 * 6.5 / _MIB, rel_sd=0.3)

    def declared_time(self, params: dict[str, Any]) -> TimeDecl:
        n = params["samples_per_unit"]
        return TimeDecl(warmup_s=0.02, per_unit_s=n * 6e-8, rel_sd=0.5)

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        n, seed = params["samples_per_unit"], params["seed"]
        blocks = [
            np.random.default_rng([seed, unit]).random((2, n))
            for unit in range(unit_start, unit_start + units)
        ]
        pts = np.concatenate(blocks, axis=1)
        del blocks
        inside = (pts[0] * pts[0] + pts[1] * pts[1]) <= 1.0
        return _enc.encode(_Acc(hits=int(inside.sum()), samples=units * n))

    def merge(self, acc: bytes, partial: bytes) -> bytes:
        x = _dec.decode(acc) if acc else _Acc()
        y = _dec.decode(partial)
        return _enc.encode(_Acc(hits=x.hits + y.hits, samples=x.samples + y.samples))

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
        x = _dec.decode(acc) if acc else _Acc()
        pi = 4.0 * x.hits / x.samples if x.samples else 0.0
        return {"hits": x.hits, "samples": x.samples, "pi": pi}
