"""``sja up`` as a user runs it: each run starts with an empty temporary NATS store, removed at exit,
unless ``--keep-store DIR`` keeps jobs from one run to the next."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from sja.bus.natsd import free_port

pytestmark = pytest.mark.slow

START_GUARD_S = 300


def env() -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SJA_", "OTEL_"))}
    return dict(base, PYTHONUNBUFFERED="1", COLUMNS="200", SJA_RAY_NUM_CPUS="1")


@contextmanager
def sja_up(out: Path, *args: str) -> Iterator[str]:
    """``sja up`` in the background until it says it is up; yields the NATS URL; SIGTERM at the end."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sja.cli.main", "up", "--out", str(out), "--port", str(port), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env(),
    )
    assert proc.stdout is not None
    seen = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if "SJA is up" in line:
                break
        else:
            raise AssertionError("sja up exited before it was up:\n" + "".join(seen))
        yield f"nats://127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=120)
        seen.append(rest or "")
    assert proc.returncode == 0, "".join(seen)


def sja(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "sja.cli.main", *args], capture_output=True, text=True, env=env(), timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def store_dirs_in_log(log: Path) -> list[str]:
    """The JetStream store directories nats-server reported, in order of the runs."""
    return re.findall(r'Store Directory:\s+"([^"]+)"', log.read_text(errors="replace"))


def test_up_keeps_a_store_only_when_asked(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # `sja up` writes the operator's credentials there, and `sja` finds them there.
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    out = tmp_path / "stack"
    kept = out / "nats"  # where earlier versions kept the store by default

    spec = tmp_path / "small.yaml"
    spec.write_text("name: small\ntenant: t\nworkload: montecarlo\nparams: {units: 2}\n")

    with sja_up(out, "--keep-store", str(kept)) as url:
        job_id = sja("submit", str(spec), "--nats", url).strip()
    with sja_up(out, "--keep-store", str(kept)) as url:
        assert job_id in sja("jobs", "--nats", url), "--keep-store keeps the jobs of the run before"
    with sja_up(out) as url:
        assert job_id not in sja("jobs", "--nats", url), "a plain `sja up` starts with an empty store"

    stores = store_dirs_in_log(out / "logs" / "nats.log")
    assert len(stores) == 3, stores
    assert all(Path(s).is_relative_to(kept) for s in stores[:2]), stores
    temporary = Path(stores[2])
    assert not temporary.is_relative_to(out)
    assert not temporary.exists(), "the temporary store is removed at exit"
