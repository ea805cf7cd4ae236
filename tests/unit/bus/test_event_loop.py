"""A service process's event loop: uvloop unless ``SJA_EVENT_LOOP`` says the standard one, and a
wrong name refused before anything starts."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from sja.bus.service import run_loop
from sja.bus.settings import BaseSettings, SettingsError


async def loop_kind() -> str:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop()).__module__


def test_the_default_loop_is_uvloop_and_the_standard_one_can_be_had(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("uvloop")
    monkeypatch.delenv("SJA_EVENT_LOOP", raising=False)
    assert run_loop(loop_kind()).startswith("uvloop")
    assert run_loop(loop_kind(), "asyncio").startswith("asyncio")
    monkeypatch.setenv("SJA_EVENT_LOOP", "asyncio")
    assert run_loop(loop_kind()).startswith("asyncio")
    assert BaseSettings.from_env({}).event_loop == "uvloop"
    assert BaseSettings.from_env({"SJA_EVENT_LOOP": "asyncio"}).event_loop == "asyncio"


def test_an_unknown_loop_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match="SJA_EVENT_LOOP"):
        run_loop(loop_kind(), "trio")
    with pytest.raises(SettingsError, match="event_loop"):
        BaseSettings.from_env({"SJA_EVENT_LOOP": "trio"})
    done = subprocess.run(
        [sys.executable, "-m", "sja.cli.main", "service", "agent"],
        env={"SJA_EVENT_LOOP": "trio", "PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "event_loop" in done.stderr and "trio" in done.stderr
