"""PyTorch batched inference over item ranges: a subjob classifies items ``[s, s + k)``.

The model's weights come from ``seed``; item ``i``'s input is a deterministic function of ``i``, so
any range can be computed on its own. A subjob runs its items in batches of ``batch_size`` and
returns the count of items per predicted class; counts add, so the job cut into pieces ends with
the counts of the job in one piece. On the CPU the model runs in float64 (so batch composition
cannot flip an argmax), on a GPU in float32.
"""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec

from sja.protocol.messages import MemoryDecl, TimeDecl
from sja.workloads.base import check_known, int_param
from sja.workloads.torch_common import device_param, flops_per_s, import_torch, pick_device

_MIB = 1024 * 1024


class _Acc(msgspec.Struct, array_like=True):
    counts: list[int] = []
    items: int = 0


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(_Acc)


class TorchInfer:
    name: ClassVar[str] = "torch-infer"
    sequential: ClassVar[bool] = False
    framework: ClassVar[str] = "torch"

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(params, {"items", "batch_size", "inputs", "hidden", "classes", "seed", "device"})
        return {
            "items": int_param(params, "items", 20_000, 1, 100_000_000),
            "batch_size": int_param(params, "batch_size", 256, 1, 65_536),
            "inputs": int_param(params, "inputs", 64, 1, 65_536),
            "hidden": int_param(params, "hidden", 256, 1, 65_536),
            "classes": int_param(params, "classes", 10, 2, 65_536),
            "seed": int_param(params, "seed", 0, 0, 2**31 - 1),
            "device": device_param(params),
        }

    def total_units(self, params: dict[str, Any]) -> int:
        return int(params["items"])

    def declared_memory(self, params: dict[str, Any]) -> MemoryDecl:
        i, h, c, b = params["inputs"], params["hidden"], params["classes"], params["batch_size"]
        weights = 8 * (i * h + h * h + h * c) / _MIB
        activations = 8 * b * (i + 2 * h + c) * 3 / _MIB
        return MemoryDecl(base_mib=64.0 + weights + activations, per_unit_mib=0.001, rel_sd=0.5)

    def declared_time(self, params: dict[str, Any]) -> TimeDecl:
        i, h, c = params["inputs"], params["hidden"], params["classes"]
        flops = 2.0 * (i * h + h * h + h * c)
        rate = flops_per_s(params["device"], 1e9)
        return TimeDecl(warmup_s=0.3, per_unit_s=max(flops / rate, 1e-6), rel_sd=0.5)

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        torch = import_torch()
        device = pick_device(torch, params["device"])
        dtype = torch.float64 if device.type == "cpu" else torch.float32
        torch.manual_seed(params["seed"])
        i, h, c = params["inputs"], params["hidden"], params["classes"]
        model = (
            torch.nn.Sequential(
                torch.nn.Linear(i, h),
                torch.nn.ReLU(),
                torch.nn.Linear(h, h),
                torch.nn.ReLU(),
                torch.nn.Linear(h, c),
            )
            .to(device=device, dtype=dtype)
            .eval()
        )
        freq = (
            torch.arange(1, i + 1, dtype=dtype, device=device) * 0.0137 + params["seed"] * 1e-3
        ).unsqueeze(0)
        phase = torch.linspace(0.0, 3.0, i, dtype=dtype, device=device).unsqueeze(0)
        counts = torch.zeros(c, dtype=torch.int64, device=device)
        end = unit_start + units
        with torch.inference_mode():
            for b in range(unit_start, end, params["batch_size"]):
                idx = torch.arange(b, min(b + params["batch_size"], end), dtype=dtype, device=device)
                x = torch.sin(idx.unsqueeze(1) * freq + phase)
                counts += torch.bincount(model(x).argmax(dim=1), minlength=c)
        return _enc.encode(_Acc(counts=[int(v) for v in counts.cpu().tolist()], items=units))

    def merge(self, acc: bytes, partial: bytes) -> bytes:
        x = _dec.decode(acc) if acc else _Acc()
        y = _dec.decode(partial)
        n = max(len(x.counts), len(y.counts))
        xs, ys = x.counts + [0] * (n - len(x.counts)), y.counts + [0] * (n - len(y.counts))
        return _enc.encode(_Acc(counts=[a + b for a, b in zip(xs, ys, strict=True)], items=x.items + y.items))

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
        x = _dec.decode(acc) if acc else _Acc()
        return {"items": x.items, "counts": x.counts}
