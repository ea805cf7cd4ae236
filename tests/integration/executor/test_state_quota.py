"""Quotas on what tenants' programs leave in the checkpoint store, tried as a tenant filling it would:
a state over the limit per state fails its subjob with the reason before anything is stored (and
the job, when every try does the same); a tenant whose states together would pass its limit has the
next one refused, while another tenant's job still stores its own; the store is created with a size
limit of its own. A real nats-server, the real services and executor, real programs."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import nats.js.errors
import pytest

from sja.core import jobs as J
from sja.protocol import messages as m
from sja.workloads import checkpoint as ckpt
from tests.integration.agent.test_sequential_checkpoints import Actors, running, until_state

pytestmark = pytest.mark.timeout(180)

MIB = 1024 * 1024


def writer(mib: float) -> list[str]:
    """A program that leaves ``mib`` MiB of state per unit (random: it does not compress)."""
    body = textwrap.dedent(
        f"""
        import os, pathlib
        e = os.environ
        out = pathlib.Path(e["SJA_STATE_OUT"])
        size = int(e["SJA_UNITS"]) * {int(mib * MIB)}
        (out / ("part-" + e["SJA_UNIT_START"])).write_bytes(os.urandom(size))
        """
    )
    return [sys.executable, "-c", body]


def spec(name: str, tenant: str, mib: float, units: int) -> m.JobSpec:
    return m.JobSpec(
        name=name,
        tenant=tenant,
        workload="command",
        # Independent subjobs: every state is kept (the accumulator lists them all); each subjob its
        # planned range only (not going on past its window), so that the job is cut.
        params={
            "argv": writer(mib),
            "units": units,
            "sequential": False,
            "merge_argv": ["true"],
            "continue": False,
        },
        max_parallel=1,
        min_units=1,
        memory=m.MemoryDecl(base_mib=64.0, per_unit_mib=0.0, rel_sd=0.2),
        time=m.TimeDecl(warmup_s=0.05, per_unit_s=0.01, rel_sd=0.5),
    )


async def stored(nc: object) -> dict[str, int]:
    """Object name -> size of every state in the store."""
    store = await nc.jetstream().object_store(ckpt.BUCKET)  # type: ignore[attr-defined]
    try:
        return {o.name: o.size for o in await store.list() if not o.deleted}
    except nats.js.errors.NotFoundError:
        return {}


async def test_a_state_over_the_limit_fails_its_subjob_and_is_never_stored(
    nats_url: str, tmp_path: Path
) -> None:
    async with running(
        nats_url, tmp_path, Actors(), state_max_mib=1.0, checkpoint_store_max_mib=64.0
    ) as stack:
        ack = await stack.client.submit(spec("big", "t", 2.0, 1))
        state = await until_state(stack.client, ack.job_id, J.is_terminal, 120, "the job to end")
        assert state.status == "failed"
        assert "over the limit of 1 MiB per state (SJA_STATE_MAX_MIB)" in state.error, state.error
        tried = [h for h in state.history if h.status == "failed"]
        assert len(tried) == J.MAX_CONSECUTIVE_FAILURES
        assert all("its state is 2.0 MiB" in h.error for h in tried)
        assert not any(name.startswith(ack.job_id) for name in await stored(stack.nc))
        info = await stack.nc.jetstream().stream_info(f"OBJ_{ckpt.BUCKET}")
        assert info.config.max_bytes == 64 * MIB


async def test_a_tenant_over_its_total_is_refused_and_another_tenant_is_not(
    nats_url: str, tmp_path: Path
) -> None:
    async with running(nats_url, tmp_path, Actors(), tenant_state_max_mib=2.0) as stack:
        # 0.8 MiB per unit: at most two units' states fit the tenant's 2 MiB, however the job is cut.
        hog = await stack.client.submit(spec("hog", "greedy", 0.8, 6))
        state = await until_state(stack.client, hog.job_id, J.is_terminal, 120, "the hog to end")
        assert state.status == "failed" and state.units_done <= 2, (state.units_done, state.error)
        assert "tenant greedy holds" in state.error and "SJA_TENANT_STATE_MAX_MIB" in state.error, state.error
        refused = [h for h in state.history if h.status == "failed"]
        assert refused and all("would pass its limit of 2 MiB" in h.error for h in refused)
        held = {n: s for n, s in (await stored(stack.nc)).items() if n.startswith(hog.job_id)}
        assert sum(held.values()) <= 2 * MIB

        # Another tenant has a quota of its own: its states are stored.
        other = await stack.client.submit(spec("fine", "modest", 0.8, 2))
        done = await until_state(stack.client, other.job_id, J.is_terminal, 120, "the other job to end")
        assert done.status == "done", done.error
        assert len([n for n in await stored(stack.nc) if n.startswith(other.job_id)]) == 2
