"""Fixtures of the integration tests beyond those of ``tests/conftest.py``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sja.bus.natsd import EmbeddedNats
from tests.integration.hostile_stack import MAX_PAYLOAD


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A nats-server with JetStream for one test, ``max_payload`` raised to ``MAX_PAYLOAD`` (the
    hostile-input tests, ``tests/integration/<service>/test_bad_input.py``)."""
    conf = tmp_path / "nats.conf"
    conf.write_text(f"max_payload: {MAX_PAYLOAD}\n")
    srv = EmbeddedNats(
        store_dir=str(tmp_path / "nats"), config_file=str(conf), log_file=str(tmp_path / "nats.log")
    )
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
