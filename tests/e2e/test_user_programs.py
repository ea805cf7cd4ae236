"""End to end: users' own code through the whole stack (every service a process, a local Ray).

The examples under ``examples/`` run as they are documented, and each result equals the same
program run in one piece:

- ``examples/batch-inference``: a program using the SDK under the ``command`` contract, independent
  ranges (``sequential: false``), fetched and merged in item order by ``sja result``;
- ``examples/entrypoint-pkg``: a workload of a separate package, found through its entry point (the
  package is put on the executor's path only, with a ``dist-info`` written from its own
  ``pyproject.toml``, which is what ``pip install`` leaves: nothing is installed into the
  environment); its facts are computed where it is submitted and its result combined where it is
  fetched, so the gateway and the agents run without it;
- ``examples/torch-train``: a PyTorch script resuming from its state (skipped unless an interpreter
  with ``torch`` is found: this one, or ``SJA_TORCH_PYTHON``).
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml

from sja.client import SjaClient
from sja.protocol.messages import JobSpec, JobState
from sja.results import fetch_result
from sja.stack import LocalStack

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"


def entry_point_path(tmp: Path) -> Path:
    """A directory holding the example package's ``dist-info`` (its entry points, from its own
    pyproject), to put on ``PYTHONPATH`` with its sources."""
    meta = tomllib.loads((EXAMPLES / "entrypoint-pkg" / "pyproject.toml").read_text())
    project = meta["project"]
    dist = tmp / f"{project['name'].replace('-', '_')}-{project['version']}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {project['name']}\nVersion: {project['version']}\n"
    )
    lines = []
    for group, eps in project["entry-points"].items():
        lines.append(f"[{group}]")
        lines += [f"{name} = {target}" for name, target in eps.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return tmp


def torch_python() -> str | None:
    for candidate in (os.environ.get("SJA_TORCH_PYTHON", ""), sys.executable):
        if (
            candidate
            and subprocess.run([candidate, "-c", "import torch"], capture_output=True).returncode == 0
        ):
            return candidate
    return None


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    out = tmp_path_factory.mktemp("stack")
    eps = entry_point_path(tmp_path_factory.mktemp("eps"))
    # Subjobs import the package in their sandbox, as the slice's uid: readable by others, as an
    # installed package is (pytest makes its directories the user's only).
    eps.chmod(0o755)
    path = os.pathsep.join(
        p for p in (str(eps), str(EXAMPLES / "entrypoint-pkg" / "src"), os.environ.get("PYTHONPATH", "")) if p
    )
    env = {
        "SJA_HORIZON_S": "30.0",
        "SJA_POLICY": "fair",
        "SJA_LOG_LEVEL": "INFO",
        "SJA_RAY_NUM_CPUS": "2",
    }
    # The package only where subjobs run: the gateway and the agents never import a tenant's code.
    s = LocalStack(out_dir=out, env=env, service_env={"executor": {"PYTHONPATH": path}})
    try:
        s.start()
        asyncio.run(s.wait_ready())
        yield s
    finally:
        s.stop()


def load(path: Path, **params: Any) -> JobSpec:
    raw = yaml.safe_load(path.read_text())
    raw["params"].update(params)
    return msgspec.convert(raw, JobSpec)


def absolute(argv: list[str], python: str = sys.executable) -> list[str]:
    """The example's argv as the executor must run it here: this interpreter, paths from the root."""
    return [python if a == "python" else str(ROOT / a) if a.startswith("examples/") else a for a in argv]


async def run_jobs(stack: LocalStack, specs: list[JobSpec], timeout_s: float) -> list[JobState]:
    client = await SjaClient.connect(stack.nats_url)
    try:
        ids = [(await client.submit(s)).job_id for s in specs]
        deadline = time.monotonic() + timeout_s
        while True:
            states = [await client.status(j) for j in ids]
            if all(s.status in ("done", "failed", "cancelled") for s in states):
                return states
            assert time.monotonic() < deadline, [(s.job_id, s.status, s.units_done) for s in states]
            await asyncio.sleep(0.5)
    finally:
        await client.close()


async def fetch(stack: LocalStack, state: JobState, out: Path) -> dict[str, Any]:
    client = await SjaClient.connect(stack.nats_url)
    try:
        return await fetch_result(client, state, out)
    finally:
        await client.close()


def test_batch_inference_and_an_entry_point_workload_equal_their_one_piece_runs(
    stack: LocalStack, tmp_path: Path
) -> None:
    infer = load(EXAMPLES / "batch-inference" / "job.yaml")
    infer = msgspec.structs.replace(
        infer,
        params={
            **infer.params,
            "argv": absolute(infer.params["argv"]),
            "merge_argv": absolute(infer.params["merge_argv"]),
        },
        # Slower than it is, declared: the first subjobs are cut small.
        time=msgspec.structs.replace(infer.time, per_unit_s=0.05) if infer.time else None,
    )
    # As `sja submit` does where the package is installed: the facts come from the workload there,
    # the control plane never imports it.
    pkg_path = os.pathsep.join(
        [str(entry_point_path(tmp_path / "eps")), str(EXAMPLES / "entrypoint-pkg" / "src")]
    )
    submitted = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, msgspec; from sja.client import load_spec; "
            "sys.stdout.write(msgspec.json.encode(load_spec(open(sys.argv[1]).read())).decode())",
            str(EXAMPLES / "entrypoint-pkg" / "job.yaml"),
        ],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": pkg_path},
    ).stdout
    primes = msgspec.json.decode(submitted, type=JobSpec)
    assert primes.facts is not None and primes.facts.total_units > 1
    primes = msgspec.convert(
        {**msgspec.to_builtins(primes), "time": {"warmup_s": 0.05, "per_unit_s": 0.1, "rel_sd": 0.5}}, JobSpec
    )
    states = asyncio.run(run_jobs(stack, [infer, primes], 240))
    for s in states:
        assert s.status == "done", (s.job_id, s.error)
        assert len([h for h in s.history if h.status == "ok"]) >= 2, "the job was cut into subjobs"
    infer_state, primes_state = states

    got = asyncio.run(fetch(stack, infer_state, tmp_path / "infer"))
    assert got["merged"] and got["parts"] >= 2
    one_piece = subprocess.run(
        [sys.executable, str(EXAMPLES / "batch-inference" / "infer.py")],
        capture_output=True,
        text=True,
        check=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("SJA_")},
    ).stdout
    assert (tmp_path / "infer" / "predictions.jsonl").read_text() == one_piece
    ok = [h for h in infer_state.history if h.status == "ok"]
    assert all(h.peak_mem_mib > 1 for h in ok), "the program's memory was measured"

    reference = subprocess.run(
        [
            sys.executable,
            "-c",
            "import json, sys; sys.path.insert(0, sys.argv[1]); from sja_example_primes import Primes; "
            "from sja.workloads import run_in_one_piece; "
            "print(json.dumps(run_in_one_piece('sja_example_primes:Primes', json.loads(sys.argv[2]))))",
            str(EXAMPLES / "entrypoint-pkg" / "src"),
            msgspec.json.encode(primes_state.spec.params).decode(),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # The control plane kept the parts; the tenant's own `sja result` merges and finalizes them.
    assert primes_state.result["result"] == "sja result" and primes_state.result["parts"] >= 2
    fetched = subprocess.run(
        [
            str(Path(sys.executable).parent / "sja"),
            "result",
            primes_state.job_id,
            "--out",
            str(tmp_path / "primes"),
            "--nats",
            stack.nats_url,
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": pkg_path},
    )
    assert fetched.returncode == 0, fetched.stderr
    combined = msgspec.json.decode((tmp_path / "primes" / "result.json").read_bytes())
    assert combined == msgspec.json.decode(reference)


CODE_MAIN = """
import os, pathlib, sys
from helpers.sums import total
e = os.environ
i, o = pathlib.Path(e["SJA_STATE_IN"]), pathlib.Path(e["SJA_STATE_OUT"])
start, n = int(e["SJA_UNIT_START"]), int(e["SJA_UNITS"])
before = int((i / "total").read_text()) if (i / "total").exists() else 0
(o / "total").write_text(str(before + total(start, start + n)))
(o / "executable").write_text(sys.executable)
(o / "where").write_text(os.getcwd() + " " + e["SJA_CODE_DIR"] + " " + e["PYTHONPATH"])
"""


def test_a_program_runs_in_its_uploaded_code_with_the_interpreter_the_job_names(
    stack: LocalStack, tmp_path: Path
) -> None:
    """``sja submit --code DIR``: the directory goes through the gateway and Ray to the slice's node,
    where the program runs in it (importing its own module); ``python`` is the interpreter the job
    names, or the executor's own. An interpreter missing where the job is submitted is refused."""
    code = tmp_path / "code"
    (code / "helpers").mkdir(parents=True)
    (code / "helpers" / "__init__.py").write_text("")
    (code / "helpers" / "sums.py").write_text("def total(a, b):\n    return sum(range(a, b))\n")
    (code / "main.py").write_text(CODE_MAIN)
    named = os.path.realpath(sys.executable)  # not the executor's (a virtual environment's) own
    specs = []
    for name, extra in (("own-python", ""), ("named-python", f", python: {named}")):
        f = tmp_path / f"{name}.yaml"
        f.write_text(
            f"name: {name}\ntenant: t\nworkload: command\n"
            # Each subjob its planned range (none goes on past its window): the job is cut, and
            # every subjob runs in the code afresh.
            f"params: {{argv: [python, main.py], units: 60, continue: false{extra}}}\n"
            "time: {warmup_s: 0.2, per_unit_s: 0.2}\n"
        )
        specs.append(f)
    sja = str(Path(sys.executable).parent / "sja")
    missing = tmp_path / "missing.yaml"
    missing.write_text(specs[1].read_text().replace(named, "/opt/no-such-venv/bin/python"))
    refused = subprocess.run(
        [sja, "submit", "--nats", stack.nats_url, "--code", str(code), str(missing)],
        capture_output=True,
        text=True,
    )
    assert refused.returncode == 2
    assert "params.python: /opt/no-such-venv/bin/python does not exist here" in refused.stderr

    submitted = subprocess.run(
        [sja, "submit", "--json", "--nats", stack.nats_url, "--code", str(code), *map(str, specs)],
        capture_output=True,
        text=True,
    )
    assert submitted.returncode == 0, submitted.stderr
    ids = [a["job_id"] for a in msgspec.json.decode(submitted.stdout)]

    async def wait() -> list[JobState]:
        client = await SjaClient.connect(stack.nats_url)
        try:
            deadline = time.monotonic() + 240
            while True:
                states = [await client.status(j) for j in ids]
                if all(s.status in ("done", "failed", "cancelled") for s in states):
                    return states
                assert time.monotonic() < deadline, [(s.job_id, s.status, s.error) for s in states]
                await asyncio.sleep(0.5)
        finally:
            await client.close()

    states = asyncio.run(wait())
    for state, python in zip(states, (sys.executable, named), strict=True):
        assert state.status == "done", (state.job_id, state.error)
        assert state.spec.params["code"].startswith("sha256:")
        assert len([h for h in state.history if h.status == "ok"]) >= 2, "the job was cut into subjobs"
        out = tmp_path / state.job_id
        asyncio.run(fetch(stack, state, out))
        assert (out / "total").read_text() == str(sum(range(60)))
        assert (out / "executable").read_text() == python
        assert (out / "where").read_text() == "/tmp/sja-code /tmp/sja-code /tmp/sja-code"


@pytest.mark.parametrize("warm", [False, True], ids=["cold", "warm"])
def test_a_torch_training_script_resumes_from_its_state_and_ends_as_in_one_piece(
    stack: LocalStack, tmp_path: Path, warm: bool
) -> None:
    """Warm (``params.warm``): the script continues in one process where its subjobs follow each
    other on a slice (``ctx.next_range()``); the weights are the same bit for bit either way."""
    python = torch_python()
    if python is None:
        pytest.skip("no interpreter with torch (install it, or point SJA_TORCH_PYTHON at one)")
    spec = load(EXAMPLES / "torch-train" / "job.yaml", units=300)
    spec = msgspec.structs.replace(
        spec,
        name=f"{spec.name}-{'warm' if warm else 'cold'}",
        params={
            **spec.params,
            "argv": absolute(spec.params["argv"], python),
            "warm": warm,
            # Each subjob its planned range (none goes on past its window): the script resumes
            # from its state, or warm, from its own memory.
            "continue": False,
            "env": {"PYTHONPATH": str(ROOT / "libs")} if warm else {},
        },
        time=msgspec.structs.replace(spec.time, per_unit_s=0.03) if spec.time else None,
    )
    (state,) = asyncio.run(run_jobs(stack, [spec], 400))
    assert state.status == "done", state.error
    assert len([h for h in state.history if h.status == "ok"]) >= 2, "the job was cut into subjobs"
    asyncio.run(fetch(stack, state, tmp_path / "sja"))
    subprocess.run(
        [
            python,
            str(EXAMPLES / "torch-train" / "train.py"),
            "--steps",
            "300",
            "--out",
            str(tmp_path / "one"),
        ],
        check=True,
        capture_output=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("SJA_")},
    )
    compare = (
        "import sys, torch; a = torch.load(sys.argv[1], weights_only=True); "
        "b = torch.load(sys.argv[2], weights_only=True); "
        "assert a['step'] == b['step'] == 300, (a['step'], b['step']); "
        "assert all(torch.equal(a['model'][k], b['model'][k]) for k in a['model']), 'weights differ'"
    )
    subprocess.run(
        [python, "-c", compare, str(tmp_path / "sja" / "state.pt"), str(tmp_path / "one" / "state.pt")],
        check=True,
    )
