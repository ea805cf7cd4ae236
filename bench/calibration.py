"""Calibration on real memory data: how fast a 2x-pessimistic memory prior converges.

Ground truth is the measured GPU memory per model and batch size of MISO (SoCC'22, A100-40GB;
``shared/traces/mig-profiles/mps_configs_memory.json``): between measured batch sizes memory is
interpolated linearly, and the table is made monotone by a running maximum (a larger batch never
needs less memory; the few drops in the table are allocator rounding). Each completion observes the
true memory at the planned batch size times a seeded 3 % run-to-run noise.

A job starts from a declared profile that overestimates memory 2x (twice the least-squares line
through the table). Every round the planner picks the largest batch size whose ``1 - eps_mem``
memory quantile fits the MIG slice (time is not binding here); an observed peak above the slice's
usable memory is an OOM (a censored observation). We report after how many completions the planned
size is within 10 % of the true safe maximum, and the realized OOM rate against ``eps_mem``.

    python bench/calibration.py --json        # last line: a JSON object
    python bench/calibration.py --json --mem-prior wide   # the memory weights' former 50 % floor
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from sja.core.mig import gpu_model
from sja.core.planner import PlanLimits, PlanRequest, largest_safe_size
from sja.core.profiles import MEMORY_NOISE_PRIOR, WEIGHT_PRIOR_REL_SD, JobProfile, LinearPosterior
from sja.protocol.messages import MemoryDecl, TimeDecl, Window

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mig-profiles"
MEMORY_TABLE = "mps_configs_memory.json"

# (model, GPU, MIG profile): cases where the safe maximum lies inside or at the end of the table.
CASES = [
    ("transformer", "A100-40GB", "1g.5gb"),
    ("transformer", "A100-40GB", "2g.10gb"),
    ("transformer", "A100-40GB", "3g.20gb"),
    ("gnn", "A100-40GB", "1g.5gb"),
    ("embedding", "A100-40GB", "1g.5gb"),
    ("embedding", "A100-40GB", "2g.10gb"),
    ("bert", "A100-40GB", "3g.20gb"),
    ("cyclegan", "A100-40GB", "3g.20gb"),
]


def find_table(explicit: str | None) -> dict[str, dict[str, int]]:
    candidates = [Path(explicit)] if explicit else []
    candidates += [DATA / MEMORY_TABLE, Path.cwd().parent / "shared/traces/mig-profiles" / MEMORY_TABLE]
    for c in candidates:
        if c.exists():
            table: dict[str, dict[str, int]] = json.loads(c.read_text())
            return table
    raise SystemExit(f"memory table not found (looked in {', '.join(map(str, candidates))})")


class TrueMemory:
    """Monotone piecewise-linear interpolation of a measured (batch size -> MiB) table."""

    def __init__(self, points: dict[str, int]) -> None:
        pts = sorted((int(b), float(m)) for b, m in points.items())
        running = 0.0
        self.xs: list[int] = []
        self.ys: list[float] = []
        for b, m in pts:
            running = max(running, m)
            self.xs.append(b)
            self.ys.append(running)

    @property
    def max_batch(self) -> int:
        return self.xs[-1]

    def __call__(self, b: int) -> float:
        xs, ys = self.xs, self.ys
        if b <= xs[0]:
            if len(xs) == 1 or b == xs[0]:
                return ys[0]
            slope = max((ys[1] - ys[0]) / (xs[1] - xs[0]), 0.0)
            return max(ys[0] - slope * (xs[0] - b), 0.0)
        for i in range(1, len(xs)):
            if b <= xs[i]:
                t = (b - xs[i - 1]) / (xs[i] - xs[i - 1])
                return ys[i - 1] + t * (ys[i] - ys[i - 1])
        return ys[-1]

    def least_squares(self) -> tuple[float, float]:
        n = len(self.xs)
        mx, my = sum(self.xs) / n, sum(self.ys) / n
        sxx = sum((x - mx) ** 2 for x in self.xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(self.xs, self.ys, strict=True)) / sxx if sxx else 0.0
        slope = max(slope, 0.0)
        return max(my - slope * mx, 1.0), slope

    def safe_max(self, cap: float) -> int:
        best = 0
        for b in range(1, self.max_batch + 1):
            if self(b) <= cap:
                best = b
        return best


DECL_REL_SD = 0.25


def run_case(
    truth: TrueMemory,
    mem_mib: int,
    eps: float,
    seed: int,
    completions: int,
    noise: float,
    limits: PlanLimits,
    mem_prior: str = "declared",
) -> dict[str, object]:
    rng = random.Random(seed)
    base, slope = truth.least_squares()
    typical = max(1, truth.max_batch // 2)
    profile = JobProfile.from_declaration(
        MemoryDecl(base_mib=2 * base, per_unit_mib=2 * slope, rel_sd=DECL_REL_SD),
        TimeDecl(warmup_s=0.01, per_unit_s=1e-6, rel_sd=0.1),
        typical_units=typical,
    )
    if mem_prior == "wide":
        # The prior as it was before the memory weights followed the declaration: at least 50 %.
        profile.mem = LinearPosterior.prior_from(
            2 * base,
            2 * slope,
            DECL_REL_SD,
            typical,
            MEMORY_NOISE_PRIOR,
            weight_rel_sd=max(DECL_REL_SD, WEIGHT_PRIOR_REL_SD),
        )
    cap = mem_mib - limits.mem_reserve_mib
    k_star = truth.safe_max(cap)
    window = Window(
        slice_id="bench",
        node="bench",
        pool="bench",
        gpu_model="A100-40GB",
        profile="bench",
        mem_mib=mem_mib,
        compute_share=1.0,
        start_s=0.0,
        end_s=3600.0,
    )
    req = PlanRequest(window=window, now=0.0, eps_mem=eps, eps_time=0.05, max_units=truth.max_batch)
    planned: list[int] = []
    ooms = 0
    runs = 0
    first_within: int | None = None
    for n in range(completions):
        k = largest_safe_size(profile, req, limits)
        if k is None:  # nothing fits yet: the planner would not bid; learn from the smallest size
            k = 1
        planned.append(k)
        if first_within is None and abs(k - k_star) <= 0.1 * k_star:
            first_within = n
        peak = truth(k) * (1.0 + rng.gauss(0.0, noise))
        runs += 1
        if peak > cap:
            ooms += 1
            profile.observe_oom(k, cap, peak)
        else:
            profile.observe_memory(k, peak)
    return {
        "k_star": k_star,
        "planned": planned,
        "completions_to_within_10pct": first_within,
        "ooms": ooms,
        "runs": runs,
        "final_planned": planned[-1],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true", help="print a JSON object as the last line")
    ap.add_argument("--eps-mem", type=float, default=0.05)
    ap.add_argument("--seeds", type=int, default=30)
    ap.add_argument("--completions", type=int, default=40)
    ap.add_argument("--noise", type=float, default=0.03, help="run-to-run relative sd of peak memory")
    ap.add_argument("--table", help="path of mps_configs_memory.json")
    ap.add_argument(
        "--mem-prior",
        choices=("declared", "wide"),
        default="declared",
        help="memory weights' prior width: the declaration's rel_sd (the core's) or at least 50 %%",
    )
    args = ap.parse_args(argv)

    t0 = time.perf_counter()
    table = find_table(args.table)
    limits = PlanLimits()
    rows = []
    all_first: list[float] = []
    total_ooms = total_runs = never = 0
    for model, gpu, profile_name in CASES:
        truth = TrueMemory(table[model])
        mem = gpu_model(gpu).profile(profile_name).mem_mib
        firsts: list[float] = []
        ooms = runs = 0
        finals = []
        k_star = 0
        for seed in range(args.seeds):
            r = run_case(truth, mem, args.eps_mem, seed, args.completions, args.noise, limits, args.mem_prior)
            k_star = int(r["k_star"])  # type: ignore[call-overload]
            ooms += int(r["ooms"])  # type: ignore[call-overload]
            runs += int(r["runs"])  # type: ignore[call-overload]
            finals.append(int(r["final_planned"]))  # type: ignore[call-overload]
            if r["completions_to_within_10pct"] is None:
                never += 1
            else:
                firsts.append(float(r["completions_to_within_10pct"]))  # type: ignore[arg-type]
        total_ooms += ooms
        total_runs += runs
        all_first += firsts
        rows.append(
            {
                "model": model,
                "gpu": gpu,
                "slice": profile_name,
                "slice_mem_mib": mem,
                "true_safe_max_batch": k_star,
                "median_completions_to_within_10pct": statistics.median(firsts) if firsts else None,
                "runs_never_within_10pct": args.seeds - len(firsts),
                "median_final_planned_batch": statistics.median(finals),
                "oom_rate": round(ooms / runs, 4),
            }
        )
    result = {
        "bench": "calibration",
        "source": "MISO (SoCC'22) mps_configs_memory.json, A100-40GB",
        "prior": "2x the least-squares line through the measured table",
        "mem_prior": args.mem_prior,
        "eps_mem": args.eps_mem,
        "noise_rel_sd": args.noise,
        "seeds": args.seeds,
        "completions_per_run": args.completions,
        "completions_to_within_10pct": statistics.median(all_first) if all_first else None,
        "completions_to_within_10pct_p90": (
            sorted(all_first)[int(0.9 * (len(all_first) - 1))] if all_first else None
        ),
        "runs_never_within_10pct": never,
        "oom_rate": round(total_ooms / total_runs, 4),
        "oom_rate_within_eps": total_ooms / total_runs <= args.eps_mem,
        "cases": rows,
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    if not args.json:
        for row in rows:
            print(
                f"{row['model']:12s} {row['slice']:8s} k*={row['true_safe_max_batch']:4d} "
                f"median completions to 10%: {row['median_completions_to_within_10pct']} "
                f"final {row['median_final_planned_batch']} oom rate {row['oom_rate']:.3f}"
            )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
