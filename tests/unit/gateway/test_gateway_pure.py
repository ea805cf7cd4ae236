"""The gateway's own pure pieces: job ids for retried submissions, subjob numbers, the stored
states a job's state refers to, and its settings from the environment."""

from __future__ import annotations

import msgspec
import pytest

from services.gateway.records import job_id_for, stored_states, subjob_seq
from services.gateway.settings import GatewaySettings
from sja.core import defaults
from sja.core.jobs import new_job
from sja.protocol.messages import JobSpec, JobState
from sja.workloads import checkpoint as ckpt


def test_a_retried_submission_is_the_same_job_and_only_for_the_same_tenant() -> None:
    first = job_id_for("train", "alice", "req-1")
    assert job_id_for("train", "alice", "req-1") == first
    assert first.startswith("train-") and len(first) == len("train-") + 12
    # Another tenant's request id never names alice's job; another request is another job.
    assert job_id_for("train", "bob", "req-1") != first
    assert job_id_for("train", "alice", "req-2") != first
    # Without a request id every submission is a new job.
    assert job_id_for("train", "alice", "") != job_id_for("train", "alice", "")


@pytest.mark.parametrize(
    ("subjob_id", "seq"), [("job-1.s0", 0), ("job-1.s12", 12), ("a.s.b.s7", 7), ("job-1", 0), ("j.sx", 0)]
)
def test_a_subjobs_number_is_read_from_its_id(subjob_id: str, seq: int) -> None:
    assert subjob_seq(subjob_id) == seq


def ref(name: str, bucket: str = ckpt.BUCKET) -> bytes:
    return ckpt.make_ref(bucket, name, ckpt.Blob(b"", b"data"))


def state(workload: str, accumulator: bytes, params: dict[str, object] | None = None) -> JobState:
    spec = JobSpec(name="j", tenant="t", workload=workload, params=params or {"units": 4})
    return msgspec.structs.replace(new_job("j-1", spec, 0.0, window_s=599.0), accumulator=accumulator)


def test_the_stored_states_of_a_job_are_the_references_in_its_state() -> None:
    parts = msgspec.msgpack.encode([(0, ref("t/a")), (2, ref("t/b")), (3, b"inline state")])
    assert stored_states(state("command", parts, {"units": 4, "argv": ["true"]})) == {"t/a", "t/b"}
    # A sequential job's final state stored whole; a reference into another bucket is not ours.
    assert stored_states(state("montecarlo", ref("t/final"))) == {"t/final"}
    assert stored_states(state("montecarlo", ref("t/x", bucket="elsewhere"))) == set()
    # Nothing stored, or a state the gateway cannot read: nothing to serve, and no error.
    assert stored_states(state("montecarlo", b"")) == set()
    assert stored_states(state("command", b"\xc1 not msgpack", {"units": 4, "argv": ["true"]})) == set()


def test_the_settings_are_the_shared_defaults_unless_the_environment_says_otherwise() -> None:
    plain = GatewaySettings.from_env({})
    assert plain.horizon_s == defaults.HORIZON_S and plain.start_overhead_s == defaults.START_OVERHEAD_S
    tuned = GatewaySettings.from_env({"SJA_HORIZON_S": "300", "SJA_CODE_MAX_MIB": "8"})
    assert tuned.horizon_s == 300.0 and tuned.code_max_mib == 8.0
