"""The profiles a process holds for its jobs (``ProfileCache``): rebuilt once per profile state, one
held per job, and the same profiles as without a cache."""

from __future__ import annotations

import msgspec

from sja.core.jobs import apply_completion, new_job
from sja.core.profile_cache import ProfileCache, profile_of
from sja.core.profiles import JobProfile
from tests.unit.core._jobs_in_process import T0, execute, spec, win_window


def test_a_profile_is_rebuilt_once_per_profile_state_and_calibration_leaves_it_alone() -> None:
    profiles = ProfileCache()
    state = new_job("j1", spec(), T0)
    state, sj = win_window(state, T0)
    before = profile_of(state, profiles)
    assert profile_of(state, profiles) is before  # the same profile state: not refit
    q = before.mem_quantile(sj.units, 0.95)
    after, applied = apply_completion(
        state, execute(sj, T0 + 0.2, peak=sj.planned_mem_q_mib * 3), T0 + 1.0, profiles=profiles
    )
    assert applied and after.profile != state.profile
    # The completion calibrated a copy: the profile of the state it came from is what it was.
    assert before.mem_quantile(sj.units, 0.95) == q
    # The calibrated profile is kept as the new state's (the job's one profile held now), and is
    # what rebuilding it gives.
    assert profiles.held("j1") is after.profile
    kept = profile_of(after, profiles)
    assert profile_of(after, profiles) is kept and kept.mem_quantile(sj.units, 0.95) > q
    assert kept == JobProfile.from_state(after.profile)
    # The older state's profile, asked for again, is rebuilt as it was.
    assert (
        profile_of(state, profiles) == before
        and profile_of(state, profiles).mem_quantile(sj.units, 0.95) == q
    )
    # A state equal in content but not the same object gets a profile equal in what it says.
    twin = msgspec.convert(msgspec.to_builtins(state.profile), type(state.profile))
    assert twin is not state.profile
    assert (
        profile_of(msgspec.structs.replace(state, profile=twin), profiles).mem_quantile(sj.units, 0.95) == q
    )


def test_without_a_cache_nothing_is_held_and_the_profile_is_the_same() -> None:
    profiles = ProfileCache()
    state = new_job("j1", spec(), T0)
    assert profile_of(state) == profile_of(state, profiles)
    assert profile_of(state) is not profile_of(state)  # rebuilt for each use
    state, sj = win_window(state, T0)
    cached, _ = apply_completion(state, execute(sj, T0 + 0.2), T0 + 1.0, profiles=profiles)
    uncached, _ = apply_completion(state, execute(sj, T0 + 0.2), T0 + 1.0)
    assert cached == uncached


def test_one_profile_is_held_per_job_and_a_forgotten_job_holds_none() -> None:
    profiles = ProfileCache()
    other = ProfileCache()
    state = new_job("j-held", spec(), T0)
    for _ in range(3):
        state, sj = win_window(state, T0)
        profile_of(state, profiles)
        state, applied = apply_completion(state, execute(sj, T0 + 0.2), T0 + 1.0, profiles=profiles)
        assert applied
        profile_of(state, profiles)
    assert profiles.held("j-held") is state.profile
    assert len(profiles) == 1  # three calibrations, one profile held
    assert len(other) == 0  # caches are their owners': nothing shared through the process
    profiles.forget("j-held")
    assert "j-held" not in profiles and len(profiles) == 0


def test_a_full_cache_starts_again_empty() -> None:
    profiles = ProfileCache(limit=2)
    for i in range(3):
        profile_of(new_job(f"j{i}", spec(), T0), profiles)
    assert len(profiles) == 1 and "j2" in profiles
