"""What the PyTorch workloads share. ``torch`` is imported only when a subjob runs (the ``gpu``
extra: ``pip install .[gpu]``), so the registry, the gateway and the agents never need it."""

from __future__ import annotations

import importlib
from typing import Any

from sja.workloads.base import SpecError

DEVICES = ("auto", "cpu", "cuda")


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
