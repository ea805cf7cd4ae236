"""Hostile values for the hostile-input tests, drawn by Hypothesis with a fixed seed
(``SJA_FUZZ_SEED``) and a moderate count (``SJA_FUZZ_EXAMPLES`` scales every storm; 1 by default):
undecodable bytes, other MessagePack values, messages of the wrong type or with a wrong tag, valid
messages with one field replaced by a value of the wrong type, a negative / NaN / infinite / huge
number or text with control characters, fields removed or added, and valid-looking messages about
jobs, slices, offers and grants that do not exist (ids with the ``zz`` prefix, which the stack never
uses)."""

from __future__ import annotations

import math
import string
import time
from typing import Any

import msgspec
from hypothesis import HealthCheck, Phase, given, seed, settings
from hypothesis import strategies as st

from sja.bus.codec import encode
from sja.core import jobs as J
from sja.protocol import messages as m
from sja.protocol import subjects
from tests.integration.hostile_stack import (
    AGENT,
    FUZZ_SEED,
    NODE,
    POOL,
    PROTECTED_TENANT,
    SCALE,
    SLICES,
    TAGS,
)

# --- hostile values ----------------------------------------------------------------------------------


def draw_examples(strategy: st.SearchStrategy[Any], n: int) -> list[Any]:
    """``n`` examples of ``strategy``, drawn by Hypothesis with a fixed seed."""
    out: list[Any] = []

    @seed(FUZZ_SEED)
    @settings(
        max_examples=n * SCALE,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(x: Any) -> None:
        out.append(x)

    collect()
    return out


# Ids that are no KV key (':', a trailing '.'): test_ids_that_are_no_kv_key_get_a_typed_error.
TOKEN_CHARS = string.ascii_letters + string.digits + "_-"


def unknown_id(prefix: str) -> st.SearchStrategy[str]:
    """A valid id (dot-separated tokens) that names nothing (the ``zz`` prefix is never used by the
    stack)."""
    tokens = st.lists(st.text(TOKEN_CHARS, min_size=1, max_size=8), min_size=1, max_size=3)
    return tokens.map(lambda t: f"zz{prefix}{'.'.join(t)}0")


unknown_token = st.text(TOKEN_CHARS, min_size=1, max_size=24).map(lambda s: f"zz{s}")
weird_text = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        [
            "",
            " ",
            "\x00",
            "\x1b[2J",
            "\r\n",
            "a" * 129,
            "é" * 70,
            "..",
            "a.b",
            "*",
            ">",
            "$SRV.PING",
            "\u202eevil",
            "😀" * 20,
            "local-g0-1g.5gb-2",
            AGENT,
        ]
    ),
)
weird_number = st.one_of(
    st.sampled_from(
        [0, -1, 1, -(2**63), 2**63 - 1, 2**64 - 1, math.nan, math.inf, -math.inf, -0.0, 1e308, -1e308, 5e-324]
    ),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(),
)
weird_value = st.recursive(
    st.one_of(st.none(), st.booleans(), weird_number, weird_text, st.binary(max_size=64)),
    lambda inner: st.one_of(
        st.lists(inner, max_size=6), st.dictionaries(st.text(max_size=10), inner, max_size=6)
    ),
    max_leaves=16,
)
finite = st.floats(allow_nan=False, allow_infinity=False, min_value=-1e9, max_value=1e12)
nonneg = st.floats(allow_nan=False, allow_infinity=False, min_value=0.0, max_value=1e12)
now_ish = st.floats(-100.0, 100.0).map(lambda d: time.time() + d)


def raw(msg: Any) -> Any:
    """A message as plain MessagePack values (a dict with its ``type`` tag; bytes stay bytes)."""
    return msgspec.msgpack.decode(encode(msg))


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value[:3]):
            out += _paths(v, (*prefix, i))
    return out


def _replace(value: Any, path: tuple[Any, ...], new: Any, delete: bool = False) -> Any:
    if not path:
        return new
    head, rest = path[0], path[1:]
    if isinstance(value, dict):
        copy = dict(value)
        if delete and not rest:
            copy.pop(head, None)
        else:
            copy[head] = _replace(value[head], rest, new, delete)
        return copy
    copy_list = list(value)
    if delete and not rest:
        del copy_list[head]
    else:
        copy_list[head] = _replace(value[head], rest, new, delete)
    return copy_list


@st.composite
def mutated(draw: st.DrawFn, template: Any) -> bytes:
    """A message with one hostile change: a field's value, a field removed or added, the tag."""
    value = raw(template)
    paths = _paths(value)
    kind = draw(st.sampled_from(["value", "value", "value", "delete", "extra", "tag", "as-is"]))
    if kind == "value":
        value = _replace(value, draw(st.sampled_from(paths)), draw(weird_value))
    elif kind == "delete":
        value = _replace(value, draw(st.sampled_from(paths)), None, delete=True)
    elif kind == "extra":
        value = {**value, draw(st.text(max_size=12)): draw(weird_value)}
    elif kind == "tag":
        value = {**value, "type": draw(st.one_of(st.sampled_from(TAGS), weird_text))}
    return msgspec.msgpack.encode(value)


def hostile(valid: st.SearchStrategy[Any], others: list[st.SearchStrategy[Any]]) -> st.SearchStrategy[bytes]:
    """Bytes for a subject whose messages ``valid`` generates (valid-looking, naming nothing)."""
    return st.one_of(
        valid.map(encode),  # valid-looking: unknown ids, extreme but legal values
        valid.flatmap(mutated),
        valid.flatmap(mutated),
        st.one_of(*others).map(encode),  # a well-formed message of another type
        st.binary(max_size=300),  # not MessagePack at all (or something else)
        weird_value.map(msgspec.msgpack.encode),
        st.sampled_from(
            [b"", b"\xc1", b"\x80", b"{}", b'{"type": "sja.offer.v1"}', b"\x91\xc0", b"\xdd\xff\xff\xff\xff"]
        ),
    )


# --- valid-looking messages that name nothing ---------------------------------------------------------


@st.composite
def windows(draw: st.DrawFn) -> m.Window:
    real = draw(st.booleans())
    start = draw(now_ish)
    return m.Window(
        slice_id=draw(st.sampled_from(SLICES)) if real else draw(unknown_id("-slice-")),
        node=NODE if real else draw(unknown_token),
        pool=POOL,
        gpu_model=draw(st.sampled_from(["A100-40GB", "H100-80GB", "nope"])),
        profile=draw(st.sampled_from(["1g.5gb", "3g.20gb", "7g.80gb", "x"])),
        mem_mib=draw(st.integers(1, 2**40)),
        compute_share=draw(st.floats(min_value=1e-9, max_value=1.0)),
        start_s=start,
        end_s=draw(st.none() | st.floats(0, 100).map(lambda d: start + d)),
    )


candidates = st.builds(
    m.Candidate,
    size=st.integers(1, 2**40),
    mem_q_mib=nonneg,
    p_fit_mem=st.floats(0, 1),
    duration_q_s=nonneg,
    duration_mean_s=nonneg,
    p_fit_time=st.floats(0, 1),
    score=finite,
    bid=nonneg,
)
names = st.text(TOKEN_CHARS, min_size=1, max_size=20)
proposals = st.builds(
    m.Proposal,
    job_id=unknown_id("-job-"),
    tenant=names,
    mode=st.sampled_from(["sja", "jasda"]),
    candidates=st.lists(candidates, min_size=1, max_size=3),
    submitted_at=now_ish,
    remaining_units=st.integers(0, 2**40),
    total_units=st.integers(1, 2**40),
    priority=st.integers(-(2**31), 2**31),
    deadline_at=st.none() | now_ish,
    expected_remaining_s=nonneg,
    capacity=st.integers(0, 64),
    grants_seen=st.integers(0, 2**31),
)


@st.composite
def offers(draw: st.DrawFn) -> m.Offer:
    w = draw(windows())
    now = time.time()
    return m.Offer(
        offer_id=draw(unknown_id("-offer-")),
        round=draw(st.integers(0, 2**63 - 1)),
        window=w,
        # Real slices get a fence they never reach: a forged offer for a real slice can never be granted.
        slice_fence=draw(st.integers(10**9, 2**63 - 1)),
        slice_revision=draw(st.integers(0, 2**63 - 1)),
        issued_at=now,
        reply_by=now + draw(st.floats(0.0, 0.2)),
        reply_to=subjects.offer_replied(POOL),
    )


replies = st.builds(
    m.Reply,
    offer_id=unknown_id("-offer-"),
    agent_id=unknown_id("-agent-") | st.just(AGENT),
    proposals=st.lists(proposals, max_size=3),
)


@st.composite
def grants(draw: st.DrawFn) -> m.Grant:
    return m.Grant(
        grant_id=draw(unknown_id("-grant-")),
        offer_id=draw(unknown_id("-offer-")),
        round=draw(st.integers(0, 2**63 - 1)),
        job_id=draw(unknown_id("-job-")),
        tenant=draw(names),
        agent_id=AGENT,
        window=draw(windows()),
        candidate=draw(candidates),
        fence=draw(st.integers(1, 2**63 - 1)),
        lease_until=draw(now_ish),
        policy=draw(st.text(max_size=10)),
        granted_at=draw(now_ish),
    )


verdicts = st.builds(
    m.Verdict,
    job_id=st.text(max_size=20),
    tenant=st.text(max_size=20),
    agent_id=st.text(max_size=20),
    won=st.booleans(),
    reason=st.text(max_size=40),
    score=finite,
    size=st.integers(-(2**31), 2**31),
)
outcomes = st.builds(m.Outcome, offer_id=unknown_id("-offer-"), verdicts=st.lists(verdicts, max_size=4))
heartbeats = st.builds(
    m.AgentHeartbeat,
    agent_id=unknown_id("-agent-"),
    jobs=st.integers(0, 2**63 - 1),
    sent_at=now_ish,
    interval_s=st.floats(min_value=1e-6, max_value=1e6),
)
demand = st.builds(m.DemandChanged, agent_id=unknown_id("-agent-"), jobs=st.integers(0, 2**63 - 1))
cancels = st.builds(m.JobCancel, job_id=unknown_id("-job-"))


@st.composite
def subjob_msgs(draw: st.DrawFn) -> m.Subjob:
    real = draw(st.booleans())
    return m.Subjob(
        subjob_id=draw(unknown_id("-sj-")),
        seq=draw(st.integers(0, 2**31)),
        job_id=draw(unknown_id("-job-")),
        tenant=draw(names),
        agent_id=draw(unknown_id("-agent-")),
        workload=draw(st.sampled_from(["montecarlo", "matmul", "nope"])),
        params=draw(st.dictionaries(st.text(max_size=10), weird_value, max_size=4)),
        unit_start=draw(st.integers(0, 2**40)),
        units=draw(st.integers(1, 2**40)),
        grant_id=draw(unknown_id("-grant-")),
        fence=draw(st.integers(1, 2**63 - 1)),
        slice_id=draw(st.sampled_from(SLICES)) if real else draw(unknown_id("-slice-")),
        node=NODE,
        mem_cap_mib=draw(st.integers(1, 2**40)),
        time_cap_s=draw(st.floats(min_value=1e-6, max_value=1e6)),
        planned_mem_q_mib=draw(nonneg),
        planned_duration_q_s=draw(nonneg),
        input_checkpoint=draw(st.binary(max_size=64)),
        created_at=draw(now_ish),
    )


def completions_for(job_ids: st.SearchStrategy[str]) -> st.SearchStrategy[m.Completion]:
    return st.builds(
        m.Completion,
        subjob_id=unknown_id("-sj-"),
        job_id=job_ids,
        grant_id=unknown_id("-grant-"),
        fence=st.integers(0, 2**63 - 1),
        slice_id=st.sampled_from(SLICES) | unknown_id("-slice-"),
        status=st.sampled_from(["ok", "oom", "timeout", "failed", "cancelled", "lost"]),
        unit_start=st.integers(0, 2**40),
        units=st.integers(0, 2**40),
        units_done=st.integers(0, 2**40),
        peak_mem_mib=nonneg,
        duration_s=nonneg,
        mem_cap_mib=st.integers(0, 2**40),
        time_cap_s=nonneg,
        started_at=now_ish,
        finished_at=now_ish,
        output_checkpoint=st.binary(max_size=64),
        error=st.text(max_size=40),
        executor_id=st.text(max_size=20),
    )


round_records = st.builds(
    m.RoundRecord,
    offer_id=unknown_id("-offer-"),
    round=st.integers(0, 2**63 - 1),
    window=windows(),
    policy=st.text(max_size=10),
    replies_from=st.lists(st.text(max_size=10), max_size=3),
    verdicts=st.lists(verdicts, max_size=3),
    winner_job=st.text(max_size=20),
    grant_id=st.text(max_size=20),
    fence=st.integers(-(2**63), 2**63 - 1),
    closed_because=st.sampled_from(["deadline", "all_replied"]),
    charged_gpu_s=finite,
    price=nonneg,
    note=st.text(max_size=20),
    trace_id=st.text(max_size=32),
    opened_at=now_ish,
    cleared_at=now_ish,
)


def job_states() -> st.SearchStrategy[m.JobState]:
    spec = m.JobSpec(name="zz", tenant="t", workload="montecarlo", params={"units": 4})
    return st.builds(
        lambda job_id: J.new_job(job_id, spec, time.time()), unknown_id("-job-").map(lambda s: s[:100])
    )


def job_specs() -> st.SearchStrategy[m.JobSpec]:
    params = st.one_of(
        st.fixed_dictionaries(
            {"units": st.integers(-5, 40), "samples_per_unit": st.integers(-5, 3000)},
            optional={"seed": weird_number},
        ),
        st.fixed_dictionaries(
            {"rows": st.integers(-5, 64), "inner": st.integers(-5, 64), "cols": st.integers(-5, 64)}
        ),
        st.dictionaries(st.text(max_size=8), weird_value, max_size=3),
    )
    decl_float = st.floats(min_value=0.0, max_value=1e12)  # beyond: test_hostile_profile_declaration
    return st.builds(
        m.JobSpec,
        name=names,
        tenant=st.sampled_from(["t", PROTECTED_TENANT, "zz-other"]),
        workload=st.sampled_from(["montecarlo", "matmul", "nope"]),
        params=params,
        mode=st.sampled_from(["sja", "jasda"]),
        eps_mem=st.floats(min_value=1e-9, max_value=0.499),
        eps_time=st.floats(min_value=1e-9, max_value=0.499),
        priority=st.integers(-(2**63), 2**63 - 1),
        deadline_s=st.none() | st.floats(min_value=1e-9),
        max_parallel=st.integers(1, 64),
        min_units=st.integers(1, 2**31),
        bid_per_gpu_s=st.floats(0, 1e6),
        memory=st.none() | st.builds(m.MemoryDecl, base_mib=decl_float, per_unit_mib=decl_float),
        time=st.none()
        | st.builds(m.TimeDecl, warmup_s=decl_float, per_unit_s=st.floats(min_value=1e-12, max_value=1e12)),
    )
