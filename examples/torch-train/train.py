"""A PyTorch training script that resumes from its state: SJA's command contract, nothing more.

One unit is one optimizer step of a small MLP regressing a fixed random function; the batch of step
``t`` is drawn from a generator seeded with ``t``, so the data does not depend on how the run is
cut. The state is ``state.pt`` (model, optimizer, step) in ``$SJA_STATE_OUT``; a subjob loads it from
``$SJA_STATE_IN`` when the previous one left it. On SIGTERM (the window is ending) it saves after the
current step and says how far it got (``$SJA_REPORT``), so the next subjob goes on from there.

With ``warm: true`` in the job's params (and ``sja`` importable), it keeps running between its
subjobs on one slice: ``ctx.next_range()`` hands it the next range, and when ``ctx.resumed`` says it
holds the state that range starts from, it goes on from memory without loading ``state.pt``.

Without SJA (``python train.py --steps N --out DIR``) it runs the N steps in one piece; the scheduled
job's final ``state.pt`` holds the very same weights (CPU, deterministic algorithms, one thread).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

# Deterministic CUDA matrix products need this before CUDA starts (the CPU ignores it).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch

WIDTH = int(os.environ.get("TRAIN_WIDTH", "256"))
BATCH = 64


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, WIDTH),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, WIDTH),
        torch.nn.Tanh(),
        torch.nn.Linear(WIDTH, 1),
    )


def batch(step: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1_000_003 + step)
    x = torch.randn(BATCH, 32, generator=g)
    y = torch.sin(x[:, :8].sum(dim=1, keepdim=True)) + 0.1 * x[:, 8:9]
    return x.to(device), y.to(device)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=0, help="run in one piece: this many steps")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    device = torch.device(
        "cuda" if torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES") else "cpu"
    )
    env = os.environ
    in_sja = "SJA_JOB_ID" in env
    if in_sja:
        start, units = int(env["SJA_UNIT_START"]), int(env["SJA_UNITS"])
        state_in, state_out = Path(env["SJA_STATE_IN"]), Path(env["SJA_STATE_OUT"])
    else:
        start, units, state_in, state_out = 0, args.steps, Path("/nonexistent"), args.out
        state_out.mkdir(parents=True, exist_ok=True)
    stop = False

    def on_term(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    net = model().to(device)
    opt = torch.optim.Adam(net.parameters(), lr=args.lr)
    ctx = None
    if in_sja and env.get("SJA_WARM_FD"):
        import sja.job

        ctx = sja.job.context()
        signal.signal(signal.SIGTERM, on_term)  # ours, not the SDK's: ``stop`` is read below
    resumed = False
    step = 0
    while True:
        if not resumed and (state_in / "state.pt").exists():
            saved = torch.load(state_in / "state.pt", map_location=device, weights_only=True)
            net.load_state_dict(saved["model"])
            opt.load_state_dict(saved["optimizer"])
            step = int(saved["step"])
        if step != start:
            print(f"state is at step {step}, the subjob starts at {start}", file=sys.stderr)
            sys.exit(2)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        loss = torch.tensor(0.0)
        t0 = time.perf_counter()
        while step < start + units and not stop:
            x, y = batch(step, device)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(net(x), y)
            loss.backward()
            opt.step()
            step += 1
        torch.save(
            {"model": net.state_dict(), "optimizer": opt.state_dict(), "step": step}, state_out / "state.pt"
        )
        report: dict = {
            "units_done": step - start,
            "metrics": {
                "loss": float(loss.detach()),
                "steps_per_s": (step - start) / max(time.perf_counter() - t0, 1e-9),
            },
        }
        if device.type == "cuda":
            report["torch_cuda_peak_mib"] = torch.cuda.max_memory_reserved() / 2**20
        if ctx is not None:
            ctx.report(units_done=report["units_done"], **report["metrics"])
            ctx = ctx.next_range()  # warm: the next range, in this process
            if ctx is None:
                return
            start, units, resumed, stop = ctx.unit_start, ctx.count, ctx.resumed, False
            state_in, state_out = ctx.state_in, ctx.state_out
            assert state_in is not None and state_out is not None
            continue
        if in_sja:
            Path(env["SJA_REPORT"]).write_text(json.dumps(report))
        else:
            print(json.dumps(report))
        return


if __name__ == "__main__":
    main()
