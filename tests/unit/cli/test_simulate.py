"""``sja simulate`` (``sja.cli.simulate``): metrics and a report written for every policy, bad input
refused in one line with exit code 2, and repartitioning chosen through the cluster spec."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from rich.console import Console

from sja.cli.simulate import simulate_command
from sja.sim.runner import parse_policies

TINY_CSV = """job_id,submit_s,duration_s,num_gpus,gpu_fraction,mem_mib,true_mem_mib,tenant
a,0,900,1,1.0,8000,6000,alice
b,60,1500,2,1.0,12000,9000,bob
c,120,600,1,0.5,4000,3000,alice
"""


def test_simulate_command_writes_metrics_and_a_report(tmp_path: Path) -> None:
    trace_file = tmp_path / "tiny.csv"
    trace_file.write_text(TINY_CSV)
    out = tmp_path / "m.json"
    code = simulate_command(
        trace=trace_file,
        fmt="csv",
        cluster="2xA100-80GB:4g.40gb+3g.40gb",
        policies="fifo,easy,bestfit,sja,sja:efficiency",
        json_out=out,
        report_dir=tmp_path / "report",
        console=Console(file=io.StringIO()),
    )
    assert code == 0
    metrics = json.loads(out.read_text())
    assert list(metrics) == ["bestfit", "easy", "fifo", "sja:efficiency", "sja:fair"]
    for m in metrics.values():
        assert m["jobs_finished"] == 3
        for key in ("utilization", "mean_jct_s", "p95_jct_s", "mean_wait_s", "p95_wait_s", "makespan_s"):
            assert m[key] is not None
        assert m["makespan_s"] >= m["makespan_lower_bound_s"] - 1e-6
        assert m["rho_jobs"] == 3 and m["rho_max"] >= m["rho_p99"] > 0
    assert metrics["sja:efficiency"]["subjobs"] > 3
    assert metrics["bestfit"]["rho_max"] == 1.0
    assert metrics["sja:efficiency"]["overhead_s"] > 0
    report = (tmp_path / "report" / "report.md").read_text()
    assert "jct_cdf.png" in report and (tmp_path / "report" / "utilization.png").is_file()
    assert "## Finish-time fairness" in report and "- fifo: p99 rho" in report


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"trace": Path("/nonexistent.csv")}, "no such trace file"),
        ({"fmt": "parquet"}, "unknown trace format"),
        ({"cluster": "3xQ9000"}, "bad cluster spec"),
        ({"policies": "lottery"}, "unknown policy"),
        ({"eps_mem": 0.7}, "--eps-mem"),
    ],
)
def test_simulate_command_rejects_bad_input_with_exit_code_2(
    tmp_path: Path, overrides: dict[str, object], message: str
) -> None:
    trace_file = tmp_path / "tiny.csv"
    trace_file.write_text(TINY_CSV)
    err = io.StringIO()
    args: dict[str, object] = {
        "trace": trace_file,
        "fmt": "csv",
        "cluster": "1xA100-80GB",
        "policies": "fifo",
    }
    args.update(overrides)
    code = simulate_command(**args, console=Console(file=io.StringIO()), err_console=Console(file=err))  # type: ignore[arg-type]
    assert code == 2
    text = err.getvalue()
    assert message in text and len(text.strip().splitlines()) == 1


def test_cli_selects_repartitioning_through_the_cluster_spec(tmp_path: Path) -> None:
    trace_file = tmp_path / "small.csv"
    rows = [f"s{i},{10 * i},1200,1,{1 / 7:.6f},5000,4000,t{i % 2}" for i in range(14)]
    trace_file.write_text(
        "job_id,submit_s,duration_s,num_gpus,gpu_fraction,mem_mib,true_mem_mib,tenant\n"
        + "\n".join(rows)
        + "\n"
    )
    results = {}
    for spec in ("2xA100-80GB", "2xA100-80GB~repart", "2xA100-80GB~repart=60"):
        out = tmp_path / "m.json"
        code = simulate_command(
            trace=trace_file,
            fmt="csv",
            cluster=spec,
            policies="bestfit,sja",
            json_out=out,
            report_dir=tmp_path / "report",
            horizon_s=3600.0,
            console=Console(file=io.StringIO()),
        )
        assert code == 0
        results[spec] = json.loads(out.read_text())
    static, repart, slow = results.values()
    for policy in parse_policies("bestfit,sja"):
        assert static[policy]["repartitions"] == 0
        assert repart[policy]["repartitions"] > 0
        assert repart[policy]["makespan_s"] < static[policy]["makespan_s"]
        assert slow[policy]["reconfig_s"] == pytest.approx(60.0 * slow[policy]["repartitions"])
    report = (tmp_path / "report" / "report.md").read_text()
    assert "repartitions" in report and "reconfiguration 5 s" in report
