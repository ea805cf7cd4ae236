"""Users' own workloads: loading them by name, planning them without running their code (the control
plane reads the spec's facts), combining their parts where the result is fetched, and surviving what
SJA's own workloads' code does."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path
from typing import Any, ClassVar

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sja.bus.codec import encode
from sja.core.bidding import propose
from sja.core.jobs import (
    MAX_CONSECUTIVE_FAILURES,
    apply_completion,
    materialize,
    new_job,
    request_cancel,
    validate_spec,
)
from sja.core.planner import PlanLimits
from sja.protocol.messages import (
    Completion,
    Grant,
    JobSpec,
    JobState,
    MemoryDecl,
    Offer,
    Subjob,
    TimeDecl,
    Window,
    WorkloadFacts,
)
from sja.workloads import _LOADED as LOADED
from sja.workloads import WORKLOADS, SpecError, facts_of, trusted, workload
from sja.workloads.parts import combine, parts_of

LIMITS = PlanLimits()
T0 = 1_000.0

# --- a well-behaved workload, and a family of misbehaving ones drawn by hypothesis ----------------


class Sum:
    """Sum of the units' indices: independent ranges, merged by addition."""

    name: ClassVar[str] = "sum"
    sequential: ClassVar[bool] = False

    def validate(self, params: dict[str, Any]) -> dict[str, Any]:
        return {"units": int(params.get("units", 200))}

    def total_units(self, params: dict[str, Any]) -> int:
        return int(params["units"])

    def declared_memory(self, params: dict[str, Any]) -> MemoryDecl:
        return MemoryDecl(base_mib=10.0, per_unit_mib=1.0, rel_sd=0.1)

    def declared_time(self, params: dict[str, Any]) -> TimeDecl:
        return TimeDecl(warmup_s=0.1, per_unit_s=0.01, rel_sd=0.3)

    def run(self, params: dict[str, Any], unit_start: int, units: int, checkpoint: bytes) -> bytes:
        return msgspec.msgpack.encode(sum(range(unit_start, unit_start + units)))

    def merge(self, acc: bytes, partial: bytes) -> bytes:
        total = msgspec.msgpack.decode(acc) if acc else 0
        return msgspec.msgpack.encode(total + msgspec.msgpack.decode(partial))

    def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
        return {"sum": msgspec.msgpack.decode(acc) if acc else 0}


SUM = Sum()


class _Boom(Exception):
    pass


def misbehaving(where: str, how: str) -> Any:
    """A ``Sum`` whose ``where`` (merge, finalize) does ``how`` instead of its job."""

    class Bad(Sum):
        def merge(self, acc: bytes, partial: bytes) -> bytes:
            if where == "merge":
                return _misbehave(how)  # type: ignore[no-any-return]
            return super().merge(acc, partial)

        def finalize(self, params: dict[str, Any], acc: bytes) -> dict[str, Any]:
            if where == "finalize":
                return _misbehave(how)  # type: ignore[no-any-return]
            return super().finalize(params, acc)

    return Bad()


def _misbehave(how: str) -> Any:
    if how == "raise":
        raise _Boom("user code failed")
    if how == "huge-int":
        return {"n": 2**70}
    if how == "not-a-map":
        return [1, 2, 3]
    if how == "object":
        return {"x": object()}
    if how == "nested-huge":
        return {"a": [{"b": -(2**80)}]}
    raise AssertionError(how)


HOWS = ["raise", "huge-int", "not-a-map", "object", "nested-huge"]


def register(name: str, w: Any) -> None:
    """``w`` as one of SJA's own workloads (the only code the core runs), under ``spec_of``'s name."""
    WORKLOADS[f"sja_test_user_{name}:W"] = w


@pytest.fixture(autouse=True)
def _forget_registered() -> Any:
    yield
    for name in [n for n in WORKLOADS if n.startswith("sja_test_user_")]:
        del WORKLOADS[name]


def spec_of(name: str, **kw: Any) -> JobSpec:
    fields: dict[str, Any] = dict(
        name="user",
        tenant="alice",
        workload=f"sja_test_user_{name}:W",
        params={"units": 200},
        mode="sja",
        max_parallel=2,
    )
    fields.update(kw)
    if isinstance(fields.get("facts"), dict):
        fields["facts"] = msgspec.convert(fields["facts"], WorkloadFacts)
    return JobSpec(**fields)


def window(now: float) -> Window:
    return Window(
        slice_id="local-g0-1g.5gb-2",
        node="local",
        pool="local",
        gpu_model="A100-40GB",
        profile="1g.5gb",
        mem_mib=4864,
        compute_share=1 / 7,
        start_s=now,
        end_s=now + 10.0,
    )


def step(state: JobState, now: float, n: int) -> tuple[JobState, Subjob]:
    w = window(now)
    offer = Offer(
        offer_id=f"o-{n}",
        round=n,
        window=w,
        slice_fence=0,
        slice_revision=0,
        issued_at=now,
        reply_by=now + 0.5,
        reply_to="_INBOX.x",
    )
    proposal = propose(state, offer, now, LIMITS)
    assert proposal is not None
    grant = Grant(
        grant_id=f"g-{n}",
        offer_id=offer.offer_id,
        round=n,
        job_id=state.job_id,
        tenant="alice",
        agent_id="agent-1",
        window=w,
        candidate=proposal.candidates[0],
        fence=n,
        lease_until=now + 10.0,
        policy="fair",
        granted_at=now,
    )
    mat = materialize(state, grant, now, LIMITS, "agent-1")
    assert mat.subjob is not None, mat.reason
    return mat.state, mat.subjob


def completion(
    sj: Subjob, now: float, output: bytes, status: str = "ok", units_done: int | None = None
) -> Completion:
    return Completion(
        subjob_id=sj.subjob_id,
        job_id=sj.job_id,
        grant_id=sj.grant_id,
        fence=sj.fence,
        slice_id=sj.slice_id,
        status=status,  # type: ignore[arg-type]
        unit_start=sj.unit_start,
        units=sj.units,
        units_done=sj.units if units_done is None else units_done,
        peak_mem_mib=10.0 + sj.units,
        duration_s=0.01,
        mem_cap_mib=sj.mem_cap_mib,
        time_cap_s=sj.time_cap_s,
        started_at=now,
        finished_at=now + 0.01,
        output_checkpoint=output,
    )


def run_job(state: JobState, rounds: int = 200) -> JobState:
    now = T0
    for n in range(1, rounds):
        if state.status in ("done", "failed", "cancelled"):
            return state
        state, sj = step(state, now, n)
        out = SUM.run(sj.params, sj.unit_start, sj.units, b"")
        state, applied = apply_completion(state, completion(sj, now, out), now + 0.1)
        assert applied
        # Whatever the workload did, the job's state can always be written.
        encode(state)
        now += 1.0
    raise AssertionError(f"job not over: {state.status}")


# --- loading --------------------------------------------------------------------------------------


def test_a_tenant_workload_runs_by_its_facts_and_its_parts_combine_to_the_one_piece_result(
    tmp_path: Path,
) -> None:
    # Not importable here: the core plans and merges the job without its code.
    name = "sja_test_tenant_nowhere:Sum"
    assert not trusted(name)
    # The facts `sja submit` would have computed from the workload where it runs.
    register("sum", SUM)
    _, facts = facts_of("sja_test_user_sum:W", {"units": 200})
    spec = spec_of("x", workload=name, facts=facts)
    state = run_job(new_job("j1", spec, T0))
    assert state.status == "done", state.error
    kept = len(parts_of(state.accumulator))
    assert state.result == {"units_done": 200, "parts": kept, "result": "sja result"}
    assert len(parts_of(state.accumulator)) >= 2, "the job should have been cut"
    assert "sja_test_tenant_nowhere" not in sys.modules
    # Where the result is fetched, the tenant's own code merges the parts.
    assert combine(SUM, spec.params, state.accumulator, sequential=False) == {"sum": sum(range(200))}


def test_the_core_never_imports_a_tenant_workload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = tmp_path / "imported"
    (tmp_path / "sja_test_tenant_spy.py").write_text(
        f"open({str(marker)!r}, 'w').write('imported')\n"
        "from sja.workloads.montecarlo import MonteCarloPi as W\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    register("sum", SUM)
    _, facts = facts_of("sja_test_user_sum:W", {"units": 40})
    spec = spec_of("x", workload="sja_test_tenant_spy:W", params={"units": 40}, facts=facts)
    state = new_job("j1", spec, T0)
    state, sj = step(state, T0, 1)
    state, _ = apply_completion(state, completion(sj, T0, b"\x01"), T0 + 0.1)
    assert not marker.exists() and "sja_test_tenant_spy" not in sys.modules


def test_a_tenant_workload_without_facts_is_refused_saying_how_to_give_them() -> None:
    with pytest.raises(SpecError) as e:
        validate_spec(spec_of("nope", workload="no_such_module_xyz:Thing"))
    assert e.value.field == "facts" and "never runs a tenant's code" in e.value.message
    with pytest.raises(SpecError) as e:
        validate_spec(spec_of("seq", workload="x:Y", facts={"total_units": 10, "sequential": True}))
    assert e.value.field == "max_parallel"


def test_unknown_and_broken_workloads_are_refused_naming_them_and_the_error() -> None:
    with pytest.raises(SpecError) as e:
        facts_of("no_such_module_xyz:Thing", {})
    assert e.value.field == "workload"
    assert "no_such_module_xyz:Thing" in e.value.message and "ModuleNotFoundError" in e.value.message
    with pytest.raises(SpecError) as e:
        facts_of("not-registered", {})
    assert "unknown workload 'not-registered'" in e.value.message and "matmul" in e.value.message
    with pytest.raises(SpecError) as e:
        facts_of("json:dumps", {})
    assert "is not a workload" in e.value.message and "validate" in e.value.message


def test_a_workload_module_that_raises_on_import_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sja_test_broken_mod.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SpecError) as e:
        workload("sja_test_broken_mod:W")
    assert "RuntimeError: broken at import" in e.value.message


def test_a_workload_registered_by_entry_point_is_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "sja_test_ep_mod.py").write_text(
        textwrap.dedent(
            """
            from sja.workloads.montecarlo import MonteCarloPi

            class Mine(MonteCarloPi):
                name = "mine"
            """
        )
    )
    dist = tmp_path / "sja_test_ep-1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: sja-test-ep\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[sja.workloads]\nmine-ep = sja_test_ep_mod:Mine\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    LOADED.pop("mine-ep", None)
    w = workload("mine-ep")
    assert type(w).__name__ == "Mine"
    params, facts = facts_of("mine-ep", {"units": 4})
    assert facts.total_units == 4 and not facts.sequential and params["units"] == 4
    _, total = validate_spec(spec_of("x", workload="mine-ep", params=params, facts=facts))
    assert total == 4


@pytest.mark.parametrize("name", ["a:b:c", "pkg.mod:", ":attr", "a b", "x" * 201])
def test_a_malformed_workload_name_is_refused_by_the_message(name: str) -> None:
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"name": "n", "tenant": "t", "workload": name}, JobSpec)


# --- untrusted code -------------------------------------------------------------------------------


@given(where=st.sampled_from(["merge", "finalize"]), how=st.sampled_from(HOWS), units=st.integers(100, 400))
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_misbehaving_merge_or_finalize_fails_the_job_with_the_reason(
    where: str, how: str, units: int
) -> None:
    register("bad", misbehaving(where, how))
    state = run_job(new_job("j1", spec_of("bad", params={"units": units}), T0))
    assert state.status == "failed"
    assert f"the workload's {where}" in state.error or "cannot be encoded" in state.error, state.error
    assert state.in_flight == []
    # The failed state is written as any other: no OverflowError loop in the agent.
    encode(state)


def test_a_cancel_after_a_result_that_cannot_be_encoded_is_answered() -> None:
    register("huge", misbehaving("finalize", "huge-int"))
    state = run_job(new_job("j1", spec_of("huge"), T0))
    assert state.status == "failed" and "OverflowError" in state.error
    assert request_cancel(state, T0) == state  # over already: the cancel changes nothing, and returns


@given(how=st.sampled_from(["raise", "huge-params", "bad-total", "zero-total", "not-a-map"]))
@settings(max_examples=10, deadline=None)
def test_misbehaving_validation_is_a_spec_error(how: str) -> None:
    class Bad(Sum):
        def validate(self, params: dict[str, Any]) -> dict[str, Any]:
            if how == "raise":
                raise KeyError("units")
            if how == "huge-params":
                return {"units": 2**80}
            if how == "not-a-map":
                return ["units"]  # type: ignore[return-value]
            return {"units": 3}

        def total_units(self, params: dict[str, Any]) -> int:
            if how == "bad-total":
                return "ten"  # type: ignore[return-value]
            if how == "zero-total":
                return 0
            return 3

    register("badspec", Bad())
    with pytest.raises(SpecError) as e:
        validate_spec(spec_of("badspec"))
    assert e.value.field == "params"
    # A tenant's workload misbehaves where it runs: in the submitter's own process.
    module = type(sys)("sja_test_tenant_badspec")
    module.W = Bad()  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    LOADED.pop("sja_test_tenant_badspec:W", None)
    if how != "huge-params":
        with pytest.raises(SpecError) as refused:
            facts_of("sja_test_tenant_badspec:W", {})
        assert refused.value.field == "params"
        return
    # Facts it can give, but parameters no job can hold: the core refuses them.
    params, facts = facts_of("sja_test_tenant_badspec:W", {})
    with pytest.raises(SpecError):
        validate_spec(spec_of("x", workload="sja_test_tenant_badspec:W", params=params, facts=facts))


@pytest.mark.parametrize("how", HOWS)
@pytest.mark.parametrize("where", ["merge", "finalize"])
def test_a_tenant_merge_or_finalize_that_misbehaves_fails_where_the_result_is_fetched(
    where: str, how: str
) -> None:
    parts = msgspec.msgpack.encode([(0, msgspec.msgpack.encode(3)), (3, msgspec.msgpack.encode(4))])
    bad = misbehaving(where, how)
    if where == "merge" or how in ("raise", "not-a-map"):
        with pytest.raises(ValueError, match=r"the workload's (merge or finalize|finalize) "):
            combine(bad, {}, parts, sequential=False)
    else:  # a map the fetching side writes as it can (JSON with every value as text where needed)
        assert isinstance(combine(bad, {}, parts, sequential=False), dict)
    assert combine(SUM, {}, parts, sequential=False) == {"sum": 7}


def test_a_subjob_that_stopped_early_keeps_what_it_did_and_the_rest_runs_again() -> None:
    register("sum", SUM)
    state = new_job("j1", spec_of("sum", max_parallel=1), T0)
    state, sj = step(state, T0, 1)
    assert sj.units >= 2
    done = sj.units // 2
    out = SUM.run(sj.params, sj.unit_start, done, b"")
    state, applied = apply_completion(state, completion(sj, T0, out, units_done=done), T0 + 0.1)
    assert applied
    assert state.units_done == done
    assert state.retry and state.retry[0].start == sj.unit_start + done
    assert state.retry[0].count == sj.units - done
    state, sj2 = step(state, T0 + 1, 2)
    assert sj2.unit_start == sj.unit_start + done


def test_a_range_tried_again_knows_its_attempt() -> None:
    register("sum", SUM)
    state = new_job("j1", spec_of("sum", max_parallel=1), T0)
    state, sj = step(state, T0, 1)
    assert sj.attempt == 0
    state, _ = apply_completion(state, completion(sj, T0, b"", status="failed"), T0 + 0.1)
    state, sj2 = step(state, T0 + 1, 2)
    assert sj2.unit_start == sj.unit_start and sj2.attempt == 1
    assert MAX_CONSECUTIVE_FAILURES > 1


def test_the_cli_computes_a_tenant_workloads_facts_or_asks_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("nats", reason="the client needs nats-py")
    from sja.client import load_spec

    with pytest.raises(ValueError, match="state them in the spec") as e:
        load_spec("name: p\ntenant: t\nworkload: some_pkg_not_here:Thing\n")
    assert "ModuleNotFoundError" in str(e.value)
    stated = load_spec("name: p\ntenant: t\nworkload: some_pkg_not_here:Thing\nfacts: {total_units: 7}\n")
    assert stated.facts is not None and stated.facts.total_units == 7
    (tmp_path / "sja_test_cli_mod.py").write_text("from sja.workloads.montecarlo import MonteCarloPi as W\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = load_spec("name: p\ntenant: t\nworkload: sja_test_cli_mod:W\nparams: {units: 12}\n")
    assert got.facts is not None and got.facts.total_units == 12 and got.facts.memory is not None
    with pytest.raises(ValueError, match=r"params\.rows"):
        load_spec("name: m\ntenant: t\nworkload: matmul\nparams: {rows: -1}\n")


def test_a_merge_failure_with_subjobs_in_flight_fails_the_job_when_they_end() -> None:
    register("badmerge", misbehaving("merge", "raise"))
    state = new_job("j1", spec_of("badmerge", max_parallel=2), T0)
    state, first = step(state, T0, 1)
    state, second = step(state, T0, 2)
    out = SUM.run(first.params, first.unit_start, first.units, b"")
    state, _ = apply_completion(state, completion(first, T0, out), T0 + 0.1)
    assert state.status != "failed" and state.in_flight, "the other subjob is still running"
    out = SUM.run(second.params, second.unit_start, second.units, b"")
    state, _ = apply_completion(state, completion(second, T0, out), T0 + 0.2)
    assert state.status == "failed" and "the workload's merge failed" in state.error
