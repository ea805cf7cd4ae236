"""Discrete-event simulation of SJA in virtual time, driving the same decision core as the services.

One batch of offers per instant, as the live stack runs them: the slices freed at an instant (and the
idle ones some changed job may now want) become windows (``core.windows.find_windows``) and
``Offer``s; the jobs bid through the agent's own bidder (``core.bidder.Bidder``: memoized proposals,
the policy's shortlist of the bids that could win); ``core.policies.clear_batch`` clears the batch
with the clearer's ``Ledger``; each winner is charged and its slice leased as the clearer does
(``core.grants``: ``award``, ``lease``, ``grant``), the winner materializes its subjob
(``core.jobs.materialize``), the subjob runs for a modeled duration, and its ``Completion`` is
folded back with ``core.jobs.apply_completion`` (which calibrates the job's profiles). Rounds clear
instantly in virtual time, or after a configurable negotiation latency. There is no bus, no asyncio
and no wall clock.

What the simulator models, and the live stack measures:

- **work**: a trace job is ``total_units = ceil(work x GPUs / unit_s)`` units, its work being its
  recorded duration less one start-up and one checkpoint (``JobModel.start_s``: the recorded run
  paid them once, as a rigid scheduler's run does), one unit being an
  equal share (at most ``unit_s`` seconds) of the job's own runtime on what it asked for, so cutting
  it adds no work (``f`` times that in GPU-seconds for a job asking for a fraction ``f`` of a GPU).
  A piece progresses at rate ``min(speed of the slice, f)``: a slice larger than the job's fraction
  does not speed it up.
- **cost of atomization**: every subjob pays ``start_s`` before and ``checkpoint_s`` after its work
  (one subjob for the whole job costs what the recorded run took),
  on the slice, counted as overhead. The job declares both as its program's start-up
  (``TimeDecl.warmup_s``), as a user declares a program's, and a subjob's measured duration includes
  them; the planner takes only the stack's own ``start_overhead_s`` off the window, as it does live.
- **speed**: a slice runs at its compute share of the full GPU (or the measured MISO speed of its
  profile, ``load_speed_table``), times seeded log-normal noise.
- **time caps**: a subjob that reaches its time cap stops after its last whole unit and keeps the
  units it finished (what the SDK's ``should_stop``/``report`` and the command contract's SIGTERM
  grace give a program that checkpoints per unit); the rest of its range is planned again. One that
  finished no unit is a timeout.
- **open subjobs** (``core.continuation``): a job that runs one subjob at a time gets open subjobs
  from ``core.jobs.materialize`` (``Subjob.max_units``). Such a subjob pays its start once, then does
  units at the slice's speed with no time cap; its completion is scheduled at the end of its whole
  open range. From the end of its window (``SliceState.contestable_at``) its slice is offered with
  the free ones whenever the slices are offered while jobs wait; nothing happens at that instant
  while nobody waits. A grant of it (``leases.grant``, ``leases.preempts``) makes the holder yield:
  its progress at that instant gives the unit it is doing, it stops after that unit and
  checkpoints, its pending completion is replaced by one with the units it did (``yielded``, folded
  in by ``apply_completion``, which takes units past its planned range as done), and the winner's
  subjob starts on the slice then. Free slices are offered before held ones. A holder is never
  asked to yield before its window is over.
- **declared vs real memory**: the job declares ``peak(k) = base + per_unit * k`` from the trace's
  declared memory; its real peak follows the trace's true memory the same way, times seeded noise. A
  real peak above the slice's memory cap is an OOM: the work is lost, the completion says ``oom`` and
  the core re-plans the range. An open subjob whose memory grows with its units runs out of memory
  on the first unit past what the slice holds, unless it yields before (``open_units`` keeps its
  range within the ``1 - eps_mem`` quantile).

A batch's outcome comes at once in virtual time, so the bidder's likely winners never sit out a later
batch; everything else about bidding is the agent's. A slice offered and not taken is offered again
only once some job changed since (a completion, an arrival, a grant); a held slice whose holder's
window has just ended counts as changed if jobs wait.

**Repartitioning.** A GPU marked repartitionable in the cluster spec may be re-cut into another MIG
layout. Before and after the dispatch of an instant (when the idle GPUs or the demand changed, or
once per window length), the idle repartitionable GPUs and the waiting jobs' demand
(``repartition_demand``: one slice per subjob a job could still start, of the profiles its planner
would propose for) go to ``core.repartition.plan_repartitions``, which returns the GPUs to re-cut
and their new layouts; what they leave goes to ``core.repartition.plan_drains`` with the busy ones
(whose open holders count as demand too: a job that can use a whole GPU, stuck on a 3g, gets its
GPU made whole even while nobody waits).
A drained GPU offers nothing more; each open holder on it yields at its window's end (as to a
taker, but nobody takes the slice), a closed one ends as planned, and when the last has ended the
GPU is re-cut. A re-cut GPU offers nothing for its reconfiguration time (``SimConfig.reconfig_s`` or
the group's ``=<seconds>``), then its new slices are offered as freshly freed ones.
"""

from __future__ import annotations

import bisect
import heapq
import math
import random
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from sja.core import continuation, grants, leases
from sja.core.bidder import Bidder
from sja.core.bidding import may_bid_on, propose
from sja.core.jobs import apply_completion, can_take_more, hopeless, materialize, slots_left
from sja.core.mig import GpuModel, gpu_model
from sja.core.policies import POLICIES, REGISTRY, Bid, Ledger, PolicyConfig, clear_batch
from sja.core.profile_cache import ProfileCache
from sja.core.repartition import (
    BusyGpu,
    HeldSlice,
    SliceDemand,
    demand_of,
    held_demand,
    layout_value,
    plan_drains,
    plan_repartitions,
    served_value,
)
from sja.core.shadow import RigidJob, RigidShadow, RigidSlice, due_by_evidence, finish_by_evidence
from sja.core.windows import WindowRequest, find_windows, probe_offer, unheld
from sja.protocol.messages import (
    Completion,
    Grant,
    JobState,
    Offer,
    Proposal,
    SliceState,
    Subjob,
    SubjobStatus,
    Window,
)
from sja.sim.metrics import JobRecord, ScheduleRecorder
from sja.sim.model import (
    PROGRESS_EVERY,
    JobModel,
    Progress,
    SimCluster,
    SimConfig,
    SimResult,
    SimSlice,
    TraceJob,
    compute_capacity,
    job_model,
    mem_capacity,
    repartitionable,
    slice_speed,
)
from sja.sim.recut import Cut
from sja.sim.translate import (
    gpu_indices,
    job_spec,
    lognormal,
    repartition_kinds,
    sim_job,
    slice_state,
    slice_states,
    unschedulable_reason,
)

REPART_DEMAND_ITEMS = 64
"""Slices of waiting demand considered when choosing layouts for idle repartitionable GPUs."""

BIDS_REMEMBERED = 100_000
"""Bids the engine keeps for the bidder's proposals (``SjaEngine._bids``); past it they are made again."""

# --- the engine -------------------------------------------------------------------------------------

WindowKind = tuple[str, int, float]
"""(profile, memory, compute share): windows of one kind get the same proposals from a job."""


@dataclass
class _Job:
    idx: int
    model: JobModel
    state: JobState


@dataclass
class _Slice:
    idx: int
    sim: SimSlice
    state: SliceState
    kind: WindowKind
    speed: float
    idle: bool = False
    """Offered and not taken: re-offered only when a job that might want it changes."""
    retired: bool = False
    """Destroyed by a re-cut of its GPU: never offered again."""
    run: _Running | None = None
    """The subjob holding the slice (its lease's), if any."""
    free_at: float = 0.0
    """When the last subjob to run on the slice stops: a grant taking the slice from a holder
    past its window starts its subjob once the holder has yielded."""


@dataclass
class _Recut:
    """A re-cut in progress: ``gpu_id`` offers nothing until ``ends``, then ``layout``."""

    gpu_id: str
    layout: tuple[str, ...]
    started: float
    ends: float


@dataclass
class _DrainYield:
    """The holder of slice ``idx`` (at ``fence``) on a draining GPU reaches its window's end: it yields."""

    idx: int
    fence: int


@dataclass
class _Due:
    """A job becomes due at ``at`` (``core.shadow``): it comes first in the order of service."""

    job_id: str
    at: float


_DUE_RANK = -continuation.DUE_KEY / 2
"""A ``held_rank`` entry's ``-key`` above this is a due holder's (its key does not grow)."""


@dataclass
class _Rest:
    """A job's back-off after timeouts (``core.bidding.resting``) ends at ``ends``: it bids again."""

    job_id: str
    ends: float


@dataclass
class _Running:
    """A subjob on its slice, as modeled when it started: its completion (at its end, unless it is
    asked to yield) and what its progress at another instant is computed from."""

    job: _Job
    slice: _Slice
    grant: Grant
    completion: Completion
    held_from: float
    overhead_s: float
    useful_gpu_s: float
    real_peak_mib: float
    unit_s: float = 0.0
    """Seconds of one unit on this slice (noise drawn once for the subjob)."""
    reach: int = 0
    """Units it does if nothing stops it: an open subjob's ``max_units``, else its ``units``."""
    mem_noise: float = 1.0
    """The subjob's factor on the job's true peak memory."""
    oom_at: int = 0
    """An open subjob runs out of memory on reaching this many units (0: it does not)."""
    stale: bool = False
    """Replaced by its yield (another job won its slice): its pending event is void."""


class SjaEngine:
    """Runs SJA over a trace on a cluster. ``run()`` returns a ``SimResult``."""

    def __init__(self, cluster: SimCluster, jobs: Sequence[TraceJob], cfg: SimConfig) -> None:
        if cfg.policy not in POLICIES:
            raise ValueError(f"unknown SJA policy {cfg.policy!r} (known: {', '.join(sorted(POLICIES))})")
        if not cluster.slices:
            raise ValueError("the cluster has no slices")
        self.cfg = cfg
        self.limits = cfg.limits()
        self.policy_config = PolicyConfig(horizon_s=cfg.horizon_s)
        self.ledger = Ledger()
        self.rng = random.Random(cfg.seed)
        states = slice_states(cluster)
        self.slices = [
            _Slice(
                idx=i,
                sim=s,
                state=st,
                kind=(st.profile, st.mem_mib, st.compute_share),
                speed=slice_speed(s, cfg),
            )
            for i, (s, st) in enumerate(zip(cluster.slices, states, strict=True))
        ]
        self.gpu_index = gpu_indices(cluster)
        self.shadow = _rigid_reference(cluster, cfg)
        self.due_jobs: set[str] = set()
        """Jobs marked due (``_set_due``)."""
        self._span_seen: tuple[float, float] = (-math.inf, -math.inf)
        """The reference's busy period and its latest finish when the due jobs were last looked at."""
        """The rigid reference, run beside the replay: when each job becomes due (``core.shadow``)."""
        self.gpu_slices: dict[str, list[int]] = {}
        for sl in self.slices:
            self.gpu_slices.setdefault(sl.sim.gpu_id, []).append(sl.idx)
        self.gpu_busy = dict.fromkeys(self.gpu_slices, 0)
        """Slices of each GPU running a subjob: a repartitionable GPU is re-cut only at 0."""
        self.cuts: dict[str, Cut] = {}
        for g in cluster.gpus:
            if repartitionable(g) and g.gpu_id in self.gpu_slices:
                # Its layout is its slices' profiles, in the order the engine lists them.
                layout = tuple(self.slices[i].sim.profile for i in self.gpu_slices[g.gpu_id])
                self.cuts[g.gpu_id] = Cut.of(g, layout, cfg)
        self.recuts: list[_Recut] = []
        """Every re-cut, in order (for checks and plots)."""
        self.recut_at: dict[str, float] = {}
        """When each GPU's last re-cut ended."""
        self.draining: dict[str, tuple[str, ...]] = {}
        """GPUs being drained (``core.repartition.plan_drains``) and the layout each is re-cut to once
        nothing runs on it: none of its slices is offered meanwhile."""
        self.demand_epoch = 0
        """Bumped on every arrival (new demand a re-cut may serve)."""
        self.repart_checked: tuple[int, tuple[str, ...], int] | None = None
        self.kind_offers: tuple[float, dict[WindowKind, Offer]] = (-math.inf, {})
        self.cut_free: set[str] = set(self.cuts)
        """Repartitionable GPUs with nothing running and no re-cut in progress."""
        self.kind_states = repartition_kinds(cluster)
        """A template slice state of every kind a re-cut could create."""
        self.model_kinds: dict[str, list[WindowKind]] = {}
        for cut in self.cuts.values():
            self.model_kinds[cut.gpu.model] = sorted(
                {k for k, st in self.kind_states.items() if st.gpu_model == cut.gpu.model}
            )
        self.kinds: list[WindowKind] = sorted({s.kind for s in self.slices} | set(self.kind_states))
        largest = max(k[1] for k in self.kinds)
        self.largest_by_pool = {"sim": largest}
        """The largest slice any GPU offers (a repartitionable GPU's whole profile included)."""
        self.recorder = ScheduleRecorder(
            mem_capacity_mib=mem_capacity(cluster),
            compute_capacity=compute_capacity(cluster),
            bin_s=cfg.bin_s,
        )
        self.models = sorted(
            (job_model(tj, cfg) for tj in jobs), key=lambda m: (m.trace.submit_s, m.trace.job_id)
        )
        for m in self.models:
            tj = m.trace
            parallel = max(1, tj.num_gpus)
            self.recorder.add_job(
                JobRecord(
                    job_id=tj.job_id,
                    tenant=tj.tenant,
                    submit_s=tj.submit_s,
                    duration_s=tj.duration_s,
                    work_gpu_s=m.work_gpu_s,
                    critical_path_s=m.work_gpu_s / (m.fraction * parallel),
                    **unschedulable_reason(m, largest, cfg),
                )
            )
        self.jobs: dict[str, _Job] = {}
        self.profiles = ProfileCache()
        self.bidder = Bidder(self.limits, self.policy_config, self.profiles)
        """The jobs' bids, as an agent makes them (one agent for every job)."""
        self.changed_since: set[WindowKind] = set()
        """Kinds of window an idle slice of which some job may take now (a job changed since the
        last batch offered it)."""
        self.by_idx: dict[int, _Job] = {}
        self.events: list[tuple[float, int, _Running | _Recut | _Rest | _DrainYield | _Due]] = []
        self.contests: list[tuple[float, int, int, int]] = []
        """``(contestable_at, seq, slice idx, fence)`` of every open subjob's slice: from then on
        its slice is offered while its holder runs (``core.continuation``). Looked at only while
        jobs wait (a slice nobody waits for needs no event); an entry whose slice moved on since
        (its fence) is dropped."""
        self.contested: dict[WindowKind, set[int]] = {}
        """Held slices past their holder's window (``leases.preempts``), by kind: offered, as idle
        free slices are, when a job that may want them changes."""
        self.held_rank: dict[WindowKind, list[tuple[float, int]]] = {}
        """The contested slices per kind, most-served holder first: ``(-key, idx)`` sorted, where
        ``key`` (the holder's service at its window's end, less that end times the kind's compute
        share) orders them by their holder's service at any instant (``continuation.held_attained``)."""
        self.seq = 0
        self.round_no = 0
        self.now = 0.0
        self.fresh: set[int] = {s.idx for s in self.slices}
        """Free slices not yet offered since they were freed."""
        self.counters: dict[str, float] = {
            "events": 0,
            "rounds": 0,
            "rounds_without_winner": 0,
            "batches": 0,
            "declined_grants": 0,
            "repartitions": 0,
            "open_subjobs": 0,
            "yields": 0,
            "drains": 0,
        }
        self.idle_by_kind: dict[WindowKind, set[int]] = {k: set() for k in self.kinds}
        self.contested = {k: set() for k in self.kinds}
        self.held_rank = {k: [] for k in self.kinds}
        self.held_entry: dict[int, tuple[float, int]] = {}
        self.idle_mem = 0.0
        """Memory of free slices that were offered and drew no taker."""
        self.waiting = 0
        """Jobs with work not yet handed out and room for another subjob (for fragmentation)."""
        self.waiting_jobs: set[int] = set()
        """Their indices (the demand a re-cut serves)."""
        self.least_served: list[tuple[float, int]] = []
        """``(service key, idx)`` of the waiting jobs (``continuation.service_key``), a heap: the first
        in the order of service on top. An entry whose job no longer waits or has been served since
        (``served``) is dropped when met."""
        self.bid_of: dict[int, tuple[Proposal, Bid]] = {}
        """``id(proposal) -> (proposal, its bid)`` (``_bids``; the proposal held keeps its id its own)."""
        self.served: dict[int, float] = {}
        """The service key of each waiting job as entered in ``least_served``."""

    # --- bidder queues ---------------------------------------------------------------------------

    def _rank(self, job: _Job) -> tuple[float, ...]:
        """The policy's natural order of waiting jobs (the demand a re-cut serves first)."""
        return REGISTRY[self.cfg.policy].queue_key(job.state, Ledger(job_attained=self.ledger.job_attained))

    def _set_state(self, job: _Job, state: JobState) -> None:
        """The job moved to ``state``: the bidder plans and ranks it again, and idle slices of every
        kind may be offered again."""
        job.state = state
        if state.status in ("done", "failed", "cancelled"):
            self.bidder.drop(state.job_id)
            return
        self.bidder.own(state)
        if can_take_more(state):
            self.changed_since.update(self.kinds)
        if state.bids_again_at > self.now:
            # Backing off after timeouts: it bids again when the back-off ends (the agent's timer).
            self.seq += 1
            heapq.heappush(
                self.events, (state.bids_again_at, self.seq, _Rest(state.job_id, state.bids_again_at))
            )

    def _end_rest(self) -> None:
        """A back-off ended: the jobs done waiting bid again, for the idle slices of every kind."""
        self.bidder.wake(self.now)
        self.changed_since.update(self.kinds)

    def _proposal(self, job: _Job, offer: Offer) -> Proposal | None:
        return self.bidder.proposal(job.state.job_id, offer, self.now, self.cfg.policy)

        # --- rounds ------------------------------------------------------------------------------------

    def _offer(self, s: _Slice) -> Offer | None:
        now = self.now
        self.round_no += 1
        self.counters["rounds"] += 1
        req = WindowRequest(
            now=now, horizon_s=self.cfg.horizon_s, open_ended=True, largest_mib=self.largest_by_pool
        )
        windows = find_windows([s.state], req)
        if not windows:
            return None
        return Offer(
            offer_id=f"o{self.round_no}",
            round=self.round_no,
            window=windows[0],
            slice_fence=s.state.fence,
            slice_revision=s.state.fence,
            issued_at=now,
            reply_by=now + self.cfg.negotiation_latency_s,
            reply_to="sim",
        )

    def _batch(self, batch: list[_Slice], asked: Mapping[WindowKind, list[Bid]] | None = None) -> int:
        """One batch of offers: bids from the bidder per kind of window (the shortlist for as many
        windows of that kind as the batch has, or ``asked``: the bids already given for at least as
        many), cleared by ``core.policies.clear_batch``; returns how many subjobs started."""
        self.counters["batches"] += 1
        offers: list[tuple[Offer, _Slice]] = []
        for s in batch:
            o = self._offer(s)
            if o is not None:
                offers.append((o, s))
        if not offers:
            return 0
        like: dict[WindowKind, int] = {}
        for _, s in offers:
            like[s.kind] = like.get(s.kind, 0) + 1
        bids: dict[WindowKind, list[Bid]] = dict(asked or {})
        for o, s in offers:
            if s.kind not in bids:
                props = self.bidder.proposals_for(unheld(o), self.now, like[s.kind], self.cfg.policy)
                bids[s.kind] = self._bids(props)
        slice_of = {o.offer_id: s for o, s in offers}
        grants.learn_service(self.ledger, [o for o, _ in offers], (b for bs in bids.values() for b in bs))
        held_bids: dict[str, list[Bid]] = {}
        for o, s in offers:
            if o.window.held_by:
                # A held slice: only the bids of jobs that bid for it (``bidding.may_bid_on``).
                held_bids[o.offer_id] = [b for b in bids[s.kind] if self._bids_on(b, o)]

        decisions = clear_batch(
            self.cfg.policy,
            [o for o, _ in offers],
            lambda o: held_bids[o.offer_id] if o.offer_id in held_bids else bids[slice_of[o.offer_id].kind],
            self.ledger,
            config=self.policy_config,
        )
        started = 0
        for offer, decision in decisions:
            s = slice_of[offer.offer_id]
            won = grants.award(self.ledger, offer, decision, _grant_id, self.now, self.cfg.lease_s)
            if won is None:
                # Offered again once a job changes (a held slice stays among the contested ones).
                if s.state.status == "free":
                    self._set_idle(s, True)
                self.counters["rounds_without_winner"] += 1
                continue
            started += self._grant(s, won)
        return started

    def _bids(self, props: list[Proposal]) -> list[Bid]:
        """The proposals as bids, one ``Bid`` per proposal: the bidder's proposals are memoized per
        job state, and so are their bids (``bid_of``)."""
        memo = self.bid_of
        if len(memo) >= BIDS_REMEMBERED:
            memo.clear()
        out: list[Bid] = []
        for p in props:
            got = memo.get(id(p))
            if got is None or got[0] is not p:
                got = memo[id(p)] = (p, Bid(agent_id="sim", proposal=p))
            out.append(got[1])
        return out

    def _grant(self, s: _Slice, won: grants.Award) -> int:
        """Lease the slice to the winner (charged already) and materialize its subjob (1 if one
        started). The slice is the simulator's own: the lease is written without a conflict. A
        slice held by an open subjob past its window (``leases.preempts``) is taken from it: the
        holder yields at its next unit boundary and the winner's subjob starts then."""
        now = self.now
        job = self.jobs[won.job_id]
        grant_id = won.grant_id
        holder = s.run if leases.preempts(s.state, now) else None
        leased = grants.lease(s.state, won)
        grant = grants.grant(won, leased)
        self._uncontest(s)
        if holder is not None:
            self._yield(s, holder)
        was_waiting = self._is_waiting(job)
        made = materialize(job.state, grant, now, self.limits, "sim", profiles=self.profiles)
        self._set_state(job, made.state)
        if made.subjob is None:
            s.state = leases.release(leased, grant_id=grant_id, fence=leased.fence, now=now)
            self._set_idle(s, True)
            self.counters["declined_grants"] += 1
            self._update_waiting(was_waiting, job)
            return 0
        sj = made.subjob
        held_from = max(now, s.free_at)
        start = max(now + self.cfg.negotiation_latency_s, s.free_at)
        run = self._model_subjob(job, s, grant, sj, start, held_from)
        self.recorder.add_plan_check(
            mem_violated=run.real_peak_mib > sj.planned_mem_q_mib,
            time_violated=run.completion.status == "ok"
            and self._program_s(job.model, run.unit_s, sj.units) > sj.planned_duration_q_s,
        )
        self._slice_busy(s, +1)
        contestable = continuation.contestable_at(start, sj.time_cap_s, sj.max_units, sj.units)
        s.state = leases.start(
            leased,
            grant_id=grant_id,
            fence=leased.fence,
            now=start,
            time_cap_s=sj.time_cap_s,
            expected_s=sj.planned_duration_q_s,
            grace_s=self.cfg.lease_s,
            contestable_at=contestable,
            holder_attained_gpu_s=sj.attained_gpu_s,
            holder_submitted_at=sj.submitted_at,
            holder_due_at=sj.due_at,
            holder_tenant=sj.tenant,
        )
        s.run = run
        s.free_at = run.completion.finished_at
        self._set_idle(s, False)
        self.recorder.start_job(job.model.trace.job_id, start)
        self.seq += 1
        heapq.heappush(self.events, (run.completion.finished_at, self.seq, run))
        if contestable > 0:
            self.counters["open_subjobs"] += 1
            heapq.heappush(self.contests, (contestable, self.seq, s.idx, s.state.fence))
        self._update_waiting(was_waiting, job)
        return 1

    def _peak(self, m: JobModel, units: int, noise: float) -> float:
        """A subjob's real peak memory after ``units`` units."""
        peak = m.true_peak(units) * noise
        if m.true_mem_mib <= m.decl_mem_mib:
            # An honest declaration is a bound (a memory limit the job keeps): noise stays under it.
            peak = min(peak, m.decl_peak(units))
        return peak

    def _model_subjob(
        self, job: _Job, s: _Slice, grant: Grant, sj: Subjob, start: float, held_from: float
    ) -> _Running:
        """Draw what really happens to a subjob: its peak memory, duration and outcome. An open
        subjob (``Subjob.max_units``) runs through its whole open range unless it is asked to
        yield (``_yield``); it has no time cap (its program stops when asked)."""
        cfg = self.cfg
        m = job.model
        rate = min(s.speed, m.fraction)
        units, cap_mib = sj.units, sj.mem_cap_mib
        reach = sj.max_units if sj.max_units > units else units
        # The noise is a window-long piece's: an open range of n windows' worth of units varies as
        # the mean of n such pieces (sd / sqrt(n)), so one draw does not set a days-long run's speed.
        sd = cfg.time_noise_sd / math.sqrt(max(reach / max(units, 1), 1.0))
        unit_s = m.unit_run_s * m.fraction / rate * lognormal(self.rng, sd)
        noise = lognormal(self.rng, cfg.mem_noise_sd)
        peak = self._peak(m, units, noise)
        # The program's time: the time cap less what the planner kept for the stack itself.
        cap = max(sj.time_cap_s - self.limits.start_overhead_s, 0.0)
        fixed = m.start_s + m.checkpoint_s
        useful = 0.0
        oom_at = 0
        status: SubjobStatus
        if peak <= cap_mib and reach > units and self._peak(m, reach, noise) > cap_mib:
            # Memory that grows with the units done: the open subjob runs out of memory on the
            # first unit past what the slice holds (unless it yields before).
            oom_at = next(n for n in range(units + 1, reach + 1) if self._peak(m, n, noise) > cap_mib)
        if peak > cap_mib or oom_at:
            status = "oom"
            before = (oom_at - 1) * unit_s if oom_at else 0.0
            ran = before + min(unit_s if oom_at else units * unit_s, cfg.oom_detect_s)
            held = m.start_s + ran
            overhead = m.start_s
            units_done = 0
            peak = max(peak, self._peak(m, oom_at, noise)) if oom_at else peak
        elif reach > units or fixed + units * unit_s <= cap:
            status = "ok"
            units_done = reach
            held = self._program_s(m, unit_s, reach)
            overhead = fixed
            useful = reach * m.unit_run_s * m.fraction
            peak = self._peak(m, reach, noise)
        elif int((cap - fixed) / unit_s) >= 1:
            # Stopped at its time cap after its last whole unit, which it keeps (the SDK's
            # ``should_stop``/``report``, the command contract's SIGTERM grace): the rest of its
            # range is planned again.
            status = "ok"
            units_done = min(int((cap - fixed) / unit_s), units - 1)
            held = cap
            overhead = fixed
            useful = units_done * m.unit_run_s * m.fraction
        else:
            status = "timeout"
            held = cap
            overhead = m.start_s
            units_done = 0
        completion = Completion(
            subjob_id=sj.subjob_id,
            job_id=job.state.job_id,
            grant_id=grant.grant_id,
            fence=grant.fence,
            slice_id=s.state.slice_id,
            status=status,
            unit_start=sj.unit_start,
            units=units,
            units_done=units_done,
            peak_mem_mib=round(peak if status != "oom" else cap_mib, 3),
            duration_s=round(held, 6),
            mem_cap_mib=cap_mib,
            time_cap_s=round(cap, 6),
            started_at=start,
            finished_at=start + held,
        )
        return _Running(
            job=job,
            slice=s,
            grant=grant,
            completion=completion,
            held_from=held_from,
            overhead_s=overhead,
            useful_gpu_s=useful,
            real_peak_mib=min(peak, float(cap_mib)),
            unit_s=unit_s,
            reach=reach,
            mem_noise=noise,
            oom_at=oom_at,
        )

    @staticmethod
    def _program_s(m: JobModel, unit_s: float, units: int) -> float:
        """Seconds a subjob's program runs to do ``units`` units of ``unit_s`` (start-up and
        checkpoint included: what the executor measures as its duration)."""
        return m.start_s + units * unit_s + m.checkpoint_s

    def _yield(self, s: _Slice, run: _Running, *, leaves: bool = False) -> None:
        """Another job won the slice of ``run``, an open subjob past its window: it stops after the
        unit it is doing, checkpoints and completes with the units it did (``yielded``); its
        pending completion is replaced by that one. A holder that runs out of memory before that
        boundary ends so, as drawn. ``leaves``: nobody won the slice (its GPU is drained); the
        holder's lease ends with its yielded completion."""
        c = run.completion
        begun = c.started_at + run.job.model.start_s
        done = max(1, math.ceil((self.now - begun) / run.unit_s - 1e-9))
        done = min(done, run.reach)
        self.counters["yields"] += 1
        if run.oom_at and done >= run.oom_at:
            return  # out of memory during the unit it was finishing: the drawn OOM stands
        held = self._program_s(run.job.model, run.unit_s, done)
        peak = self._peak(run.job.model, done, run.mem_noise)
        m = run.job.model
        yielded = _Running(
            job=run.job,
            slice=s,
            grant=run.grant,
            completion=msgspec.structs.replace(
                c,
                status="ok",
                units_done=done,
                peak_mem_mib=round(peak, 3),
                duration_s=round(held, 6),
                finished_at=c.started_at + held,
                yielded=True,
            ),
            held_from=run.held_from,
            overhead_s=m.start_s + m.checkpoint_s,
            useful_gpu_s=done * m.unit_run_s * m.fraction,
            real_peak_mib=min(peak, float(c.mem_cap_mib)),
            unit_s=run.unit_s,
            reach=done,
            mem_noise=run.mem_noise,
        )
        run.stale = True
        s.run = yielded if leaves else None
        s.free_at = yielded.completion.finished_at
        self.seq += 1
        heapq.heappush(self.events, (yielded.completion.finished_at, self.seq, yielded))

    def _complete(self, run: _Running) -> None:
        job, s, c = run.job, run.slice, run.completion
        self.recorder.add_piece(
            run.held_from,
            c.finished_at,
            share=s.state.compute_share,
            mem_mib=run.real_peak_mib,
            useful_gpu_s=run.useful_gpu_s,
            overhead_s=run.overhead_s,
            status=c.status,
        )
        self._slice_busy(s, -1)
        if s.run is run:
            # The slice's holder ended: the slice is free. (A holder that yielded has left the slice
            # to the job that won it, whose subjob starts as this one ends.)
            g = run.grant
            s.state = leases.release(s.state, grant_id=g.grant_id, fence=g.fence, now=self.now)
            s.run = None
            self._uncontest(s)
            self._set_idle(s, False)
            if s.sim.gpu_id not in self.draining:
                self.fresh.add(s.idx)
        gpu_id = s.sim.gpu_id
        if gpu_id in self.draining and self.gpu_busy[gpu_id] == 0:
            self._start_recut(gpu_id, self.draining.pop(gpu_id))
        was_waiting = self._is_waiting(job)
        state, applied = apply_completion(job.state, c, self.now, profiles=self.profiles)
        assert applied, f"completion {c.subjob_id} not applied"
        self._set_state(job, state)
        if job.state.status in ("done", "failed", "cancelled"):
            self.due_jobs.discard(job.state.job_id)
            if job.state.status == "done":
                self.recorder.finish_job(job.model.trace.job_id, self.now)
            else:
                rec = self.recorder.jobs[job.model.trace.job_id]
                rec.failed = True
                rec.reason = job.state.error or job.state.status
        self._update_waiting(was_waiting, job)
        if job.state.due_at > 0 and job.state.status not in ("done", "failed", "cancelled"):
            self._recheck_due(job)

    # --- waiting jobs and stranded memory ------------------------------------------------------

    @staticmethod
    def _is_waiting(job: _Job) -> bool:
        return can_take_more(job.state)

    def _update_waiting(self, was: bool, job: _Job) -> None:
        now = self._is_waiting(job)
        self.waiting += int(now) - int(was)
        if now:
            self.waiting_jobs.add(job.idx)
            attained = self._service_key(job.state)
            if self.served.get(job.idx) != attained:
                self.served[job.idx] = attained
                heapq.heappush(self.least_served, (attained, job.idx))
        else:
            self.waiting_jobs.discard(job.idx)
            self.served.pop(job.idx, None)

    def _least_served(self) -> float:
        """The service key of the waiting job first in the order of service (``inf``: none waits)."""
        heap = self.least_served
        while heap:
            attained, idx = heap[0]
            if self.served.get(idx) == attained:
                return attained
            heapq.heappop(heap)
        return math.inf

    def _none_takes(self, kind: WindowKind) -> bool:
        """Whether no waiting job may take any held slice of ``kind`` (``continuation.takes_held``):
        not even the least served one, the most served holder's. Every bidder is a waiting job, so
        the bidder need not be asked."""
        rank = self.held_rank[kind]
        if not rank:
            return True
        most = self._held_now(rank[0][0], kind[2])  # as ``_takeable`` reads it
        return not continuation.takes_held(self._least_served(), most)

    def _set_idle(self, s: _Slice, idle: bool) -> None:
        if idle == s.idle:
            return
        s.idle = idle
        if idle:
            self.idle_by_kind[s.kind].add(s.idx)
            self.idle_mem += s.state.mem_mib
        else:
            self.idle_by_kind[s.kind].discard(s.idx)
            self.idle_mem -= s.state.mem_mib

    def _slice_busy(self, s: _Slice, delta: int) -> None:
        g = s.sim.gpu_id
        self.gpu_busy[g] += delta
        if g in self.cuts:
            if self.gpu_busy[g] == 0 and not self.cuts[g].reconfiguring and g not in self.draining:
                self.cut_free.add(g)
            else:
                self.cut_free.discard(g)

    # --- repartitioning ------------------------------------------------------------------------

    def _kind_offer(self, kind: WindowKind) -> Offer:
        """An offer of a window of ``kind`` starting now (what a slice of that kind would get)."""
        at, offers = self.kind_offers
        if at != self.now:
            offers = {}
            self.kind_offers = (self.now, offers)
        if kind in offers:
            return offers[kind]
        st = self.kind_states[kind]
        req = WindowRequest(
            now=self.now, horizon_s=self.cfg.horizon_s, open_ended=True, largest_mib=self.largest_by_pool
        )
        window = find_windows([st], req)[0]
        offers[kind] = probe_offer(
            window, self.now, offer_id="repartition", reply_to="sim", round_no=self.round_no
        )
        return offers[kind]

    def repartition_demand(
        self,
        model: str,
        limit: int = REPART_DEMAND_ITEMS,
        enough: Callable[[list[SliceDemand]], bool] | None = None,
    ) -> list[SliceDemand]:
        """What waiting jobs want from a GPU of ``model``, in the policy's natural order
        (``core.repartition.demand_of``): one slice per subjob each could still start, of the
        profiles its planner would propose for (``core.bidding.propose``, memoized like the rounds'
        proposals), using up to its GPU fraction. Stops early once ``enough(items so far)`` holds."""
        order = heapq.nsmallest(limit, self.waiting_jobs, key=lambda i: (self._rank(self.by_idx[i]), i))
        waiting = [
            (
                self.by_idx[i].state.job_id,
                self.by_idx[i].model.fraction,
                slots_left(self.by_idx[i].state),
            )
            for i in order
        ]
        return demand_of(
            waiting, lambda job_id: self._profiles(self.jobs[job_id], model), limit=limit, enough=enough
        )

    def _profiles(self, job: _Job, model: str) -> list[str]:
        """The profiles of ``model`` the job's planner would propose for."""
        return [k[0] for k in self.model_kinds[model] if self._proposal(job, self._kind_offer(k)) is not None]

    def _repartition(self) -> None:
        """Re-cut the repartitionable GPUs with nothing running that the waiting demand is better
        served by another layout; drain busy ones for demand nothing in place can hold, or where a
        drain pays (``core.repartition.plan_drains``)."""
        idle = tuple(sorted(self.cut_free))
        # Looked at again when the idle GPUs change or a job arrives, and once per window length in
        # any case (calibration may have changed what a waiting job can use).
        key = (self.demand_epoch, idle, int(self.now // self.cfg.horizon_s))
        if key == self.repart_checked:
            return
        self.repart_checked = key
        for model in sorted({cut.gpu.model for cut in self.cuts.values()}):
            gpus = [
                (g, gpu_model(model), self.cuts[g].layout) for g in idle if self.cuts[g].gpu.model == model
            ]
            enough = None
            if len(gpus) == 1:
                # One idle GPU (the usual case): once its current layout serves the first jobs with
                # all of the GPU's compute, no layout can do better; stop asking jobs.
                _, gpu, current = gpus[0]

                def enough(items: list[SliceDemand], gpu: GpuModel = gpu, current: Any = current) -> bool:
                    return layout_value(gpu, current, items)[0] >= 1.0 - 1e-9

            # A GPU holds at most 7 instances: the first 7 per idle GPU (and 7 more) are enough.
            demand = self.repartition_demand(model, min(REPART_DEMAND_ITEMS, 7 * len(gpus) + 7), enough)
            chosen = {g: layout for g, _, layout in gpus}
            if gpus and demand and not (enough is not None and enough(demand)):
                for r in plan_repartitions(gpus, demand):
                    chosen[r.gpu_id] = r.new
                    self._start_recut(r.gpu_id, r.new)
            self._drain(model, chosen)

    def _drain(self, model: str, chosen: Mapping[str, tuple[str, ...]]) -> None:
        """Drain the busy GPUs of ``model`` that ``plan_drains`` picks for what still waits."""
        busy: list[BusyGpu] = []
        in_place: list[tuple[str, ...]] = list(chosen.values())
        for g, cut in self.cuts.items():
            if cut.gpu.model != model or g in chosen:
                continue
            if cut.reconfiguring:
                in_place.append(next(r.layout for r in reversed(self.recuts) if r.gpu_id == g))
            elif g in self.draining:
                in_place.append(self.draining[g])
            else:
                since = self.now - self.recut_at.get(g, -math.inf)
                busy.append(BusyGpu(g, gpu_model(model), cut.layout, self._held_slices(g), since))
        if not busy:
            return
        demand = self.repartition_demand(model)
        reconfig = max(self.cuts[b.gpu_id].reconfig_s for b in busy)
        for r in plan_drains(
            busy, demand, in_place=in_place, reconfig_s=reconfig, payoff_s=self.cfg.horizon_s
        ):
            self._start_drain(r.gpu_id, r.new)

    def _held_slices(self, g: str) -> tuple[HeldSlice, ...]:
        """The slices of busy GPU ``g`` as a drain sees them (``core.repartition.HeldSlice``)."""
        out = []
        for idx in self.gpu_slices[g]:
            s = self.slices[idx]
            run = s.run
            share = s.state.compute_share
            if run is None:
                out.append(HeldSlice(s.sim.profile, share, 0.0, max(s.free_at - self.now, 0.0)))
                continue
            rate = served_value(s.state.compute_share, run.job.model.fraction)
            ends = run.completion.finished_at
            at = s.state.contestable_at
            restart = run.job.model.start_s
            if at > 0 and ends > max(at, self.now) + restart:
                holder = held_demand(run.job.state.job_id, s.state.mem_mib, run.job.model.fraction)
                out.append(HeldSlice(s.sim.profile, share, rate, max(at - self.now, 0.0), restart, holder))
            else:
                out.append(HeldSlice(s.sim.profile, share, rate, max(ends - self.now, 0.0)))
        return tuple(out)

    def _start_drain(self, g: str, layout: tuple[str, ...]) -> None:
        """Offer nothing more on ``g``; its open holders yield at their windows' ends; the last slice
        to free starts the re-cut to ``layout``."""
        self.draining[g] = layout
        self.counters["drains"] += 1
        self.cut_free.discard(g)
        for idx in self.gpu_slices[g]:
            s = self.slices[idx]
            self._uncontest(s)
            self._set_idle(s, False)
            self.fresh.discard(idx)
            run = s.run
            at = s.state.contestable_at
            if run is not None and at > 0:
                self.seq += 1
                heapq.heappush(self.events, (max(at, self.now), self.seq, _DrainYield(idx, s.state.fence)))
        if self.gpu_busy[g] == 0:
            self._start_recut(g, self.draining.pop(g))

    def _drain_yield(self, ev: _DrainYield) -> None:
        s = self.slices[ev.idx]
        run = s.run
        if run is None or run.stale or s.state.fence != ev.fence or s.sim.gpu_id not in self.draining:
            return
        if run.completion.finished_at <= self.now + 1e-9:
            return  # it ends now anyway
        self._yield(s, run, leaves=True)

    def _start_recut(self, gpu_id: str, layout: tuple[str, ...]) -> None:
        for idx in self.gpu_slices[gpu_id]:
            s = self.slices[idx]
            self._set_idle(s, False)
            s.retired = True
            s.state = msgspec.structs.replace(s.state, status="offline", updated_at=self.now)
            self.fresh.discard(idx)
        self.gpu_slices[gpu_id] = []
        self.cut_free.discard(gpu_id)
        recut = _Recut(gpu_id, layout, self.now, self.cuts[gpu_id].start(self.now, self.recorder))
        self.recuts.append(recut)
        self.counters["repartitions"] += 1
        self.seq += 1
        heapq.heappush(self.events, (recut.ends, self.seq, recut))

    def _finish_recut(self, recut: _Recut) -> None:
        made = self.cuts[recut.gpu_id].finish(recut.layout)
        self.recut_at[recut.gpu_id] = self.now
        self.cut_free.add(recut.gpu_id)
        for sim in made:
            st = slice_state(sim, self.gpu_index.get(sim.gpu_id, 0))
            idx = len(self.slices)
            self.slices.append(
                _Slice(
                    idx=idx,
                    sim=sim,
                    state=st,
                    kind=(st.profile, st.mem_mib, st.compute_share),
                    speed=slice_speed(sim, self.cfg),
                )
            )
            self.gpu_slices[recut.gpu_id].append(idx)
            self.fresh.add(idx)

    # --- the loop ------------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Offer the freshly freed slices, and the idle slices of kinds some job that changed may now
        take, as one batch; again while a batch starts subjobs (its winners changed). Repartitionable
        GPUs with nothing running are re-cut first if the waiting demand is better served by another
        layout, and again after the batches for what still waits."""
        if self.cuts:
            self._repartition()
        fresh = [self.slices[i] for i in sorted(self.fresh) if self.slices[i].state.status == "free"]
        self.fresh.clear()
        if self.waiting == 0:
            for s in fresh:  # nobody to bid: offered again once a job arrives
                self._set_idle(s, True)
            fresh = []
        while True:
            kinds, self.changed_since = self.changed_since, set()
            batch, bids = self._wanted(fresh, kinds if self.waiting > 0 else set())
            fresh = []
            if not batch or not self._batch(batch, bids):
                break
        if self.cuts and self.waiting > 0:
            self._repartition()

    def _wanted(
        self, fresh: list[_Slice], kinds: set[WindowKind]
    ) -> tuple[list[_Slice], dict[WindowKind, list[Bid]]]:
        """The slices to offer in one batch, and the bids for them per kind: per kind of the freshly
        freed slices and of ``kinds`` (the kinds some job that changed may now take), the bidder is
        asked once for all of them (fresh ones, then idle free ones, then held ones past their
        holder's window), and as many are offered as the bidders have room for subjobs (an
        advertiser re-offers idle windows to demand the same way: ``OfferPacer``). A fresh slice
        left over is idle, as if it had been offered without a taker. Free slices come first: a held
        one is taken only for what they leave (its holder yields)."""
        by_kind: dict[WindowKind, list[_Slice]] = {}
        for s in fresh:
            by_kind.setdefault(s.kind, []).append(s)
        for kind in kinds:
            if self.idle_by_kind[kind] or self.contested[kind]:
                by_kind.setdefault(kind, [])
        out: list[_Slice] = []
        bids: dict[WindowKind, list[Bid]] = {}
        unasked: list[WindowKind] = []
        for kind in sorted(by_kind):
            new = by_kind[kind]
            idle, held = (self.idle_by_kind[kind], self.contested[kind]) if kind in kinds else (set(), set())
            if not new and not idle and self._none_takes(kind):
                # Only held slices, and no waiting job may take one: nothing of this kind is offered.
                # Its bids matter only to a batch of other kinds (``_unasked``); asked for then.
                unasked.append(kind)
                bids[kind] = []
                continue
            first = new[0] if new else self.slices[min(idle) if idle else min(held)]
            probe = self._probe(first)
            n = len(new) + len(idle) + len(held)
            props = [] if probe is None else self.bidder.proposals_for(probe, self.now, n, self.cfg.policy)
            room = sum(p.capacity for p in props)
            for s in new[room:]:
                self._set_idle(s, True)
            if not room:
                continue
            # the lowest-numbered ones, as many as there is room for (not the whole idle set sorted)
            take = new[:room]
            if len(take) < room and idle:
                take += [self.slices[i] for i in heapq.nsmallest(room - len(take), idle)]
            if len(take) < room and held:
                # Only held slices some bidder may take (``bidding.may_bid_on``: not its own, and a holder
                # after it in the order of service): the others would be rounds without a winner.
                # As many as those bidders have room for: the held slices whose holders come last in
                # that order first (the likeliest taken).
                keys = {p.job_id: self._service_key(self.jobs[p.job_id].state) for p in props}
                takers = sorted((k, job_id) for job_id, k in keys.items())
                takeable = self._takeable(kind, takers, room - len(take))
                if takeable:
                    most = takeable[0][0]
                    can = sum(p.capacity for p in props if continuation.takes_held(keys[p.job_id], most))
                    take += [self.slices[i] for _, i in takeable[:can]]
            out.extend(take)
            bids[kind] = self._bids(props)
        if unasked:
            self._unasked(unasked, bids, bool(out))
        return out, bids

    @staticmethod
    def _service_key(state: JobState) -> float:
        return continuation.service_key(state.attained_gpu_s, state.submitted_at, state.due_at)

    def _unasked(self, unasked: list[WindowKind], bids: dict[WindowKind, list[Bid]], batch: bool) -> None:
        """The bids of the kinds ``_wanted`` offers nothing of (held slices nobody may take), in their
        place in ``bids``: the batch learns its bidders' service from every bid (``grants.learn_service``),
        so they are the bidder's answers for those held slices, as if it had been asked for them in
        turn; none when there is no batch (``batch`` false) or nobody bids."""
        for kind in unasked:
            props: list[Proposal] = []
            if batch:
                held = self.contested[kind]
                probe = self._probe(self.slices[min(held)])
                if probe is not None:
                    props = self.bidder.proposals_for(probe, self.now, len(held), self.cfg.policy)
            if sum(p.capacity for p in props):
                bids[kind] = self._bids(props)
            else:
                del bids[kind]

    def _held_key(self, s: _Slice) -> float:
        """The holder's ``service_key`` less its growth with ``now`` (``continuation.held_attained``):
        the same order at every instant."""
        st = s.state
        key = continuation.service_key(st.holder_attained_gpu_s, st.holder_submitted_at, st.holder_due_at)
        return key if st.holder_due_at > 0 else key - st.contestable_at * st.compute_share

    def _held_now(self, negkey: float, share: float) -> float:
        """A ``held_rank`` entry's holder's service key now (``continuation.held_attained``, past its
        window's end; a due holder's does not grow)."""
        return -negkey if negkey > _DUE_RANK else -negkey + self.now * share

    def _uncontest(self, s: _Slice) -> None:
        """``s`` is no longer held past its holder's window (granted, or its holder ended)."""
        if s.idx in self.contested[s.kind]:
            self.contested[s.kind].discard(s.idx)
            rank = self.held_rank[s.kind]
            entry = self.held_entry.pop(s.idx)
            k = bisect.bisect_left(rank, entry)
            assert rank[k] == entry
            del rank[k]

    def _takeable(
        self, kind: WindowKind, takers: list[tuple[float, str]], most: int
    ) -> list[tuple[float, int]]:
        """Up to ``most`` held slices of ``kind`` one of ``takers`` ((attained service, job id), least
        first) may bid for (``bidding.may_bid_on``), most-served holder first, with their holders'
        service now."""
        out: list[tuple[float, int]] = []
        if not takers:
            return out
        share = kind[2]
        for negkey, idx in self.held_rank[kind]:
            held = self._held_now(negkey, share)
            holder = self.slices[idx].state.holder_job
            least = next((a for a, job_id in takers[:2] if job_id != holder), None)
            if least is None or not continuation.takes_held(least, held):
                if least is not None and least == takers[0][0]:
                    break  # the least served taker cannot take this one: nor any after it
                continue
            out.append((held, idx))
            if len(out) >= most:
                break
        return out

    def _bids_on(self, b: Bid, o: Offer) -> bool:
        job = self.jobs.get(b.proposal.job_id)
        return job is not None and may_bid_on(job.state, o.window)

    def _probe(self, s: _Slice) -> Offer | None:
        """An offer of ``s`` that is not a round (to ask whether anyone bids)."""
        req = WindowRequest(
            now=self.now, horizon_s=self.cfg.horizon_s, open_ended=True, largest_mib=self.largest_by_pool
        )
        windows = find_windows([s.state], req)
        # What a job bids depends on the window's shape; a held one's holder is checked per offer.
        return unheld(_offer_of(windows[0], self.now)) if windows else None

    def _live_events(self) -> bool:
        """Whether an event is pending; completions a yield replaced, and due times of jobs that
        have ended, are dropped from the top on the way (they are no instants)."""
        events = self.events
        while events and self._no_instant(events[0][2]):
            heapq.heappop(events)
        return bool(events)

    def _no_instant(self, item: _Running | _Recut | _Rest | _DrainYield | _Due) -> bool:
        if isinstance(item, _Running):
            return item.stale
        if isinstance(item, _Due):
            job = self.jobs.get(item.job_id)
            return job is None or job.state.status in ("done", "failed", "cancelled")
        return False

    def _next_contest(self) -> float:
        """When the next held slice's holder reaches its window's end (``inf``: none); entries whose
        holder is gone (its fence moved on) are dropped on the way."""
        while self.contests:
            at, _, idx, fence = self.contests[0]
            s = self.slices[idx]
            if s.state.fence == fence and s.state.status == "busy" and s.state.contestable_at == at:
                return at
            heapq.heappop(self.contests)
        return math.inf

    def _contest(self) -> None:
        """The held slices whose holder's window has passed join the idle ones (``core.continuation``):
        offered at once (their kind counts as changed), then again when a job changes. Called only
        while jobs wait: until then an open subjob just goes on."""
        while self.contests and self.contests[0][0] <= self.now:
            _, _, idx, fence = heapq.heappop(self.contests)
            s = self.slices[idx]
            if s.sim.gpu_id in self.draining:
                continue  # its holder yields to the drain, not to a taker
            if s.state.fence == fence and leases.preempts(s.state, self.now):
                if idx not in self.contested[s.kind]:
                    self.contested[s.kind].add(idx)
                    entry = self.held_entry[idx] = (-self._held_key(s), idx)
                    bisect.insort(self.held_rank[s.kind], entry)
                self.changed_since.add(s.kind)

    def run(self, progress: Progress | None = None) -> SimResult:
        """Replay every arrival and completion. The loop does not end while a job that can still run
        waits: with nothing left to happen, every waiting job is asked again for every free slice
        (``_wake``); a job still waiting after that is recorded with the reason (it never happens
        under the planner's rules, see ``core.planner``, and the tests hold it)."""
        arrivals = self.models
        next_arrival = 0
        events = 0
        jobs_done = 0
        stranded = 0.0
        contended = 0.0
        next_progress = PROGRESS_EVERY
        last_t = arrivals[0].trace.submit_s if arrivals else 0.0
        while True:
            while next_arrival < len(arrivals) or self._live_events():
                t_arr = arrivals[next_arrival].trace.submit_s if next_arrival < len(arrivals) else math.inf
                t_evt = self.events[0][0] if self.events else math.inf
                # A held slice becoming contestable is an instant only while jobs wait.
                t_con = self._next_contest() if self.waiting > 0 else math.inf
                t = min(t_arr, t_evt, t_con)
                self.recorder.add_stranded(stranded, t - last_t)
                if self.waiting > 0:
                    contended += t - last_t
                self.now = last_t = t
                self._dues(self.shadow.advance(t))
                # Completions first (they free slices), then arrivals, all at time t; then one dispatch.
                while self.events and self.events[0][0] <= t:
                    _, _, item = heapq.heappop(self.events)
                    if isinstance(item, _Running) and item.stale:
                        continue  # replaced by its yield (after t: dropped before t was chosen)
                    events += 1
                    if isinstance(item, _Recut):
                        self._finish_recut(item)
                        continue
                    if isinstance(item, _Rest):
                        self._end_rest()
                        continue
                    if isinstance(item, _DrainYield):
                        self._drain_yield(item)
                        continue
                    if isinstance(item, _Due):
                        self._due(item)
                        continue
                    self._complete(item)
                    if item.job.state.status in ("done", "failed", "cancelled"):
                        jobs_done += 1
                while next_arrival < len(arrivals) and arrivals[next_arrival].trace.submit_s <= t:
                    self._arrive(arrivals[next_arrival], next_arrival)
                    next_arrival += 1
                    events += 1
                if self.waiting > 0:
                    self._contest()
                self._dispatch()
                stranded = self.idle_mem if self.waiting > 0 else 0.0
                if progress is not None and events >= next_progress:
                    progress(events, jobs_done)
                    next_progress = events + PROGRESS_EVERY
            if not self._wake():
                break
        self._record_stuck()
        self.counters["events"] = events
        self.counters["jobs_done"] = jobs_done
        # Virtual seconds some job waited for a slice: every open subjob's window end in that time
        # is an instant of the replay.
        self.counters["contended_s"] = round(contended, 3)
        self.recorder.end_s = last_t
        if progress is not None:
            progress(events, jobs_done)
        return SimResult(
            policy=f"sja:{self.cfg.policy}", recorder=self.recorder, counters=dict(self.counters)
        )

    def _unfinished(self) -> list[_Job]:
        return [j for j in self.jobs.values() if j.state.status not in ("done", "failed", "cancelled")]

    def _wake(self) -> bool:
        """Nothing is left to happen while jobs wait: ask every waiting job again for every free
        slice. Returns whether a subjob started (the loop goes on)."""
        waiting = self._unfinished()
        if not waiting:
            return False
        self.counters["wakes"] = self.counters.get("wakes", 0) + 1
        for job in waiting:
            self.bidder.drop(job.state.job_id)
            self.bidder.own(job.state)
        self.changed_since.update(self.kinds)
        for s in self.slices:
            if s.state.status == "free" and not s.retired and s.sim.gpu_id not in self.draining:
                self._set_idle(s, False)
                self.fresh.add(s.idx)
        self._dispatch()
        return self._live_events()

    def _record_stuck(self) -> None:
        """Fail every job still waiting when nothing is left to happen, with its reason: what the
        agent's ``hopeless`` check says (it gives such a job up live), else what its planner says of
        the largest slice."""
        for job in self._unfinished():
            rec = self.recorder.jobs[job.model.trace.job_id]
            rec.failed = True
            largest = max(self.slices, key=lambda s: (s.state.mem_mib, s.state.compute_share))
            req = WindowRequest(
                now=self.now, horizon_s=self.cfg.horizon_s, open_ended=True, largest_mib=self.largest_by_pool
            )
            window = find_windows([msgspec.structs.replace(largest.state, status="free")], req)[0]
            p = propose(job.state, _offer_of(window, self.now), self.now, self.limits, profiles=self.profiles)
            given_up = hopeless(job.state, window, self.now, self.limits, profiles=self.profiles)
            rec.reason = given_up or (
                f"never planned: no safe subjob even on the largest slice ({largest.state.profile}, "
                f"{largest.state.mem_mib} MiB)"
                if p is None
                else f"left waiting with a plan for {largest.state.profile} (a simulator defect)"
            )

    def _arrive(self, m: JobModel, idx: int) -> None:
        if self.recorder.jobs[m.trace.job_id].unschedulable:
            return  # refused at submission, as the gateway refuses it
        state = sim_job(f"j{idx}", job_spec(m, self.cfg), self.now, self.cfg)
        job = _Job(idx=idx, model=m, state=state)
        self.jobs[state.job_id] = job
        self.by_idx[idx] = job
        self._set_state(job, state)
        self._update_waiting(False, job)
        self.demand_epoch += 1
        tj = m.trace
        rigid = RigidJob(
            job_id=state.job_id,
            submitted_at=self.now,
            run_s=tj.duration_s,
            mem_mib=m.decl_mem_mib,
            gpus=max(1, tj.num_gpus),
            fraction=m.fraction,
        )
        self._dues(self.shadow.submit(rigid, self.now))

    # --- the rigid reference (``core.shadow``) ---------------------------------------------------

    def _dues(self, started: list[tuple[str, float]]) -> None:
        """Jobs the reference started: each becomes due at its due time (at once if that has passed).
        An arrival or start that moves the reference's busy period's end later puts the span bound
        of the jobs due in it back (``shadow.span_due_at``): they are looked at again."""
        for job_id, at in started:
            self.seq += 1
            heapq.heappush(self.events, (max(at, self.now), self.seq, _Due(job_id, at)))
        period = self.shadow.busy_since
        end = self.shadow.span_ends.get(period, -math.inf)
        if self._span_seen != (period, end):
            self._span_seen = (period, end)
            for job_id in list(self.due_jobs):
                job = self.jobs.get(job_id)
                basis = self.shadow.basis.get(job_id)
                if job is not None and basis is not None and basis.busy_since == period:
                    self._recheck_due(job)

    def _due(self, ev: _Due) -> None:
        """A job's due time by the reference came: counting its own measurements
        (``shadow.due_by_evidence``) it is due now, later (looked at again then) or never."""
        job = self.jobs.get(ev.job_id)
        if job is None or job.state.status in ("done", "failed", "cancelled") or job.state.due_at > 0:
            return
        at = self._due_by_evidence(job)
        if at > self.now:
            self.seq += 1
            heapq.heappush(self.events, (at, self.seq, _Due(ev.job_id, at)))
        elif at > 0:
            self._set_due(job, self._finish_by(job))

    def _due_by_evidence(self, job: _Job) -> float:
        basis = self.shadow.basis.get(job.state.job_id)
        if basis is None:
            return 0.0
        profile = self.profiles.of(job.state) if job.state.profile is not None else None
        shadow = self.shadow
        return due_by_evidence(
            basis, job.state, profile, shadow.slack, shadow.span_end(basis), shadow.span_slack
        )

    def _finish_by(self, job: _Job) -> float:
        """What a due job carries (``JobState.due_at``): the instant it is due to finish by."""
        basis = self.shadow.basis[job.state.job_id]
        profile = self.profiles.of(job.state) if job.state.profile is not None else None
        shadow = self.shadow
        return finish_by_evidence(
            basis, job.state, profile, shadow.slack, shadow.span_end(basis), shadow.span_slack
        )

    def _recheck_due(self, job: _Job) -> None:
        """A due job completed a subjob (or its busy period's span grew): its measurements may move
        the instant it is due to finish by, put its due time back (unmarked, and looked at again
        then) or void it."""
        at = self._due_by_evidence(job)
        if 0 < at <= self.now:
            by = self._finish_by(job)
            if by != job.state.due_at:
                self._set_due(job, by)
            return
        self._set_due(job, 0.0)
        if at > 0:
            self.seq += 1
            heapq.heappush(self.events, (at, self.seq, _Due(job.state.job_id, at)))

    def _set_due(self, job: _Job, at: float) -> None:
        """The job is due, to finish by ``at`` (0: not due): it comes first in the order of service,
        earliest first, and so do the slices it holds, or no longer does."""
        job_id = job.state.job_id
        was = self._is_waiting(job)
        self.bidder.drop(job_id)
        self._set_state(job, msgspec.structs.replace(job.state, due_at=at))
        if at > 0:
            self.due_jobs.add(job_id)
        else:
            self.due_jobs.discard(job_id)
        self._update_waiting(was, job)
        held = {f.slice_id for f in job.state.in_flight}
        for s in self.slices:
            if s.state.holder_job != job_id or s.state.slice_id not in held or s.state.contestable_at <= 0:
                continue
            ranked = s.idx in self.contested[s.kind]
            if ranked:
                self._uncontest(s)
            s.state = msgspec.structs.replace(s.state, holder_due_at=at)
            if ranked:
                self.contested[s.kind].add(s.idx)
                entry = self.held_entry[s.idx] = (-self._held_key(s), s.idx)
                bisect.insort(self.held_rank[s.kind], entry)
        self.changed_since.update(self.kinds)
        self.demand_epoch += 1


def _rigid_reference(cluster: SimCluster, cfg: SimConfig) -> RigidShadow:
    """Best-fit on the cluster's slices at their share of the GPU, a GPU that may be re-cut taken
    whole by a job no slice holds (its largest profile: best-fit re-cuts a free GPU for what waits).
    A share, not a measured speed (``--speed-table``): as in the live agents, what a job measures
    beyond its slices' shares moves its due time (``shadow.due_by_evidence``)."""
    slices = [RigidSlice(s.gpu_id, s.mem_mib, s.compute_share) for s in cluster.slices]
    pooled: dict[Hashable, float] = {
        g.gpu_id: max(p.mem_mib for p in gpu_model(g.model).profiles)
        for g in cluster.gpus
        if g.repartitionable
    }
    return RigidShadow(slices, pooled=pooled, reserve_mib=cfg.mem_reserve_mib)


def _grant_id(offer: Offer) -> str:
    return f"g{offer.round}"


def _offer_of(window: Window, now: float) -> Offer:
    return probe_offer(window, now, offer_id="check", reply_to="sim")


def run_sja(
    cluster: SimCluster, jobs: Sequence[TraceJob], cfg: SimConfig, progress: Progress | None = None
) -> SimResult:
    """Simulate SJA with ``cfg.policy`` clearing on ``cluster`` over ``jobs``."""
    return SjaEngine(cluster, jobs, cfg).run(progress)
