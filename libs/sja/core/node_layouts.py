"""A node's MIG layouts for the work waiting: the live inventory's question to
``core.repartition``, asked with what the slice bucket and the job store hold.

``plan_node`` groups a node's MIG GPUs by model and asks, as the simulator does, which idle GPU to
re-cut (``plan_repartitions``) and which busy one to drain (``plan_drains``) for the demand of the
waiting jobs in queue order (``demand_of``: one slice per subjob each could still start, of the
profiles it would propose for, asked with a window of each profile: ``probe_offers``). A live job
declares no compute share: a holder counts as using its whole slice, and a waiting job as able to
use a whole GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence

from sja.core import defaults
from sja.core.jobs import slots_left
from sja.core.mig import CATALOGUE, GpuModel, id_token
from sja.core.repartition import (
    BusyGpu,
    HeldSlice,
    Repartition,
    demand_of,
    held_demand,
    plan_drains,
    plan_repartitions,
    served_value,
)
from sja.core.windows import WindowRequest, find_windows, probe_offer
from sja.protocol.messages import JobState, Offer, SliceState


def probe_offers(node: str, model: GpuModel, now: float) -> dict[str, Offer]:
    """A window of each profile of ``model``, as a free slice of it would be offered now: what a job
    is asked whether it would bid for."""
    largest = max(p.mem_mib for p in model.profiles)
    out: dict[str, Offer] = {}
    for p in model.profiles:
        st = SliceState(
            slice_id=f"{node}-probe-{id_token(p.name)}",
            node=node,
            pool=node,
            gpu_index=0,
            gpu_model=model.name,
            profile=p.name,
            mem_mib=p.mem_mib,
            compute_slots=p.compute_slots,
            compute_share=min(p.compute_slots / model.compute_slots, 1.0),
            source="nvml",
        )
        req = WindowRequest(
            now=now, horizon_s=defaults.HORIZON_S, open_ended=True, largest_mib={node: largest}
        )
        window = find_windows([st], req)[0]
        out[p.name] = probe_offer(window, now, offer_id="repartition", reply_to="inventory")
    return out


def held_slices(slices: Sequence[SliceState], now: float, restart_s: float) -> tuple[HeldSlice, ...]:
    """A busy GPU's slices as a drain sees them. A live job's compute share is not declared: a
    holder counts as using its whole slice."""
    out = []
    for s in slices:
        share = s.compute_share
        if s.status == "free":
            out.append(HeldSlice(s.profile, share, 0.0, 0.0))
        elif s.contestable_at > 0:
            holder = held_demand(s.holder_job, s.mem_mib, 1.0)
            frees_in = max(s.contestable_at - now, 0.0)
            out.append(HeldSlice(s.profile, share, served_value(share, 1.0), frees_in, restart_s, holder))
        else:
            ends = s.expected_end or s.lease_until or now
            out.append(HeldSlice(s.profile, share, served_value(share, 1.0), max(ends - now, 0.0)))
    return tuple(out)


def plan_node(
    gpus: Mapping[int, Sequence[SliceState]],
    waiting: Sequence[JobState],
    propose_for: Callable[[JobState, Offer], bool],
    *,
    node: str,
    now: float,
    draining: Mapping[int, tuple[str, ...]],
    recut_at: Mapping[int, float],
) -> list[Repartition]:
    """The re-cuts and drains the core picks for a node's MIG GPUs (``gpu index -> its slices``),
    model by model (``Repartition.gpu_id`` is the GPU's index)."""
    out: list[Repartition] = []
    by_model: dict[str, list[int]] = {}
    for idx, slices in gpus.items():
        if slices and all(s.source == "nvml" for s in slices) and slices[0].gpu_model in CATALOGUE:
            by_model.setdefault(slices[0].gpu_model, []).append(idx)
    states = {s.job_id: s for s in waiting}
    for name, indices in sorted(by_model.items()):
        model = CATALOGUE[name]
        offers = probe_offers(node, model, now)

        def profiles_for(job_id: str, offers: Mapping[str, Offer] = offers) -> Iterable[str]:
            return [p for p, o in offers.items() if propose_for(states[job_id], o)]

        demand = demand_of([(s.job_id, 1.0, slots_left(s)) for s in waiting], profiles_for)
        if not demand:
            continue
        layouts = {
            idx: tuple(s.profile for s in sorted(gpus[idx], key=lambda s: s.placement_start))
            for idx in indices
        }
        idle = [
            (str(idx), model, layouts[idx])
            for idx in sorted(indices)
            if idx not in draining and all(s.status == "free" for s in gpus[idx])
        ]
        chosen = {int(g): layout for g, _, layout in idle}
        for r in plan_repartitions(idle, demand):
            chosen[int(r.gpu_id)] = r.new
            out.append(r)
        busy = [
            BusyGpu(
                str(idx),
                model,
                layouts[idx],
                held_slices(gpus[idx], now, defaults.START_OVERHEAD_S),
                now - recut_at.get(idx, -math.inf),
            )
            for idx in sorted(indices)
            if idx not in chosen and idx not in draining and all(s.status != "offline" for s in gpus[idx])
        ]
        in_place = list(chosen.values()) + [draining[i] for i in indices if i in draining]
        out += plan_drains(
            busy, demand, in_place=in_place, reconfig_s=defaults.RECONFIG_S, payoff_s=defaults.HORIZON_S
        )
    return out
