"""Combine the parts of the batch-inference job in item order (``merge_argv``, run by
``sja result JOB --out DIR``): ``$SJA_PARTS_DIR/<unit start>/part.jsonl`` ->
``$SJA_STATE_OUT/predictions.jsonl``."""

from __future__ import annotations

import os
from pathlib import Path

parts = Path(os.environ["SJA_PARTS_DIR"])
out = Path(os.environ["SJA_STATE_OUT"]) / "predictions.jsonl"
with out.open("w", encoding="utf-8") as f:
    for part in sorted(parts.iterdir()):  # names are zero-padded unit starts: unit order
        f.write((part / "part.jsonl").read_text(encoding="utf-8"))
