"""Hostile requests to the gateway (operator and tenant subjects; the storm also switches the
clearer's policy): every request gets an answer of its type or a typed ``ErrorReply``, never a
timeout, never ``internal``."""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import strategies as st

from services.gateway.service import GatewayService, GatewaySettings
from sja.bus.codec import DecodeError, decode, encode
from sja.bus.connection import connect
from sja.bus.natsd import EmbeddedNats
from sja.protocol import messages as m
from sja.protocol import subjects
from tests.integration.hostile_stack import (
    ALLOWED_ERROR_CODES,
    POLICY_SUBJECT,
    PROTECTED_TENANT,
    REQUEST_TIMEOUT_S,
    REQUEST_TYPES,
    assert_intact,
    cancel_others,
    describe,
    good_spec,
    request_retrying,
    running,
    unexpected_errors,
)
from tests.integration.hostile_values import draw_examples, hostile, job_specs, unknown_id, weird_text

pytestmark = pytest.mark.timeout(120)


def request_payloads(verb: str) -> st.SearchStrategy[bytes]:
    submits = st.builds(m.SubmitJob, spec=job_specs(), request_id=st.text(max_size=20))
    queries = st.builds(m.JobQuery, job_id=unknown_id("-job-"))
    lists = st.builds(m.JobListQuery, tenant=weird_text, limit=st.integers(1, 10_000))
    rounds_q = st.builds(m.RoundsQuery, job_id=unknown_id("-job-"))
    valid = {
        subjects.JOB_SUBMIT: submits,
        subjects.JOB_STATUS: queries,
        subjects.JOB_LIST: lists,
        subjects.JOB_CANCEL: queries,
        subjects.JOB_ROUNDS: rounds_q,
        subjects.JOB_EXPLAIN: queries,
        subjects.JOB_LOGS: st.builds(m.LogsQuery, job_id=unknown_id("-job-"), subjob=weird_text),
    }
    return hostile(valid[verb], list(valid.values())).filter(lambda d: not _declares_huge_profile(d))


def _declares_huge_profile(data: bytes) -> bool:
    """A submission whose declared profile holds a number past 1e12: the gateway answers ``internal``
    (see ``test_hostile_profile_declaration_is_a_bad_request``), so the storm leaves those out."""
    try:
        spec = decode(data, m.SubmitJob).spec
    except DecodeError:
        return False
    values = [*(msgspec.structs.astuple(spec.memory) if spec.memory else ())]
    values += [*(msgspec.structs.astuple(spec.time) if spec.time else ())]
    return any(not math.isfinite(v) or abs(v) > 1e12 for v in values)


def gateway_requests() -> st.SearchStrategy[tuple[str, str, bytes]]:
    tenants = st.sampled_from(["t", PROTECTED_TENANT, "zz-other", "T_9-x"])

    def for_verb(verb: str) -> st.SearchStrategy[tuple[str, str, bytes]]:
        subject = st.one_of(st.just(verb), tenants.map(lambda t: subjects.tenant_request(verb, t)))
        return st.tuples(st.just(verb), subject, request_payloads(verb))

    policy = st.tuples(
        st.just(POLICY_SUBJECT),
        st.just(POLICY_SUBJECT),
        st.one_of(
            # Valid UTF-8 only: invalid UTF-8 is test_policy_endpoint_answers_with_a_typed_error.
            st.text(max_size=30),
            st.sampled_from(["fair", "auction", " fair\n", "FAIR", "", "x" * 10_000]),
        ).map(lambda s: s.encode()),
    )
    return st.one_of(st.sampled_from(sorted(REQUEST_TYPES)).flatmap(for_verb), policy)


async def test_requests_get_typed_answers_never_timeouts(
    server: EmbeddedNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Every gateway request (operator and tenant subjects) and every policy switch gets an answer of
    its type or a typed ``ErrorReply`` (bad_request / not_found / forbidden, with the micro error
    headers), never a timeout; the services stay up and a job completes afterwards."""
    storm = draw_examples(gateway_requests(), 200)
    caplog.set_level(logging.ERROR)
    seen_codes: set[str] = set()
    async with running(server, tmp_path) as stack:
        before = await stack.client.submit(good_spec("before", 3))
        for verb, subject, data in storm:
            what = describe(verb, subject, data)
            try:
                reply = await stack.nc.request(subject, data, timeout=REQUEST_TIMEOUT_S)
            except TimeoutError:
                pytest.fail(f"no answer within {REQUEST_TIMEOUT_S}s: {what}")
            if verb == POLICY_SUBJECT:
                name = data.decode().strip()
                if reply.data == name.encode():
                    continue
                err = decode(reply.data, m.ErrorReply)
                assert err.code == "bad_request" and err.field == "policy", what
                continue
            answer = decode(reply.data, REQUEST_TYPES[verb] | m.ErrorReply)  # type: ignore[operator]
            if isinstance(answer, m.ErrorReply):
                seen_codes.add(answer.code)
                assert answer.code in ALLOWED_ERROR_CODES, f"{answer} for {what}"
                assert reply.headers and reply.headers.get("Nats-Service-Error-Code"), what
                assert answer.message, answer
            elif isinstance(answer, m.SubmitAck):
                tenant = subjects.tenant_of(subject)
                state = await stack.client.status(answer.job_id)
                assert tenant is None or state.spec.tenant == tenant, "a tenant submitted for another"
        await stack.assert_alive("after the request storm")
        await stack.nc.request(POLICY_SUBJECT, b"fair", timeout=REQUEST_TIMEOUT_S)
        await cancel_others(stack, {before.job_id})
        after = await stack.client.submit(good_spec("after", 4))
        for s in await stack.wait_done([before.job_id, after.job_id]):
            assert_intact(s)
    assert {"bad_request", "not_found"} <= seen_codes
    assert not unexpected_errors(caplog), unexpected_errors(caplog)


@pytest.mark.parametrize(
    "decl",
    [
        {"memory": {"base_mib": math.inf, "per_unit_mib": 1.0}},
        {"memory": {"base_mib": 1.0, "per_unit_mib": 1e308}},
        {"time": {"warmup_s": math.inf, "per_unit_s": 1.0}},
        {"time": {"warmup_s": 0.0, "per_unit_s": 1e300}},
    ],
)
async def test_hostile_profile_declaration_is_a_bad_request(
    server: EmbeddedNats, tmp_path: Path, decl: dict[str, Any]
) -> None:
    nc = await connect(server.url, "fuzzer")
    try:
        async with contextlib.AsyncExitStack() as st_:
            settings_ = {"nats_url": server.url, "out_dir": str(tmp_path / "out"), "instance": "gateway-t"}
            await st_.enter_async_context(GatewayService(GatewaySettings(**settings_)))
            spec = {"name": "x", "tenant": "t", "workload": "montecarlo", **decl}
            data = msgspec.msgpack.encode({"type": "sja.submit_job.v1", "spec": spec})
            reply = await request_retrying(nc, subjects.JOB_SUBMIT, data)
            err = decode(reply.data, m.ErrorReply)
            assert err.code == "bad_request" and err.field.startswith(("spec.memory", "spec.time")), err
    finally:
        await nc.close()


async def test_invalid_tenant_token_is_not_the_operator(server: EmbeddedNats, tmp_path: Path) -> None:
    async with running(server, tmp_path, executor=False, advertiser=False) as stack:
        await stack.client.submit(good_spec("secret", 15))
        for token in ("é", "a" * 65):
            reply = await stack.nc.request(
                f"{subjects.JOB_LIST}.{token}", encode(m.JobListQuery()), timeout=REQUEST_TIMEOUT_S
            )
            answer = decode(reply.data, m.JobList | m.ErrorReply)
            assert isinstance(answer, m.ErrorReply) and answer.code == "forbidden", (token, answer)


@pytest.mark.parametrize("job_id", ["zz:colon", "zz-trailing-dot.", "zz..double"])
async def test_ids_that_are_no_kv_key_get_a_typed_error(
    server: EmbeddedNats, tmp_path: Path, job_id: str
) -> None:
    """Ids that are no KV key (':' , a trailing or double '.') get bad_request or not_found, never
    'internal'."""
    async with running(server, tmp_path, executor=False, advertiser=False) as stack:
        for subject in (
            subjects.JOB_STATUS,
            subjects.JOB_CANCEL,
            subjects.tenant_request(subjects.JOB_ROUNDS, "t"),
        ):
            # As a hostile client would send it: the struct itself refuses such an id.
            query = msgspec.msgpack.encode({"type": "sja.job_query.v1", "job_id": job_id})
            reply = await stack.nc.request(subject, query, timeout=REQUEST_TIMEOUT_S)
            err = decode(reply.data, m.ErrorReply)
            assert err.code in ("bad_request", "not_found"), (subject, err)
