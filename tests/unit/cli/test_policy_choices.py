"""A clearing policy is one module and one registration, everywhere: the command line offers it
(``sja up``, ``sja demo``, ``sja simulate``) and ``sja explain`` orders the waiting jobs by it and
names it among the policies that read deadlines, with no edit to either."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import msgspec
import pytest
from typer.testing import CliRunner

from sja.cli.main import app
from sja.core import jobs as J
from sja.core.explain import deadline_note, explain, queue_order
from sja.core.planner import PlanLimits
from sja.core.policies import (
    REGISTRY,
    Bid,
    Decision,
    Keyed,
    Ledger,
    Policy,
    PolicyConfig,
    rank,
    register,
    unregister,
)
from sja.protocol.messages import JobSpec, JobState, Offer, RoundRecord, Window

# --- the module: one policy ------------------------------------------------------------------------


class Youngest(Policy):
    """A toy policy: the most recently submitted job wins, and is served first; it reads deadlines
    (to say so, not to use them)."""

    def __init__(self) -> None:
        super().__init__("youngest", reads_deadline=True)

    def clear(self, offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
        def key(b: Bid) -> Keyed:
            p = b.proposal
            return (-p.submitted_at,), self.candidate(offer, p, cfg), f"submitted at {p.submitted_at:g}"

        return rank(self.name, bids, key, lambda k: -k[0][0])

    def queue_key(self, job: JobState, ledger: Ledger) -> tuple[float, ...]:
        return (-job.submitted_at,)

    def queue_order(self) -> str:
        return "the latest submitted first"


# --- the registration ----------------------------------------------------------------------------------


@pytest.fixture
def youngest() -> Iterator[Policy]:
    pol = register(Youngest())
    yield pol
    unregister(pol.name)


def cli(*args: str) -> str:
    result = CliRunner().invoke(app, list(args), env={"COLUMNS": "250"})
    return result.output


def job(job_id: str, submitted_at: float, **spec: object) -> JobState:
    s = JobSpec(name=job_id, tenant="t", workload="montecarlo", params={"units": 10}, **spec)  # type: ignore[arg-type]
    state = J.new_job(job_id, s, submitted_at, window_s=7.7)
    return msgspec.structs.replace(state, owner_agent="agent-0")


def test_the_command_line_offers_every_registered_policy(youngest: Policy) -> None:
    choices = "[efficiency|fair|sla|auction|token|jasda|youngest]"
    assert choices in cli("up", "--help")
    assert choices in cli("demo", "--help")
    assert "sja:jasda, sja:youngest." in cli("simulate", "--help")
    refused = cli("demo", "--policy", "oldest")
    assert "'oldest' is not one of" in refused and "'youngest'" in refused


def test_the_command_line_forgets_an_unregistered_policy() -> None:
    assert "youngest" not in REGISTRY
    assert "[efficiency|fair|sla|auction|token|jasda]" in cli("up", "--help")
    assert "youngest" not in cli("simulate", "--help")


def test_explain_orders_the_queue_by_the_policy(youngest: Policy) -> None:
    a, b, c = job("a", 100.0), job("b", 102.0), job("c", 101.0, deadline_s=60.0)
    ranked, words = queue_order("youngest", [a, b, c])
    assert [s.job_id for s in ranked] == ["b", "c", "a"]
    assert words == "youngest: the latest submitted first"
    # submission order under a policy that ranks each window by its fit
    assert [s.job_id for s in queue_order("efficiency", [a, b, c])[0]] == ["a", "c", "b"]

    record = RoundRecord(
        offer_id="o1", round=1, policy="youngest", replies_from=["agent-0"], verdicts=[], opened_at=103.0,
        window=Window(
            slice_id="n-g0-3g.40gb-0", node="n", pool="p", gpu_model="A100", profile="3g.40gb",
            mem_mib=40_448, compute_share=0.5, start_s=0.0,
        ),
    )  # fmt: skip
    limits = PlanLimits(mem_reserve_mib=256.0, start_overhead_s=0.3, horizon_s=8.0)
    e = explain(a, [record], [a, b, c], 104.0, limits)
    assert (e.policy, e.position, e.waiting, e.order) == ("youngest", 3, 3, words)

    # It reads deadlines: no note under it, and it is named where another policy clears.
    assert deadline_note("youngest", c.spec) is None
    assert deadline_note("fair", c.spec) == (
        "deadline_s is read only by the sla, jasda and youngest policies; rounds are cleared under fair, "
        "which does not: `sja status` shows whether the deadline is met"
    )
