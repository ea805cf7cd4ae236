"""Wire messages: every registered message survives the codec, tags and subjects are well formed, and
invalid payloads fail with a ``DecodeError`` that names the offending field."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sja.bus.codec import MAX_MESSAGE_BYTES, DecodeError, decode, encode
from sja.protocol import messages as m
from sja.protocol import subjects

WINDOW = m.Window(
    slice_id="local-g0-3g.20gb-4",
    node="local",
    pool="local",
    gpu_model="A100-40GB",
    profile="3g.20gb",
    mem_mib=19968,
    compute_share=3 / 7,
    start_s=1000.0,
    end_s=1030.0,
)
CANDIDATE = m.Candidate(
    size=12,
    mem_q_mib=1234.5,
    p_fit_mem=0.99,
    duration_q_s=3.25,
    duration_mean_s=2.0,
    p_fit_time=0.97,
    score=0.5,
    bid=1.5,
)
SPEC = m.JobSpec(
    name="mm-1",
    tenant="alice",
    workload="matmul",
    params={"rows": 64, "inner": 8, "cols": 8, "seed": 3},
    mode="sja",
    eps_mem=0.01,
    eps_time=0.2,
    priority=2,
    deadline_s=120.0,
    max_parallel=4,
    min_units=2,
    memory=m.MemoryDecl(base_mib=10.0, per_unit_mib=0.5, rel_sd=0.1),
    time=m.TimeDecl(warmup_s=0.1, per_unit_s=0.01, rel_sd=0.3),
)
VERDICT = m.Verdict(
    job_id="j1", tenant="alice", agent_id="agent-1", won=True, reason="won: x", score=0.3, size=12
)
PROPOSAL = m.Proposal(
    job_id="j1",
    tenant="alice",
    mode="jasda",
    candidates=[
        CANDIDATE,
        m.Candidate(
            size=6,
            mem_q_mib=600.0,
            p_fit_mem=1.0,
            duration_q_s=1.0,
            duration_mean_s=0.8,
            p_fit_time=1.0,
        ),
    ],
    submitted_at=999.0,
    remaining_units=64,
    total_units=64,
    priority=1,
    deadline_at=2000.0,
    expected_remaining_s=5.5,
    capacity=3,
    grants_seen=2,
)
ROUND_RECORD = m.RoundRecord(
    offer_id="o-1",
    round=7,
    window=WINDOW,
    policy="fair",
    replies_from=["agent-1", "agent-2"],
    verdicts=[VERDICT],
    winner_job="j1",
    grant_id="g-1",
    fence=4,
    closed_because="all_replied",
    charged_gpu_s=0.86,
    note="n",
    trace_id="abc",
    opened_at=1000.0,
    cleared_at=1000.2,
)
JOB_STATE = m.JobState(
    job_id="j1",
    spec=SPEC,
    total_units=64,
    status="running",
    submitted_at=999.0,
    first_started_at=1000.0,
    owner_agent="agent-1",
    next_unit=40,
    retry=[m.UnitRange(start=12, count=4)],
    units_done=24,
    accumulator=b"\x01\x02",
    in_flight=[
        m.InFlight(
            subjob_id="j1.s3",
            grant_id="g-3",
            slice_id="s",
            unit_start=28,
            units=12,
            dispatched_at=1001.0,
            time_cap_s=30.0,
            profile="3g.20gb",
            compute_share=3 / 7,
            planned_mem_q_mib=100.0,
            planned_duration_q_s=2.0,
        )
    ],
    next_seq=4,
    history=[
        m.SubjobSummary(
            subjob_id="j1.s0",
            slice_id="s",
            profile="3g.20gb",
            status="ok",
            unit_start=0,
            units=12,
            planned_mem_q_mib=100.0,
            peak_mem_mib=80.0,
            mem_cap_mib=19712,
            planned_duration_q_s=2.0,
            duration_s=1.5,
            time_cap_s=30.0,
            started_at=1000.0,
            finished_at=1001.5,
        )
    ],
    profile=m.ProfileState(
        mem=[1.0] * 9,
        time=[2.0] * 9,
        speed={"3g.20gb": [0.1, 0.05, 3.0]},
        oom_bounds=[(12, 4608.0)],
        timeout_bounds=[(20, 12.5)],
        observations=3,
    ),
    result={"sum": 5},
    error="",
    cancel_requested=False,
    rounds_won=4,
    attempt_failures=0,
    grants_seen=4,
)

# One valid, fully populated instance of every message type.
GRANT = m.Grant(
    grant_id="g-1",
    offer_id="o-1",
    round=7,
    job_id="j1",
    tenant="alice",
    agent_id="agent-1",
    window=WINDOW,
    candidate=CANDIDATE,
    fence=4,
    lease_until=1010.0,
    policy="fair",
    granted_at=1000.6,
)

SAMPLES: dict[type[m.Message], m.Message] = {
    m.SliceState: m.SliceState(
        slice_id="local-g0-3g.20gb-4",
        node="local",
        pool="local",
        gpu_index=0,
        gpu_model="A100-40GB",
        gpu_uuid="MIG-x",
        profile="3g.20gb",
        mem_mib=19968,
        compute_slots=3,
        compute_share=3 / 7,
        placement_start=4,
        source="declared",
        status="busy",
        fence=3,
        holder_job="j1",
        grant_id="g-3",
        lease_until=1040.0,
        expected_end=1010.0,
        updated_at=1000.0,
    ),
    m.Offer: m.Offer(
        offer_id="o-1",
        round=7,
        window=WINDOW,
        slice_fence=3,
        slice_revision=11,
        issued_at=1000.0,
        reply_by=1000.5,
        reply_to="_INBOX.abc",
    ),
    m.Reply: m.Reply(offer_id="o-1", agent_id="agent-1", proposals=[PROPOSAL]),
    m.OfferBatch: m.OfferBatch(
        batch_id="b-1",
        offers=[
            m.Offer(
                offer_id="o-2",
                round=8,
                window=WINDOW,
                slice_fence=3,
                slice_revision=11,
                issued_at=1000.0,
                reply_by=1000.05,
                reply_to="sja.v1.offer.replied.pool-a",
            )
        ],
        issued_at=1000.0,
        reply_by=1000.05,
        reply_to="sja.v1.offer.replied.pool-a",
    ),
    m.BatchReply: m.BatchReply(
        batch_id="b-1",
        agent_id="agent-1",
        groups=[m.ReplyGroup(offer_ids=["o-2"], proposals=[PROPOSAL])],
    ),
    m.Grant: GRANT,
    m.Outcome: m.Outcome(offer_id="o-1", verdicts=[VERDICT], pool="node-a", policy="fair"),
    m.GrantBatch: m.GrantBatch(
        batch_id="b-1",
        grants=[GRANT, msgspec.structs.replace(GRANT, grant_id="g-2", job_id="j2")],
        trace_contexts=[{"traceparent": "00-" + "1" * 32 + "-" + "2" * 16 + "-01"}, {}],
    ),
    m.RoundRecord: ROUND_RECORD,
    m.YieldRequest: m.YieldRequest(
        slice_id="node-a-g0-7g.40gb-0",
        node="node-a",
        holder_grant_id="g-1",
        grant_id="g-2",
        fence=8,
        issued_at=1000.0,
    ),
    m.RoundBatch: m.RoundBatch(batch_id="b-1", records=[ROUND_RECORD, ROUND_RECORD]),
    m.SubmitJob: m.SubmitJob(spec=SPEC, request_id="req-1"),
    m.SubmitAck: m.SubmitAck(job_id="j1", duplicate=True, notes=["deadline_s is read only by sla"]),
    m.JobQuery: m.JobQuery(job_id="j1"),
    m.JobListQuery: m.JobListQuery(tenant="alice", limit=10),
    m.ErrorReply: m.ErrorReply(code="bad_request", message="nope", field="spec.eps_mem"),
    m.Subjob: m.Subjob(
        subjob_id="j1.s0",
        seq=0,
        job_id="j1",
        tenant="alice",
        agent_id="agent-1",
        workload="matmul",
        params={"rows": 64, "inner": 8, "cols": 8, "seed": 3},
        unit_start=0,
        units=12,
        grant_id="g-1",
        fence=4,
        slice_id="local-g0-3g.20gb-4",
        node="local",
        mem_cap_mib=19712,
        time_cap_s=29.7,
        planned_mem_q_mib=100.0,
        planned_duration_q_s=2.0,
        input_checkpoint=b"ck",
        created_at=1000.7,
    ),
    m.Completion: m.Completion(
        subjob_id="j1.s0",
        job_id="j1",
        grant_id="g-1",
        fence=4,
        slice_id="local-g0-3g.20gb-4",
        status="oom",
        unit_start=0,
        units=12,
        units_done=0,
        peak_mem_mib=20000.0,
        duration_s=0.5,
        mem_cap_mib=19712,
        time_cap_s=29.7,
        started_at=1000.8,
        finished_at=1001.3,
        output_checkpoint=b"",
        error="CUDA OOM",
        executor_id="ex-1",
    ),
    m.JobState: JOB_STATE,
    m.JobCancel: m.JobCancel(job_id="j1"),
    m.JobView: m.JobView(state=JOB_STATE),
    m.JobList: m.JobList(jobs=[JOB_STATE, m.JobState(job_id="j2", spec=SPEC, total_units=3)]),
    m.RoundsQuery: m.RoundsQuery(job_id="j1"),
    m.RoundsView: m.RoundsView(rounds=[ROUND_RECORD]),
    m.LogsQuery: m.LogsQuery(job_id="j1", subjob="3"),
    m.StateQuery: m.StateQuery(job_id="j1", name="j1/j1.s0", offset=1024),
    m.StateChunk: m.StateChunk(job_id="j1", name="j1/j1.s0", offset=1024, total=4096, data=b"\x00" * 16),
    m.CodeChunk: m.CodeChunk(tenant="t", digest="ab" * 32, total=4096, offset=1024, data=b"PK", commit=False),
    m.CodeAck: m.CodeAck(digest="ab" * 32, stored=True),
    m.LogsView: m.LogsView(
        job_id="j1",
        subjobs=[
            m.SubjobLog(
                subjob_id="j1.s0",
                slice_id="n0-g0-1g.5gb-0",
                status="oom",
                unit_start=0,
                units=10,
                units_done=0,
                finished_at=2.0,
                error="killed by signal 9",
                stdout="step 3\n",
                stderr="Killed\n",
            )
        ],
    ),
    m.Explanation: m.Explanation(
        job_id="j1",
        status="pending",
        summary="pending (0/10 units): waiting for a window",
        windows=[
            m.WindowReason(
                pool="p",
                profile="1g.5gb",
                mem_mib=4864,
                slice_id="s1",
                offer_id="o1",
                opened_at=1.0,
                policy="fair",
                outcome="no_bid",
                reason="its smallest subjob (1 unit) needs 9 MiB",
            )
        ],
        policy="fair",
        position=1,
        waiting=1,
        order="fair",
        notes=["a note"],
    ),
    m.AgentHeartbeat: m.AgentHeartbeat(agent_id="agent-1", jobs=2, sent_at=1000.0, interval_s=1.0),
    m.DemandChanged: m.DemandChanged(agent_id="agent-1", jobs=3),
    m.LeaseRelease: m.LeaseRelease(slice_id="local-g0-7g.40gb-0", grant_id="g-1", fence=3, job_id="j1"),
    m.LeaseReleased: m.LeaseReleased(slice_id="local-g0-7g.40gb-0", released=False, reason="not_held"),
}


def _all_message_types() -> list[type[m.Message]]:
    out: list[type[m.Message]] = []
    stack = list(m.Message.__subclasses__())
    while stack:
        cls = stack.pop()
        out.append(cls)
        stack.extend(cls.__subclasses__())
    return sorted(out, key=lambda c: c.__name__)


def _tag(cls: type[m.Message]) -> str:
    tag = cls.__struct_config__.tag
    assert isinstance(tag, str)
    return tag


def test_samples_cover_every_message_type() -> None:
    assert set(SAMPLES) == set(_all_message_types())
    assert {route.message for route in subjects.REGISTRY} <= set(SAMPLES)


@pytest.mark.parametrize("route", subjects.REGISTRY, ids=[r.message.__name__ for r in subjects.REGISTRY])
def test_registered_message_round_trips(route: subjects.Route) -> None:
    msg = SAMPLES[route.message]
    data = encode(msg)
    back = decode(data, route.message)
    assert back == msg
    assert type(back) is route.message
    # encoding is stable: the decoded message encodes to the same bytes
    assert encode(back) == data


@pytest.mark.parametrize("cls", _all_message_types(), ids=lambda c: c.__name__)
def test_every_message_round_trips(cls: type[m.Message]) -> None:
    msg = SAMPLES[cls]
    assert decode(encode(msg), cls) == msg


def test_minimal_messages_get_documented_defaults() -> None:
    state = decode(encode(m.JobState(job_id="j", spec=SPEC, total_units=5)), m.JobState)
    assert state.status == "pending"
    assert state.retry == []
    assert state.in_flight == []
    assert state.profile is None
    spec = decode(encode(m.JobSpec(name="n", tenant="t", workload="w")), m.JobSpec)
    assert (spec.mode, spec.eps_mem, spec.eps_time, spec.max_parallel, spec.min_units) == (
        "jasda",
        0.05,
        0.05,
        1,
        1,
    )


def test_encoded_message_carries_its_tag() -> None:
    raw = msgspec.msgpack.decode(encode(SAMPLES[m.Offer]))
    assert raw["type"] == "sja.offer.v1"


def test_tags_are_unique_and_versioned() -> None:
    tags = [_tag(cls) for cls in _all_message_types()]
    assert len(tags) == len(set(tags))
    for tag in tags:
        assert re.fullmatch(r"sja\.[a-z0-9_]+\.v1", tag), tag


def test_registry_lists_each_message_once() -> None:
    names = [route.message for route in subjects.REGISTRY]
    assert len(names) == len(set(names))
    assert subjects.route_of(m.Completion).durable is True
    assert subjects.route_of(m.Offer).durable is False
    with pytest.raises(KeyError, match="SubmitAck"):
        subjects.route_of(m.SubmitAck)


@pytest.mark.parametrize("route", subjects.REGISTRY, ids=[r.message.__name__ for r in subjects.REGISTRY])
def test_subject_tokens_are_valid(route: subjects.Route) -> None:
    assert route.subject.startswith(subjects.PREFIX + ".")
    tokens = route.subject.split(".")
    for token in tokens:
        assert token == "*" or subjects.TOKEN.match(token), (route.subject, token)
    assert ">" not in tokens


def test_durable_subjects_are_captured_by_exactly_one_stream() -> None:
    for route in subjects.REGISTRY:
        concrete = route.subject.replace("*", "k")
        matching = [
            s
            for s in subjects.STREAMS
            if any(concrete.startswith(pat.removesuffix(">")) for pat in s.subjects)
        ]
        assert len(matching) == (1 if route.durable else 0), route.subject


@pytest.mark.parametrize(
    "builder",
    [
        subjects.offer_opened,
        subjects.offer_replied,
        subjects.grant_issued,
        subjects.outcome_sent,
        subjects.job_submitted,
        subjects.subjob_completed,
        subjects.round_cleared,
    ],
)
def test_ids_with_dots_and_colons_stay_one_token(builder: Any) -> None:
    subject = builder("node.a:b")
    tokens = subject.split(".")
    assert len(tokens) == 5
    assert all(subjects.TOKEN.match(t) for t in tokens)
    assert tokens[-1] == "node_a_b"


def test_subjob_subject_keys_node_and_job() -> None:
    assert subjects.subjob_dispatched("n1", "job.7") == "sja.v1.subjob.dispatched.n1.job_7"


# --- invalid payloads ------------------------------------------------------------------------------


def _raw_submit(**spec_overrides: Any) -> bytes:
    spec: dict[str, Any] = {"name": "a", "tenant": "t", "workload": "matmul"}
    spec.update(spec_overrides)
    return msgspec.msgpack.encode({"type": "sja.submit_job.v1", "spec": spec})


@pytest.mark.parametrize(
    "garbage", [b"", b"\xc1", b"\xc1\xc1\xc1", b"not msgpack at all \xff\xfe", b"\x92\x01"]
)
def test_garbage_raises_decode_error(garbage: bytes) -> None:
    with pytest.raises(DecodeError) as exc:
        decode(garbage, m.SubmitJob)
    assert exc.value.expected == "SubmitJob"
    assert "SubmitJob" in str(exc.value)


def test_malformed_payload_has_no_field() -> None:
    with pytest.raises(DecodeError) as exc:
        decode(b"\xc1", m.Offer)
    assert exc.value.field == ""
    assert "malformed" in exc.value.detail


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"eps_mem": 0.9}, "spec.eps_mem"),
        ({"eps_time": 0.0}, "spec.eps_time"),
        ({"eps_mem": "small"}, "spec.eps_mem"),
        ({"memory": {"base_mib": -1.0, "per_unit_mib": 1.0}}, "spec.memory.base_mib"),
        ({"memory": {"base_mib": 1.0, "per_unit_mib": -5.0}}, "spec.memory.per_unit_mib"),
        ({"time": {"warmup_s": 0.0, "per_unit_s": 0.0}}, "spec.time.per_unit_s"),
        ({"max_parallel": 0}, "spec.max_parallel"),
        ({"max_parallel": 65}, "spec.max_parallel"),
        ({"min_units": 0}, "spec.min_units"),
        ({"mode": "greedy"}, "spec.mode"),
        ({"tenant": "has space"}, "spec.tenant"),
        ({"name": ""}, "spec.name"),
        ({"deadline_s": -3.0}, "spec.deadline_s"),
        ({"priority": "high"}, "spec.priority"),
    ],
)
def test_invalid_field_is_named(overrides: dict[str, Any], field: str) -> None:
    with pytest.raises(DecodeError) as exc:
        decode(_raw_submit(**overrides), m.SubmitJob)
    assert exc.value.field == field
    assert exc.value.expected == "SubmitJob"


def test_missing_required_field_is_reported() -> None:
    data = msgspec.msgpack.encode({"type": "sja.submit_job.v1", "spec": {"name": "a"}})
    with pytest.raises(DecodeError) as exc:
        decode(data, m.SubmitJob)
    assert exc.value.field == "spec"
    assert "tenant" in exc.value.detail


def test_job_spec_forbids_unknown_fields() -> None:
    with pytest.raises(DecodeError) as exc:
        decode(_raw_submit(eps_memory=0.1), m.SubmitJob)
    assert exc.value.field == "spec"
    assert "eps_memory" in str(exc.value)
    with pytest.raises(DecodeError):
        decode(msgspec.msgpack.encode({"name": "a", "tenant": "t", "workload": "w", "x": 1}), m.JobSpec)


def test_wrong_tag_is_rejected() -> None:
    with pytest.raises(DecodeError) as exc:
        decode(encode(SAMPLES[m.Offer]), m.Grant)
    assert exc.value.field == "type"


def test_nested_list_field_path_is_reported() -> None:
    raw = msgspec.to_builtins(SAMPLES[m.Reply])
    raw["proposals"][0]["candidates"][1]["p_fit_mem"] = 1.5
    with pytest.raises(DecodeError) as exc:
        decode(msgspec.msgpack.encode(raw), m.Reply)
    assert exc.value.field == "proposals[0].candidates[1].p_fit_mem"


def test_proposal_needs_a_candidate() -> None:
    raw = msgspec.to_builtins(SAMPLES[m.Reply])
    raw["proposals"][0]["candidates"] = []
    with pytest.raises(DecodeError) as exc:
        decode(msgspec.msgpack.encode(raw), m.Reply)
    assert exc.value.field == "proposals[0].candidates"


def test_negative_memory_in_completion_is_rejected() -> None:
    raw = msgspec.to_builtins(SAMPLES[m.Completion])
    raw["peak_mem_mib"] = -1.0
    with pytest.raises(DecodeError) as exc:
        decode(msgspec.msgpack.encode(raw), m.Completion)
    assert exc.value.field == "peak_mem_mib"


def test_oversized_payload_is_rejected_before_decoding() -> None:
    with pytest.raises(DecodeError, match="exceeds"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1), m.JobQuery)


def test_id_pattern_is_enforced() -> None:
    data = msgspec.msgpack.encode({"type": "sja.job_query.v1", "job_id": "a b"})
    with pytest.raises(DecodeError) as exc:
        decode(data, m.JobQuery)
    assert exc.value.field == "job_id"


# --- ids and names: checked once per distinct string (messages.Tokens) ---------------------------------


def test_a_bad_id_deep_in_a_batch_names_its_path() -> None:
    raw = msgspec.to_builtins(SAMPLES[m.OfferBatch])
    raw["offers"][0]["window"]["node"] = "no de"
    with pytest.raises(DecodeError) as exc:
        decode(msgspec.msgpack.encode(raw), m.OfferBatch)
    assert exc.value.field == "offers[0].window.node"
    assert "matching regex" in str(exc.value)


def test_a_bad_id_in_a_list_of_ids_names_its_index() -> None:
    raw = msgspec.to_builtins(SAMPLES[m.BatchReply])
    raw["groups"][0]["offer_ids"] = ["o-1", "o 2"]
    with pytest.raises(DecodeError) as exc:
        decode(msgspec.msgpack.encode(raw), m.BatchReply)
    assert exc.value.field == "groups[0].offer_ids[1]"


@pytest.mark.parametrize("bad", ["a b", "a..b", ".a", "a.", "a\n", "a/b", "a>b", "*", "é"])
def test_ids_outside_the_pattern_are_refused_every_time(bad: str) -> None:
    data = msgspec.msgpack.encode({"type": "sja.job_query.v1", "job_id": bad})
    for _ in range(2):  # a refused string is never remembered as valid
        with pytest.raises(DecodeError) as exc:
            decode(data, m.JobQuery)
        assert exc.value.field == "job_id"
    assert bad not in m._valid_ids


def test_a_name_is_checked_as_a_name_even_when_it_was_seen_as_an_id() -> None:
    # "a.b" is a valid id (dot-separated tokens) but not a valid name.
    decode(msgspec.msgpack.encode({"type": "sja.job_query.v1", "job_id": "a.b"}), m.JobQuery)
    raw = msgspec.to_builtins(SAMPLES[m.SliceState])
    raw["node"] = "a.b"
    with pytest.raises(DecodeError) as exc:
        decode(msgspec.msgpack.encode(raw), m.SliceState)
    assert exc.value.field == "node"


def test_constructing_a_message_with_a_bad_id_fails_too() -> None:
    with pytest.raises(ValueError, match="matching regex"):
        m.JobQuery(job_id="a b")


def test_every_struct_with_ids_is_checked() -> None:
    class Unchecked(msgspec.Struct):
        job_id: m.Id

    with pytest.raises(TypeError, match="must derive from Tokens"):
        m.register_token_fields([Unchecked])

    class Hidden(m.Tokens, frozen=True):
        maybe: m.Id | None = None

    with pytest.raises(TypeError, match="only as the field's type"):
        m.register_token_fields([Hidden])


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet=st.sampled_from("aZ09_-. \n/*>é"), max_size=12))
def test_the_same_strings_are_accepted_as_by_the_patterns(s: str) -> None:
    data = msgspec.msgpack.encode({"type": "sja.job_query.v1", "job_id": s})
    expected = 1 <= len(s) <= 128 and re.fullmatch(m.ID_PATTERN, s) is not None
    try:
        decode(data, m.JobQuery)
        accepted = True
    except DecodeError:
        accepted = False
    assert accepted == expected
