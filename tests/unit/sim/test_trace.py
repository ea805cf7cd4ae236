"""Trace adapters: what each format's columns become, what is modeled, and how bad input is reported."""

from __future__ import annotations

import itertools
import math
import os
import statistics
from pathlib import Path

import pytest

from sja.sim.model import TraceJob
from sja.sim.trace import (
    FRACTION_GPU_MEM_MIB,
    MEM_GAP_CLIP,
    MODELED_TENANTS,
    OPENB_GPU_MEM_MIB,
    OPENB_SINGLE_GPU_MILLI,
    load_trace,
    openb_single_gpu_milli_table,
)


def _traces() -> Path:
    return Path(os.environ.get("SJA_TRACES_DIR", Path(__file__).resolve().parents[4] / "shared" / "traces"))


def _real(rel: str) -> Path:
    path = _traces() / rel
    if not path.is_file():
        pytest.skip(f"real trace {path} not available")
    return path


def _write(tmp_path: Path, text: str, name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text(text.lstrip())
    return path


OPENB_HEADER = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,"
    "creation_time,deletion_time,scheduled_time\n"
)
OPENB = OPENB_HEADER + (
    "pod-a,4000,8000,1,500,,LS,Running,100,400,150\n"  # share of a GPU, runs 250 s
    "pod-b,8000,8000,0,0,,BE,Running,120,500,120\n"  # CPU only: dropped
    "pod-c,8000,8000,2,1000,V100M16|V100M32,BE,Succeeded,130,330,130\n"  # two whole GPUs, runs 200 s
    "pod-d,8000,8000,1,1000,,BE,Pending,140,160,\n"  # never scheduled: modeled duration
    "pod-e,8000,8000,1,250,T4,,Failed,100,190,110\n"  # same submit as pod-a: ordered by id after it
)


def _by_id(jobs: list[TraceJob]) -> dict[str, TraceJob]:
    return {j.job_id: j for j in jobs}


def test_openb_maps_pods_to_jobs(tmp_path: Path) -> None:
    jobs = load_trace(_write(tmp_path, OPENB), "alibaba-openb", seed=3)
    assert [j.job_id for j in jobs] == ["pod-a", "pod-e", "pod-c", "pod-d"], "GPU pods by (submit, id)"
    assert [j.submit_s for j in jobs] == [0.0, 0.0, 30.0, 40.0], "first submission shifted to 0"
    a, c, d, e = (_by_id(jobs)[k] for k in ("pod-a", "pod-c", "pod-d", "pod-e"))
    assert (a.num_gpus, a.gpu_fraction, a.duration_s, a.tenant) == (1, 0.5, 250.0, "LS")
    assert a.mem_mib == 0.5 * OPENB_GPU_MEM_MIB["V100M32"], "no gpu_spec: share of a 32 GB V100"
    assert (c.num_gpus, c.gpu_fraction, c.duration_s) == (2, 1.0, 200.0)
    assert c.mem_mib == OPENB_GPU_MEM_MIB["V100M16"], "several models allowed: the smallest must fit"
    assert e.mem_mib == 0.25 * OPENB_GPU_MEM_MIB["T4"]
    assert e.tenant == "default", "empty qos"
    assert d.duration_s in {250.0, 200.0, 80.0}, "pending pod: a duration of a scheduled pod"
    for j in jobs:
        assert "mem_mib" in j.synthetic and "true_mem_mib" in j.synthetic
        assert ("duration_s" in j.synthetic) == (j.job_id == "pod-d")
        assert "gpu_fraction" not in j.synthetic and "tenant" not in j.synthetic


def test_msitp_models_fraction_memory_and_tenant(tmp_path: Path) -> None:
    rows = "".join(f"job{i},{1000 + i},{60 * (i + 1)},{1 if i % 3 else 4}\n" for i in range(60))
    jobs = load_trace(_write(tmp_path, "job_id,submission_time,duration,num_gpu\n" + rows), "ms-itp", seed=5)
    assert len(jobs) == 60
    assert jobs[0].submit_s == 0.0 and jobs[-1].submit_s == 59.0
    shares = {m / 1000 for m, _ in OPENB_SINGLE_GPU_MILLI}
    for j in jobs:
        assert j.duration_s == 60 * (int(j.job_id[3:]) + 1)
        assert j.tenant in MODELED_TENANTS
        assert j.mem_mib == pytest.approx(j.gpu_fraction * FRACTION_GPU_MEM_MIB)
        if j.num_gpus == 1:
            assert j.gpu_fraction in shares
            assert j.synthetic == ("gpu_fraction", "mem_mib", "tenant", "true_mem_mib")
        else:
            assert j.gpu_fraction == 1.0
            assert j.synthetic == ("mem_mib", "tenant", "true_mem_mib")
    assert any(j.gpu_fraction < 1 for j in jobs) and len({j.tenant for j in jobs}) > 1


def test_generic_csv_keeps_given_fields_and_models_missing_ones(tmp_path: Path) -> None:
    text = """
job_id,submit_s,duration_s,num_gpus,gpu_fraction,mem_mib,tenant,deadline_s,true_mem_mib
full,10,100,1,0.25,5000,alice,500,3000
bare,20,50,1,,,,,
multi,30,70,2,,,bob,,
"""
    jobs = _by_id(load_trace(_write(tmp_path, text), "csv", seed=1))
    full, bare, multi = jobs["full"], jobs["bare"], jobs["multi"]
    assert full == TraceJob("full", 0.0, 100.0, 1, 0.25, 5000.0, 3000.0, "alice", 490.0, ())
    assert bare.synthetic == ("gpu_fraction", "mem_mib", "tenant", "true_mem_mib")
    assert bare.mem_mib == pytest.approx(bare.gpu_fraction * FRACTION_GPU_MEM_MIB)
    assert bare.deadline_s is None, "no deadline model: absent stays absent"
    assert multi.gpu_fraction == 1.0 and multi.tenant == "bob"
    assert multi.synthetic == ("mem_mib", "true_mem_mib")


def test_generic_csv_needs_only_the_required_columns(tmp_path: Path) -> None:
    jobs = load_trace(_write(tmp_path, "job_id,submit_s,duration_s,num_gpus\nx,5,1.5,8\n"), "csv")
    assert jobs == [jobs[0]] and jobs[0].num_gpus == 8 and jobs[0].duration_s == 1.5


def test_time_scale_start_and_limit(tmp_path: Path) -> None:
    text = "job_id,submit_s,duration_s,num_gpus,deadline_s\n" + "".join(
        f"j{i},{100 + 10 * i},40,1,{100 + 10 * i + 300}\n" for i in range(10)
    )
    path = _write(tmp_path, text)
    scaled = load_trace(path, "csv", time_scale=0.5)
    assert [j.submit_s for j in scaled] == [5.0 * i for i in range(10)]
    assert all(j.duration_s == 40 for j in scaled), "durations are not compressed"
    assert all(j.deadline_s == j.submit_s + 300 for j in scaled), "deadlines keep their slack"
    windowed = load_trace(path, "csv", start_s=150, limit=3)
    assert [(j.job_id, j.submit_s) for j in windowed] == [("j5", 0.0), ("j6", 10.0), ("j7", 20.0)]
    assert load_trace(path, "csv", limit=0) == []


def test_same_seed_same_jobs_and_limit_does_not_change_draws(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "job_id,submit_s,duration_s,num_gpus\n" + "".join(f"j{i},{i},9,1\n" for i in range(200))
    )
    a = load_trace(path, "csv", seed=7)
    assert a == load_trace(path, "csv", seed=7)
    assert load_trace(path, "csv", seed=7, limit=20) == a[:20]
    b = load_trace(path, "csv", seed=8)
    assert [j.true_mem_mib for j in a] != [j.true_mem_mib for j in b]
    assert [j.tenant for j in a] != [j.tenant for j in b]


def test_true_memory_is_a_clipped_share_of_the_declared(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        "job_id,submit_s,duration_s,num_gpus,mem_mib\n"
        + "".join(f"j{i},{i},9,1,1000\n" for i in range(2000)),
    )
    ratios = [j.true_mem_mib / 1000 for j in load_trace(path, "csv") if j.true_mem_mib is not None]
    assert len(ratios) == 2000
    assert MEM_GAP_CLIP[0] <= min(ratios) and max(ratios) <= MEM_GAP_CLIP[1]
    assert statistics.median(ratios) == pytest.approx(0.6, abs=0.03)


@pytest.mark.parametrize(
    ("fmt", "text", "expected"),
    [
        ("csv", "job_id,submit_s,duration_s\nx,1,2\n", r"trace\.csv:1: missing column\(s\) 'num_gpus'"),
        (
            "csv",
            "job_id,submit_s,duration_s,num_gpus\nx,1,2,1\ny,abc,2,1\n",
            r":3: column 'submit_s': .*'abc'",
        ),
        ("csv", "job_id,submit_s,duration_s,num_gpus\nx,1,-2,1\n", r":2: column 'duration_s': must be >= 0"),
        ("csv", "job_id,submit_s,duration_s,num_gpus\nx,1,2,0\n", r":2: column 'num_gpus': must be >= 1"),
        ("csv", "job_id,submit_s,duration_s,num_gpus\nx,1,2,1.5\n", r":2: column 'num_gpus': .*whole number"),
        (
            "csv",
            "job_id,submit_s,duration_s,num_gpus\nx,1,2,1\nx,3,2,1\n",
            r":3: column 'job_id': duplicate .*line 2",
        ),
        (
            "csv",
            "job_id,submit_s,duration_s,num_gpus,gpu_fraction\nx,1,2,2,0.5\n",
            r":2: column 'gpu_fraction': .*num_gpus == 1",
        ),
        (
            "csv",
            "job_id,submit_s,duration_s,num_gpus,gpu_fraction\nx,1,2,1,1.5\n",
            r"'gpu_fraction': must be in",
        ),
        (
            "csv",
            "job_id,submit_s,duration_s,num_gpus,deadline_s\nx,10,2,1,5\n",
            r":2: column 'deadline_s': .*precedes",
        ),
        ("csv", "job_id,submit_s,duration_s,num_gpus\nx,1,2,1,extra\n", r":2: more fields than the header"),
        ("csv", "", r"trace\.csv:1: empty file"),
        ("alibaba-openb", OPENB_HEADER + "p,1,1,1,500,,LS,Running,1,9,x\n", r":2: column 'scheduled_time'"),
        ("alibaba-openb", OPENB_HEADER + "p,1,1,1,500,,LS,Running,1,5,9\n", r":2: column 'deletion_time'"),
        ("alibaba-openb", OPENB_HEADER + "p,1,1,2,500,,LS,Running,1,9,1\n", r":2: column 'gpu_milli'"),
        (
            "alibaba-openb",
            OPENB_HEADER + "p,1,1,1,500,H800,LS,Running,1,9,1\n",
            r":2: column 'gpu_spec'.*H800",
        ),
        (
            "alibaba-openb",
            OPENB_HEADER + "p,1,1,1,500,,LS,Pending,1,9,\n",
            r"never-scheduled .* no scheduled",
        ),
        ("ms-itp", "job_id,submission_time,duration,num_gpu\na,1,2,nan\n", r":2: column 'num_gpu'"),
        ("parquet", "x\n", r"trace\.csv: unknown trace format 'parquet'"),
    ],
)
def test_malformed_input_names_file_line_and_column(
    tmp_path: Path, fmt: str, text: str, expected: str
) -> None:
    with pytest.raises(ValueError, match=expected):
        load_trace(_write(tmp_path, text), fmt)


def test_missing_file_and_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"nope\.csv: cannot read"):
        load_trace(tmp_path / "nope.csv", "csv")
    path = _write(tmp_path, "job_id,submit_s,duration_s,num_gpus\nx,1,2,1\n")
    for kwargs in ({"seed": -1}, {"time_scale": 0.0}, {"time_scale": math.inf}, {"limit": -1}):
        with pytest.raises(ValueError, match="must be"):
            load_trace(path, "csv", **kwargs)


def test_real_openb_default() -> None:
    jobs = load_trace(_real("alibaba-openb/openb_pod_list_default.csv"), "alibaba-openb", seed=0)
    assert len(jobs) == 7064, "GPU pods of the trace"
    assert sum(j.gpu_fraction < 1 for j in jobs) == 3078
    modeled = [j for j in jobs if "duration_s" in j.synthetic]
    assert 0 < len(modeled) <= 897, "at most the never-scheduled pods have a modeled duration"
    assert {j.tenant for j in jobs} == {"LS", "BE", "Burstable", "Guaranteed"}
    assert jobs[0].submit_s == 0 and all(a.submit_s <= b.submit_s for a, b in itertools.pairwise(jobs))
    assert all(j.duration_s >= 0 and j.mem_mib is not None for j in jobs)


def test_bundled_fraction_table_is_the_openb_distribution() -> None:
    table = openb_single_gpu_milli_table(_real("alibaba-openb/openb_pod_list_default.csv"))
    assert table == OPENB_SINGLE_GPU_MILLI


def test_real_msitp_with_limit() -> None:
    jobs = load_trace(_real("ms-itp/cluster04.csv"), "ms-itp", seed=2, limit=500, time_scale=0.1)
    assert len(jobs) == 500 and jobs[0].submit_s == 0
    assert jobs == load_trace(_real("ms-itp/cluster04.csv"), "ms-itp", seed=2, limit=500, time_scale=0.1)
    assert all("tenant" in j.synthetic and "mem_mib" in j.synthetic for j in jobs)
    assert {j.num_gpus for j in jobs} >= {1, 8}
