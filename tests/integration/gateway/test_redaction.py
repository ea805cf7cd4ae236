"""The values of a job's ``params.env`` are shown to nobody: a command job is given an API key in its
environment, its program proves it received it (it writes the key's digest in its state), and then
every way the gateway answers about the job (``status``, ``jobs``, ``cancel``, ``explain``,
``trace``'s rounds, ``logs``), through the client and through the CLI's text and JSON, is searched
for the key: it is nowhere, while the job's own stored state still holds it (the executor needs it).
A real nats-server, the real services, the real executor and runner, a real program."""

from __future__ import annotations

import hashlib
import json
import sys
import textwrap
from pathlib import Path

import msgspec
import pytest

from sja.bus.codec import decode
from sja.core import jobs as J
from sja.protocol import messages as m
from sja.protocol import subjects
from sja.redaction import REDACTED
from tests.integration.agent.test_sequential_checkpoints import Actors, running, until_state
from tests.integration.cli.test_cli_errors import sja_async

pytestmark = pytest.mark.timeout(120)

API_KEY = "sk-live-7f3a9c1e5b2d4680aa11bb22cc33dd44"

PROGRAM = textwrap.dedent(
    """
    import hashlib, os, pathlib
    e = os.environ
    key = e["API_KEY"]
    print(f"units {e['SJA_UNIT_START']}+{e['SJA_UNITS']} with a key of {len(key)} characters")
    (pathlib.Path(e["SJA_STATE_OUT"]) / "digest").write_text(hashlib.sha256(key.encode()).hexdigest())
    """
)


def spec(name: str) -> m.JobSpec:
    return m.JobSpec(
        name=name,
        tenant="t",
        workload="command",
        params={
            "argv": [sys.executable, "-c", PROGRAM],
            "units": 4,
            "env": {"API_KEY": API_KEY, "REGION": "eu-west-1"},
        },
        memory=m.MemoryDecl(base_mib=64.0, per_unit_mib=0.0, rel_sd=0.2),
        time=m.TimeDecl(warmup_s=0.05, per_unit_s=0.01, rel_sd=0.5),
    )


def shown(value: object) -> str:
    return json.dumps(msgspec.to_builtins(value))


async def test_no_answer_about_a_job_shows_its_env_values(nats_url: str, tmp_path: Path) -> None:
    async with running(nats_url, tmp_path, Actors()) as stack:
        ack = await stack.client.submit(spec("keyed"))
        state = await until_state(stack.client, ack.job_id, J.is_terminal, 90, "the job to end")
        assert state.status == "done", state.error

        # The program had the key: the digest it left in its state is the key's.
        out = tmp_path / "result"
        code, _, err = await sja_async("result", ack.job_id, "--out", str(out), "--nats", nats_url)
        assert code == 0, err
        assert (out / "digest").read_text() == hashlib.sha256(API_KEY.encode()).hexdigest()
        # The store keeps it (the executor runs the job from there): the key is there to be leaked.
        entry = await (await stack.nc.jetstream().key_value(subjects.BUCKET_JOBS)).get(ack.job_id)
        assert decode(entry.value, m.JobState).spec.params["env"]["API_KEY"] == API_KEY

        # Every answer of the gateway about the job: the names are there, no value is.
        assert state.spec.params["env"] == {"API_KEY": REDACTED, "REGION": REDACTED}
        answers: list[object] = [
            state,
            await stack.client.jobs(),
            await stack.client.jobs("t"),
            await stack.client.cancel(ack.job_id),
            await stack.client.explain(ack.job_id),
            await stack.client.rounds(ack.job_id),
            await stack.client.logs(ack.job_id),
        ]
        logs = answers[-1]
        assert isinstance(logs, m.LogsView)
        assert any(f"with a key of {len(API_KEY)} characters" in s.stdout for s in logs.subjobs)
        for answer in answers:
            text = shown(answer)
            assert API_KEY not in text and "eu-west-1" not in text, text[:300]
        listed = next(j for j in await stack.client.jobs() if j.job_id == ack.job_id)
        assert listed.spec.params["env"]["API_KEY"] == REDACTED

        # The CLI, as text and as JSON.
        for args in (
            ("status", ack.job_id),
            ("status", ack.job_id, "--json"),
            ("jobs",),
            ("jobs", "--json"),
            ("explain", ack.job_id, "--json"),
            ("trace", ack.job_id, "--json"),
            ("logs", ack.job_id, "--json"),
        ):
            code, text, err = await sja_async(*args, "--nats", nats_url)
            assert code == 0, (args, err)
            assert API_KEY not in text + err and "eu-west-1" not in text + err, args
        code, text, _ = await sja_async("status", ack.job_id, "--json", "--nats", nats_url)
        assert json.loads(text)["spec"]["params"]["env"] == {"API_KEY": REDACTED, "REGION": REDACTED}
