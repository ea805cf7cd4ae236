"""Fixtures of the integration tests beyond those of ``tests/conftest.py``.

Modules are imported inside the fixtures, as there: a conftest is loaded before the session asks
for the compiled core, so importing services (and the core) here would keep the core pure Python."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from sja.bus.natsd import EmbeddedNats


@pytest.fixture
def server(tmp_path: Path) -> Iterator[EmbeddedNats]:
    """A nats-server with JetStream for one test, ``max_payload`` raised so that messages just over
    the codec's limit can be sent at all (the hostile-input tests,
    ``tests/integration/<service>/test_bad_input.py``)."""
    from sja.bus.natsd import EmbeddedNats
    from tests.integration.hostile_stack import MAX_PAYLOAD

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
