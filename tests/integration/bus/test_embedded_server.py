"""The embedded nats-server's Go threads (``GOMAXPROCS``): half the machine's cores by default, the
environment's value when it sets one, the caller's when it asks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from sja.bus.natsd import EmbeddedNats, server_gomaxprocs, usable_cores


def test_half_the_cores_unless_the_environment_says() -> None:
    assert server_gomaxprocs({}, 2) == 1
    assert server_gomaxprocs({}, 1) == 1
    assert server_gomaxprocs({}, 16) == 8
    assert server_gomaxprocs({"GOMAXPROCS": "3"}, 2) == 3
    # Not a positive number: Go would ignore it; the default holds.
    for bad in ("", "0", "-2", "two", " "):
        assert server_gomaxprocs({"GOMAXPROCS": bad}, 4) == 2
    assert usable_cores() >= 1


def server_env(server: EmbeddedNats) -> dict[str, str]:
    assert server.proc is not None
    raw = Path(f"/proc/{server.proc.pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode().split("\0") if "=" in item)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_server_runs_with_its_gomaxprocs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOMAXPROCS", raising=False)
    with EmbeddedNats() as server:
        assert server_env(server)["GOMAXPROCS"] == str(max(1, usable_cores() // 2))
    with EmbeddedNats(gomaxprocs=3) as server:
        assert server_env(server)["GOMAXPROCS"] == "3"
    monkeypatch.setenv("GOMAXPROCS", "5")
    with EmbeddedNats() as server:
        assert server_env(server)["GOMAXPROCS"] == "5"
