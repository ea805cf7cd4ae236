"""``SJA_JS_REPLICAS``: how many copies of every stream and bucket a service declares.

On one server (no cluster) more than one copy cannot be kept: declaring fails with an error that
names the setting, the stream and what the server said, and ``sja service`` exits with it on one
line; the streams already there are left as they were. Bad values are refused as settings. (On a
three-server cluster, raising existing streams to three copies and losing a server after it:
``tests/e2e/test_nats_cluster.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.gateway.service import GatewaySettings
from sja.bus.connection import connect
from sja.bus.settings import SettingsError
from sja.bus.streams import JetStreamReplicasError, ensure_jetstream
from sja.protocol import subjects

STREAMS = [s.name for s in subjects.STREAMS] + [f"KV_{b}" for b in subjects.BUCKETS]


def test_the_setting_defaults_to_one_copy_and_refuses_what_jetstream_cannot_have() -> None:
    assert GatewaySettings.from_env({}).js_replicas == 1
    assert GatewaySettings.from_env({"SJA_JS_REPLICAS": "3"}).js_replicas == 3
    for bad in ("0", "6", "three"):
        with pytest.raises(SettingsError, match="js_replicas"):
            GatewaySettings.from_env({"SJA_JS_REPLICAS": bad})


async def test_one_server_cannot_keep_three_copies(nats_url: str) -> None:
    nc = await connect(nats_url, "replicas-test")
    try:
        js = nc.jetstream()
        with pytest.raises(JetStreamReplicasError) as refused:
            await ensure_jetstream(js, replicas=3)
        said = str(refused.value)
        assert "SJA_JS_REPLICAS=3" in said and "SJA_" in said.split("copies of ", 1)[1]
        assert "non-clustered" in said, said  # the server's own words
        assert "SJA_JS_REPLICAS=1" in said

        # Nothing half-made is in the way: one copy each declares as before, and asking for three
        # again (raising the streams that now exist) is refused the same way, changing nothing.
        await ensure_jetstream(js, replicas=1)
        with pytest.raises(JetStreamReplicasError, match="non-clustered"):
            await ensure_jetstream(js, replicas=3)
        for name in STREAMS:
            assert (await js.stream_info(name)).config.num_replicas == 1, name
        with pytest.raises(JetStreamReplicasError, match="1 to 5"):
            await ensure_jetstream(js, replicas=0)
    finally:
        await nc.close()


def test_a_service_asked_for_more_copies_than_the_server_can_keep_exits_with_one_line(nats_url: str) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SJA_", "OTEL_"))}
    env.update(SJA_NATS_URL=nats_url, SJA_JS_REPLICAS="3", SJA_LOG_LEVEL="WARNING", PYTHONUNBUFFERED="1")
    done = subprocess.run(
        [sys.executable, "-m", "sja.cli.main", "service", "gateway"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,  # a guard against a hang only
    )
    assert done.returncode == 2, done
    assert "Traceback" not in done.stderr, done.stderr
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, done.stderr
    assert "SJA_JS_REPLICAS=3" in errors[0] and "JetStream cluster of at least 3 servers" in errors[0]
