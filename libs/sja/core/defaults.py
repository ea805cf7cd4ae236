"""The one set of defaults: what the simulator evaluates is what ``sja up``, compose and the services run.

Every setting below is read by the services' settings (``SJA_*`` variables override them per
deployment), by ``sja up`` and ``make demo``, by ``docker-compose.yml`` (which states none of them),
and by the simulator's ``SimConfig``. A test checks that they agree.
"""

from __future__ import annotations

HORIZON_S = 600.0
"""Length of an offered window when nothing bounds it (``SJA_HORIZON_S``). It is the quantum of
contention, not the length of a subjob: a subjob whose program stops at a unit boundary goes on
past its window while no other job wants its slice (``core.continuation``), so a longer window
saves nothing while the slice is uncontested; under contention a job waiting for a held slice waits
at most a window (plus the holder's unit). Ten minutes, as the leases of GPU-cluster schedulers
that share GPUs by time: long beside a program's start-up (seconds to a minute), short beside the
hours a training job runs."""

START_OVERHEAD_S = 1.0
"""Seconds the planner takes off every window for what a subjob costs the stack itself
(``SJA_START_OVERHEAD_S``): its sandbox made, its state unpacked and packed, an interpreter for a
Python workload. A program's own start-up is the job's to declare (``time.warmup_s``)."""

EPS_MEM = 0.05
"""A job's default bound on the probability that a subjob runs out of memory (``eps_mem``)."""

EPS_TIME = 0.05
"""A job's default bound on the probability that a subjob runs out of its window (``eps_time``)."""

POLICY = "fair"
"""The clearing policy (``SJA_POLICY``, ``sja simulate --policy sja``)."""


RECONFIG_S = 5.0
"""Seconds a MIG GPU offers nothing while it is re-cut (its instances destroyed and created again):
what a re-cut costs in the layout decisions (``core.repartition``) and the simulator's default."""

__all__ = ["EPS_MEM", "EPS_TIME", "HORIZON_S", "POLICY", "RECONFIG_S", "START_OVERHEAD_S"]
