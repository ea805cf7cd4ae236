"""The compose Ray path without Docker: ``infra/ray/start-head.sh`` (the ``ray-head`` service's
command) runs as a local process with the compose service's environment (token authentication on),
and the executor runs as its own process with the compose executor's environment, joining the head
through the compose address form (``SJA_RAY_ADDRESS=ray://<head>:10001``, a Ray Client) with the
same token. A job submitted to the stack completes with the result of the job computed in one piece,
its subjobs running on the head's slice actors.

The Ray Client needs ``grpcio`` (``ray[client]``, which the image installs); without it the test is
skipped with that reason."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import yaml

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from services.agent.service import AgentService, AgentSettings
from services.clearer.service import ClearerService, ClearerSettings
from services.gateway.service import GatewayService, GatewaySettings
from services.inventory.service import InventoryService, InventorySettings
from sja.bus.natsd import free_port
from sja.client import SjaClient
from sja.core import jobs as J
from sja.inventory.declared import load_declared
from sja.protocol.messages import JobSpec
from sja.workloads import codepack, run_in_one_piece

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
START_HEAD = ROOT / "infra" / "ray" / "start-head.sh"
REQUIRED = re.compile(r"\$\{([A-Z0-9_]+):\?[^}]*\}")


def compose_env(service: str, values: dict[str, str]) -> dict[str, str]:
    """A compose service's environment with its ``${VAR:?...}`` variables filled from ``values``
    (empty when not given: this test uses no NATS credentials)."""
    doc = yaml.safe_load(COMPOSE.read_text(encoding="utf-8"))
    env = doc["services"][service]["environment"]
    return {k: REQUIRED.sub(lambda m: values.get(m.group(1), ""), str(v)) for k, v in env.items()}


def clean_environ() -> dict[str, str]:
    """This process's environment without SJA, Ray or OpenTelemetry settings (no local Ray forced)."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("SJA_", "RAY_", "OTEL_"))}


@pytest.fixture(scope="module")
def grpc_available() -> None:
    r = subprocess.run([sys.executable, "-c", "import grpc"], capture_output=True, env=clean_environ())
    if r.returncode != 0:
        pytest.skip("the Ray Client (ray://) needs grpcio, which `pip install 'ray[client]'` installs")


@pytest.fixture
def ray_head(grpc_available: None) -> Iterator[tuple[str, dict[str, str], Path]]:
    """start-head.sh as a local process; yields the executor's ``SJA_RAY_ADDRESS``, the compose
    executor's environment (token included) and the head's log."""
    token = secrets.token_hex(32)  # what infra/nats/gen-passwords.sh makes
    head_env = compose_env("ray-head", {"RAY_AUTH_TOKEN": token})
    assert head_env["RAY_AUTH_MODE"] == "token"
    gcs_port, client_port = free_port(), free_port()
    # A short root: Ray's Unix sockets live under it (their paths have a length limit).
    temp = Path(tempfile.mkdtemp(prefix="sja-rh-", dir="/tmp"))
    log = temp / "head.log"
    env = {
        **clean_environ(),
        **head_env,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "RAY_PORT": str(gcs_port),
        "RAY_CLIENT_SERVER_PORT": str(client_port),
        "RAY_NUM_CPUS": "2",
    }
    env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)  # no Jaeger here: spans go to files
    # Extra arguments go to `ray start`: loopback only, and ports of its own (tests run side by side).
    args = [
        "--node-ip-address=127.0.0.1",
        f"--temp-dir={temp / 'ray'}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        "--object-store-memory=100000000",
    ]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            ["sh", str(START_HEAD), *args],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        # The compose health check: `ray status` against the head (with the token).
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, tail(log)
            r = subprocess.run(
                ["ray", "status", "--address", f"127.0.0.1:{gcs_port}"],
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            if r.returncode == 0:
                break
            assert time.monotonic() < deadline, f"head never healthy: {r.stderr[-2000:]}"
            time.sleep(1.0)
        # Token authentication is on: the same check with another token is refused.
        wrong = {**env, "RAY_AUTH_TOKEN": secrets.token_hex(32)}
        r = subprocess.run(
            ["ray", "status", "--address", f"127.0.0.1:{gcs_port}"],
            env=wrong,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode != 0 and "InvalidAuthToken" in r.stderr + r.stdout, r.stderr[-2000:]
        executor_env = compose_env("executor", {"RAY_AUTH_TOKEN": token})
        address = executor_env["SJA_RAY_ADDRESS"]
        assert address == "ray://ray-head:10001", "the compose address form"
        executor_env["SJA_RAY_ADDRESS"] = address.replace("ray-head:10001", f"127.0.0.1:{client_port}")
        yield executor_env["SJA_RAY_ADDRESS"], executor_env, log
    finally:
        # As `docker stop` does: SIGTERM to the container's first process, `ray start --block` (the
        # script execs it), which drains the node and stops the processes it started. A SIGTERM to
        # the whole group would stop the GCS first, and `ray start` would then wait for it.
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        # `ray start --block` stops the head's processes when it is terminated; what is left of the
        # group (if anything) goes with it.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(temp, ignore_errors=True)


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:]


def start_executor(env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    """``sja service executor`` (the compose executor's command) as its own process."""
    with log.open("ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "sja.cli.main", "service", "executor"],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


@contextlib.asynccontextmanager
async def running(*services: object) -> AsyncIterator[None]:
    async with contextlib.AsyncExitStack() as stack:
        for s in services:
            await stack.enter_async_context(s)  # type: ignore[arg-type]
        yield


async def wait_for_instance(nc: object, instance: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until the process answers NATS micro discovery as ``instance`` (it is serving)."""
    deadline = time.monotonic() + 150
    while True:
        assert proc.poll() is None, tail(log)
        with contextlib.suppress(Exception):
            msg = await nc.request("$SRV.PING.sja-executor", b"", timeout=1.0)  # type: ignore[attr-defined]
            if json.loads(msg.data)["metadata"]["instance"] == instance:
                return
        assert time.monotonic() < deadline, tail(log)
        await asyncio.sleep(0.5)


SUMS = """
import os, pathlib
from helpers import total
e = os.environ
i, o = pathlib.Path(e["SJA_STATE_IN"]), pathlib.Path(e["SJA_STATE_OUT"])
start, n = int(e["SJA_UNIT_START"]), int(e["SJA_UNITS"])
before = int((i / "sum").read_text()) if (i / "sum").exists() else 0
(o / "sum").write_text(str(before + total(start, start + n)))
"""


async def test_an_executor_joins_the_compose_ray_head_as_a_ray_client_and_completes_a_job(
    ray_head: tuple[str, dict[str, str], Path], nats_url: str, tmp_path: Path, nc
) -> None:
    address, executor_env, head_log = ray_head
    assert address.startswith("ray://127.0.0.1:")
    assert executor_env["RAY_AUTH_MODE"] == "token" and executor_env["RAY_AUTH_TOKEN"]

    def c(name: str) -> dict[str, object]:
        return {"nats_url": nats_url, "out_dir": str(tmp_path / "out"), "instance": name}

    services = [
        InventoryService(InventorySettings(**c("inventory-rh"))),
        GatewayService(GatewaySettings(**c("gateway-rh"))),
        ClearerService(ClearerSettings(**c("clearer-rh"))),
        AgentService(AgentSettings(**c("agent-rh"), horizon_s=4.0)),
        AdvertiserService(AdvertiserSettings(**c("advertiser-rh"), horizon_s=4.0)),
    ]
    log = tmp_path / "executor.log"
    env = {
        **clean_environ(),
        **{k: v for k, v in executor_env.items() if k.startswith(("SJA_RAY_", "SJA_NODE", "RAY_AUTH_"))},
        "SJA_NATS_URL": nats_url,
        "SJA_OUT_DIR": str(tmp_path / "out"),
        "SJA_INSTANCE": "executor-rh",
        "PYTHONUNBUFFERED": "1",
    }
    async with running(*services):
        proc = start_executor(env, log)
        try:
            await wait_for_instance(nc, "executor-rh", proc, log)
            client = SjaClient(nc)
            spec = JobSpec(
                name="ray-head-mc",
                tenant="t",
                workload="montecarlo",
                max_parallel=2,
                params={"units": 30, "samples_per_unit": 20_000, "seed": 11},
            )
            job = await client.submit(spec)
            # A job's code: the executor, a Ray Client, hands it to the head's cluster.
            code = tmp_path / "code"
            code.mkdir()
            (code / "helpers.py").write_text("def total(a, b):\n    return sum(range(a, b))\n")
            (code / "sums.py").write_text(SUMS)
            ref = await client.upload_code("t", codepack.pack(code, 1 << 20))
            with_code = await client.submit(
                JobSpec(
                    name="ray-head-code",
                    tenant="t",
                    workload="command",
                    params={"argv": ["python", "sums.py"], "units": 30, "code": ref},
                )
            )
            deadline = time.monotonic() + 150
            for j in (job, with_code):
                while not J.is_terminal(state := await client.status(j.job_id)):
                    assert time.monotonic() < deadline, (state.status, state.units_done)
                    assert proc.poll() is None, tail(log)
                    await asyncio.sleep(0.3)
            state = await client.status(job.job_id)
            coded = await client.status(with_code.job_id)
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)

    assert state.status == "done", (state.status, state.error, tail(log))
    assert state.result == run_in_one_piece(spec.workload, spec.params)
    assert coded.status == "done", (coded.status, coded.error, tail(log))
    assert coded.result["units_done"] == 30
    local = {s.slice_id for s in load_declared(None) if s.node == "local"}
    assert {h.slice_id for h in state.history if h.status == "ok"} <= local
    # The executor started no Ray of its own: its actors are the head's (the head's log names the
    # slices it declared, and the executor's connects through the Ray Client).
    head = tail(head_log, 1_000_000)
    assert all(f"sja_slice:{sid}" in head for sid in local), head[-2000:]
    assert "Started a local Ray instance" not in tail(log, 1_000_000)
