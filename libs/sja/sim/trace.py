"""Trace adapters: real cluster traces (and a generic CSV) as ``TraceJob`` lists for the simulator.

Three formats are read (``docs/traces.md`` has the full mapping):

- ``alibaba-openb``: Alibaba's GPU-sharing trace (``openb_pod_list_*.csv``, FGD, USENIX ATC'23);
- ``ms-itp``: Microsoft ITP training clusters (``cluster04.csv``/``cluster07.csv``, ElasticFlow, ASPLOS'23);
- ``csv``: a generic format (``job_id,submit_s,duration_s,num_gpus`` plus optional columns).

No trace carries everything the simulator needs (none records real GPU memory use, ms-itp knows only
whole GPUs). What is missing is filled in by seeded models whose parameters are module constants below,
and every field so filled is named in ``TraceJob.synthetic``. The draws for a file are made once for all
its rows in file order, one random stream per model, so the same ``seed`` gives the same jobs whatever
``limit`` or ``start_s`` select, and changing one model does not shift another's draws.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from sja.core.mig import A100_40GB
from sja.sim.model import TraceJob

FORMATS = ("alibaba-openb", "ms-itp", "csv")

# GPU memory (MiB) of the models named in the openb traces, as the driver reports it. Source: the FGD
# simulator's table (hkust-adsl/kubernetes-scheduler-simulator, pkg/type/open-gpu-share/utils/const.go),
# which records nvidia-smi's total memory in bytes for each card (e.g. Tesla-T4: 15842934784 B = 15109 MiB).
# G1, G2 and G3 are undisclosed internal GPU codes (alibaba/clusterdata cluster-trace-gpu-v2023 README);
# nothing public gives their memory, so they are assumed to be 32 GB V100-class cards like the default below.
OPENB_GPU_MEM_MIB: dict[str, int] = {
    "P4": 7611,  # Tesla-P4
    "2080": 11019,  # GeForce-RTX-2080-Ti
    "1080": 11178,  # GeForce-GTX-1080-Ti
    "M40": 11448,  # Tesla-M40
    "T4": 15109,  # Tesla-T4
    "V100M16": 16160,  # Tesla-V100-SXM2-16GB
    "P100": 16280,  # Tesla-P100-PCIE-16GB
    "A10": 22731,  # NVIDIA-A10
    "3090": 24268,  # GeForce-RTX-3090
    "V100M32": 32510,  # Tesla-V100-SXM2-32GB, Tesla-V100S-PCIE-32GB
    "A100": 81251,  # A100-SXM4-80GB
    "G1": 32510,  # undisclosed: assumed V100M32-class
    "G2": 32510,  # undisclosed: assumed V100M32-class
    "G3": 32510,  # undisclosed: assumed V100M32-class
}

OPENB_DEFAULT_GPU_MODEL = "V100M32"
"""GPU whose memory sizes an openb pod without ``gpu_spec`` (the declared memory of a whole GPU)."""

FRACTION_GPU_MEM_MIB = max(p.mem_mib for p in A100_40GB.profiles) - 256
"""GPU memory that a modeled fraction is a share of (ms-itp and generic CSV): what one A100-40GB gives
a job, its whole 7g.40gb instance less the 256 MiB driver reserve (39,936 MiB). A job asking for a
whole such GPU declares exactly what one holds."""

# Empirical distribution of gpu_milli over the single-GPU pods (num_gpu == 1, every pod phase) of
# openb_pod_list_default.csv, 6,989 pods: (gpu_milli, count). Bundled rather than read at run time so a
# model's draws do not depend on which files a machine has; tests check it against the file.
OPENB_SINGLE_GPU_MILLI: tuple[tuple[int, int], ...] = (
    (50, 7),
    (110, 24),
    (140, 1),
    (160, 74),
    (220, 62),
    (230, 140),
    (270, 4),
    (290, 1),
    (320, 328),
    (330, 7),
    (350, 6),
    (370, 47),
    (440, 2),
    (460, 128),
    (470, 750),
    (480, 19),
    (550, 72),
    (590, 75),
    (650, 253),
    (810, 1078),
    (1000, 3911),
)

# Declared versus real peak memory: true_mem_mib = mem_mib * r, with ln r ~ Normal(ln MEDIAN, SIGMA) clipped
# to CLIP. No public trace pairs a declared GPU memory with the measured peak, so this is an assumption
# (declared peaks are sized for the worst case and overestimate typical use); reports sweep or state it.
MEM_GAP_MEDIAN = 0.6
MEM_GAP_SIGMA = 0.35
MEM_GAP_CLIP = (0.2, 1.0)

MODELED_TENANTS = ("t1", "t2", "t3", "t4")
"""Tenants assigned uniformly at random where a trace names none (ms-itp, generic CSV without ``tenant``)."""

# One random stream per model: numpy's SeedSequence([seed, stream]).
_STREAM_DURATION = 1
_STREAM_FRACTION = 2
_STREAM_MEM_GAP = 3
_STREAM_TENANT = 4

_MILLI = 1000


# --- CSV reading with located errors -------------------------------------------------------------------


class CsvRow:
    """One CSV record with typed accessors whose errors name the file, line and column."""

    __slots__ = ("line", "path", "values")

    def __init__(self, path: Path, line: int, values: dict[str, str]) -> None:
        self.path = path
        self.line = line
        self.values = values

    def error(self, column: str, message: str) -> ValueError:
        return ValueError(f"{self.path}:{self.line}: column {column!r}: {message}")

    def text(self, column: str) -> str:
        return (self.values.get(column) or "").strip()

    def has(self, column: str) -> bool:
        return self.text(column) != ""

    def number(self, column: str, *, minimum: float | None = None) -> float:
        raw = self.text(column)
        if raw == "":
            raise self.error(column, "missing value")
        try:
            value = float(raw)
        except ValueError:
            raise self.error(column, f"expected a number, got {raw!r}") from None
        if not math.isfinite(value):
            raise self.error(column, f"expected a finite number, got {raw!r}")
        if minimum is not None and value < minimum:
            raise self.error(column, f"must be >= {minimum:g}, got {raw!r}")
        return value

    def integer(self, column: str, *, minimum: int | None = None) -> int:
        value = self.number(column)
        if value != int(value):
            raise self.error(column, f"expected a whole number, got {self.text(column)!r}")
        if minimum is not None and value < minimum:
            raise self.error(column, f"must be >= {minimum}, got {self.text(column)!r}")
        return int(value)


def read_csv_rows(path: str | Path, required: Sequence[str]) -> Iterator[CsvRow]:
    """Yield the records of a CSV file with a header, after checking the header has ``required``.

    Raises:
        ValueError: the file is missing, empty, or lacks a required column (named with ``path:1``).
    """
    p = Path(path)
    try:
        fh = p.open(newline="", encoding="utf-8-sig")
    except OSError as exc:
        raise ValueError(f"{p}: cannot read trace file: {exc.strerror or exc}") from None
    with fh:
        reader = csv.DictReader(fh)
        header = reader.fieldnames
        if not header:
            raise ValueError(f"{p}:1: empty file (expected a header with {', '.join(required)})")
        names = {h.strip() for h in header}
        missing = [c for c in required if c not in names]
        if missing:
            raise ValueError(f"{p}:1: missing column(s) {', '.join(map(repr, missing))}")
        strip = any(h != h.strip() for h in header)
        for values in reader:
            if None in values:
                raise ValueError(f"{p}:{reader.line_num}: more fields than the header names")
            if strip:
                values = {k.strip(): v for k, v in values.items()}
            yield CsvRow(p, reader.line_num, values)


# --- Seeded models -------------------------------------------------------------------------------------


def _rng(seed: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream])


def _draw_single_gpu_fraction(seed: int, n: int) -> np.ndarray:
    milli = np.array([m for m, _ in OPENB_SINGLE_GPU_MILLI], dtype=np.float64)
    weights = np.array([c for _, c in OPENB_SINGLE_GPU_MILLI], dtype=np.float64)
    return np.asarray(_rng(seed, _STREAM_FRACTION).choice(milli, size=n, p=weights / weights.sum())) / _MILLI


def _draw_mem_gap(seed: int, n: int) -> np.ndarray:
    ratio = np.exp(_rng(seed, _STREAM_MEM_GAP).normal(math.log(MEM_GAP_MEDIAN), MEM_GAP_SIGMA, size=n))
    return np.clip(ratio, *MEM_GAP_CLIP)


def _draw_tenants(seed: int, n: int) -> list[str]:
    picks = _rng(seed, _STREAM_TENANT).integers(len(MODELED_TENANTS), size=n)
    return [MODELED_TENANTS[int(i)] for i in picks]


def openb_single_gpu_milli_table(path: str | Path) -> tuple[tuple[int, int], ...]:
    """The (gpu_milli, count) distribution of an openb pod list's single-GPU pods, as bundled above."""
    counts: dict[int, int] = {}
    for row in read_csv_rows(path, ("num_gpu", "gpu_milli")):
        if row.integer("num_gpu", minimum=0) == 1:
            milli = min(row.integer("gpu_milli", minimum=0), _MILLI)
            if milli > 0:
                counts[milli] = counts.get(milli, 0) + 1
    return tuple(sorted(counts.items()))


# --- Adapters ------------------------------------------------------------------------------------------


@dataclass
class _Draft:
    """A job as read, before the shared models and the time transform fill and shift it."""

    job_id: str
    submit_s: float
    duration_s: float
    num_gpus: int
    gpu_fraction: float
    mem_mib: float
    tenant: str
    deadline_s: float | None
    true_mem_mib: float | None
    synthetic: list[str]


def _check_unique(row: CsvRow, column: str, job_id: str, seen: dict[str, int]) -> None:
    if job_id == "":
        raise row.error(column, "missing job id")
    if job_id in seen:
        raise row.error(column, f"duplicate job id {job_id!r} (first on line {seen[job_id]})")
    seen[job_id] = row.line


OPENB_COLUMNS = (
    "name",
    "num_gpu",
    "gpu_milli",
    "gpu_spec",
    "qos",
    "pod_phase",
    "creation_time",
    "deletion_time",
    "scheduled_time",
)


def _openb_gpu_mem(row: CsvRow) -> float:
    models = [m for m in row.text("gpu_spec").split("|") if m]
    if not models:
        return float(OPENB_GPU_MEM_MIB[OPENB_DEFAULT_GPU_MODEL])
    unknown = [m for m in models if m not in OPENB_GPU_MEM_MIB]
    if unknown:
        known = ", ".join(sorted(OPENB_GPU_MEM_MIB))
        raise row.error("gpu_spec", f"unknown GPU model(s) {', '.join(unknown)} (known: {known})")
    # A pod that may run on any of several models must fit the smallest of them.
    return float(min(OPENB_GPU_MEM_MIB[m] for m in models))


def _read_openb(path: Path, seed: int) -> list[_Draft]:
    drafts: list[_Draft] = []
    pending: list[int] = []
    seen: dict[str, int] = {}
    for row in read_csv_rows(path, OPENB_COLUMNS):
        num_gpu = row.integer("num_gpu", minimum=0)
        milli = row.integer("gpu_milli", minimum=0)
        if num_gpu == 0 and milli == 0:
            continue  # CPU-only pod
        job_id = row.text("name")
        _check_unique(row, "name", job_id, seen)
        if num_gpu > 1 and 0 < milli < _MILLI:
            raise row.error(
                "gpu_milli",
                f"a share of a GPU ({milli}) with num_gpu={num_gpu}: openb defines "
                "gpu_milli below 1000 only for single-GPU pods",
            )
        # gpu_milli above 1000 means one whole GPU (as the FGD YAML converter clips it); 0 with num_gpu > 0
        # means whole GPUs; a share with num_gpu == 0 is a one-GPU share.
        sharing = 0 < milli < _MILLI
        fraction = milli / _MILLI if sharing else 1.0
        num_gpus = max(num_gpu, 1)
        submit = row.number("creation_time")
        synthetic = ["mem_mib"]
        scheduled = (
            row.text("pod_phase") != "Pending" and row.has("scheduled_time") and row.has("deletion_time")
        )
        if scheduled:
            duration = row.number("deletion_time") - row.number("scheduled_time")
            if duration < 0:
                raise row.error("deletion_time", "deleted before it was scheduled")
        else:
            duration = math.nan
            pending.append(len(drafts))
            synthetic.append("duration_s")
        drafts.append(
            _Draft(
                job_id=job_id,
                submit_s=submit,
                duration_s=duration,
                num_gpus=num_gpus,
                gpu_fraction=fraction,
                mem_mib=fraction * _openb_gpu_mem(row),
                tenant=row.text("qos") or "default",
                deadline_s=None,
                true_mem_mib=None,
                synthetic=synthetic,
            )
        )
    if pending:
        observed = np.sort(np.array([d.duration_s for d in drafts if not math.isnan(d.duration_s)]))
        if observed.size == 0:
            raise ValueError(
                f"{path}: {len(pending)} never-scheduled GPU pods but no scheduled one whose "
                "duration could model theirs"
            )
        draws = _rng(seed, _STREAM_DURATION).choice(observed, size=len(drafts))
        for i in pending:
            drafts[i].duration_s = float(draws[i])
    return drafts


MSITP_COLUMNS = ("job_id", "submission_time", "duration", "num_gpu")


def _read_msitp(path: Path, seed: int) -> list[_Draft]:
    rows = list(read_csv_rows(path, MSITP_COLUMNS))
    fractions = _draw_single_gpu_fraction(seed, len(rows))
    tenants = _draw_tenants(seed, len(rows))
    drafts: list[_Draft] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        num_gpus = row.integer("num_gpu", minimum=0)
        if num_gpus == 0:
            continue  # not a GPU job
        job_id = row.text("job_id")
        _check_unique(row, "job_id", job_id, seen)
        synthetic = ["mem_mib", "tenant"]
        fraction = 1.0
        if num_gpus == 1:
            fraction = float(fractions[i])
            synthetic.insert(0, "gpu_fraction")
        drafts.append(
            _Draft(
                job_id=job_id,
                submit_s=row.number("submission_time"),
                duration_s=row.number("duration", minimum=0),
                num_gpus=num_gpus,
                gpu_fraction=fraction,
                mem_mib=fraction * FRACTION_GPU_MEM_MIB,
                tenant=tenants[i],
                deadline_s=None,
                true_mem_mib=None,
                synthetic=synthetic,
            )
        )
    return drafts


CSV_REQUIRED = ("job_id", "submit_s", "duration_s", "num_gpus")
CSV_OPTIONAL = ("gpu_fraction", "mem_mib", "tenant", "deadline_s", "true_mem_mib")


def _read_generic(path: Path, seed: int) -> list[_Draft]:
    rows = list(read_csv_rows(path, CSV_REQUIRED))
    fractions = _draw_single_gpu_fraction(seed, len(rows))
    tenants = _draw_tenants(seed, len(rows))
    drafts: list[_Draft] = []
    seen: dict[str, int] = {}
    for i, row in enumerate(rows):
        job_id = row.text("job_id")
        _check_unique(row, "job_id", job_id, seen)
        submit = row.number("submit_s")
        num_gpus = row.integer("num_gpus", minimum=1)
        synthetic: list[str] = []
        if row.has("gpu_fraction"):
            fraction = row.number("gpu_fraction")
            if not 0 < fraction <= 1:
                raise row.error("gpu_fraction", f"must be in (0, 1], got {row.text('gpu_fraction')!r}")
            if fraction < 1 and num_gpus != 1:
                raise row.error("gpu_fraction", f"a share of a GPU needs num_gpus == 1, got {num_gpus}")
        elif num_gpus == 1:
            fraction = float(fractions[i])
            synthetic.append("gpu_fraction")
        else:
            fraction = 1.0
        if row.has("mem_mib"):
            mem = row.number("mem_mib")
            if mem <= 0:
                raise row.error("mem_mib", f"must be > 0, got {row.text('mem_mib')!r}")
        else:
            mem = fraction * FRACTION_GPU_MEM_MIB
            synthetic.append("mem_mib")
        true_mem: float | None = None
        if row.has("true_mem_mib"):
            true_mem = row.number("true_mem_mib")
            if true_mem <= 0:
                raise row.error("true_mem_mib", f"must be > 0, got {row.text('true_mem_mib')!r}")
        tenant = row.text("tenant")
        if not tenant:
            tenant = tenants[i]
            synthetic.append("tenant")
        deadline: float | None = None
        if row.has("deadline_s"):
            deadline = row.number("deadline_s")
            if deadline < submit:
                raise row.error("deadline_s", f"deadline {deadline:g} precedes submission {submit:g}")
        drafts.append(
            _Draft(
                job_id=job_id,
                submit_s=submit,
                duration_s=row.number("duration_s", minimum=0),
                num_gpus=num_gpus,
                gpu_fraction=fraction,
                mem_mib=mem,
                tenant=tenant,
                deadline_s=deadline,
                true_mem_mib=true_mem,
                synthetic=synthetic,
            )
        )
    return drafts


_READERS = {"alibaba-openb": _read_openb, "ms-itp": _read_msitp, "csv": _read_generic}


def load_trace(
    path: str | Path,
    fmt: str,
    *,
    seed: int = 0,
    limit: int | None = None,
    time_scale: float = 1.0,
    start_s: float | None = None,
) -> list[TraceJob]:
    """Read a trace file into jobs sorted by ``(submit_s, job_id)``.

    Args:
        path: the trace file.
        fmt: ``"alibaba-openb"``, ``"ms-itp"`` or ``"csv"``.
        seed: seeds every modeled field (non-negative); the same seed gives the same jobs.
        limit: keep only the first ``limit`` jobs after sorting.
        time_scale: multiplies submission times after the shift; below 1 compresses arrivals (raising
            the load), durations stay as recorded.
        start_s: the trace time that becomes 0; jobs submitted earlier are dropped. Default: the first
            job's submission time.

    Returns:
        The jobs; ``submit_s`` is ``(t - origin) * time_scale``, a deadline keeps its slack after
        submission (``deadline - submit`` is unchanged).

    Raises:
        ValueError: unknown format, bad arguments, or a malformed file (naming the file, line and column).
    """
    reader = _READERS.get(fmt)
    if reader is None:
        raise ValueError(f"{path}: unknown trace format {fmt!r} (known: {', '.join(FORMATS)})")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"time_scale must be a positive number, got {time_scale}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    p = Path(path)
    drafts = reader(p, seed)

    gaps = _draw_mem_gap(seed, len(drafts))
    for d, ratio in zip(drafts, gaps, strict=True):
        if d.true_mem_mib is None:
            d.true_mem_mib = d.mem_mib * float(ratio)
            d.synthetic.append("true_mem_mib")

    drafts.sort(key=lambda d: (d.submit_s, d.job_id))
    if start_s is not None:
        drafts = [d for d in drafts if d.submit_s >= start_s]
        origin = start_s
    else:
        origin = drafts[0].submit_s if drafts else 0.0
    if limit is not None:
        drafts = drafts[:limit]

    jobs: list[TraceJob] = []
    for d in drafts:
        submit = (d.submit_s - origin) * time_scale
        deadline = None if d.deadline_s is None else submit + (d.deadline_s - d.submit_s)
        jobs.append(
            TraceJob(
                job_id=d.job_id,
                submit_s=submit,
                duration_s=d.duration_s,
                num_gpus=d.num_gpus,
                gpu_fraction=d.gpu_fraction,
                mem_mib=d.mem_mib,
                true_mem_mib=d.true_mem_mib,
                tenant=d.tenant,
                deadline_s=deadline,
                synthetic=tuple(d.synthetic),
            )
        )
    return jobs
