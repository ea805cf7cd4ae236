"""The agent's settings (``SJA_<FIELD>``, see ``docs/operations.md``)."""

from __future__ import annotations

from typing import Annotated

import msgspec

from sja.bus.settings import BaseSettings
from sja.core import defaults


class AgentSettings(BaseSettings, frozen=True, kw_only=True):
    mem_reserve_mib: float = 256.0
    start_overhead_s: float = defaults.START_OVERHEAD_S
    horizon_s: float = defaults.HORIZON_S
    heartbeat_s: float = 1.0
    max_jobs: int = 10_000
    lease_s: float = 5.0
    """The clearers' lease (``SJA_LEASE_S``): a subjob with no completion two leases past its time
    cap, whose slice moved on, is given up (``reap``)."""
    reap_every_s: float = 1.0
    takeover_after_s: float = 10.0
    """Liveness bound: the jobs of an agent not heard from (``AgentHeartbeat``) for this long are
    taken over by the live agents (a job by one agent: compare-and-set on its owner). Keep it many
    heartbeats long, so that an agent that is merely slow keeps its jobs. 0: no takeover."""
    takeover_scan_s: float = 60.0
    """Besides whenever an agent falls silent, the job store is scanned this often for jobs whose
    owner was never heard from (an agent gone before this one started)."""
    completions_inactive_s: float = 600.0
    """An agent's own ``SJA_COMPLETIONS`` consumer is deleted by the server once nobody has pulled
    from it this long (a recreated or scaled-down agent's, whose id never comes back)."""
    release_timeout_s: float = 1.0
    """How long a request to give a grant back (``sja.v1.lease.release``) waits for the inventory;
    unanswered, the lease simply runs out."""
    demand_coalesce_s: float = 0.005
    """Jobs that became able to take a window (claimed, or a subjob done) are announced to the
    advertisers (``DemandChanged.ready``) after this pause, so a burst is one message."""
    completion_batch: Annotated[int, msgspec.Meta(ge=1, le=1024)] = 16
    """Completions fetched (and folded in) at a time. Larger batches cost less per completion; while
    a batch is folded in, offers wait, so smaller ones answer offers sooner (CHANGELOG.md, items 24 and 29: at
    (1000, 512), 16 gives more grants a second and a shorter offer-to-grant p50 than 32 did before
    completions were fetched by ``Fetcher``; 32 now gives more grants a second still, for a p50
    about 10 ms longer)."""
    completion_flush_s: float = 0.25
    """A completion is folded into its job at once, and written to ``sja-jobs`` with the job's next
    write (its next subjob, usually) or after this long, whichever comes first; it is acknowledged
    only once written (a crash in between redelivers it). A job's last completion is written at
    once. 0: every completion is written on its own."""
