"""The contract of an atomizable workload.

Work is a range of ``total_units`` units. A subjob computes a partial result for a sub-range; partial
results merge associatively and commutatively into the job's accumulator (its checkpoint), so the
final result does not depend on how the job was cut. ``sequential`` workloads (a training run that
continues from a checkpoint) instead receive the accumulator as their input and run one at a time.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from sja.protocol.messages import MemoryDecl, TimeDecl


class SpecError(ValueError):
    """A job spec or workload parameter that cannot be accepted; names the offending field."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class Workload(Protocol):
    name: ClassVar[str]
    sequential: ClassVar[bool]

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        """Return normalized parameters (defaults filled in) or raise ``SpecError``."""

    def total_units(self, params: dict[str, Any]) -> int: ...

    def declared_memory(self, params: dict[str, Any]) -> MemoryDecl:
        """Prior functional memory profile (MiB as a function of units)."""

    def declared_time(self, params: dict[str, Any]) -> TimeDecl:
        """Prior temporal profile on a full-speed slice."""

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        """Compute the partial result of ``[unit_start, unit_start + units)``."""

    def merge(self, acc: bytes, partial: bytes) -> bytes: ...

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]: ...


def int_param(params: dict[str, Any], name: str, default: int, lo: int, hi: int) -> int:
    value = params.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"params.{name}", f"expected an integer, got {value!r}")
    if not lo <= value <= hi:
        raise SpecError(f"params.{name}", f"must be between {lo} and {hi}, got {value}")
    return value


def check_known(params: dict[str, Any], known: set[str]) -> None:
    unknown = sorted(set(params) - known)
    if unknown:
        raise SpecError(f"params.{unknown[0]}", f"unknown parameter (known: {', '.join(sorted(known))})")
