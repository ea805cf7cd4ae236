"""The configuration reference in ``docs/operations.md`` cannot fall behind the code: every settings
field of every service is listed (as ``SJA_<FIELD>``, in a row naming its service, with its default),
and so is every variable the CLI, the telemetry set-up, the Ray head script and the compose file
read; the reference names no variable that nothing reads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from services.registry import SERVICES, load
from sja.bus.settings import BaseSettings
from sja.protocol import subjects

ROOT = Path(__file__).resolve().parents[3]
OPERATIONS = ROOT / "docs" / "operations.md"
NAME = re.compile(r"\b(?:SJA|OTEL|RAY)_[A-Z0-9_]*[A-Z0-9]\b")

SET_BY_THE_EXECUTOR = {"SJA_SLICE_ID", "SJA_SLICE_SOURCE"}
"""Variables the executor sets for a subjob's process (``sja.execution.actor.actor_env``)."""


def table_rows(text: str) -> list[list[str]]:
    """Every row of every Markdown table, as its cells (header and rule rows left out)."""
    rows = []
    for line in text.splitlines():
        line = line.strip()
        if not (line.startswith("|") and line.endswith("|")) or re.fullmatch(r"\|[-| :]+\|", line):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells and cells[0] in ("service", "variable", "command", "metric"):
            continue  # a header
        rows.append(cells)
    return rows


@pytest.fixture(scope="module")
def rows() -> list[list[str]]:
    return table_rows(OPERATIONS.read_text(encoding="utf-8"))


def rows_naming(rows: list[list[str]], variable: str) -> list[list[str]]:
    return [r for r in rows if any(f"`{variable}`" in c for c in r)]


def shown_default(value: object) -> str | None:
    """How a default is written in the reference (in backticks); None: nothing to show."""
    if value in ("", None):
        return None
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, int | float):
        return f"{value:g}"
    if isinstance(value, tuple | list):  # as the variable is written: comma-separated
        return ",".join(shown_default(v) or "" for v in value) or None
    if isinstance(value, dict):
        return ",".join(f"{k}={shown_default(v)}" for k, v in value.items()) or None
    return str(value)


def undocumented(service: str, rows: list[list[str]]) -> list[str]:
    """The service's own settings that no row under its name lists with their default."""
    _service_cls, settings_cls = load(service)
    shared = dict(BaseSettings.variables())
    out = []
    for variable, default in settings_cls.variables():
        if variable in shared:
            continue
        found = [
            r
            for r in rows_naming(rows, variable)
            if service in {s.strip() for s in r[0].split(",")} and f"`{variable}`" in r[1]
        ]
        shown = shown_default(default)
        if not found:
            out.append(variable)
        elif shown is not None and not any(f"`{shown}`" in r[2] for r in found):
            out.append(f"{variable} (default {shown})")
    return out


def test_every_shared_setting_is_listed_with_its_default(rows: list[list[str]]) -> None:
    variables = dict(BaseSettings.variables())
    # Not vacuous: the NATS settings group is read variable by variable.
    assert {"SJA_NATS_URL", "SJA_NATS_USER", "SJA_NATS_TLS_KEY", "SJA_JS_REPLICAS"} <= set(variables)
    for variable, value in variables.items():
        found = [r for r in rows_naming(rows, variable) if r[0] == "all"]
        assert found, f"{variable} is not in the 'every service' table of docs/operations.md"
        default = shown_default(value)
        if default is not None:
            assert any(f"`{default}`" in r[2] for r in found), (variable, default, found)


@pytest.mark.parametrize("service", sorted(SERVICES))
def test_every_service_setting_is_listed_under_its_service(rows: list[list[str]], service: str) -> None:
    assert undocumented(service, rows) == [], f"{service}: missing from docs/operations.md"


def read_in_code() -> set[str]:
    """Variables the code and deployment files read other than through settings classes."""
    names: set[str] = set()
    for path in (ROOT / "libs" / "sja" / "cli").glob("*.py"):
        names |= set(re.findall(r'envvar="([A-Z0-9_]+)"', path.read_text(encoding="utf-8")))
    for path in (ROOT / "libs" / "sja" / "telemetry").glob("*.py"):
        names |= set(re.findall(r'"(OTEL_[A-Z0-9_]+)"', path.read_text(encoding="utf-8")))
    accel = (ROOT / "libs" / "sja" / "accel.py").read_text(encoding="utf-8")
    names |= set(re.findall(r'environ\.get\("((?:SJA|RAY)_[A-Z0-9_]+)"', accel))
    head = (ROOT / "infra" / "ray" / "start-head.sh").read_text(encoding="utf-8")
    names |= set(re.findall(r"\$\{((?:SJA|RAY)_[A-Z0-9_]+)", head))
    names |= set(re.findall(r'environ\.get\("((?:SJA|RAY)_[A-Z0-9_]+)"', head))
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text(encoding="utf-8"))
    for svc in compose["services"].values():
        env = svc.get("environment") or {}
        names |= {k for k in env if NAME.fullmatch(k)}
    return names


def test_every_variable_the_cli_telemetry_ray_head_and_compose_read_is_listed() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    read = read_in_code()
    # Not vacuous: each source contributes what it is known to read.
    assert {"SJA_TENANT", "SJA_INVENTORY_SOURCE", "SJA_SOFT_SLICES"} <= read
    assert {"OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_METRICS_EXPORTER", "OTEL_EXPORTER_PROMETHEUS_HOST"} <= read
    assert {"RAY_PORT", "RAY_CLIENT_SERVER_PORT", "RAY_NUM_CPUS", "SJA_INVENTORY"} <= read
    assert {"RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "SJA_RAY_ADDRESS"} <= read
    assert {"SJA_PURE_PYTHON", "SJA_COMPILED_CORE_DIR"} <= read
    missing = sorted(v for v in read if f"`{v}`" not in text)
    assert not missing, f"not in docs/operations.md: {missing}"


def test_the_reference_names_no_variable_that_nothing_reads() -> None:
    known = set(read_in_code()) | SET_BY_THE_EXECUTOR
    known |= {"OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG", "OTEL_PROPAGATORS"}  # read by the SDK
    known |= {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_METRIC_EXPORT_INTERVAL"}  # read by the SDK
    for name in SERVICES:
        _service_cls, settings_cls = load(name)
        known |= {variable for variable, _ in settings_cls.variables()}
    text = OPERATIONS.read_text(encoding="utf-8")
    streams = {s.name for s in vars(subjects).values() if isinstance(s, subjects.StreamSpec)}
    listed = {m.group(0) for m in NAME.finditer(text)} - streams
    assert listed, "the reference lists variables"
    stale = sorted(listed - known)
    assert not stale, f"docs/operations.md names variables nothing reads: {stale}"


def test_the_drift_check_notices_a_missing_row_or_a_wrong_default() -> None:
    """The per-service check fails on a reference that lacks a setting or shows another default."""
    text = OPERATIONS.read_text(encoding="utf-8")
    without = "\n".join(ln for ln in text.splitlines() if "`SJA_OFFER_QUEUE`" not in ln)
    assert undocumented("clearer", table_rows(without)) == ["SJA_OFFER_QUEUE"]
    wrong = text.replace("| `SJA_POLICY` | `fair` |", "| `SJA_POLICY` | `sla` |")
    assert wrong != text
    assert undocumented("clearer", table_rows(wrong)) == ["SJA_POLICY (default fair)"]
