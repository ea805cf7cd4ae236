"""The job profiles a process holds: the one piece of state beside the core's pure transitions.

Rebuilding a job's profile from its state refits its regressions; an agent and the simulator each
keep one ``ProfileCache`` for as long as they run and pass it to the transitions that read or
calibrate profiles (``jobs.materialize``, ``jobs.apply_completion``, ``bidding.propose``, ...).
"""

from __future__ import annotations

from sja.core.profiles import JobProfile
from sja.protocol.messages import JobState, ProfileState


class ProfileCache:
    """Job profiles rebuilt from their states, one held per job: a process passes its own to the
    transitions that plan with them (the agent and the simulator one each, for as long as they run).

    Rebuilding a profile refits both of its regressions; held here, it is rebuilt once per profile
    state, not once per offer, grant and completion. Job states are immutable, so a profile state's
    identity is its content while it is held. One profile is held per job, its latest state's: a
    calibration replaces it, so the cache holds as many profiles as its owner has jobs, not every
    one since it started (they were a large part of what the cycle collector went through), and at
    most ``limit`` (past that it starts again empty). Profiles handed out are to read (plan with),
    not to change: to update one, ``JobProfile.from_state`` makes one of your own."""

    def __init__(self, limit: int = 20_000) -> None:
        self.limit = limit
        self._held: dict[str, tuple[ProfileState, JobProfile]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._held

    def of(self, state: JobState) -> JobProfile:
        """The profile of ``state.profile``: the one held when it is that state's, else rebuilt and held."""
        ps = state.profile
        assert ps is not None
        got = self._held.get(state.job_id)
        if got is not None and got[0] is ps:
            return got[1]
        profile = JobProfile.from_state(ps)
        self.keep(state.job_id, ps, profile)
        return profile

    def held(self, job_id: str) -> ProfileState | None:
        """The profile state whose profile is held for the job, if any."""
        got = self._held.get(job_id)
        return None if got is None else got[0]

    def keep(self, job_id: str, ps: ProfileState, profile: JobProfile) -> None:
        """Hold ``profile`` as the job's, that of ``ps`` (it must be what ``JobProfile.from_state(ps)``
        gives): read-only from now on, its predictions remembered (``JobProfile.freeze``)."""
        if job_id not in self._held and len(self._held) >= self.limit:
            self._held.clear()
        self._held[job_id] = (ps, profile.freeze())

    def forget(self, job_id: str) -> None:
        """Drop the profile held for a job its owner no longer plans for (finished, or not its own)."""
        self._held.pop(job_id, None)


def profile_of(state: JobState, profiles: ProfileCache | None = None) -> JobProfile:
    """The job's profile, to read and not to change: held in ``profiles`` when given (see
    ``ProfileCache``), else rebuilt for this one use."""
    if profiles is not None:
        return profiles.of(state)
    assert state.profile is not None
    return JobProfile.from_state(state.profile).freeze()
