"""Probabilistic job profiles: functional memory profile and temporal profile.

Both are Bayesian linear regressions (Normal-inverse-gamma conjugate prior) on the job's size
parameter ``k``: ``peak_mem(k) = a + b*k + noise`` and ``duration_full(k) = warmup + c*k + noise``,
where ``duration_full`` is the duration on a full-speed slice. A slice profile's speed relative to the
full GPU starts from its compute share and is learned per profile as a log-ratio.

Quantiles use the posterior predictive, approximated by a normal with the Student-t variance
(``nu / (nu - 2)``), which is conservative at the quantiles used here (eps in [0.01, 0.2]).

An OOM or a timeout is a censored observation ("more than the cap at size k"): it is fed to the
regression as a pseudo-observation above the cap and it sets a hard bound so that no size >= k is
planned again on a slice with that much memory or time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from statistics import NormalDist

from sja.protocol.messages import MemoryDecl, ProfileState, TimeDecl

_STD = NormalDist()

CENSORED_INFLATION = 1.15
"""A censored observation is recorded this far above the cap it broke."""


Z_MAX = 7.0344869100478356
"""z of the most extreme quantile used (q clamped to [1e-12, 1 - 1e-12])."""


def z_of(q: float) -> float:
    return _STD.inv_cdf(min(max(q, 1e-12), 1 - 1e-12))


WEIGHT_PRIOR_REL_SD = 0.5
"""Relative sd of a prior's weights when the caller does not say (time profiles): declared speeds are
often off by 2x or more, so the prior is kept wide whatever the declared noise."""
WEIGHT_PRIOR_MIN_REL_SD = 0.1
"""Smallest relative sd of a prior's weights when the caller sets it (memory profiles follow their
declaration's ``rel_sd``): even a confident declaration leaves room to learn it was 10 % off."""

MEMORY_NOISE_PRIOR = 0.05
"""Expected run-to-run spread of peak memory at a given size (memory is nearly deterministic)."""
TIME_NOISE_PRIOR = 0.25
"""Expected run-to-run spread of duration at a given size (shared machines are noisy)."""

MAX_OBSERVATIONS = 64
"""Observations kept per regression (the oldest are dropped; the prior always stays)."""


@dataclass
class LinearPosterior:
    """NIG posterior over ``y = w0 + w1 * x`` with noise proportional to the prediction.

    Durations and memory vary multiplicatively (a 10x larger subjob varies about 10x more), so the
    regression runs on ``y / s(x)`` with features ``(1 / s(x), x / s(x))``: the weights keep their
    meaning and the noise is relative to ``s(x)``. The reference ``s(x)`` starts as the prior's
    prediction and is re-anchored to the posterior mean after every observation (the posterior is
    refitted from the prior and the kept observations), so a prior that was 5x off does not leave a
    5x-inflated spread behind.
    """

    prior: tuple[float, float, float, float, float, float, float]
    """(mu0, mu1, p00, p01, p11, a, b) of the prior; precision scaled by the noise variance."""
    floor: float
    """Smallest reference scale (keeps ``s(x) > 0``)."""
    obs: list[tuple[float, float, bool]] = field(default_factory=list)
    """(x, y, censored): a censored y is a lower bound (an OOM or a timeout), not a measurement."""
    s0: float = 1.0
    s1: float = 0.0
    mu0: float = 0.0
    mu1: float = 0.0
    p00: float = 1.0
    p01: float = 0.0
    p11: float = 1.0
    a: float = 2.0
    b: float = 1.0

    @classmethod
    def prior_from(
        cls,
        intercept: float,
        slope: float,
        rel_sd: float,
        typical_x: float,
        noise_rel_sd: float | None = None,
        weight_rel_sd: float | None = None,
    ) -> LinearPosterior:
        """A weak prior centred on a declaration.

        ``rel_sd`` says how far off the declaration may be. ``weight_rel_sd`` is the weights' prior
        sd relative to their value: by default at least 50 % (``WEIGHT_PRIOR_REL_SD``) whatever
        ``rel_sd`` says; when given, it is followed down to ``WEIGHT_PRIOR_MIN_REL_SD``.
        ``noise_rel_sd`` is the expected run-to-run spread (default ``rel_sd``); with ``a = 2`` it
        weighs about four observations, so measured spread takes over quickly.
        """
        rel_sd = max(rel_sd, 0.02)
        typical_y = max(intercept + slope * typical_x, 1e-9)
        noise_var = max(noise_rel_sd if noise_rel_sd is not None else rel_sd, 0.01) ** 2
        a = 2.0
        # The weights' prior is independent of the declared noise: in a NIG model the weight prior
        # scales with the noise, and a declaration that is 2x off must not outweigh a few dozen
        # precise observations. Without an explicit width it is kept wide (at least 50 %).
        if weight_rel_sd is None:
            w_rel = max(rel_sd, WEIGHT_PRIOR_REL_SD)
        else:
            w_rel = max(weight_rel_sd, WEIGHT_PRIOR_MIN_REL_SD)
        sd0 = max(w_rel * abs(intercept), 0.05 * typical_y)
        sd1 = max(w_rel * abs(slope), 0.05 * typical_y / max(typical_x, 1.0))
        post = cls(
            prior=(intercept, slope, noise_var / sd0**2, 0.0, noise_var / sd1**2, a, noise_var * a),
            floor=0.02 * typical_y,
            s0=max(intercept, 0.02 * typical_y),
            s1=max(slope, 0.0),
        )
        post._fit()
        return post

    def scale(self, x: float) -> float:
        return self.s0 + self.s1 * max(x, 0.0)

    def copy(self) -> LinearPosterior:
        """An independent copy, fitted as this one is (no refit)."""
        return replace(self, obs=list(self.obs))

    def _fit(self) -> None:
        """Posterior of the weights from the prior and the kept observations; the noise is estimated
        from the residuals around the posterior line (plus the prior's pseudo-observations). The
        conjugate update would also charge the prior's own error to the noise, and a declaration
        2x off would then look like 2x noise for a long time."""
        mu0, mu1, p00, p01, p11, a, b = self.prior
        r0, r1 = p00 * mu0 + p01 * mu1, p01 * mu0 + p11 * mu1
        for x, y, _ in self.obs:
            s = self.scale(x)
            f0, f1, t = 1.0 / s, x / s, y / s
            p00, p01, p11 = p00 + f0 * f0, p01 + f0 * f1, p11 + f1 * f1
            r0, r1 = r0 + f0 * t, r1 + f1 * t
        det = p00 * p11 - p01 * p01
        mu0, mu1 = (p11 * r0 - p01 * r1) / det, (-p01 * r0 + p00 * r1) / det
        # Memory and time neither start below zero nor shrink with size: project the posterior
        # mean onto w0 >= 0, w1 >= 0 (the conditional mean of the other weight given the clamp).
        if mu0 < 0.0:
            mu0, mu1 = 0.0, mu1 + (p01 / p11) * mu0
        if mu1 < 0.0:
            mu0, mu1 = max(mu0 + (p01 / p00) * mu1, 0.0), 0.0
        for x, y, censored in self.obs:
            if censored:  # a lower bound moves the line up; it says nothing about the spread
                continue
            resid = (y - (mu0 + mu1 * x)) / self.scale(x)
            b += 0.5 * resid * resid
            a += 0.5
        self.mu0, self.mu1, self.p00, self.p01, self.p11, self.a, self.b = mu0, mu1, p00, p01, p11, a, b

    def update(self, x: float, y: float, censored: bool = False) -> None:
        self.obs.append((float(x), float(y), censored))
        del self.obs[:-MAX_OBSERVATIONS]
        self._fit()
        # Re-anchor the noise reference on what we now believe, and refit once with it.
        self.s0, self.s1 = max(self.mu0, self.floor), max(self.mu1, 0.0)
        self._fit()

    def mean(self, x: float) -> float:
        return self.mu0 + self.mu1 * x

    def rel_sd(self, x: float) -> float:
        """Predictive sd relative to the reference scale at ``x``."""
        s = self.scale(x)
        f0, f1 = 1.0 / s, x / s
        det = self.p00 * self.p11 - self.p01 * self.p01
        lev = (self.p11 * f0 * f0 - 2.0 * self.p01 * f0 * f1 + self.p00 * f1 * f1) / det
        nu = 2.0 * self.a
        t_inflation = nu / (nu - 2.0) if nu > 2.0 else 3.0
        return math.sqrt(max((self.b / self.a) * (1.0 + lev) * t_inflation, 0.0))

    def sd(self, x: float) -> float:
        return self.scale(x) * self.rel_sd(x)

    def quantile(self, x: float, q: float) -> float:
        return self.mean(x) + z_of(q) * self.sd(x)

    def cdf(self, x: float, y: float) -> float:
        sd = self.sd(x)
        if sd <= 0.0:
            return 1.0 if y >= self.mean(x) else 0.0
        return _STD.cdf((y - self.mean(x)) / sd)

    def to_list(self) -> list[float]:
        flat = [v for x, y, c in self.obs for v in (x, y, 1.0 if c else 0.0)]
        return [*self.prior, self.floor, self.s0, self.s1, *flat]

    @classmethod
    def from_list(cls, v: list[float]) -> LinearPosterior:
        obs = [(v[i], v[i + 1], v[i + 2] > 0.5) for i in range(10, len(v) - 2, 3)]
        post = cls(prior=tuple(v[:7]), floor=v[7], s0=v[8], s1=v[9], obs=obs)  # type: ignore[arg-type]
        post._fit()
        return post


@dataclass
class SpeedEstimate:
    """Log of (observed duration / predicted full-speed duration * share) for one slice profile."""

    mean: float = 0.0
    var: float = 0.09
    n: int = 0

    OBS_VAR = 0.05

    def update(self, log_ratio: float) -> None:
        k = self.var / (self.var + self.OBS_VAR)
        self.mean += k * (log_ratio - self.mean)
        self.var = (1.0 - k) * self.var + 1e-4
        self.n += 1


@dataclass
class JobProfile:
    """A job's memory and time model. Pure; serialized to ``ProfileState`` in the job state."""

    mem: LinearPosterior
    time: LinearPosterior
    speed: dict[str, SpeedEstimate] = field(default_factory=dict)
    oom_bounds: list[tuple[int, float]] = field(default_factory=list)
    """(size, cap): size ``>= k`` exceeded ``cap`` MiB once; never plan it again under that cap."""
    timeout_bounds: list[tuple[int, float]] = field(default_factory=list)
    """(size, full-speed seconds) of every timeout: kept for the record, not a hard bound. Durations
    are noisy (a stalled host, a slow neighbour); one timeout must not ban a size forever, or a job
    offered fixed-length windows could never run again. The censored observation moves the model."""
    """(size, seconds, full-speed-equivalent): size ``>= k`` overran this length once."""
    observations: int = 0

    @classmethod
    def from_declaration(cls, mem: MemoryDecl, time: TimeDecl, typical_units: int) -> JobProfile:
        return cls(
            # Memory follows its declaration's confidence: a 50 % floor would make the planner ask
            # for 2.2x the declared peak at eps 0.05 before the first observation, and a job that
            # declares most of the largest slice could then never run and never learn.
            mem=LinearPosterior.prior_from(
                mem.base_mib,
                mem.per_unit_mib,
                mem.rel_sd,
                typical_units,
                MEMORY_NOISE_PRIOR,
                weight_rel_sd=mem.rel_sd,
            ),
            time=LinearPosterior.prior_from(
                time.warmup_s, time.per_unit_s, time.rel_sd, typical_units, min(time.rel_sd, TIME_NOISE_PRIOR)
            ),
        )

    # --- predictions ------------------------------------------------------------------------------

    # Quantiles of a regression are convex in k (a line plus the norm of an affine function), so
    # their running maximum over [1, k] is max(q(1), q(k)): taking it makes every quantile
    # non-decreasing in k (a larger subjob never needs less) at no cost where it already was.

    def mem_quantile(self, k: int, q: float) -> float:
        return max(self.mem.quantile(k, q), self.mem.quantile(1, q), 0.0)

    def mem_fit_probability(self, k: int, cap_mib: float) -> float:
        """P(peak <= cap) consistent with ``mem_quantile``: its q at which the quantile is the cap."""
        return min(self.mem.cdf(k, cap_mib), self.mem.cdf(1, cap_mib))

    def slowdown(self, profile: str, share: float) -> tuple[float, float]:
        """(mean, sd) of log(duration on this profile / full-speed duration)."""
        est = self.speed.get(profile, SpeedEstimate())
        return -math.log(share) + est.mean, math.sqrt(est.var)

    def duration_mean(self, k: int, profile: str, share: float) -> float:
        mu, _ = self.slowdown(profile, share)
        return max(self.time.mean(k), 0.0) * math.exp(mu)

    def _duration_parts(
        self, k: int, profile: str, share: float
    ) -> tuple[float, float, float, float, float, float]:
        """(mean, sd) of the full-speed duration at ``k`` and at 1, and of the log slowdown."""
        mu, sd = self.slowdown(profile, share)
        t = self.time
        return t.mean(k), t.sd(k), t.mean(1), t.sd(1), mu, sd

    @staticmethod
    def _duration_at(z: float, parts: tuple[float, float, float, float, float, float]) -> float:
        mk, sk, m1, s1, mu, sd = parts
        return max(mk + z * sk, m1 + z * s1, 0.0) * math.exp(mu + z * sd)

    def duration_quantile(self, k: int, q: float, profile: str, share: float) -> float:
        """The ``q`` quantile of the full-speed duration times the ``q`` quantile of the profile's
        slowdown (conservative: both tails at once)."""
        return self._duration_at(z_of(q), self._duration_parts(k, profile, share))

    def time_fit_probability(self, k: int, length_s: float, profile: str, share: float) -> float:
        """P(duration <= length) consistent with ``duration_quantile``: the quantile is increasing in
        z, so the z at which it equals the length is found by bisection and mapped back to q."""
        if length_s <= 0:
            return 0.0
        parts = self._duration_parts(k, profile, share)
        lo, hi = -Z_MAX, Z_MAX
        if self._duration_at(lo, parts) > length_s:
            return 0.0
        if self._duration_at(hi, parts) <= length_s:
            return 1.0
        for _ in range(40):
            mid = 0.5 * (lo + hi)
            if self._duration_at(mid, parts) <= length_s:
                lo = mid
            else:
                hi = mid
        return _STD.cdf(lo)

    def max_size_under_bounds(self, mem_cap_mib: float, length_s: float, share: float) -> int | None:
        """Largest size allowed by past OOMs for this memory cap (None: unbounded). Peak memory at a
        size is nearly deterministic, so an OOM is a hard bound; timeouts are not (see
        ``timeout_bounds``)."""
        limit: int | None = None
        for size, cap in self.oom_bounds:
            if mem_cap_mib <= cap:
                limit = size - 1 if limit is None else min(limit, size - 1)
        return limit

    # --- calibration ------------------------------------------------------------------------------

    def observe(self, k: int, peak_mem_mib: float, duration_s: float, profile: str, share: float) -> None:
        """A completed subjob: both measurements are exact observations."""
        self.observe_memory(k, peak_mem_mib)
        self.observe_duration(k, duration_s, profile, share)
        self.observations += 1

    def observe_memory(self, k: int, peak_mem_mib: float) -> None:
        self.mem.update(k, peak_mem_mib)

    def observe_duration(self, k: int, duration_s: float, profile: str, share: float) -> None:
        predicted_full = max(self.time.mean(k), 1e-6)
        est = self.speed.setdefault(profile, SpeedEstimate())
        log_ratio = math.log(max(duration_s, 1e-6) / predicted_full) + math.log(share)
        est.update(log_ratio)
        mu, _ = self.slowdown(profile, share)
        self.time.update(k, duration_s / math.exp(mu))

    def observe_oom(self, k: int, cap_mib: float, peak_seen_mib: float = 0.0) -> None:
        """Peak memory at size ``k`` exceeded ``cap_mib`` (censored from below)."""
        self.oom_bounds.append((k, cap_mib))
        self.mem.update(k, max(cap_mib, peak_seen_mib) * CENSORED_INFLATION, censored=True)
        self.observations += 1

    def observe_timeout(self, k: int, cap_s: float, profile: str, share: float) -> None:
        """Duration at size ``k`` exceeded ``cap_s`` on this profile (censored from below)."""
        mu, _ = self.slowdown(profile, share)
        full_len = cap_s / math.exp(mu)
        self.timeout_bounds.append((k, cap_s * share))
        self.time.update(k, full_len * CENSORED_INFLATION, censored=True)
        self.observations += 1

    def copy(self) -> JobProfile:
        """An independent copy to update (what ``from_state(self.to_state())`` gives, without
        refitting)."""
        return JobProfile(
            mem=self.mem.copy(),
            time=self.time.copy(),
            speed={k: replace(v) for k, v in self.speed.items()},
            oom_bounds=list(self.oom_bounds),
            timeout_bounds=list(self.timeout_bounds),
            observations=self.observations,
        )

    # --- serialization ----------------------------------------------------------------------------

    def to_state(self) -> ProfileState:
        return ProfileState(
            mem=self.mem.to_list(),
            time=self.time.to_list(),
            speed={name: [s.mean, s.var, float(s.n)] for name, s in sorted(self.speed.items())},
            oom_bounds=list(self.oom_bounds),
            timeout_bounds=list(self.timeout_bounds),
            observations=self.observations,
        )

    @classmethod
    def from_state(cls, state: ProfileState) -> JobProfile:
        return cls(
            mem=LinearPosterior.from_list(state.mem),
            time=LinearPosterior.from_list(state.time),
            speed={name: SpeedEstimate(mean=v[0], var=v[1], n=int(v[2])) for name, v in state.speed.items()},
            oom_bounds=[(int(k), float(c)) for k, c in state.oom_bounds],
            timeout_bounds=[(int(k), float(c)) for k, c in state.timeout_bounds],
            observations=state.observations,
        )
