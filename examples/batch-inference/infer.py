"""Batch inference over a JSONL file of items, as SJA subjobs (``workload: command``).

Each subjob scores its range of items (``ctx.units``) with a small fixed model and writes the
predictions of that range to ``$SJA_STATE_OUT/part.jsonl``; it stops early, keeping what it did,
when the window ends (``ctx.should_stop()``, then ``ctx.report(units_done=...)``). ``merge.py``
concatenates the parts in item order.

Run in one piece (no SJA), ``python infer.py items.jsonl`` prints every prediction: the scheduled
job's merged ``predictions.jsonl`` equals that output.
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def items(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def features(text: str, dims: int = 16) -> list[float]:
    """Hashed character trigrams: a fixed, deterministic featurization."""
    v = [0.0] * dims
    for i in range(max(1, len(text) - 2)):
        h = int.from_bytes(hashlib.blake2b(text[i : i + 3].encode(), digest_size=4).digest(), "big")
        v[h % dims] += 1.0 if (h >> 8) & 1 else -1.0
    return v


WEIGHTS = [math.sin(1.7 * i + 0.3) for i in range(16)]


def predict(item: dict) -> dict:
    z = sum(w * x for w, x in zip(WEIGHTS, features(item["text"]), strict=True))
    score = 1.0 / (1.0 + math.exp(-z / 4.0))
    return {"id": item["id"], "label": "positive" if score >= 0.5 else "negative", "score": round(score, 6)}


def main() -> None:
    data = Path(sys.argv[1]) if len(sys.argv) > 1 else HERE / "items.jsonl"
    rows = items(data)
    try:
        import sja.job

        ctx = sja.job.context()
    except (ImportError, RuntimeError):  # not a subjob: the whole file, to stdout
        for item in rows:
            print(json.dumps(predict(item), sort_keys=True))
        return
    done = 0
    with (ctx.state_out / "part.jsonl").open("w", encoding="utf-8") as out:
        for i in ctx.units:
            if ctx.should_stop():
                break
            out.write(json.dumps(predict(rows[i]), sort_keys=True) + "\n")
            done += 1
    ctx.report(units_done=done, items=done)


if __name__ == "__main__":
    main()
