"""``sja inventory``: the slices a source sees, as JSON or as Ray resources, and NVML's errors as the
command reports them."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from sja.cli.main import app


def test_inventory_command_prints_the_slices_a_source_sees() -> None:
    runner = CliRunner()
    out = runner.invoke(
        app, ["inventory", "--source", "fake-nvml:h100-nomig", "--soft-slices", "2", "--json"]
    )
    assert out.exit_code == 0, out.output
    got = json.loads(out.stdout)
    assert [s["slice_id"] for s in got["slices"]] == ["local-g0-soft0", "local-g0-soft1"]
    assert got["lost"] == [] and got["source"] == "fake-nvml:h100-nomig"

    res = runner.invoke(
        app, ["inventory", "--source", "fake-nvml:a100-40gb", "--node", "n2", "--ray-resources"]
    )
    assert res.exit_code == 0, res.output
    resources = json.loads(res.stdout)
    assert resources["sja_node:n2"] == 1000.0 and "sja_slice:n2-g0-3g.20gb-4" in resources

    missing = runner.invoke(app, ["inventory", "--source", "fake-nvml:no-driver"])
    assert missing.exit_code == 2 and "LibraryNotFound" in missing.output

    lost = runner.invoke(app, ["inventory", "--source", "fake-nvml:gpu-lost"])
    assert lost.exit_code == 0 and "GpuIsLost" in lost.output
