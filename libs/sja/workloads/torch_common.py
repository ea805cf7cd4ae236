"""What the PyTorch workloads share. ``torch`` is imported only when a subjob runs (the ``gpu``
extra: ``pip install .[gpu]``), so the registry, the gateway and the agents never need it."""

from __future__ import annotations

import importlib
from typing import Any

from sja.workloads.base import SpecError

DEVICES = ("auto", "cpu", "cuda")

GPU_FLOPS = 2e12
"""Floating-point operations a second a GPU is declared to sustain on these small fp32 models (a
fraction of any data-centre GPU's rate: an H100 ran them far faster). A declaration only starts
the job's time profile, which learns the real speed from the first subjobs; what it must not be is
so slow that even one unit looks longer than a window: at a CPU's rate a 2048-wide training step
would be declared 6.6 s, 26 s on a quarter of a GPU, and the job would never be planned."""


def flops_per_s(device: str, cpu_flops: float) -> float:
    """The rate a subjob on ``device`` is declared to run at: ``cpu_flops`` for ``cpu``, a GPU's
    otherwise (``auto`` runs on the slice's GPU wherever there is one; on a slice with none, the
    first subjobs may overrun their windows, are stopped at their cap and teach the profile)."""
    return cpu_flops if device == "cpu" else GPU_FLOPS


def import_torch() -> Any:
    # Imported by name: type checking must not need the optional dependency.
    try:
        return importlib.import_module("torch")
    except ImportError:
        raise RuntimeError("PyTorch is not installed on this node: pip install 'sja[gpu]'") from None


def device_param(params: dict[str, Any]) -> str:
    value = params.get("device", "auto")
    if value not in DEVICES:
        raise SpecError("params.device", f"expected one of {', '.join(DEVICES)}, got {value!r}")
    return str(value)


def pick_device(torch: Any, wanted: str) -> Any:
    """``auto``: the slice's GPU when CUDA sees one (``CUDA_VISIBLE_DEVICES`` pins it), else the CPU."""
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", 0)
    return torch.device("cpu")
