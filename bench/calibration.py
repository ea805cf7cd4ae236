"""Calibration on real memory data: how fast a 2x-pessimistic memory prior converges.

Ground truth is the measured GPU memory per model and batch size of MISO (SoCC'22, A100-40GB;
``shared/traces/mig-profiles/mps_configs_memory.json``): between measured batch sizes memory is
interpolated linearly, and the table is made monotone by a running maximum (a larger batch never
needs less memory; the few drops in the table are allocator rounding). Each completion observes the
true memory at the planned batch size times a seeded 3 % run-to-run noise.

A job starts from a declared profile that overestimates memory 2x (twice the least-squares line
through the table). Every round the planner picks the largest batch size whose ``1 - eps_mem``
memory quantile fits the MIG slice (time is not binding here); an observed peak above the slice's
usable memory is an OOM (a censored observation). When the planner finds no safe size on the slice
(the 2x declaration does not fit it), that round runs on the smallest larger slice of the same GPU
where the planner finds one, as a cluster offering the job its other windows does, and counts as a
completion: a job is planned where its declaration fits and learns there what fits the small slice.

Every MIG slice of the A100-40GB (each distinct memory size) with every model of the table that
fits it at a measured batch size is a case. A run converges after ``n`` subjobs when the planned size
enters the band ``[min(0.9 k_eps, k_eps - 1), k*]`` and stays in it to the end of the run: ``k*`` is
the true safe maximum, ``k_eps`` the largest size that fits at the stated probability when the
noise's spread is known exactly (within 10 %, or one unit where 10 % is less than one). A run that
does not is censored at the number of subjobs per run. The median and p90 are over every run,
converged or not; overshoots (plans above ``k*``) are counted apart, with the realized OOM rate
against ``eps_mem``.

Memory that depends on the data (``--data-only`` runs these alone): a job declares a flat peak
(30,000 MiB unless the case says) and each subjob's peak is drawn from a distribution that does not
depend on its size: log-normal between subjobs with a large sigma, a mixture with rare 8x spikes, a
job whose first peaks are small and the later ones large, and plain 3 % noise as a control. Every
round the job runs on the smallest A100-40GB slice where the planner finds a safe size (the
cluster offers it every window; a rigid scheduler would take the smallest slice that holds the
declaration); a peak above that slice's usable memory is an OOM. Each case reports the realized OOM
rate against ``eps_mem``, the OOM rate the plans it made would have had under the true distribution
(``expected_oom_rate``: exact, not sampled), the OOM rate of the rigid slice itself
(``rigid_oom_rate``: a declaration below the peaks' own ``1 - eps_mem`` quantile fails there too), and
the slice memory saved against the rigid slice.

    python bench/calibration.py --json        # last line: a JSON object
    python bench/calibration.py --data-only --json
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path
from statistics import NormalDist

import msgspec

from sja.accel import use_compiled_core

use_compiled_core()  # before the decision core is imported

from sja.core.mig import gpu_model
from sja.core.planner import PlanLimits, PlanRequest, largest_safe_size, usable_memory
from sja.core.profiles import JobProfile
from sja.protocol.messages import MemoryDecl, TimeDecl, Window

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "traces" / "mig-profiles"
MEMORY_TABLE = "mps_configs_memory.json"

GPU = "A100-40GB"


def cases(table: dict[str, dict[str, int]], reserve: float) -> list[tuple[str, str, str]]:
    """(model, GPU, MIG profile) for every slice of the GPU (one per memory size) and every model of
    the table that fits it at a measured batch size (a safe maximum below the smallest measured size
    would be the interpolation's, not a measurement)."""
    profiles: dict[int, str] = {}
    for p in sorted(gpu_model(GPU).profiles, key=lambda p: (p.mem_mib, p.compute_slots)):
        profiles.setdefault(p.mem_mib, p.name)
    out = []
    for model in sorted(table):
        truth = TrueMemory(table[model])
        if len(truth.xs) < 2:
            continue  # one measured size: no size parameter to plan
        for mem, name in sorted(profiles.items()):
            if truth.safe_max(mem - reserve) >= truth.xs[0]:
                out.append((model, GPU, name))
    return out


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

    def safe_max(self, cap: float, margin: float = 0.0) -> int:
        """Largest batch whose memory, ``margin`` above the table, fits ``cap`` (0: none does)."""
        best = 0
        for b in range(1, self.max_batch + 1):
            if self(b) * (1.0 + margin) <= cap:
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
    fallback_mem_mib: tuple[int, ...] = (),
    k_eps: int = 0,
) -> dict[str, object]:
    rng = random.Random(seed)
    base, slope = truth.least_squares()
    typical = max(1, truth.max_batch // 2)
    profile = JobProfile.from_declaration(
        MemoryDecl(base_mib=2 * base, per_unit_mib=2 * slope, rel_sd=DECL_REL_SD),
        TimeDecl(warmup_s=0.01, per_unit_s=1e-6, rel_sd=0.1),
        typical_units=typical,
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
    larger = [
        PlanRequest(
            window=msgspec.structs.replace(window, mem_mib=m),
            now=0.0,
            eps_mem=eps,
            eps_time=0.05,
            max_units=truth.max_batch,
        )
        for m in sorted(fallback_mem_mib)
    ]
    planned: list[int | None] = []
    ooms = runs = elsewhere = 0
    no_plan = False
    for _ in range(completions):
        k = largest_safe_size(profile, req, limits)
        planned.append(k)
        run_cap = cap
        for other in larger if k is None else []:
            # nothing fits this slice: the job takes the smallest larger slice it can use instead
            k = largest_safe_size(profile, other, limits)
            if k is not None:
                run_cap = usable_memory(other.window, limits)
                elsewhere += 1
                break
        if k is None:  # no plan is no plan: the job does not bid, runs nothing and learns nothing
            no_plan = True
            break
        peak = truth(k) * (1.0 + rng.gauss(0.0, noise))
        runs += 1
        if peak > run_cap:
            ooms += 1
            profile.observe_oom(k, run_cap, peak)
        else:
            profile.observe_memory(k, peak, run_cap)
    return {
        "k_star": k_star,
        "planned": planned,
        "converged_after": converged_after(planned, k_star, completions, k_eps),
        "overshoots": sum(1 for k in planned if k is not None and k > k_star),
        "no_plan": no_plan,
        "runs_elsewhere": elsewhere,
        "ooms": ooms,
        "runs": runs,
        "final_planned": planned[-1],
    }


def in_band(k: int | None, k_star: int, k_eps: int) -> bool:
    return k is not None and min(0.9 * k_eps, k_eps - 1) <= k <= k_star


def converged_after(planned: list[int | None], k_star: int, completions: int, k_eps: int) -> int | None:
    """Subjobs run before the planned size entered the band for good (None: it did not by the end
    of the run, which must have planned all ``completions`` rounds)."""
    if len(planned) < completions or not in_band(planned[-1], k_star, k_eps):
        return None
    n = len(planned)
    while n > 0 and in_band(planned[n - 1], k_star, k_eps):
        n -= 1
    return n


def censored_quantile(values: list[int | None], cap: int, q: float) -> float:
    """The ``q`` quantile (nearest rank, lower) of ``values`` with None counted as ``cap``."""
    xs = sorted(cap if v is None else v for v in values)
    return float(xs[int(q * (len(xs) - 1))]) if q != 0.5 else float(statistics.median(xs))


# --- memory that depends on the data ------------------------------------------------------------

DATA_GPU = "A100-40GB"
DATA_UNITS = 8
"""Units a subjob may take (memory does not depend on its size in these cases: it takes them all)."""


class PeakLaw:
    """A subjob's peak memory: drawn per subjob (``draw``) and its exact survival function."""

    def __init__(self, name: str, declared_mib: float, what: str) -> None:
        self.name, self.declared_mib, self.what = name, declared_mib, what

    def draw(self, rng: random.Random, i: int) -> float:
        raise NotImplementedError

    def p_above(self, cap: float, i: int) -> float:
        """P(peak of the ``i``-th subjob > cap)."""
        raise NotImplementedError


class LogNormal(PeakLaw):
    def __init__(self, name: str, declared_mib: float, median: float, sigma: float) -> None:
        super().__init__(name, declared_mib, f"log-normal, median {median:g} MiB, sigma {sigma:g}")
        self.median, self.sigma = median, sigma

    def draw(self, rng: random.Random, i: int) -> float:
        return self.median * math.exp(rng.gauss(0.0, self.sigma))

    def p_above(self, cap: float, i: int) -> float:
        return 1.0 - NormalDist().cdf(math.log(cap / self.median) / self.sigma)


class Spikes(PeakLaw):
    """``base`` with a 3 % normal noise; with probability ``p`` a spike ``factor`` times larger."""

    def __init__(self, name: str, declared_mib: float, base: float, p: float, factor: float) -> None:
        super().__init__(name, declared_mib, f"{base:g} MiB (3 % noise), {p:.0%} of subjobs {factor:g}x")
        self.base, self.p, self.factor = base, p, factor

    def draw(self, rng: random.Random, i: int) -> float:
        spike = rng.random() < self.p
        return self.base * (self.factor if spike else 1.0) * (1.0 + rng.gauss(0.0, 0.03))

    def p_above(self, cap: float, i: int) -> float:
        n = NormalDist(1.0, 0.03)
        return (1.0 - self.p) * (1.0 - n.cdf(cap / self.base)) + self.p * (
            1.0 - n.cdf(cap / (self.base * self.factor))
        )


class Shift(PeakLaw):
    """``small`` MiB (3 % noise) for the first ``first`` subjobs, then ``large``: not exchangeable."""

    def __init__(self, name: str, declared_mib: float, small: float, large: float, first: int) -> None:
        what = f"{small:g} MiB for the first {first} subjobs, then {large:g} MiB (3 % noise)"
        super().__init__(name, declared_mib, what)
        self.small, self.large, self.first = small, large, first

    def draw(self, rng: random.Random, i: int) -> float:
        return (self.small if i < self.first else self.large) * (1.0 + rng.gauss(0.0, 0.03))

    def p_above(self, cap: float, i: int) -> float:
        m = self.small if i < self.first else self.large
        return 1.0 - NormalDist(1.0, 0.03).cdf(cap / m)


DATA_CASES: tuple[PeakLaw, ...] = (
    LogNormal("lognormal_sigma1", 30_000.0, 300.0, 1.0),
    LogNormal("lognormal_sigma2", 30_000.0, 300.0, 2.0),
    LogNormal("declared_below_its_q95", 12_000.0, 1500.0, 1.5),
    Spikes("spikes_8x_10pct", 30_000.0, 800.0, 0.10, 8.0),
    Spikes("spikes_8x_2pct", 30_000.0, 800.0, 0.02, 8.0),
    Shift("small_then_large", 30_000.0, 300.0, 20_000.0, 5),
    LogNormal("noise_3pct", 30_000.0, 800.0, 0.03),
)


def run_data_case(
    law: PeakLaw, eps: float, seed: int, completions: int, limits: PlanLimits
) -> dict[str, float]:
    rng = random.Random(seed)
    profile = JobProfile.from_declaration(
        MemoryDecl(base_mib=law.declared_mib, per_unit_mib=0.0),
        TimeDecl(warmup_s=0.01, per_unit_s=1e-6, rel_sd=0.1),
        typical_units=DATA_UNITS,
    )
    sizes = sorted({p.mem_mib for p in gpu_model(DATA_GPU).profiles})
    rigid = min(m for m in sizes if m - limits.mem_reserve_mib >= law.declared_mib)
    reqs = [
        PlanRequest(
            window=Window(
                slice_id=f"bench-{m}",
                node="bench",
                pool="bench",
                gpu_model=DATA_GPU,
                profile=f"{m}",
                mem_mib=m,
                compute_share=1.0,
                start_s=0.0,
                end_s=3600.0,
            ),
            now=0.0,
            eps_mem=eps,
            eps_time=0.05,
            max_units=DATA_UNITS,
        )
        for m in sizes
    ]
    runs = ooms = below = 0
    expected = saved = 0.0
    first_below = -1
    for i in range(completions):
        for req in reqs:  # the smallest slice where a size is safe
            k = largest_safe_size(profile, req, limits)
            if k is not None:
                break
        else:
            break
        cap = usable_memory(req.window, limits)
        peak = law.draw(rng, i)
        runs += 1
        expected += law.p_above(cap, i)
        saved += 1.0 - req.window.mem_mib / rigid
        if req.window.mem_mib < rigid:
            below += 1
            if first_below < 0:
                first_below = i
        if peak > cap:
            ooms += 1
            profile.observe_oom(k, cap)
        else:
            profile.observe_memory(k, peak, cap)
    return {
        "runs": runs,
        "ooms": ooms,
        "expected_ooms": expected,
        "saved": saved,
        "below": below,
        "first_below": first_below,
    }


def data_dependent(eps: float, seeds: int, completions: int, limits: PlanLimits) -> dict[str, object]:
    rows = []
    all_runs = all_ooms = 0
    all_expected = 0.0
    for law in DATA_CASES:
        got = [run_data_case(law, eps, seed, completions, limits) for seed in range(seeds)]
        runs = sum(int(g["runs"]) for g in got)
        ooms = sum(int(g["ooms"]) for g in got)
        expected = sum(g["expected_ooms"] for g in got)
        firsts = [int(g["first_below"]) for g in got if g["first_below"] >= 0]
        rigid = min(
            m
            for m in sorted({p.mem_mib for p in gpu_model(DATA_GPU).profiles})
            if m - limits.mem_reserve_mib >= law.declared_mib
        )
        all_runs += runs
        all_ooms += ooms
        all_expected += expected
        rows.append(
            {
                "case": law.name,
                "peaks": law.what,
                "declared_mib": law.declared_mib,
                "runs": runs,
                "oom_rate": round(ooms / runs, 4) if runs else 0.0,
                "expected_oom_rate": round(expected / runs, 4) if runs else 0.0,
                "oom_rate_within_eps": ooms <= eps * runs,
                "rigid_slice_mib": rigid,
                "rigid_oom_rate": round(law.p_above(rigid - limits.mem_reserve_mib, completions), 4),
                "slice_memory_saved": round(sum(g["saved"] for g in got) / runs, 4) if runs else 0.0,
                "subjobs_below_declaration": round(sum(g["below"] for g in got) / runs, 4) if runs else 0.0,
                "median_first_subjob_below_declaration": statistics.median(firsts) if firsts else None,
            }
        )
    return {
        "gpu": DATA_GPU,
        "seeds": seeds,
        "completions_per_run": completions,
        "saved": "mean over subjobs of 1 - slice memory / memory of the slice a rigid scheduler takes",
        "oom_rate": round(all_ooms / all_runs, 4) if all_runs else 0.0,
        "expected_oom_rate": round(all_expected / all_runs, 4) if all_runs else 0.0,
        "cases": rows,
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
        "--data-only", action="store_true", help="only the cases of memory that depends on the data"
    )
    args = ap.parse_args(argv)

    if args.data_only:
        t0 = time.perf_counter()
        got = data_dependent(args.eps_mem, args.seeds, args.completions, PlanLimits())
        got = {"bench": "calibration", "eps_mem": args.eps_mem, "data_dependent": got}
        got["wall_s"] = round(time.perf_counter() - t0, 3)
        if not args.json:
            _print_data(got["data_dependent"])  # type: ignore[arg-type]
        print(json.dumps(got))
        return 0

    t0 = time.perf_counter()
    table = find_table(args.table)
    limits = PlanLimits()
    rows = []
    every: list[int | None] = []
    total_ooms = total_runs = total_overshoots = total_plans = 0
    for model, gpu, profile_name in cases(table, limits.mem_reserve_mib):
        truth = TrueMemory(table[model])
        mem = gpu_model(gpu).profile(profile_name).mem_mib
        fallback = tuple(sorted({p.mem_mib for p in gpu_model(gpu).profiles if p.mem_mib > mem}))
        case: list[int | None] = []
        ooms = runs = overshoots = plans = no_plan = 0
        finals: list[int] = []
        k_star = 0
        # the largest batch that fits at the stated probability if the noise's sd were known exactly
        k_eps = truth.safe_max(
            mem - limits.mem_reserve_mib, args.noise * NormalDist().inv_cdf(1 - args.eps_mem)
        )
        for seed in range(args.seeds):
            r = run_case(
                truth,
                mem,
                args.eps_mem,
                seed,
                args.completions,
                args.noise,
                limits,
                fallback,
                k_eps,
            )
            k_star = int(r["k_star"])  # type: ignore[call-overload]
            ooms += int(r["ooms"])  # type: ignore[call-overload]
            runs += int(r["runs"])  # type: ignore[call-overload]
            overshoots += int(r["overshoots"])  # type: ignore[call-overload]
            plans += sum(1 for k in r["planned"] if k is not None)  # type: ignore[attr-defined]
            no_plan += bool(r["no_plan"])
            finals.append(0 if r["final_planned"] is None else int(r["final_planned"]))  # type: ignore[call-overload]
            case.append(r["converged_after"])  # type: ignore[arg-type]
        total_ooms += ooms
        total_runs += runs
        total_overshoots += overshoots
        total_plans += plans
        every += case
        rows.append(
            {
                "model": model,
                "gpu": gpu,
                "slice": profile_name,
                "slice_mem_mib": mem,
                "true_safe_max_batch": k_star,
                "eps_safe_max_batch": k_eps,
                "median_completions_to_within_10pct": censored_quantile(case, args.completions, 0.5),
                "runs_converged": sum(1 for c in case if c is not None),
                "runs_without_plan": no_plan,
                "median_final_planned_batch": statistics.median(finals),
                "overshoot_rate": round(overshoots / plans, 4) if plans else 0.0,
                "oom_rate": round(ooms / runs, 4) if runs else 0.0,
            }
        )
    result = {
        "bench": "calibration",
        "source": "MISO (SoCC'22) mps_configs_memory.json, A100-40GB",
        "prior": "2x the least-squares line through the measured table",
        "eps_mem": args.eps_mem,
        "noise_rel_sd": args.noise,
        "seeds": args.seeds,
        "completions_per_run": args.completions,
        "band": "[min(0.9 k_eps, k_eps - 1), k*], entered and kept to the end of the run",
        "completions_to_within_10pct": censored_quantile(every, args.completions, 0.5),
        "completions_to_within_10pct_p90": censored_quantile(every, args.completions, 0.9),
        "runs": len(every),
        "runs_converged": sum(1 for c in every if c is not None),
        "runs_without_plan": sum(int(row["runs_without_plan"]) for row in rows),  # type: ignore[call-overload]
        "overshoot_rate": round(total_overshoots / total_plans, 4) if total_plans else 0.0,
        "oom_rate": round(total_ooms / total_runs, 4) if total_runs else 0.0,
        "oom_rate_within_eps": total_ooms <= args.eps_mem * total_runs,
        "median_within_10": censored_quantile(every, args.completions, 0.5) <= 10,
        "cases": rows,
        "data_dependent": data_dependent(args.eps_mem, args.seeds, args.completions, limits),
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    if not args.json:
        _print_data(result["data_dependent"])  # type: ignore[arg-type]
        for row in rows:
            print(
                f"{row['model']:12s} {row['slice']:8s} k*={row['true_safe_max_batch']:4d} "
                f"(eps-safe {row['eps_safe_max_batch']:4d}) "
                f"median completions into [0.9k*, k*]: {row['median_completions_to_within_10pct']} "
                f"converged {row['runs_converged']}/{args.seeds} no plan {row['runs_without_plan']} "
                f"final {row['median_final_planned_batch']} overshoot {row['overshoot_rate']:.3f} "
                f"oom rate {row['oom_rate']:.3f}"
            )
    print(json.dumps(result))
    return 0


def _print_data(got: dict[str, object]) -> None:
    for row in got["cases"]:  # type: ignore[attr-defined]
        print(
            f"{row['case']:24s} oom rate {row['oom_rate']:.3f} (expected {row['expected_oom_rate']:.3f}) "
            f"saved {row['slice_memory_saved']:.3f} below declaration {row['subjobs_below_declaration']:.2f} "
            f"first below {row['median_first_subjob_below_declaration']}"
        )


if __name__ == "__main__":
    sys.exit(main())
