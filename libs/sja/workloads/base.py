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
    """What SJA calls, and where (public API: workloads of other packages implement it).

    - ``validate``, ``total_units``, ``declared_memory``, ``declared_time``: at submission (the
      gateway) and wherever the job is planned (agents). They must be pure and deterministic: the same
      parameters give the same answers in every process.
    - ``run``: on a slice's executor, once per subjob, with ``[unit_start, unit_start + units)`` and
      the input checkpoint (empty unless ``sequential``: then the previous subjob's output). It may be
      run again for the same range (a lost or failed subjob); it returns bytes. Inside it
      ``sja.job.context()`` gives the subjob's deadline, slice and stop signal.
    - ``merge(acc, partial)``: in the job's agent, once per completed subjob of an independent
      workload, in completion order (so it must be associative and commutative); ``acc`` starts
      empty. Not called for ``sequential`` ones (the latest output is the state).
    - ``finalize(params, acc)``: in the agent, once, when every unit is done; its result must be
      encodable as MessagePack (strings, numbers within 64 bits, lists, maps) and is what
      ``sja status`` shows.

    An exception from any of these fails the subjob (``run``) or the job (the others) with its text;
    it never stops a service.
    """

    name: ClassVar[str]
    sequential: ClassVar[bool]
    # Optional ``yields: ClassVar[bool]``: its runs stop at a unit boundary when asked (a command's
    # program on SIGTERM), so its subjobs may go on past their window (``core.continuation``).

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


REQUIRED = ("validate", "total_units", "declared_memory", "declared_time", "run", "merge", "finalize")
"""The methods every workload has."""


def check_workload(name: str, w: object) -> None:
    """Refuse (``SpecError`` on ``workload``) an object that is not a workload."""
    missing = [m for m in REQUIRED if not callable(getattr(w, m, None))]
    if missing:
        raise SpecError(
            "workload", f"{name!r} is not a workload ({type(w).__name__} has no {', '.join(missing)})"
        )
    if not isinstance(getattr(w, "sequential", None), bool):
        raise SpecError("workload", f"{name!r}: sequential must be True or False")


def is_sequential(w: Workload, params: dict[str, Any]) -> bool:
    """Whether a job of ``w`` with ``params`` passes its state from one subjob to the next: the
    workload's ``is_sequential(params)`` where it decides per job (``command``), else its class's."""
    per_job = getattr(w, "is_sequential", None)
    return bool(per_job(params)) if callable(per_job) else bool(w.sequential)
