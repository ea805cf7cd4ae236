"""A user's PyTorch training script (examples/torch-train) run through the command contract: planned
against measured peak memory, and the per-subjob overhead.

The job is planned, materialized and calibrated by the decision core exactly as the agent does it,
and each subjob runs through the executor's own code (``run_subjob``: the sandbox, its
environment, the state packed and unpacked, the meters), without the bus. On a machine with an
NVIDIA GPU the subjobs run on soft slices of it (``CUDA_VISIBLE_DEVICES`` = the GPU's UUID, NVML per
process, the script's CUDA allocator peak); elsewhere on the CPU.

Per-subjob overhead: a subjob's wall time minus its steps at the speed the same script reaches in
one piece (its own ``steps_per_s`` report): interpreter and torch start-up, the state loaded and
saved, the archive packed and unpacked. Measured twice (``--modes``): ``cold``, every subjob a new
process, and ``warm`` (``params.warm: true``), where the script continues in the same process
(``ctx.next_range()``) and skips loading the state it holds.

    python bench/user_program.py --python /path/to/python-with-torch --json
    (bench/user_program_gpu.sh runs it on a GPU machine)

The sandbox's start cost per subjob (``sandbox`` in the JSON): a trivial program started and waited
for plainly (a process group, as without the sandbox) and in the subjob sandbox
(``sja.execution.sandbox``), interleaved A/B, ``--start-rounds`` times each: the medians, their
difference in ms and their ratio; ``within_budget`` when the sandbox adds at most 100 ms; and a
warm job's two ranges in the sandbox (``warm.continued``: the second went on in the first's
process). It needs no torch: ``--start-cost-only`` measures only that.

``--live`` runs a program of the command contract on the live stack with the defaults of ``sja up``
instead (``bench/live_program.py``): alone, past a window, and yielding its slice to a newcomer.

The last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "libs"))

from sja.accel import use_compiled_core

use_compiled_core()  # before the decision core is imported

from sja.core.bidding import propose
from sja.core.jobs import apply_completion, materialize, new_job
from sja.core.planner import PlanLimits
from sja.core.profile_cache import ProfileCache, profile_of
from sja.execution.program import run_program
from sja.execution.runner import completion_of, run_subjob
from sja.execution.sandbox import Sandbox, SandboxSettings, environment
from sja.protocol.messages import (
    Grant,
    JobSpec,
    MemoryDecl,
    Offer,
    Subjob,
    TimeDecl,
    Window,
)
from sja.workloads.command import summary_of


def gpu() -> dict[str, Any] | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        uuid = pynvml.nvmlDeviceGetUUID(h)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        name = pynvml.nvmlDeviceGetName(h)
        return {
            "uuid": uuid,
            "name": name.decode() if isinstance(name, bytes) else name,
            "mem_mib": pynvml.nvmlDeviceGetMemoryInfo(h).total // 2**20,
        }
    except Exception:
        return None


def outside_steps(duration_s: float, done: int, output: bytes) -> float | None:
    """A subjob's wall time outside its step loop, from the speed it reports itself: start-up, the
    state loaded and saved, packed and unpacked. Unlike the overhead against the one-piece speed,
    it does not move with the machine's load between the two runs."""
    if not done or not output:
        return None
    speed = summary_of(output).metrics.get("steps_per_s")
    if not isinstance(speed, int | float) or speed <= 0:
        return None
    return round(duration_s - done / speed, 3)


def one_piece(python: str, steps: int, width: int, env: dict[str, str]) -> dict[str, Any]:
    out = Path(tempfile.mkdtemp())
    t0 = time.perf_counter()
    r = subprocess.run(
        [python, str(ROOT / "examples/torch-train/train.py"), "--steps", str(steps), "--out", str(out)],
        capture_output=True,
        text=True,
        check=True,
        env={**env, "TRAIN_WIDTH": str(width)},
    )
    wall = time.perf_counter() - t0
    report = json.loads(r.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, "steps_per_s": report["metrics"]["steps_per_s"], "report": report}


START_BUDGET_MS = 100.0
"""The most the sandbox may add to a subjob's cold start."""


def sandbox_start_cost(rounds: int, argv: list[str]) -> dict[str, Any]:
    """Start and wait for ``argv`` plainly and in the sandbox, interleaved: medians and the cost."""
    boxes = {"plain": Sandbox(SandboxSettings(mode="off")), "sandbox": Sandbox(SandboxSettings())}
    times: dict[str, list[float]] = {"plain": [], "sandbox": []}
    for i in range(rounds + 1):
        order = ("plain", "sandbox") if i % 2 == 0 else ("sandbox", "plain")
        for name in order:
            t0 = time.perf_counter()
            far = time.time() + 600
            r = run_program(argv, environment({}), sandbox=boxes[name], cwd=None, term_at=far, kill_at=far)
            elapsed = (time.perf_counter() - t0) * 1000
            if r.returncode != 0:
                raise RuntimeError(f"{name}: {argv} exited with {r.returncode}: {r.stderr[-500:]}")
            if i > 0:  # the first round warms the page cache for both
                times[name].append(elapsed)
    plain, boxed = statistics.median(times["plain"]), statistics.median(times["sandbox"])
    return {
        "program": " ".join(argv),
        "rounds": rounds,
        "plain_ms_median": round(plain, 2),
        "sandbox_ms_median": round(boxed, 2),
        "added_ms": round(boxed - plain, 2),
        "ratio": round(boxed / plain, 3) if plain else None,
        "budget_ms": START_BUDGET_MS,
        "within_budget": boxed - plain <= START_BUDGET_MS,
    }


WARM_PROGRAM = """
import os, sys
sys.path.insert(0, os.environ["LIBS"])
import sja.job
ctx = sja.job.context()
total = None
while ctx is not None:
    if total is None or not ctx.resumed:
        f = ctx.state_in / "total"
        total = int(f.read_text()) if f.exists() else 0
    total += sum(ctx.units)
    (ctx.state_out / "total").write_text(str(total))
    ctx = ctx.next_range()
"""


def warm_in_the_sandbox(python: str) -> dict[str, Any]:
    """Two ranges of a warm job through ``run_subjob`` (in the sandbox): the second must continue in
    the first's process (``resumed``); the wall time of each."""
    from sja.execution import warm
    from sja.workloads import workload

    params = workload("command").validate(
        {"argv": [python, "-c", WARM_PROGRAM], "units": 20, "warm": True, "env": {"LIBS": str(ROOT / "libs")}}
    )
    os.environ.setdefault("SJA_WARM_GRACE_S", "30")
    out: dict[str, Any] = {}
    checkpoint = b""
    for i, start in enumerate((0, 10)):
        sj = Subjob(
            subjob_id=f"warm.s{i}",
            seq=i,
            job_id="warm",
            tenant="bench",
            agent_id="bench",
            workload="command",
            params=params,
            unit_start=start,
            units=10,
            grant_id=f"g{i}",
            fence=i + 1,
            slice_id="bench-slice",
            node="local",
            mem_cap_mib=4096,
            time_cap_s=60.0,
            planned_mem_q_mib=100.0,
            planned_duration_q_s=1.0,
            input_checkpoint=checkpoint,
        )
        r = run_subjob(sj)
        checkpoint = r.output
        out[f"range{i}"] = {"status": r.status, "warm": r.warm, "duration_ms": round(r.duration_s * 1000, 1)}
    warm.evict_except("", "")
    out["continued"] = out["range1"]["warm"] == "resumed" and out["range1"]["status"] == "ok"
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--python", default=sys.executable, help="an interpreter with torch")
    ap.add_argument("--steps", type=int, default=1200)
    ap.add_argument("--width", type=int, default=1024, help="hidden width of the MLP (memory scale)")
    ap.add_argument("--shares", default="0.25,0.5", help="soft slices: fractions of the GPU's memory")
    ap.add_argument("--window-s", type=float, default=20.0)
    ap.add_argument("--start-overhead-s", type=float, default=5.0)
    ap.add_argument("--modes", default="cold,warm", help="cold, warm (warm continuation) or both")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--start-rounds", type=int, default=20, help="A/B rounds of the sandbox's start cost")
    ap.add_argument("--start-cost-only", action="store_true", help="measure only the sandbox's start cost")
    ap.add_argument(
        "--live",
        action="store_true",
        help="run examples/steps on the live stack with sja up's defaults: idle, past a window, contended",
    )
    ap.add_argument(
        "--short-window-s", type=float, default=20.0, help="--live: the window of the last two cases"
    )
    args = ap.parse_args()

    if args.live:
        from live_program import run as run_live  # bench/ is the script's directory

        print(json.dumps({"bench": "user_program", "live": run_live(args.python, args.short_window_s)}))
        return

    start_cost = {
        "python": sandbox_start_cost(args.start_rounds, [args.python, "-c", "pass"]),
        "true": sandbox_start_cost(args.start_rounds, ["true"]),
        "warm": warm_in_the_sandbox(args.python),
    }
    if args.start_cost_only:
        print(json.dumps({"bench": "user_program", "sandbox": start_cost}))
        return

    g = gpu()
    env = {k: v for k, v in os.environ.items() if not k.startswith("SJA_")}
    if g is None:
        env["CUDA_VISIBLE_DEVICES"] = ""
    ref = one_piece(
        args.python, args.steps, args.width, {**env, "CUDA_VISIBLE_DEVICES": g["uuid"] if g else ""}
    )
    total_mib = g["mem_mib"] if g else 16384
    limits = PlanLimits(horizon_s=args.window_s, start_overhead_s=args.start_overhead_s)
    profiles = ProfileCache()
    rows: list[dict[str, Any]] = []
    runs = [(m, float(s)) for m in args.modes.split(",") for s in args.shares.split(",")]
    for mode, share in runs:
        slice_mib = int(total_mib * share)
        spec = JobSpec(
            name="torch-train",
            tenant="bench",
            workload="command",
            mode="sja",
            params={
                "argv": [args.python, str(ROOT / "examples/torch-train/train.py")],
                "units": args.steps,
                "env": {"TRAIN_WIDTH": str(args.width), "PYTHONPATH": str(ROOT / "libs")},
                "stop_grace_s": 2.0,
                "warm": mode == "warm",
            },
            memory=MemoryDecl(base_mib=1200.0, per_unit_mib=0.0, rel_sd=0.5),
            time=TimeDecl(warmup_s=4.0, per_unit_s=0.005, rel_sd=0.5),
        )
        state = new_job(f"bench-{mode}-{int(share * 100)}", spec, time.time(), window_s=args.window_s)
        n = 0
        while state.status not in ("done", "failed") and n < 40:
            n += 1
            now = time.time()
            window = Window(
                slice_id=f"local-g0-soft{int(share * 100)}-0",
                node="local",
                pool="local",
                gpu_model=g["name"].replace(" ", "-") if g else "cpu",
                profile=f"soft{int(share * 100)}",
                mem_mib=slice_mib,
                compute_share=1.0,
                start_s=now,
                end_s=now + args.window_s,
            )
            offer = Offer(
                offer_id=f"o{n}",
                round=n,
                window=window,
                slice_fence=n,
                slice_revision=0,
                issued_at=now,
                reply_by=now + 0.05,
                reply_to="_INBOX.b",
            )
            proposal = propose(state, offer, now, limits, profiles=profiles)
            if proposal is None:
                rows.append({"mode": mode, "share": share, "error": "no safe size in the window"})
                break
            grant = Grant(
                grant_id=f"g{n}",
                offer_id=offer.offer_id,
                round=n,
                job_id=state.job_id,
                tenant="bench",
                agent_id="bench",
                window=window,
                candidate=proposal.candidates[0],
                fence=n + 1,
                lease_until=now + 60,
                policy="fair",
                granted_at=now,
            )
            mat = materialize(state, grant, now, limits, "bench", profiles=profiles)
            assert mat.subjob is not None, mat.reason
            state, sj = mat.state, mat.subjob
            os.environ.update(
                {
                    "CUDA_VISIBLE_DEVICES": g["uuid"] if g else "",
                    "SJA_SLICE_SOURCE": "nvml" if g else "declared",
                }
            )
            r = run_subjob(sj)
            c = completion_of(sj, r)
            state, _ = apply_completion(state, c, time.time(), profiles=profiles)
            done = r.units_done
            rows.append(
                {
                    "mode": mode,
                    "warm": r.warm,
                    "share": share,
                    "slice_mib": slice_mib,
                    "subjob": sj.subjob_id,
                    "status": r.status,
                    "units": sj.units,
                    "units_done": done,
                    "planned_mem_q_mib": sj.planned_mem_q_mib,
                    "peak_mem_mib": r.peak_mem_mib,
                    "device": r.device,
                    "duration_s": r.duration_s,
                    "overhead_s": round(r.duration_s - done / ref["steps_per_s"], 3) if done else None,
                    "outside_steps_s": outside_steps(r.duration_s, done, r.output),
                    "error": r.error[:300],
                }
            )
        rows.append(
            {
                "mode": mode,
                "share": share,
                "job": state.status,
                "subjobs": n,
                "mem_q_now_mib": round(
                    profile_of(state, profiles).mem_quantile(max(1, args.steps // 4), 0.95), 1
                ),
            }
        )

    def over(mode: str, first: bool | None = None, key: str = "overhead_s") -> list[float]:
        return [
            r[key]
            for r in rows
            if r.get("mode") == mode
            and r.get(key) is not None
            and (first is None or (r.get("warm") in ("", "cold", "handed")) == first)
        ]

    modes = {
        m: {
            "subjobs": len(over(m)),
            "overhead_s_median": round(statistics.median(over(m)), 3) if over(m) else None,
            "overhead_s_max": round(max(over(m)), 3) if over(m) else None,
            "overhead_s_median_continued": (
                round(statistics.median(over(m, False)), 3) if over(m, False) else None
            ),
            "overhead_s_median_started": (
                round(statistics.median(over(m, True)), 3) if over(m, True) else None
            ),
            "outside_steps_s_median": (
                round(statistics.median(over(m, None, "outside_steps_s")), 3)
                if over(m, None, "outside_steps_s")
                else None
            ),
            "outside_steps_s_median_continued": (
                round(statistics.median(over(m, False, "outside_steps_s")), 3)
                if over(m, False, "outside_steps_s")
                else None
            ),
        }
        for m in args.modes.split(",")
    }
    overheads = over(args.modes.split(",")[0])
    ratios = [r["peak_mem_mib"] / r["planned_mem_q_mib"] for r in rows if r.get("status") == "ok"]
    summary = {
        "bench": "user_program",
        "device": g["name"] if g else "cpu",
        "gpu_mem_mib": total_mib if g else None,
        "steps": args.steps,
        "width": args.width,
        "one_piece_wall_s": round(ref["wall_s"], 3),
        "one_piece_steps_per_s": round(ref["steps_per_s"], 1),
        "one_piece_torch_cuda_peak_mib": ref["report"].get("torch_cuda_peak_mib"),
        "overhead_s_median": round(statistics.median(overheads), 3) if overheads else None,
        "overhead_s_max": round(max(overheads), 3) if overheads else None,
        "peak_over_planned_median": round(statistics.median(ratios), 3) if ratios else None,
        "modes": modes,
        "sandbox": start_cost,
        "subjobs": rows,
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
