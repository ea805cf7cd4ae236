"""The clearer's conflict paths, without a server: its slices store is a ``MemoryStore`` whose
``before_write`` hook writes as another service would between the clearer's read and its
compare-and-set. A winner whose lease write loses (another clearer leased the slice, the slice was
touched, or it is gone) gets no grant, is refunded in full, and its verdict says why; a slice is
never granted twice."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from opentelemetry import context as otel_context

from services.clearer.service import ClearerService, ClearerSettings, OpenRound
from sja.bus.store import MemoryStore
from sja.core import grants, leases
from sja.core.policies import Ledger, grant_cost
from sja.protocol.messages import Candidate, Offer, Proposal, Reply, RoundRecord, SliceState, Window

LEASE_S = 5.0


def slice_state(n: int = 0, fence: int = 3) -> SliceState:
    return SliceState(
        slice_id=f"s{n}", node="n0", pool="p", gpu_index=0, gpu_model="A100-80GB", profile="1g.10gb",
        mem_mib=10_000, compute_slots=1, compute_share=1 / 7, fence=fence,
    )  # fmt: skip


def offer_of(state: SliceState, revision: int, n: int = 0, carry: bool = True) -> Offer:
    """An offer of ``state`` as stored at ``revision`` (``carry``: with the slice in it, so the
    clearer tries its compare-and-set without reading the slice first)."""
    now = time.time()
    w = Window(
        slice_id=state.slice_id, node=state.node, pool=state.pool, gpu_model=state.gpu_model,
        profile=state.profile, mem_mib=state.mem_mib, compute_share=state.compute_share,
        start_s=now, end_s=now + 60.0,
    )  # fmt: skip
    return Offer(
        offer_id=f"o{n}", round=n + 1, window=w, slice_fence=state.fence,
        slice_revision=revision if carry else 0, slice_state=state if carry else None,
        issued_at=now, reply_by=now + 0.05, reply_to="r",
    )  # fmt: skip


def proposal(job: str, tenant: str = "a", bid: float = 1.0) -> Proposal:
    c = Candidate(
        size=1, mem_q_mib=2_000.0, p_fit_mem=0.99, duration_q_s=13.0, duration_mean_s=10.0,
        p_fit_time=0.97, bid=bid,
    )  # fmt: skip
    return Proposal(
        job_id=job, tenant=tenant, mode="sja", candidates=[c], submitted_at=1.0, remaining_units=10,
        total_units=10, capacity=4, grants_seen=0, expected_remaining_s=20.0,
    )  # fmt: skip


def clearer(
    store: MemoryStore[SliceState], policy: str = "fair", budgets: dict[str, float] | None = None
) -> ClearerService:
    c = ClearerService(ClearerSettings(policy=policy, lease_s=LEASE_S, tenant_budgets=budgets or {}))
    c.slices = store
    return c


def round_of(offers: list[Offer], replies: dict[str, list[Proposal]], key: str = "") -> OpenRound:
    """The open round of ``offers`` (a lone offer's, or a batch ``key``), each agent in ``replies``
    having answered the first offer with its proposals."""
    rnd = OpenRound(
        key=key or offers[0].offer_id, offers=offers, ctx=otel_context.Context(), opened_at=time.time()
    )
    for agent, props in replies.items():
        rnd.replies[agent] = Reply(offer_id=offers[0].offer_id, agent_id=agent, proposals=props)
    return rnd


async def clear(c: ClearerService, rnd: OpenRound) -> list[tuple[RoundRecord, grants.RoundEnd]]:
    return await c.settle(rnd, c.decide(rnd), "deadline")


def ledger_view(lg: Ledger) -> tuple[object, ...]:
    """The ledger by value, a charge of 0 counting as none."""
    return (
        {t: v for t, v in lg.tenant_attained.items() if v},
        {j: v for j, v in lg.job_attained.items() if v},
        {j: v for j, v in lg.job_grants.items() if v},
        dict(lg.tenant_budgets),
    )


async def stored(store: MemoryStore[SliceState], state: SliceState) -> int:
    return await store.put(state.slice_id, state)


async def test_a_won_slice_is_leased_granted_and_charged() -> None:
    store: MemoryStore[SliceState] = MemoryStore(SliceState)
    state = slice_state()
    o = offer_of(state, await stored(store, state))
    c = clearer(store)
    rnd = round_of([o], {"ag1": [proposal("j1")]})

    [(rec, end)] = await clear(c, rnd)

    assert end is grants.RoundEnd.GRANTED
    [(g, _)] = rnd.granted
    got = await store.get("s0")
    assert got is not None
    leased, rev = got
    assert (leased.status, leased.fence, leased.holder_job, leased.grant_id) == (
        "leased",
        4,
        "j1",
        g.grant_id,
    )
    assert (g.fence, g.slice_revision, g.slice_state, g.job_id) == (4, rev, leased, "j1")
    assert g.lease_until == leased.lease_until == pytest.approx(g.granted_at + LEASE_S)
    assert store.writes == 2 and store.conflicts == 0  # the put above, then one compare-and-set: no read
    assert (rec.winner_job, rec.grant_id, rec.fence, rec.note) == ("j1", g.grant_id, 4, "")
    assert [v.won for v in rec.verdicts] == [True]
    cost = grant_cost(o, g.candidate)
    assert rec.charged_gpu_s == cost > 0
    assert c.ledger.job_attained == {"j1": cost} and c.ledger.tenant_attained == {"a": cost}
    assert c.ledger.job_grants == {"j1": [g.granted_at + LEASE_S]}


async def test_another_clearer_leases_the_slice_first_the_winner_is_refunded_and_told_why() -> None:
    store: MemoryStore[SliceState] = MemoryStore(SliceState)
    state = slice_state()
    o = offer_of(state, await stored(store, state))
    other = leases.grant(
        state, offered_fence=3, job_id="j9", grant_id="g-other", now=time.time(), lease_s=9.0
    )

    async def another_clearer(key: str) -> None:
        await store.put(key, other)

    store.before_write = another_clearer
    c = clearer(store)
    before = ledger_view(c.ledger)
    rnd = round_of([o], {"ag1": [proposal("j1")]})

    [(rec, end)] = await clear(c, rnd)

    assert end is grants.RoundEnd.LOST_CAS
    assert rnd.granted == [] and c.grants == 0
    got = await store.get("s0")
    assert got is not None and got[0] == other  # the other clearer's lease stands
    assert ledger_view(c.ledger) == before  # refunded: service, grant and payment
    note = "not granted: slice s0 is leased"
    assert (rec.winner_job, rec.grant_id, rec.fence, rec.charged_gpu_s, rec.note) == ("", "", 0, 0.0, note)
    [v] = rec.verdicts
    assert (v.job_id, v.won, v.reason) == ("j1", False, note)


async def test_a_slice_touched_between_read_and_write_is_not_granted() -> None:
    """The offer carries no slice: the clearer reads it, and another writer changes it (same status,
    same fence) before the compare-and-set."""
    store: MemoryStore[SliceState] = MemoryStore(SliceState)
    state = slice_state()
    o = offer_of(state, await stored(store, state), carry=False)

    async def touch(key: str) -> None:
        await store.put(key, msgspec.structs.replace(state, updated_at=time.time()))

    store.before_write = touch
    c = clearer(store)
    before = ledger_view(c.ledger)
    rnd = round_of([o], {"ag1": [proposal("j1")]})

    [(rec, end)] = await clear(c, rnd)

    assert end is grants.RoundEnd.LOST_CAS and rnd.granted == []
    assert store.conflicts == 1
    got = await store.get("s0")
    assert got is not None and got[0].status == "free" and got[0].fence == 3
    assert ledger_view(c.ledger) == before
    assert rec.note == "not granted: slice changed while clearing"
    assert [(v.won, v.reason) for v in rec.verdicts] == [(False, rec.note)]


async def test_a_stale_offer_is_taken_after_one_read_when_the_slice_is_still_free() -> None:
    """The slice was touched after the offer (its revision moved, nothing else): the fast
    compare-and-set loses, the read finds it free at the offered fence, and the second one wins."""
    store: MemoryStore[SliceState] = MemoryStore(SliceState)
    state = slice_state()
    o = offer_of(state, await stored(store, state))
    await store.put("s0", msgspec.structs.replace(state, updated_at=1.0))
    c = clearer(store)
    rnd = round_of([o], {"ag1": [proposal("j1")]})

    [(_, end)] = await clear(c, rnd)

    assert end is grants.RoundEnd.GRANTED and store.conflicts == 1
    [(g, _)] = rnd.granted
    got = await store.get("s0")
    assert got is not None and (g.slice_revision, g.fence) == (got[1], 4)


async def test_a_slice_gone_is_not_granted() -> None:
    store: MemoryStore[SliceState] = MemoryStore(SliceState)
    state = slice_state()
    o = offer_of(state, await stored(store, state))

    async def remove(key: str) -> None:
        await store.delete(key)

    store.before_write = remove
    c = clearer(store)
    before = ledger_view(c.ledger)
    rnd = round_of([o], {"ag1": [proposal("j1")]})

    [(rec, end)] = await clear(c, rnd)

    assert end is grants.RoundEnd.LOST_CAS and rnd.granted == []
    assert await store.get("s0") is None
    assert ledger_view(c.ledger) == before
    assert rec.note == "slice vanished" and [v.won for v in rec.verdicts] == [False]


async def test_an_auction_payment_is_refunded_when_the_lease_is_lost() -> None:
    async def run(lose: bool) -> tuple[ClearerService, grants.RoundEnd]:
        store: MemoryStore[SliceState] = MemoryStore(SliceState)
        state = slice_state()
        o = offer_of(state, await stored(store, state))

        async def remove(key: str) -> None:
            await store.delete(key)

        if lose:
            store.before_write = remove
        c = clearer(store, policy="auction", budgets={"a": 10.0, "b": 10.0})
        rnd = round_of([o], {"ag1": [proposal("j1", "a", bid=3.0), proposal("j2", "b", bid=2.0)]})
        [(_, end)] = await clear(c, rnd)
        return c, end

    won, end = await run(lose=False)
    assert end is grants.RoundEnd.GRANTED
    assert won.ledger.tenant_budgets["a"] < 10.0  # the winner paid (second price)
    lost, end = await run(lose=True)
    assert end is grants.RoundEnd.LOST_CAS
    assert lost.ledger.tenant_budgets == {"a": 10.0, "b": 10.0}


async def test_two_clearers_clearing_one_offer_grant_the_slice_once() -> None:
    """Replicas without a queue group both clear every offer: the compare-and-set picks one grant,
    and the other replica refunds its winner."""
    store: MemoryStore[SliceState] = MemoryStore(SliceState)
    state = slice_state()
    o = offer_of(state, await stored(store, state))
    a, b = clearer(store), clearer(store)
    ra = round_of([o], {"ag1": [proposal("j1")]})
    rb = round_of([o], {"ag1": [proposal("j1")]})

    (ends_a, ends_b) = await asyncio.gather(clear(a, ra), clear(b, rb))

    ends = sorted(end.value for _, end in [*ends_a, *ends_b])
    assert ends == ["granted", "lost_cas"]
    [(g, _)] = ra.granted + rb.granted
    got = await store.get("s0")
    assert got is not None and got[0].grant_id == g.grant_id and got[0].fence == 4
    winner, loser = (a, b) if ra.granted else (b, a)
    assert winner.ledger.job_attained == {"j1": grant_cost(o, g.candidate)}
    assert ledger_view(loser.ledger) == ledger_view(Ledger())


async def test_in_a_batch_only_the_lost_slice_is_refunded() -> None:
    store: MemoryStore[SliceState] = MemoryStore(SliceState)
    s0, s1 = slice_state(0), slice_state(1)
    o0 = offer_of(s0, await stored(store, s0), n=0)
    o1 = offer_of(s1, await stored(store, s1), n=1)

    async def take_s1(key: str) -> None:
        if key == "s1":
            await store.put(key, msgspec.structs.replace(s1, status="offline"))

    store.before_write = take_s1
    c = clearer(store)
    rnd = round_of([o0, o1], {"ag1": [proposal("j1")]}, key="b1")
    rnd.replies["ag2"] = Reply(offer_id=o1.offer_id, agent_id="ag2", proposals=[proposal("j2", "b")])

    results = await clear(c, rnd)

    by_slice = {rec.window.slice_id: (rec, end) for rec, end in results}
    assert by_slice["s0"][1] is grants.RoundEnd.GRANTED
    assert by_slice["s1"][1] is grants.RoundEnd.LOST_CAS
    assert by_slice["s1"][0].note == "not granted: slice s1 is offline"
    [(g, _)] = rnd.granted
    assert g.job_id == "j1"
    assert c.ledger.job_attained == {"j1": grant_cost(o0, g.candidate), "j2": 0.0}
    assert c.ledger.job_grants == {"j1": [g.lease_until], "j2": []}
    assert c.ledger.tenant_attained == {"a": grant_cost(o0, g.candidate), "b": 0.0}
