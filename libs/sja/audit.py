"""Checking a run from its durable records: every job done with the result of the job computed in
one piece, each unit applied once, no slice granted twice at once. Used by the fault benchmarks
(``bench/chaos.py``, ``bench/control_plane.py``) and the end-to-end fault tests, which also share
the job mix and the client calls that ride out a restarting gateway or a lost NATS server."""

from __future__ import annotations

import asyncio
import collections
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.aio.client import Client

import sja.execution.commands  # noqa: F401 - runs a command job in one piece (Command.run)
from sja.bus.connection import connect
from sja.bus.rounds import iter_rounds
from sja.client import SjaClient
from sja.protocol.messages import JobSpec, JobState, RoundRecord
from sja.workloads import run_in_one_piece


@dataclass(frozen=True)
class Mix:
    """Sizes of the mixed job set: Monte Carlo jobs (odd indexes) and matrix products (even)."""

    mc_units: int = 40
    mc_samples_per_unit: int = 20_000
    mm_rows: int = 800
    mm_inner: int = 256
    tenants: int = 3


def mixed_specs(n: int, mix: Mix = Mix()) -> list[JobSpec]:
    """``n`` jobs alternating matrix products and Monte Carlo estimates over ``mix.tenants``
    tenants, each with its own seed (so every result is distinct)."""
    out = []
    for i in range(n):
        tenant = f"t{i % mix.tenants}"
        if i % 2:
            out.append(
                JobSpec(
                    name=f"mc{i}",
                    tenant=tenant,
                    workload="montecarlo",
                    max_parallel=2,
                    params={"units": mix.mc_units, "samples_per_unit": mix.mc_samples_per_unit, "seed": i},
                )
            )
        else:
            out.append(
                JobSpec(
                    name=f"mm{i}",
                    tenant=tenant,
                    workload="matmul",
                    params={"rows": mix.mm_rows, "inner": mix.mm_inner, "cols": mix.mm_inner, "seed": i},
                )
            )
    return out


async def call(url: str, fn: str, *args: object, attempts: int = 120, timeout_s: float = 3.0) -> Any:
    """``SjaClient.<fn>(*args)`` on a fresh connection, retried every half second: it rides out a
    gateway being restarted, a reconnect, or a JetStream leader election."""
    last: Exception | None = None
    for _ in range(attempts):
        try:
            c = await SjaClient.connect(url, timeout_s=timeout_s)
            try:
                return await getattr(c, fn)(*args)
            finally:
                await c.close()
        except Exception as e:  # retried: the gateway or the server may be coming back
            last = e
            await asyncio.sleep(0.5)
    raise RuntimeError(f"{fn} kept failing: {last!r}")


async def statuses(url: str, ids: Sequence[str]) -> list[JobState]:
    """The state of each job (one connection, each call retried)."""
    c = await SjaClient.connect(url, timeout_s=5.0)
    try:
        out = []
        for j in ids:
            for attempt in range(20):
                try:
                    out.append(await c.status(j))
                    break
                except Exception:
                    if attempt == 19:
                        raise
                    await asyncio.sleep(0.5)
        return out
    finally:
        await c.close()


async def read_rounds(target: str | Client, timeout_s: float = 10.0, attempts: int = 6) -> list[RoundRecord]:
    """Every round record in ``SJA_ROUNDS`` (``target``: a NATS URL or a connection). A JetStream
    API request that times out (a cluster still electing leaders after losing a server) starts the
    read again, up to ``attempts`` reads in all."""
    nc = await connect(target, "sja-audit") if isinstance(target, str) else target
    js = nc.jetstream()
    try:
        for _ in range(attempts - 1):
            try:
                return [rec async for rec in iter_rounds(js, timeout_s=timeout_s, strict=True)]
            except nats.errors.TimeoutError:
                await asyncio.sleep(1.0)
        return [rec async for rec in iter_rounds(js, timeout_s=timeout_s, strict=True)]
    finally:
        if isinstance(target, str):
            await nc.close()


@dataclass(frozen=True)
class Audit:
    jobs: int
    completed: int
    lost_jobs: list[str]
    """Jobs submitted that are not done (or not found)."""
    wrong_results: list[str]
    """Done jobs whose result differs from the job computed in one piece."""
    applied_twice: list[str]
    """Jobs whose successful subjobs overlap (some unit applied twice) or leave a gap."""
    double_grants: list[str]
    """``slice:fence`` granted more than once, and slices on which two subjobs ran at once."""
    grants: int
    subjobs_replanned: int
    """Subjobs that ended lost, timed out or out of memory (their units planned again)."""
    unrecorded: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Jobs with more subjobs than grants in the round records (job -> (subjobs, grants)): grants
    whose record never reached ``SJA_ROUNDS``, so the checks above could not see them. Not part of
    ``clean``: a clearer killed between its grants and their records loses those records (the
    grants stand); a run with no service killed should have none."""

    @property
    def unrecorded_grants(self) -> int:
        return sum(subjobs - grants for subjobs, grants in self.unrecorded.values())

    def summary(self) -> dict[str, int]:
        return {
            "jobs": self.jobs,
            "completed": self.completed,
            "lost_jobs": len(self.lost_jobs),
            "wrong_results": len(self.wrong_results),
            "double_grants": len(self.double_grants),
            "results_applied_twice": len(self.applied_twice),
            "grants": self.grants,
            "subjobs_lost_and_replanned": self.subjobs_replanned,
            "unrecorded_grants": self.unrecorded_grants,
        }

    @property
    def clean(self) -> bool:
        return not (self.lost_jobs or self.wrong_results or self.applied_twice or self.double_grants)


def audit(states: Sequence[JobState], rounds: Sequence[RoundRecord], submitted: int | None = None) -> Audit:
    """Check finished jobs and the round records of their run (see the module doc)."""
    n = len(states) if submitted is None else submitted
    lost = [s.job_id for s in states if s.status != "done"] + ["(not found)"] * max(0, n - len(states))
    done = [s for s in states if s.status == "done"]
    wrong = [s.job_id for s in done if s.result != run_in_one_piece(s.spec.workload, s.spec.params)]
    twice = []
    for s in done:
        covered = sorted((h.unit_start, h.unit_start + h.units) for h in s.history if h.status == "ok")
        exact = bool(covered) and covered[0][0] == 0 and covered[-1][1] == s.total_units
        if not exact or any(a[1] != b[0] for a, b in itertools.pairwise(covered)):
            twice.append(s.job_id)
    granted = [(r.window.slice_id, r.fence) for r in rounds if r.grant_id]
    seen: set[tuple[str, int]] = set()
    double = []
    for key in granted:
        if key in seen:
            double.append(f"{key[0]}:{key[1]}")
        seen.add(key)
    by_slice: dict[str, list[tuple[float, float]]] = {}
    for s in states:
        for h in s.history:
            if h.status == "ok":
                by_slice.setdefault(h.slice_id, []).append((h.started_at, h.finished_at))
    for slice_id, spans in sorted(by_slice.items()):
        spans.sort()
        if any(b[0] < a[1] - 1e-3 for a, b in itertools.pairwise(spans)):
            double.append(f"{slice_id}: two subjobs at once")
    # Every subjob came from a grant: a job with more subjobs than recorded grants lost records.
    recorded = collections.Counter(r.winner_job for r in rounds if r.grant_id)
    unrecorded = {
        s.job_id: (len(s.history), recorded[s.job_id]) for s in states if len(s.history) > recorded[s.job_id]
    }
    return Audit(
        jobs=n,
        completed=len(done),
        lost_jobs=lost,
        wrong_results=wrong,
        applied_twice=twice,
        double_grants=double,
        grants=len(granted),
        subjobs_replanned=sum(1 for s in states for h in s.history if h.status in ("lost", "timeout", "oom")),
        unrecorded=unrecorded,
    )
