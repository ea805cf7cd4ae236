"""Atomizable workloads and their registry: the built-in ones, the ``command`` contract, and the
workloads of other packages (entry-point group ``sja.workloads``, or ``module:attr`` in a spec).

The public API of a workload of your own is imported from here: the ``Workload`` protocol, the
declarations it returns (``MemoryDecl``, ``TimeDecl``), the error it raises for bad parameters
(``SpecError``) and the parameter helpers (``int_param``, ``check_known``)::

    from sja.workloads import MemoryDecl, SpecError, TimeDecl, Workload
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

import msgspec

from sja.protocol.messages import MemoryDecl, TimeDecl, WorkloadFacts
from sja.workloads.base import SpecError, Workload, check_known, check_workload, int_param, is_sequential
from sja.workloads.command import Command
from sja.workloads.jacobi import Jacobi
from sja.workloads.matmul import MatMul
from sja.workloads.montecarlo import MonteCarloPi
from sja.workloads.torch_infer import TorchInfer
from sja.workloads.torch_train import TorchTrain

BUILTIN: tuple[str, ...] = ("matmul", "montecarlo", "jacobi")
"""The workloads that really compute on the CPU (``jacobi`` is sequential: its state passes from one
subjob to the next as a checkpoint); the simulator registers its own modeled one ("sim")."""

GPU: tuple[str, ...] = ("torch-train", "torch-infer")
"""PyTorch workloads (the ``gpu`` extra): on a slice's GPU when there is one, else on the CPU.
Registering them does not import ``torch``; running one does."""

ENTRY_POINT_GROUP = "sja.workloads"
"""Packages register their workloads here: ``[project.entry-points."sja.workloads"]``,
``name = "package.module:Class"`` (a class implementing ``Workload``, or an instance of one)."""

WORKLOADS: dict[str, Workload] = {
    w.name: w for w in (MatMul(), MonteCarloPi(), Jacobi(), TorchTrain(), TorchInfer(), Command())
}

_LOADED: dict[str, Workload] = {}
"""Workloads loaded from other packages, by the name a spec gives (loaded once per process)."""


def workload(name: str) -> Workload:
    """The workload a spec names: built in, registered by an entry point, or ``module:attr``.

    A name that is none of these, or whose code cannot be imported or is not a workload, raises
    ``SpecError`` on ``workload`` naming it and the error (the gateway refuses the submission with it).
    """
    w = WORKLOADS.get(name) or _LOADED.get(name)
    if w is not None:
        return w
    w = _load(name)
    _LOADED[name] = w
    return w


def trusted(name: str) -> bool:
    """Whether a workload is SJA's own (built in): the only code the control plane runs. Any other
    (an entry point of another package, ``module:attr``) is the tenant's: the gateway and the agents
    never import it (they read the spec's ``facts``); it runs only in a subjob's sandbox, and in the
    submitter's own ``sja`` command."""
    return name in WORKLOADS


def facts_of(name: str, params: dict[str, Any]) -> tuple[dict[str, Any], WorkloadFacts]:
    """A workload's normalized parameters and the facts the control plane plans it by, computed by
    running its code here: in the submitter's own process (``sja submit``), never in a service.
    Raises ``SpecError`` naming the field, whatever the workload's code raises."""
    w = workload(name)
    try:
        normalized = w.validate(dict(params))
        if not isinstance(normalized, dict):
            raise SpecError(
                "params", f"workload {name!r}: validate returned {type(normalized).__name__}, not a map"
            )
        facts = msgspec.convert(
            {
                "total_units": w.total_units(normalized),
                "sequential": is_sequential(w, normalized),
                "memory": msgspec.to_builtins(w.declared_memory(normalized)),
                "time": msgspec.to_builtins(w.declared_time(normalized)),
            },
            WorkloadFacts,
        )
    except SpecError:
        raise
    except msgspec.ValidationError as e:
        raise SpecError("params", f"workload {name!r} gave facts a job cannot hold: {e}") from None
    except Exception as e:
        raise SpecError("params", f"workload {name!r} refused them: {type(e).__name__}: {e}") from None
    return normalized, facts


def registered() -> list[str]:
    """The names a spec may give without ``module:attr``: built in and from entry points."""
    try:
        extra = [ep.name for ep in entry_points(group=ENTRY_POINT_GROUP)]
    except Exception:
        extra = []
    return sorted(set(WORKLOADS) | set(extra))


def _load(name: str) -> Workload:
    try:
        if ":" in name:
            module, _, attr = name.partition(":")
            obj: Any = importlib.import_module(module)
            for part in attr.split("."):
                obj = getattr(obj, part)
        else:
            found = [ep for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name == name]
            if not found:
                known = ", ".join(registered())
                raise SpecError(
                    "workload",
                    f"unknown workload {name!r} (known: {known}; or give module:attr of an importable one)",
                )
            obj = found[0].load()
        w = obj() if isinstance(obj, type) else obj
    except SpecError:
        raise
    except BaseException as e:  # an import may raise anything, SystemExit included
        if isinstance(e, KeyboardInterrupt):
            raise
        raise SpecError(
            "workload", f"workload {name!r} could not be loaded: {type(e).__name__}: {e}"
        ) from None
    check_workload(name, w)
    loaded: Workload = w
    return loaded


def run_in_one_piece(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The reference result: the whole job computed as a single subjob."""
    w = workload(name)
    p = w.validate(params)
    out = w.run(p, 0, w.total_units(p), b"")
    return w.finalize(p, out if is_sequential(w, p) else w.merge(b"", out))


__all__ = [
    "BUILTIN",
    "ENTRY_POINT_GROUP",
    "GPU",
    "WORKLOADS",
    "MemoryDecl",
    "SpecError",
    "TimeDecl",
    "Workload",
    "check_known",
    "facts_of",
    "int_param",
    "is_sequential",
    "registered",
    "run_in_one_piece",
    "trusted",
    "workload",
]
