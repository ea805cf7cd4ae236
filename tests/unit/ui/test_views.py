"""What the dashboard shows (``services.ui.views``), from hand-made states: the timeline's bars,
the tenants' shares against their targets, the jobs' order and sentences, a round's verdicts and a
job page's trace links."""

from __future__ import annotations

import msgspec
import pytest

from services.ui import views
from sja.core.jobs import new_job
from sja.protocol.messages import (
    Explanation,
    InFlight,
    JobSpec,
    JobState,
    LogsView,
    MemoryDecl,
    RoundRecord,
    SliceState,
    SubjobLog,
    SubjobSummary,
    Verdict,
    Window,
)

NOW = 10_000.0


def slice_(sid: str, gpu: int = 0, start: int = 0) -> SliceState:
    return SliceState(
        slice_id=sid,
        node="n",
        pool="p",
        gpu_index=gpu,
        gpu_model="A100-40GB",
        profile="1g.5gb",
        mem_mib=4864,
        compute_slots=1,
        compute_share=1 / 7,
        placement_start=start,
    )


def job(job_id: str, tenant: str, **changes: object) -> JobState:
    spec = JobSpec(name=job_id, tenant=tenant, workload="montecarlo", params={"units": 10})
    return msgspec.structs.replace(new_job(job_id, spec, NOW - 100), **changes)


def done_subjob(sid: str, slice_id: str, start: float, end: float, status: str = "ok") -> SubjobSummary:
    return SubjobSummary(
        subjob_id=sid,
        slice_id=slice_id,
        profile="1g.5gb",
        status=status,
        unit_start=0,
        units=2,
        planned_mem_q_mib=100,
        peak_mem_mib=90,
        mem_cap_mib=4608,
        planned_duration_q_s=1,
        duration_s=end - start,
        time_cap_s=5,
        started_at=start,
        finished_at=end,
    )


def running(sid: str, slice_id: str, at: float) -> InFlight:
    return InFlight(
        subjob_id=sid,
        grant_id="g",
        slice_id=slice_id,
        unit_start=2,
        units=3,
        dispatched_at=at,
        time_cap_s=5,
        profile="1g.5gb",
        compute_share=1 / 7,
        planned_mem_q_mib=100,
        planned_duration_q_s=1,
    )


def test_the_timeline_draws_finished_and_running_subjobs_on_known_slices_within_its_span() -> None:
    slices = [slice_("b", start=1), slice_("a")]
    a = job(
        "ja",
        "alpha",
        history=[
            done_subjob("ja.s0", "a", NOW - 50, NOW - 40),
            done_subjob("ja.s1", "b", NOW - 45, NOW - 44, status="oom"),
            done_subjob("ja.old", "a", NOW - 900, NOW - 800),  # before the span
            done_subjob("ja.gone", "zz", NOW - 10, NOW - 5),  # a slice no longer declared
        ],
        in_flight=[running("ja.s2", "a", NOW - 3)],
    )
    tl = views.timeline([a], slices, NOW)
    segs = {g["subjob_id"]: g for g in tl["segments"]}
    assert set(segs) == {"ja.s0", "ja.s1", "ja.s2"}
    assert segs["ja.s2"]["running"] and segs["ja.s2"]["end"] == NOW and segs["ja.s2"]["status"] == "running"
    assert segs["ja.s1"]["status"] == "oom" and not segs["ja.s1"]["running"]
    assert tl["start"] == NOW - 50 and tl["end"] == NOW
    assert {g["colour"] for g in tl["segments"]} == {views.job_colours([a])["ja"]}
    assert segs["ja.s2"]["units_text"] == "2-4 (3)"
    # Rows by GPU and placement, as the MIG layout places them.
    assert [r["slice_id"] for r in views.slice_rows(slices)] == ["a", "b"]


def test_tenant_shares_follow_the_ledger_against_the_target_weights() -> None:
    states = [
        job("j1", "alpha", attained_gpu_s=30.0),
        job("j2", "alpha", attained_gpu_s=30.0),
        job("j3", "beta", attained_gpu_s=20.0),
    ]
    shares = {t["tenant"]: t for t in views.tenant_shares(states, {"alpha": 1.0, "beta": 1.0, "gamma": 2.0})}
    assert shares["alpha"]["attained"] == pytest.approx(0.75) and shares["alpha"]["jobs"] == 2
    assert shares["beta"]["attained"] == pytest.approx(0.25)
    assert shares["gamma"]["attained"] == 0.0 and shares["gamma"]["target"] == pytest.approx(0.5)
    assert shares["alpha"]["target"] == pytest.approx(0.25)
    # No targets: every tenant weighs 1; nothing granted yet: nothing attained.
    even = views.tenant_shares([job("j", "a"), job("k", "b")], {})
    assert [(t["attained"], t["target"]) for t in even] == [(0.0, 0.5), (0.0, 0.5)]


def test_jobs_list_the_live_ones_first_with_the_explain_sentence() -> None:
    old = job("old", "a", status="done", units_done=10, finished_at=NOW - 1)
    new = job("new", "a", owner_agent="agent-0", submitted_at=NOW - 5)
    rows = views.job_rows([old, new], NOW)
    assert [r["job_id"] for r in rows] == ["new", "old"]
    assert rows[0]["summary"].startswith("pending (0/10 units): waiting for a window")
    assert rows[1]["progress"] == 1.0 and rows[1]["terminal"]


def test_a_round_lists_the_winner_first_and_counts_the_verdicts_it_leaves_out() -> None:
    window = Window(
        slice_id="a", node="n", pool="p", gpu_model="A100-40GB", profile="1g.5gb", mem_mib=4864,
        compute_share=1 / 7, start_s=0.0,
    )  # fmt: skip
    verdicts = [
        Verdict(job_id=f"j{i}", tenant="t", agent_id="ag", won=False, reason="lost") for i in range(9)
    ]
    verdicts.append(Verdict(job_id="w", tenant="t", agent_id="ag", won=True, reason="won: best"))
    record = RoundRecord(
        offer_id="o1",
        round=3,
        window=window,
        policy="fair",
        replies_from=["ag"],
        verdicts=verdicts,
        winner_job="w",
        trace_id="abc",
    )
    row = views.round_row(record, shown=4)
    assert row["verdicts"][0]["job_id"] == "w" and row["winner_tenant"] == "t"
    assert len(row["verdicts"]) == 4 and row["more_verdicts"] == 6 and row["bids"] == 10

    state = job("w", "t")
    explanation = Explanation(job_id="w", status="pending", summary="s")
    page = views.job_page(state, explanation, [record], NOW, "http://jaeger:16686/", "gateway")
    assert page["rounds"][0]["trace_url"] == "http://jaeger:16686/trace/abc"
    assert page["rounds"][0]["verdict"] == {"won": True, "reason": "won: best", "size": 0}
    assert views.job_page(state, explanation, [record], NOW, "", "gateway")["rounds"][0]["trace_url"] == ""


def test_two_jobs_on_screen_never_share_a_colour() -> None:
    """``job-0`` and ``job-29`` had the same colour when it was a hash of the id (crc32 % 360 is 337
    for both): now each job on screen has its own, whatever its id, for as many jobs as a screen
    could show; the same for the same jobs in any order; a later job changes no earlier colour."""
    pair = [job("job-0", "a", submitted_at=NOW - 9), job("job-29", "a", submitted_at=NOW - 8)]
    colours = views.job_colours(pair)
    assert colours["job-0"] != colours["job-29"]
    many = [job(f"job-{i}", "a", submitted_at=NOW - 1000 + i) for i in range(500)]
    given = views.job_colours(many)
    assert len(set(given.values())) == 500
    assert views.job_colours(list(reversed(many))) == given
    later = views.job_colours([*many[:20], job("late", "b", submitted_at=NOW)])
    assert all(later[f"job-{i}"] == given[f"job-{i}"] for i in range(20))
    # The overview colours its table and its timeline alike.
    o = views.overview(pair, [], [], {}, NOW)
    assert {r["job_id"]: r["colour"] for r in o["jobs"]} == colours


def test_a_failed_jobs_subjobs_are_counted_by_how_they_ended() -> None:
    """Eight failed subjobs and one that ended ok: not "9 subjobs done"."""
    history = [done_subjob("f.s0", "a", NOW - 50, NOW - 49)] + [
        done_subjob(f"f.s{i}", "a", NOW - 40 + i, NOW - 39 + i, status="failed") for i in range(1, 9)
    ]
    failed = job("f", "a", status="failed", history=history, finished_at=NOW - 1)
    row = views.job_row(failed, NOW)
    assert row["subjob_counts"] == {"ok": 1, "failed": 8}
    assert row["subjobs_text"] == "9 subjobs ended: 1 ok, 8 failed"
    assert views.job_row(job("p", "a"), NOW)["subjobs_text"] == "no subjob ended yet"


def test_a_job_page_carries_its_subjobs_output_and_its_error_as_written() -> None:
    """The output tails (the gateway's ``logs``) and the error reach the page as the program wrote
    them, newlines and markup included: the page shows them as text in ``<pre>``."""
    trace = 'Traceback (most recent call last):\n  File "train.py", line 3\nValueError: <b>bad</b>'
    logs = LogsView(
        job_id="w",
        subjobs=[
            SubjobLog(subjob_id="w.s0", slice_id="a", status="ok", unit_start=0, units=8, units_done=8,
                      finished_at=NOW - 5, stdout="loss 0.5\nloss 0.4\n"),
            SubjobLog(subjob_id="w.s1", slice_id="a", status="failed", unit_start=8, units=1, units_done=0,
                      finished_at=NOW - 1, error="exit status 1", stderr=trace),
        ],
    )  # fmt: skip
    state = job("w", "t", status="failed", error=trace)
    explanation = Explanation(job_id="w", status="failed", summary="s")
    page = views.job_page(state, explanation, [], NOW, "", "gateway", logs=logs)
    assert page["error"] == trace
    assert [o["subjob_id"] for o in page["output"]] == ["w.s1", "w.s0"]  # the newest first
    assert page["output"][0]["stderr"] == trace and page["output"][0]["units_text"] == "8 (1)"
    assert page["output"][1]["stdout"] == "loss 0.5\nloss 0.4\n"
    assert page["output"][1]["units_text"] == "0-7 (8)"
    note = "the gateway did not answer"
    none = views.job_page(state, explanation, [], NOW, "", "dashboard", logs_note=note)
    assert none["output"] == [] and none["output_note"] == note


def test_the_page_shows_a_jobs_text_escaped_with_its_lines() -> None:
    """The page's script puts the error and the output into ``<pre>`` through ``esc`` only."""
    from services.ui import page

    assert '<pre class="status-failed" id="job-error">${esc(d.error)}</pre>' in page.JS
    for part in ("o.error", "o.stdout", "o.stderr"):
        assert f">${{esc({part})}}</pre>" in page.JS, part
    assert "subjobs done" not in page.JS and "${r.unit_start}+${r.units}" not in page.JS


def test_the_jobs_list_says_a_peak_above_the_declaration() -> None:
    def declaring(job_id: str, mib: float) -> JobState:
        spec = JobSpec(
            name=job_id, tenant="a", workload="montecarlo", params={"units": 10},
            memory=MemoryDecl(base_mib=mib, per_unit_mib=0),
        )  # fmt: skip
        ran = [done_subjob(f"{job_id}.s0", "x", NOW - 9, NOW - 8)]  # peaked at 90 MiB
        return msgspec.structs.replace(new_job(job_id, spec, NOW - 100), history=ran)

    over, fine = declaring("m", 80), declaring("f", 100)
    rows = {r["job_id"]: r for r in views.job_rows([over, fine], NOW)}
    assert (
        rows["m"]["memory"]
        == "measured 90 MiB, above the declared 80 MiB (subjob 0): declare at least 90 MiB"
    )
    assert rows["f"]["memory"] == ""
