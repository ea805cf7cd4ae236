"""Two versions of the code run one benchmark in turns, and the figures that tell them apart.

    python bench/interleaved.py main HEAD --rounds 3 -- --jobs 1000 --slices 512 \\
        --trace-sample 0.01 --cohost inventory,gateway,clearer,advertiser

Each revision is checked out once (``git worktree``, under ``--work``) and its own
``bench/control_plane.py`` (``--bench``) runs from it with the arguments after ``--``: A, B, A, B,
... ``--rounds`` times, on this interpreter, with its ``sja`` and ``services`` from that checkout
(``PYTHONPATH``). A shared two-core machine drifts by more than most changes between one hour and
the next; within a round the two runs see about the same machine, so the summary compares them
round by round: the median over rounds of B's figure over A's. ``SJA_PURE_PYTHON=1`` (the default
here: a compiled core is built for one version of the sources) runs the Python core; pass
``--compiled`` to use each checkout's ``build/core`` if it has one.

Every run's JSON line is printed as it ends (``{"rev": ..., "round": ..., <the benchmark's
fields>}``), then the summary as the last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

FIGURES = (
    "grants_per_s",
    "grant_latency_p50_ms",
    "grant_latency_p99_ms",
    "cpu_s_per_grant",
    "messages_per_grant",
    "bids_per_round_mean",
    "offers_per_batch_mean",
)
"""What the summary compares (B over A, round by round)."""


def checkout(rev: str, work: Path, made: list[Path]) -> tuple[str, Path]:
    """The commit ``rev`` names, checked out (detached) under ``work`` (``made``: if it was not)."""
    sha = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", rev], check=True, capture_output=True, text=True
    ).stdout.strip()
    path = work / sha
    if not path.exists():
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(path), sha],
            check=True,
        )
        made.append(path)
    return sha, path


def run(path: Path, bench: str, args: list[str], compiled: bool, timeout_s: float) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=f"{path / 'libs'}{os.pathsep}{path}")
    if not compiled:
        env["SJA_PURE_PYTHON"] = "1"
    else:
        env["SJA_COMPILED_CORE_DIR"] = str(path / "build" / "core")
    got = subprocess.run(
        [sys.executable, bench, *args, "--json"],
        cwd=path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    lines = [ln for ln in got.stdout.splitlines() if ln.startswith("{")]
    if got.returncode != 0 or not lines:
        tail = (got.stderr or got.stdout)[-2000:]
        return {"error": f"exit {got.returncode}: {tail}"}
    out: dict[str, Any] = json.loads(lines[-1])
    return out


def summary(runs: list[dict[str, Any]], a: str, b: str) -> dict[str, Any]:
    """Per figure: each revision's median, and the median over rounds of B's over A's."""
    by_round: dict[int, dict[str, dict[str, Any]]] = {}
    for r in runs:
        if "error" not in r:
            by_round.setdefault(r["round"], {})[r["rev"]] = r
    out: dict[str, Any] = {"a": a, "b": b, "rounds": len(by_round)}
    for f in FIGURES:
        va = [x[a][f] for x in by_round.values() if a in x and f in x[a]]
        vb = [x[b][f] for x in by_round.values() if b in x and f in x[b]]
        ratios = [
            x[b][f] / x[a][f]
            for x in by_round.values()
            if a in x and b in x and f in x[a] and f in x[b] and x[a][f]
        ]
        out[f] = {
            "a": statistics.median(va) if va else None,
            "b": statistics.median(vb) if vb else None,
            "b_over_a": round(statistics.median(ratios), 3) if ratios else None,
            "b_over_a_each": [round(v, 3) for v in ratios],
        }
    out["errors"] = sum(1 for r in runs if "error" in r)
    return out


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args: list[str] = []
    if "--" in argv:
        at = argv.index("--")
        argv, bench_args = argv[:at], argv[at + 1 :]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("a", help="the version to compare against (a git revision)")
    ap.add_argument("b", help="the version compared (a git revision)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--bench", default="bench/control_plane.py", help="the benchmark, in each checkout")
    ap.add_argument("--work", type=Path, default=None, help="where checkouts go (default: a temp dir)")
    ap.add_argument("--compiled", action="store_true", help="use each checkout's build/core")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    ap.add_argument("--keep", action="store_true", help="keep the checkouts it made")
    ns = ap.parse_args(argv)
    work = ns.work or Path(tempfile.mkdtemp(prefix="sja-interleaved-"))
    work.mkdir(parents=True, exist_ok=True)
    made: list[Path] = []
    try:
        (a, pa), (b, pb) = checkout(ns.a, work, made), checkout(ns.b, work, made)
        if a == b:
            raise SystemExit(f"{ns.a} and {ns.b} are the same commit ({a})")
        runs: list[dict[str, Any]] = []
        for rnd in range(1, ns.rounds + 1):
            for rev, path in ((a, pa), (b, pb)):
                r = {"rev": rev, "round": rnd, **run(path, ns.bench, bench_args, ns.compiled, ns.timeout_s)}
                runs.append(r)
                print(json.dumps(r), flush=True)
        print(json.dumps(summary(runs, a, b)))
    finally:
        for path in [] if ns.keep else made:
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)],
                check=False,
                capture_output=True,
            )


if __name__ == "__main__":
    main()
