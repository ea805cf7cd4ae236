"""Shared fixtures: a real nats-server with JetStream per test, on a free port.

The NATS client is imported inside the fixtures that need it, so the pure-core tests
(``tests/unit``) collect and run without nats-py installed."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from sja.bus.natsd import EmbeddedNats


def pytest_configure(config: pytest.Config) -> None:
    """The test session is a process start: it uses the compiled decision core where it is built,
    asked for before any test module imports the core."""
    from sja.accel import use_compiled_core

    use_compiled_core()


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    from sja.bus.natsd import EmbeddedNats

    server = EmbeddedNats(store_dir=str(tmp_path / "nats"), log_file=str(tmp_path / "nats.log"))
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def nats_url(nats_server: EmbeddedNats) -> str:
    return nats_server.url


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[object]:
    from sja.bus.connection import connect
    from sja.bus.streams import ensure_jetstream

    client = await connect(nats_url, "test")
    await ensure_jetstream(client.jetstream())
    try:
        yield client
    finally:
        await client.close()
