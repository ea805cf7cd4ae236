"""PyTorch training in pieces: each subjob runs N optimizer steps from a checkpoint and saves one.

A small MLP learns ``y = sin(x @ W)`` on synthetic batches; step ``t``'s batch comes from a generator
seeded by ``(seed, t)``, so a subjob's steps do not depend on how the run was cut. The workload is
sequential: a subjob continues from the previous subjob's checkpoint (model and optimizer state),
and the run cut into pieces ends with exactly the weights of the run in one piece (on the CPU;
GPU kernels may differ in the last bits). The checkpoint is a blob (``sja.workloads.checkpoint``)
that the executor keeps in the JetStream object store ``sja-checkpoints``.
"""

from __future__ import annotations

import hashlib
import io
from typing import Any, ClassVar

import msgspec

from sja.protocol.messages import MemoryDecl, TimeDecl
from sja.workloads.base import check_known, int_param
from sja.workloads.checkpoint import is_ref, pack_blob, summary_of, unpack_blob, where
from sja.workloads.torch_common import device_param, flops_per_s, import_torch, pick_device

_MIB = 1024 * 1024


class TrainSummary(msgspec.Struct, frozen=True, kw_only=True):
    step: int = 0
    loss: float = 0.0
    weights_sha256: str = ""
    device: str = ""


_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder(TrainSummary)


def _param_count(p: dict[str, Any]) -> int:
    i, h, o = int(p["inputs"]), int(p["hidden"]), int(p["outputs"])
    return i * h + h + h * h + h + h * o + o


class TorchTrain:
    name: ClassVar[str] = "torch-train"
    sequential: ClassVar[bool] = True
    framework: ClassVar[str] = "torch"

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        check_known(
            params, {"steps", "batch_size", "inputs", "hidden", "outputs", "lr_milli", "seed", "device"}
        )
        return {
            "steps": int_param(params, "steps", 200, 1, 10_000_000),
            "batch_size": int_param(params, "batch_size", 64, 1, 65_536),
            "inputs": int_param(params, "inputs", 32, 1, 65_536),
            "hidden": int_param(params, "hidden", 128, 1, 65_536),
            "outputs": int_param(params, "outputs", 8, 1, 65_536),
            "lr_milli": int_param(params, "lr_milli", 50, 1, 10_000),
            "seed": int_param(params, "seed", 0, 0, 2**31 - 1),
            "device": device_param(params),
        }

    def total_units(self, params: dict[str, Any]) -> int:
        return int(params["steps"])

    def declared_memory(self, params: dict[str, Any]) -> MemoryDecl:
        n = _param_count(params)
        b, h = params["batch_size"], params["hidden"]
        # weights, gradients, momentum, a serialized copy; activations of a batch; the runtime's own
        state = 5 * 4 * n / _MIB
        activations = b * (params["inputs"] + 4 * h + params["outputs"]) * 4 / _MIB
        return MemoryDecl(base_mib=64.0 + state + activations, per_unit_mib=0.01, rel_sd=0.5)

    def declared_time(self, params: dict[str, Any]) -> TimeDecl:
        flops = 6.0 * _param_count(params) * params["batch_size"]
        rate = flops_per_s(params["device"], 2e9)
        return TimeDecl(warmup_s=0.5, per_unit_s=max(flops / rate, 1e-4), rel_sd=0.5)

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        torch = import_torch()
        if is_ref(checkpoint):
            raise RuntimeError(
                "checkpoint reference was not resolved: the executor fetches it from the store"
            )
        device = pick_device(torch, params["device"])
        torch.manual_seed(params["seed"])
        i, h, o = params["inputs"], params["hidden"], params["outputs"]
        model = torch.nn.Sequential(
            torch.nn.Linear(i, h),
            torch.nn.Tanh(),
            torch.nn.Linear(h, h),
            torch.nn.Tanh(),
            torch.nn.Linear(h, o),
        ).to(device)
        opt = torch.optim.SGD(model.parameters(), lr=params["lr_milli"] / 1000.0, momentum=0.9)
        step = 0
        if checkpoint:
            blob = unpack_blob(checkpoint)
            step = _dec.decode(blob.summary).step
            state = torch.load(io.BytesIO(blob.data), map_location=device, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
        if step != unit_start:
            raise ValueError(f"checkpoint is at step {step}, the subjob starts at step {unit_start}")
        target = torch.randn(i, o, generator=torch.Generator().manual_seed(params["seed"] + 1)).to(device)
        loss_value = 0.0
        for t in range(unit_start, unit_start + units):
            g = torch.Generator().manual_seed(params["seed"] * 1_000_003 + t)
            x = torch.randn(params["batch_size"], i, generator=g).to(device)
            loss = torch.nn.functional.mse_loss(model(x), torch.sin(x @ target))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            loss_value = float(loss.detach())
        buf = io.BytesIO()
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
        sha = hashlib.sha256()
        for p in model.parameters():
            sha.update(p.detach().cpu().contiguous().numpy().tobytes())
        summary = TrainSummary(
            step=unit_start + units, loss=loss_value, weights_sha256=sha.hexdigest(), device=device.type
        )
        return pack_blob(_enc.encode(summary), buf.getvalue())

    def merge(self, acc: bytes, partial: bytes) -> bytes:
        return partial

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
        raw = summary_of(acc)
        s = _dec.decode(raw) if raw else TrainSummary()
        return {
            "steps": s.step,
            "loss": s.loss,
            "weights_sha256": s.weights_sha256,
            "checkpoint": where(acc),
        }
