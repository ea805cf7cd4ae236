"""Built-in atomizable workloads and their registry."""

from __future__ import annotations

from typing import Any

from sja.workloads.base import SpecError, Workload
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

WORKLOADS: dict[str, Workload] = {
    w.name: w for w in (MatMul(), MonteCarloPi(), Jacobi(), TorchTrain(), TorchInfer())
}


def workload(name: str) -> Workload:
    try:
        return WORKLOADS[name]
    except KeyError:
        known = ", ".join(sorted(WORKLOADS))
        raise SpecError("workload", f"unknown workload {name!r} (known: {known})") from None


def run_in_one_piece(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """The reference result: the whole job computed as a single subjob."""
    w = workload(name)
    p = w.validate(params)
    return w.finalize(p, w.merge(b"", w.run(p, 0, w.total_units(p), b"")))


__all__ = ["BUILTIN", "GPU", "WORKLOADS", "SpecError", "Workload", "run_in_one_piece", "workload"]
