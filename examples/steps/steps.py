"""A program of SJA's command contract and nothing more (no SDK, no import of ``sja``).

It starts (``STARTUP_S`` seconds of sleep stand for an interpreter, a framework and a model being
built), then does its units in order, each ``UNIT_S`` seconds of arithmetic. Its state is one JSON
file: a running hash of the units done and how many times the program started. On ``SIGTERM`` it
finishes the unit it is in, leaves its state in ``$SJA_STATE_OUT``, writes how far it got to
``$SJA_REPORT`` and exits 0.

Outside SJA, ``python steps.py --units N`` runs the N units in one piece and prints the same JSON
the job's last state holds (``starts`` aside).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

MODULUS = 1_000_000_007
stop = False


def on_term(signum: int, frame: object) -> None:
    global stop
    stop = True


def unit(acc: int, u: int, seconds: float) -> int:
    """One unit: ``seconds`` of busy arithmetic, then the unit folded into the hash."""
    until = time.perf_counter() + seconds
    x = u
    while time.perf_counter() < until:
        x = (x * 48271) % 2147483647
    return (acc * 31 + u) % MODULUS


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--units", type=int, default=0, help="run in one piece: this many units")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, on_term)
    startup_s = float(os.environ.get("STARTUP_S", "0"))
    unit_s = float(os.environ.get("UNIT_S", "0.1"))
    time.sleep(startup_s)
    if args.units:
        acc = {"hash": 0, "units": 0, "starts": 1}
        for u in range(args.units):
            acc["hash"] = unit(acc["hash"], u, unit_s)
            acc["units"] += 1
        print(json.dumps(acc))
        return
    start, count = int(os.environ["SJA_UNIT_START"]), int(os.environ["SJA_UNITS"])
    state = os.path.join(os.environ["SJA_STATE_IN"], "state.json")
    acc = json.load(open(state)) if os.path.exists(state) else {"hash": 0, "units": 0, "starts": 0}
    acc["starts"] += 1
    done = 0
    for u in range(start, start + count):
        if stop:
            break
        acc["hash"] = unit(acc["hash"], u, unit_s)
        acc["units"] += 1
        done += 1
    with open(os.path.join(os.environ["SJA_STATE_OUT"], "state.json"), "w") as f:
        json.dump(acc, f)
    with open(os.environ["SJA_REPORT"], "w") as f:
        json.dump({"units_done": done, "metrics": acc}, f)


if __name__ == "__main__":
    main()
