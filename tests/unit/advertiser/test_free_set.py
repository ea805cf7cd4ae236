"""The advertiser's free slices, kept in offer order as the watch reports changes, are always what a
fresh look at every slice would give."""

from __future__ import annotations

import asyncio

from hypothesis import given, settings
from hypothesis import strategies as st

from services.advertiser.service import AdvertiserService, AdvertiserSettings
from sja.protocol.messages import SliceState

KEYS = [f"node{n}-g{g}-1g.10gb-{i}" for n in range(2) for g in range(2) for i in range(3)]


def state(key: str, status: str, fence: int, pool: str) -> SliceState:
    node = key.split("-", 1)[0]
    return SliceState(
        slice_id=key,
        node=node,
        pool=pool,
        gpu_index=0,
        gpu_model="H100-80GB",
        profile="1g.10gb",
        mem_mib=9984,
        compute_slots=1,
        compute_share=1 / 7,
        status=status,  # type: ignore[arg-type]
        fence=fence,
    )


changes = st.lists(
    st.tuples(
        st.sampled_from(KEYS),
        st.sampled_from(["free", "leased", "busy", "offline", "deleted"]),
        st.integers(0, 5),
        st.sampled_from(["node0", "node1"]),
    ),
    max_size=60,
)


@settings(max_examples=200, deadline=None)
@given(changes)
def test_free_slices_in_order_follow_every_change(seq: list[tuple[str, str, int, str]]) -> None:
    adv = AdvertiserService(AdvertiserSettings(instance="advertiser-t", pools=("node0",)))
    latest: dict[str, SliceState] = {}

    async def apply() -> None:
        for key, status, fence, pool in seq:
            value = None if status == "deleted" else state(key, status, fence, pool)
            if value is None:
                latest.pop(key, None)
            else:
                latest[key] = value
            await adv._changed(key, value, 1)

    asyncio.run(apply())
    expected = sorted(k for k, s in latest.items() if s.status == "free" and s.pool == "node0")
    assert adv._free_order == expected
    assert adv.free == {k: latest[k] for k in expected}
    assert adv._free_fence == {k: latest[k].fence for k in expected}
