"""One policy, one module: the policy modules under ``sja.core.policies`` decide exactly as the
single ``policies.py`` they replaced (kept, frozen, as ``_policies_before``), on drawn batches of
offers, bids and ledgers, for every policy; and a new policy needs one module (here: a class in
this test) and one ``register``."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sja.core import policies as after
from sja.core.policies import (
    POLICIES,
    REGISTRY,
    Bid,
    Decision,
    Keyed,
    Ledger,
    Policy,
    PolicyConfig,
    bid_for,
    clear,
    clear_batch,
    likely_winners,
    rank,
    register,
    shortlist,
    unregister,
)
from sja.protocol.messages import Candidate, Offer, Proposal, Window


def _frozen(name: str) -> Any:
    """The module the policy modules replaced, as it was (a fixture of this test only)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


before = _frozen("_policies_before")

NOW = 5_000.0
TENANTS = ["a", "b", "c"]
SHAPES = [(10_000, 1 / 7, 8.0), (20_000, 3 / 7, 8.0), (10_000, 1 / 7, None), (40_000, 1.0, 30.0)]


def offer(i: int, shape: int, slice_no: int) -> Offer:
    mem, share, length = SHAPES[shape]
    w = Window(
        slice_id=f"s{slice_no:03d}", node="n", pool="p", gpu_model="H100-80GB", profile="1g.10gb",
        mem_mib=mem, compute_share=share, start_s=NOW + (slice_no % 3),
        end_s=None if length is None else NOW + (slice_no % 3) + length,
    )  # fmt: skip
    return Offer(
        offer_id=f"o{i}", round=i, window=w, slice_fence=1, slice_revision=1,
        issued_at=NOW, reply_by=NOW + 0.05, reply_to="r",
    )  # fmt: skip


cand_st = st.builds(
    lambda size, dur, mem, pm, pt, bid: Candidate(
        size=size,
        mem_q_mib=mem,
        p_fit_mem=pm,
        duration_q_s=dur * 1.3,
        duration_mean_s=dur,
        p_fit_time=pt,
        bid=bid,
    ),
    st.integers(1, 7),
    st.floats(0.5, 40.0),
    st.floats(100.0, 40_000.0),
    st.sampled_from([0.5, 0.9, 0.99, 1.0]),
    st.sampled_from([0.6, 0.97, 1.0]),
    st.sampled_from([0.0, 0.5, 1.0, 2.5, 4.0]) | st.floats(0.0, 6.0),
)

proposal_st = st.builds(
    lambda job, tenant, cands, submitted, capacity, seen, deadline, remaining, attained: Proposal(
        job_id=f"j{job:03d}",
        tenant=tenant,
        mode="sja",
        candidates=cands,
        submitted_at=submitted,
        remaining_units=10,
        total_units=10,
        capacity=capacity,
        grants_seen=seen,
        deadline_at=None if deadline is None else NOW + deadline,
        expected_remaining_s=remaining,
        attained_gpu_s=attained,
    ),
    st.integers(0, 25),
    st.sampled_from(TENANTS),
    st.lists(cand_st, min_size=1, max_size=3),
    st.sampled_from([0.0, 1.0, 2.0]) | st.floats(0.0, NOW),
    st.integers(0, 3),
    st.integers(0, 2),
    st.none() | st.floats(-50.0, 400.0),
    st.floats(0.0, 200.0),
    st.floats(0.0, 50.0),
)

config_st = st.builds(
    PolicyConfig,
    horizon_s=st.sampled_from([8.0, 30.0]),
    jasda_weights=st.sampled_from([(0.5, 0.3, 0.2), (0.0, 1.0, 0.0), (1.0, 0.0, 0.0), (0.2, 0.2, 0.6)]),
    responsiveness_scale_s=st.sampled_from([60.0, 5.0]),
    token_overuse=st.sampled_from([0.1, 0.0, 0.5]),
    reserve_price=st.sampled_from([0.0, 0.0, 1.0]),
)

ledger_st = st.fixed_dictionaries(
    {
        "shares": st.dictionaries(st.sampled_from(TENANTS), st.sampled_from([0.5, 1.0, 2.0, 3.0])),
        "attained": st.dictionaries(st.sampled_from(TENANTS), st.sampled_from([0.0, 5.0]) | st.floats(0, 60)),
        "jobs": st.dictionaries(st.integers(0, 25), st.floats(0.0, 30.0)),
        "budgets": st.dictionaries(st.sampled_from(TENANTS), st.sampled_from([0.0, 1.0]) | st.floats(0, 9)),
        "grants": st.dictionaries(st.integers(0, 25), st.integers(0, 3)),
    }
)


def make_ledger(cls: Any, d: dict[str, Any]) -> Any:
    lg = cls(
        tenant_shares=dict(d["shares"]),
        tenant_attained=dict(d["attained"]),
        job_attained={f"j{j:03d}": v for j, v in d["jobs"].items()},
        tenant_budgets=dict(d["budgets"]),
    )
    for job, n in d["grants"].items():
        for k in range(n):  # some leases still running, some lapsed
            lg.record_grant(f"j{job:03d}", NOW + (10.0 if k % 2 else -10.0))
    return lg


def seen(d: Any) -> tuple[object, ...]:
    """A decision by value, whichever module's classes made it."""
    w = d.winner
    winner = None if w is None else (w.agent_id, w.proposal)
    return (d.policy, winner, d.candidate, d.verdicts, d.price, d.shared, d.skip, d.all_verdicts())


def bids_in(cls: Any, raw: Sequence[tuple[int, Proposal]]) -> list[Any]:
    return [cls(agent_id=f"ag{agent}", proposal=p) for agent, p in raw]


REPLIED = ("ag0", "ag1", "ag2")


@settings(max_examples=300, deadline=None)
@given(
    name=st.sampled_from(sorted(before.POLICIES)),
    shapes=st.lists(st.tuples(st.integers(0, len(SHAPES) - 1), st.integers(0, 14)), min_size=1, max_size=10),
    groups=st.lists(st.lists(st.tuples(st.integers(0, 1), proposal_st), max_size=10), min_size=1, max_size=3),
    ledger=ledger_st,
    cfg=config_st,
)
def test_the_policy_modules_decide_as_the_single_module_did(
    name: str,
    shapes: list[tuple[int, int]],
    groups: list[list[tuple[int, Proposal]]],
    ledger: dict[str, Any],
    cfg: PolicyConfig,
) -> None:
    old_cfg = before.PolicyConfig(
        horizon_s=cfg.horizon_s, jasda_weights=cfg.jasda_weights,
        responsiveness_scale_s=cfg.responsiveness_scale_s, token_overuse=cfg.token_overuse,
        reserve_price=cfg.reserve_price,
    )  # fmt: skip
    offers = [offer(i, shape, slice_no) for i, (shape, slice_no) in enumerate(shapes)]
    old_lists = [bids_in(before.Bid, g) for g in groups]
    new_lists = [bids_in(Bid, g) for g in groups]

    def of(lists: list[list[Any]]) -> Callable[[Offer], Sequence[Any]]:
        # Offers of one shape share one bid list (as an agent's reply groups them).
        return lambda o: lists[int(o.offer_id[1:]) % len(lists)]

    # one offer at a time, each against the same ledger
    for o in offers:
        old = before.clear(
            name, o, of(old_lists)(o), make_ledger(before.Ledger, ledger), config=old_cfg, replied=REPLIED
        )
        new = clear(name, o, of(new_lists)(o), make_ledger(Ledger, ledger), config=cfg, replied=REPLIED)
        assert seen(new) == seen(old), o.offer_id

    # a batch
    old_batch = before.clear_batch(
        name, offers, of(old_lists), make_ledger(before.Ledger, ledger), old_cfg, REPLIED
    )
    new_batch = clear_batch(name, offers, of(new_lists), make_ledger(Ledger, ledger), cfg, REPLIED)
    assert [(o, seen(d)) for o, d in new_batch] == [(o, seen(d)) for o, d in old_batch]

    # what agents send: the candidate a policy takes, shortlists and the likely winners
    proposals = [p for g in groups for _, p in g]
    for o in offers[:2]:
        for p in proposals:
            assert bid_for(name, o, p, cfg) == before.bid_for(name, o, p, old_cfg)
        for like in (1, 3):
            assert shortlist(name, o, proposals, like, cfg) == before.shortlist(
                name, o, proposals, like, old_cfg
            )
            assert likely_winners(name, o, proposals, like, cfg) == before.likely_winners(
                name, o, proposals, like, old_cfg
            )


def test_the_registry_holds_the_same_policies_each_from_its_own_module() -> None:
    assert list(POLICIES) == list(before.POLICIES)
    assert list(after.BID_ORDERS) == list(before.BID_ORDERS)
    for name, pol in REGISTRY.items():
        assert type(pol).__module__ == f"sja.core.policies.{name}"
        assert POLICIES[name] == pol.clear


# --- a new policy: one module, one registration ------------------------------------------------------


class Youngest(Policy):
    """A toy policy: the most recently submitted job wins (then the job id)."""

    def __init__(self) -> None:
        super().__init__("youngest")

    def clear(self, offer: Offer, bids: Sequence[Bid], ledger: Ledger, cfg: PolicyConfig) -> Decision:
        def key(b: Bid) -> Keyed:
            p = b.proposal
            cand = self.candidate(offer, p, cfg)
            return (-p.submitted_at,), cand, f"submitted at {p.submitted_at:g}"

        return rank(self.name, bids, key, lambda k: -k[0][0])


@pytest.fixture
def youngest() -> Iterator[Policy]:
    pol = register(Youngest())
    yield pol
    unregister(pol.name)
    assert "youngest" not in POLICIES


def proposal(job: int, tenant: str, submitted: float, capacity: int = 1) -> Proposal:
    c = Candidate(
        size=1, mem_q_mib=1_000.0, p_fit_mem=1.0, duration_q_s=5.0, duration_mean_s=4.0, p_fit_time=1.0
    )
    return Proposal(
        job_id=f"j{job}", tenant=tenant, mode="sja", candidates=[c], submitted_at=submitted,
        remaining_units=5, total_units=5, capacity=capacity, grants_seen=0,
    )  # fmt: skip


def test_a_new_policy_needs_one_module_and_one_registration(youngest: Policy) -> None:
    assert "youngest" in POLICIES and REGISTRY["youngest"] is youngest
    bids = [
        Bid("ag0", proposal(1, "a", 10.0)),
        Bid("ag1", proposal(2, "b", 30.0)),
        Bid("ag0", proposal(3, "a", 20.0)),
    ]
    offers = [offer(i, 0, i) for i in range(4)]

    d = clear("youngest", offers[0], bids, Ledger(), config=PolicyConfig(horizon_s=8.0), replied=REPLIED)
    assert d.winner is not None and d.winner.proposal.job_id == "j2"
    assert [v.reason for v in d.verdicts if v.job_id == "j3"] == [
        "lost to j2: submitted at 20 vs submitted at 30"
    ]
    assert sum(1 for v in d.verdicts if not v.job_id) == 1  # ag2 replied without a bid

    # A batch: each job may start one subjob, so the three windows go youngest first, the fourth
    # to nobody; every bid is explained on every offer.
    batch = clear_batch("youngest", offers, lambda o: bids, Ledger(), PolicyConfig(horizon_s=8.0), REPLIED)
    assert [d.winner.proposal.job_id if d.winner else None for _, d in batch] == ["j2", "j3", "j1", None]
    for _, d in batch:
        assert {v.job_id for v in d.all_verdicts()} == {"", "j1", "j2", "j3"}
    last = batch[-1][1].all_verdicts()
    assert all(v.reason.startswith("lost: took") for v in last if v.job_id)

    # An agent cannot foresee it (no bid order): it sends every bid.
    assert shortlist("youngest", offers[0], [b.proposal for b in bids], 1) == [b.proposal for b in bids]


def test_a_policy_is_registered_once() -> None:
    with pytest.raises(ValueError, match="registered already"):
        register(REGISTRY["fair"])
