"""Completion proofs (``sja.core.proofs``): only the holder of a subjob's secret makes a completion
the agent accepts, and the proof covers the completion's identity and outcome."""

from __future__ import annotations

import time

import msgspec
import pytest

from sja.core import jobs as J
from sja.core import proofs
from sja.protocol.messages import Completion, InFlight, JobSpec, JobState

KEY = bytes(range(32))


def state_with_flight(key: bytes = KEY) -> JobState:
    spec = JobSpec(name="j", tenant="t", workload="montecarlo", params={"units": 8})
    flight = InFlight(
        subjob_id="j.s0",
        grant_id="g0",
        slice_id="s0",
        unit_start=0,
        units=2,
        dispatched_at=time.time(),
        time_cap_s=10.0,
        profile="1g.10gb",
        compute_share=1 / 7,
        planned_mem_q_mib=1.0,
        planned_duration_q_s=1.0,
        proof_key=key,
    )
    return msgspec.structs.replace(J.new_job("j", spec, time.time()), status="running", in_flight=[flight])


def completion(**kw: object) -> Completion:
    base: dict[str, object] = dict(
        subjob_id="j.s0",
        job_id="j",
        grant_id="g0",
        fence=3,
        slice_id="s0",
        status="ok",
        unit_start=0,
        units=2,
        units_done=2,
        peak_mem_mib=1.0,
        duration_s=0.1,
        mem_cap_mib=100,
        time_cap_s=10.0,
        started_at=0.0,
        finished_at=0.1,
        output_checkpoint=b"result",
    )
    base.update(kw)
    return Completion(**base)  # type: ignore[arg-type]


def test_the_holders_proof_verifies() -> None:
    assert proofs.verify_completion(state_with_flight(), proofs.signed(completion(), KEY)) is None


@pytest.mark.parametrize(
    "change",
    [
        {"status": "failed"},
        {"units_done": 1},
        {"unit_start": 2},
        {"units": 3},
        {"fence": 4},
        {"output_checkpoint": b"made up"},
        {"final": True},
    ],
)
def test_a_proof_does_not_carry_over_to_another_outcome(change: dict[str, object]) -> None:
    proof = proofs.signed(completion(), KEY).proof
    forged = completion(**change, proof=proof)
    assert proofs.verify_completion(state_with_flight(), forged) is proofs.Unproven.BAD_PROOF


def test_no_proof_a_wrong_key_and_an_unkeyed_subjob_are_refused() -> None:
    state = state_with_flight()
    assert proofs.verify_completion(state, completion()) is proofs.Unproven.NO_PROOF
    assert (
        proofs.verify_completion(state, proofs.signed(completion(), b"k" * 32)) is proofs.Unproven.BAD_PROOF
    )
    old = state_with_flight(key=b"")
    assert proofs.verify_completion(old, proofs.signed(completion(), KEY)) is proofs.Unproven.NO_KEY
    other = proofs.signed(completion(subjob_id="j.s9"), KEY)
    assert proofs.verify_completion(state, other) is proofs.Unproven.NOT_IN_FLIGHT


def test_old_messages_decode_unproven() -> None:
    raw = msgspec.msgpack.encode(
        {k: v for k, v in msgspec.structs.asdict(completion()).items() if k != "proof"}
    )
    legacy = msgspec.msgpack.decode(raw, type=dict)
    assert "proof" not in legacy
    c = msgspec.convert(legacy, Completion)
    assert c.proof == "" and proofs.verify_completion(state_with_flight(), c) is proofs.Unproven.NO_PROOF


def test_shown_states_and_the_slices_subjob_hold_no_secret() -> None:
    state = state_with_flight()
    assert all(not f.proof_key for f in proofs.without_secrets(state).in_flight)
    assert state.in_flight[0].proof_key == KEY  # the stored state keeps it
