"""Count the primes below ``limit`` (and their sum), one unit per block of ``block`` integers.

``is_prime`` is the user's plain function; ``Primes`` adapts it to SJA's ``Workload`` protocol:
independent ranges whose partial counts merge by addition, so the job cut anywhere and merged in any
order gives the one-piece result.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from sja.workloads import MemoryDecl, SpecError, TimeDecl, check_known, int_param


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


class Primes:
    name: ClassVar[str] = "primes"
    sequential: ClassVar[bool] = False

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(params, {"limit", "block"})
        p = {
            "limit": int_param(params, "limit", 200_000, 2, 10**9),
            "block": int_param(params, "block", 1000, 1, 10**7),
        }
        if p["block"] > p["limit"]:
            raise SpecError("params.block", "must not exceed limit")
        return p

    def total_units(self, params: dict[str, Any]) -> int:
        return -(-params["limit"] // params["block"])

    def declared_memory(self, params: dict[str, Any]) -> MemoryDecl:
        return MemoryDecl(base_mib=1.0, per_unit_mib=0.001, rel_sd=0.5)

    def declared_time(self, params: dict[str, Any]) -> TimeDecl:
        return TimeDecl(warmup_s=0.01, per_unit_s=params["block"] * 2e-6, rel_sd=0.5)

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        lo = unit_start * params["block"]
        hi = min(params["limit"], (unit_start + units) * params["block"])
        found = [n for n in range(lo, hi) if is_prime(n)]
        return msgspec.msgpack.encode([len(found), sum(found)])

    def merge(self, acc: bytes, partial: bytes) -> bytes:
        a = msgspec.msgpack.decode(acc) if acc else [0, 0]
        b = msgspec.msgpack.decode(partial)
        return msgspec.msgpack.encode([a[0] + b[0], a[1] + b[1]])

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
        count, total = msgspec.msgpack.decode(acc) if acc else [0, 0]
        return {"limit": params["limit"], "primes": count, "sum": total}
