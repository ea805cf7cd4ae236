"""Probabilistic job profiles: functional memory profile and temporal profile.

Both are Bayesian linear regressions (Normal-inverse-gamma conjugate prior) on the job's size
parameter ``k``: ``peak_mem(k) = a + b*k + noise`` and ``duration_full(k) = warmup + c*k + noise``,
where ``duration_full`` is the duration on a full-speed slice. A slice profile's speed relative to the
full GPU starts from its compute share and is learned per profile as a log-ratio.

Quantiles and probabilities use the posterior predictive itself, a Student-t with ``2a`` degrees of
freedom (``scipy.special.stdtrit`` / ``stdtr``; the t quantile is cached per ``(dof, q)``).

An OOM or a timeout is a censored observation ("more than the cap at size k"). It only ever tightens
the profile, in three ways (see ``LinearPosterior.observe_censored``):

- it is a fact about every size ``>= k`` (memory and time do not shrink with size): the predictive at
  those sizes is conditioned on exceeding the cap (a truncated Student-t), and the fact is kept for
  good, whatever the number of later observations, until a completion contradicts it;
- it moves the regression line (so the next plan is smaller, not one unit smaller): a pseudo-
  observation at ``max(1.15 * cap, median of the conditioned predictive)``;
- the line's move can pivot it (a higher intercept, a lower slope) or shrink its spread, so the
  predictive from before the observation is held as a floor at sizes ``>= k`` until the next completed
  subjob: the quantiles at ``k`` and above never go down on a censored observation.

It also sets a hard bound in ``JobProfile``: no size ``>= k`` is planned again under that memory cap
(an OOM) or into a window no longer than that length at that compute share (a timeout), until a
completion at a size ``>= k`` within that cap or length shows the bound was noise (timeouts only;
memory is nearly deterministic and an OOM bound stays).

**Ceilings: what the job vouched for and what it showed.** The planner's memory quantile is never
above the job's *memory ceiling* at that size (``JobProfile.mem_ceiling``), the smaller of

- its declaration (``mem_bound``: ``base + per_unit * k``), a bound the user vouches for, as Slurm's
  ``--mem`` or a Kubernetes memory limit: before any observation a job that declares most of a slice
  is planned there at its declared size, not at a quantile of a prior around it;
- the usable memory of a slice it completed a subjob of size ``>= k`` on (``proven``).

So what the job learns only lowers its plans: a slice that holds its ceiling at a size always holds
that size. A ceiling is dropped only when the job itself contradicts it: a measured peak above it,
or an OOM under a cap at or above it (a declaration that was wrong is no longer a bound; the
learned profile plans alone, as before).

**Leaving a declaration takes evidence** (``JobProfile.mem_evidence``). Peak memory often depends on
the data a subjob reads, not only on its size: one subjob of a job that declared 30,000 MiB may peak at
300 MiB and the next at 20,000. The regression's spread, fitted to a handful of peaks, says little
about such tails, so below its ceiling the quantile is also never below an *evidence bound* built
from the measured peaks relative to the regression's line ``s`` (``u_i = ln(peak_i / s(k_i))``,
weighed as the regression weighs them), with ``dof`` the effective number of peaks less the line's
parameters:

- ``dof / (dof + 1) >= q``: the largest ``u_i`` (distribution-free: a new peak exchangeable with
  ``dof`` others exceeds their maximum with probability ``1 / (dof + 1)``);
- fewer, but ``dof >= EVIDENCE_MIN_DOF``: the largest ``u_i`` or the log-normal predictive
  ``mean(u) + t_dof(q) * sd(u) * sqrt(1 + 1/n)``, whichever is higher (exact when peaks vary
  log-normally between subjobs, whatever their number: a Student-t on the log scale);
- fewer still: none, and a job with a declaration is planned at its ceiling.

Every OOM the profile keeps (``oom_bounds``) counts as a peak above its cap by the measured spread,
whatever completed at its size since, until enough measured peaks outrank it (the OOMs taken as the
largest). So the number of peaks needed before a plan leaves the declaration grows with how far below
it the plan goes (``ln(D / plan)`` against ``t_dof(q) * sd(u)``): peaks within 3 % of each other
move the plan down after two subjobs at one size, two peaks a factor 3 apart do not. A declaration a
measurement contradicted (``mem_bound`` dropped) is kept in ``declared``: without that evidence the
job is planned no lower than it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import lru_cache

from scipy.special import ndtr, ndtri, stdtr, stdtrit  # type: ignore[import-untyped]

from sja.protocol.messages import MemoryDecl, ProfileState, TimeDecl

CENSORED_INFLATION = 1.15
"""A censored observation is fed to the regression at least this far above the cap it broke."""

STALL_MARGIN = 4.0
"""A timeout at size ``s`` is taken for a stall, and released, once a smaller size ``k`` completes in
under ``1 / STALL_MARGIN`` of the timeout's cap scaled down by ``k / s``. Under the time model
(``w0 + w1 * k`` with ``w0, w1 >= 0``) the duration at ``s`` is at most ``s / k`` times the one at
``k``: such a timeout contradicts the model by more than this factor. Without the release a stalled
subjob caps every later plan below its size, since no larger one is ever planned to contradict it."""

Q_MIN, Q_MAX = 1e-12, 1.0 - 1e-12
"""Probabilities are clamped to this range (quantiles stay finite)."""

Z_MAX = 7.0344869100478356
"""Standard normal z of ``Q_MAX``."""


def z_of(q: float) -> float:
    """Standard normal quantile, clamped to ``[Q_MIN, Q_MAX]``."""
    return float(ndtri(min(max(q, Q_MIN), Q_MAX)))


def _t_ppf_raw(dof: float, q: float) -> float:
    return float(stdtrit(dof, min(max(q, Q_MIN), Q_MAX)))


t_ppf = lru_cache(maxsize=4096)(_t_ppf_raw)
"""Student-t quantile with ``dof`` degrees of freedom, cached: the planner asks for a handful of
``(dof, q)`` pairs thousands of times a second."""
_z_cached = lru_cache(maxsize=256)(z_of)

TPpf = Callable[[float, float], float]

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

MEMORY_LOCALITY = 0.7
"""Width (natural log of size) of the weight a memory observation gets by its distance from the
latest measured size: ``exp(-0.5 * (ln(x / x_latest) / width)^2)``, 0.6 at half or twice the size.
Measured memory is often not linear over the whole range (it flattens once activations stop
dominating, or jumps at an allocator's block size), and the planner works near the size it last ran:
a line fitted there, with far-away points down-weighted, follows the local shape (``bench/
calibration.py``: the embedding model whose memory stops growing at batch 256)."""

MAX_OBSERVATIONS = 64
"""Observations kept per regression (the oldest are dropped; the prior always stays, and so do the
lower bounds that censored observations set)."""

EXP_MAX, HUGE_MIB = 700.0, 1e300
"""An evidence bound is at most this (finite: an unplannable size, whose quantiles still compare)."""

EVIDENCE_MIN_DOF = 0.75
"""Degrees of freedom the peaks must leave, once the regression's line is fitted to them, before a
job's memory is planned below its declaration (``JobProfile.mem_evidence``): one peak, or one per
size, says nothing of how peaks vary between subjobs. About one: peaks the locality weighs down
count a little less than one each."""

MEMO_LIMIT = 4096
"""Predictions a frozen profile remembers (``JobProfile.freeze``); past it they are forgotten."""

_FORMAT_V2 = -2.0
"""Marks the serialized layout with censored bounds and held floors (``LinearPosterior.to_list``)."""

Fit = tuple[float, float, float, float, float, float, float, float, float]
"""A fitted posterior: (mu0, mu1, p00, p01, p11, a, b, s0, s1)."""


Evidence = tuple[float, float, float, float, float, float, float]
"""(dof, n, mean, sd, largest, largest OOM, OOMs) of a job's log peaks relative to its line
(``JobProfile.evidence``)."""


def _contradicted(x: float, y: float, xb: float, bound: float, stall_margin: float) -> bool:
    """Whether ``y`` measured at ``x`` contradicts "more than ``bound`` at ``xb``": at a size no
    larger, by not exceeding it; at a larger one (with ``stall_margin``, ``STALL_MARGIN``), by being
    so small that the line (non-negative weights, at most ``xb / x`` times it there) stays that many
    times below it."""
    if xb <= x:
        return bound >= y
    return stall_margin > 0.0 and x > 0.0 and bound >= stall_margin * y * xb / x


def _loc_scale(fit: Fit, x: float) -> tuple[float, float, float]:
    """(location, scale, degrees of freedom) of the Student-t posterior predictive at ``x``."""
    mu0, mu1, p00, p01, p11, a, b, s0, s1 = fit
    s = s0 + s1 * max(x, 0.0)
    f0, f1 = 1.0 / s, x / s
    det = p00 * p11 - p01 * p01
    lev = (p11 * f0 * f0 - 2.0 * p01 * f0 * f1 + p00 * f1 * f1) / det
    return mu0 + mu1 * x, s * math.sqrt(max((b / a) * (1.0 + lev), 0.0)), 2.0 * a


def _t_quantile(m: float, sd: float, t_q: float, dof: float, q: float, lower: float | None) -> float:
    """``q`` quantile of ``m + sd * T(dof)`` conditioned on exceeding ``lower`` (None: unconditioned);
    ``t_q`` is the unconditioned t quantile of ``q``.

    Conditioning never lowers a quantile: it is ``F^-1(q + (1 - q) F(lower))``, computed from the
    survival side so that a bound far in the upper tail keeps its precision."""
    y = m + t_q * sd
    if lower is None:
        return y
    if sd <= 0.0:
        return max(y, lower)
    surv = float(stdtr(dof, (m - lower) / sd))
    if surv >= 1.0:
        return y
    if surv <= 0.0:  # the model put no mass above the bound: all of it sits at the bound
        return lower
    p = max((1.0 - min(max(q, Q_MIN), Q_MAX)) * surv, 1e-300)
    return max(m - sd * float(stdtrit(dof, p)), lower)


def _t_cdf(m: float, sd: float, dof: float, y: float, lower: float | None) -> float:
    """P(value <= y) for the distribution ``_t_quantile`` inverts."""
    if lower is not None and y < lower:
        return 0.0
    if sd <= 0.0:
        return 1.0 if y >= m else 0.0
    if lower is None:
        return float(stdtr(dof, (y - m) / sd))
    surv_lower = float(stdtr(dof, (m - lower) / sd))
    if surv_lower <= 0.0:
        return 1.0
    return max(1.0 - float(stdtr(dof, (m - y) / sd)) / surv_lower, 0.0)


@dataclass
class LinearPosterior:
    """NIG posterior over ``y = w0 + w1 * x`` with noise proportional to the prediction.

    Durations and memory vary multiplicatively (a 10x larger subjob varies about 10x more), so the
    regression runs on ``y / s(x)`` with features ``(1 / s(x), x / s(x))``: the weights keep their
    meaning and the noise is relative to ``s(x)``. The reference ``s(x)`` starts as the prior's
    prediction and is re-anchored to the posterior mean after every observation (the posterior is
    refitted from the prior and the kept observations), so a prior that was 5x off does not leave a
    5x-inflated spread behind.

    ``quantile`` and ``cdf`` are the regression's own predictive; ``upper`` and ``upper_cdf`` add
    what censored observations taught (lower bounds, held floors) and make it non-decreasing in
    ``x``: the planner uses those.
    """

    prior: tuple[float, float, float, float, float, float, float]
    """(mu0, mu1, p00, p01, p11, a, b) of the prior; precision scaled by the noise variance."""
    floor: float
    """Smallest reference scale (keeps ``s(x) > 0``)."""
    obs: list[tuple[float, float, float]] = field(default_factory=list)
    """(x, y, bound): an exact observation has bound 0; a censored one (an OOM or a timeout: the
    value exceeded ``bound > 0``) has its pseudo-value as y."""
    lower: list[tuple[float, float]] = field(default_factory=list)
    """(x, bound): the value exceeded ``bound`` at ``x``, hence at every size ``>= x``. Kept apart
    from ``obs`` so that no number of later observations drops it; only the non-dominated ones."""
    held: list[tuple[float, ...]] = field(default_factory=list)
    """(x, *fit): the fitted posterior from before each censored observation since the last exact
    one, a floor on ``upper`` at sizes ``>= x``."""
    locality: float = 0.0
    """``MEMORY_LOCALITY``'s width for this regression (0: every observation weighs 1)."""
    s0: float = 1.0
    s1: float = 0.0
    mu0: float = 0.0
    mu1: float = 0.0
    p00: float = 1.0
    p01: float = 0.0
    p11: float = 1.0
    a: float = 2.0
    b: float = 1.0
    _weighed: tuple[list[tuple[float, float, float]], float, list[float]] | None = field(
        default=None, repr=False, compare=False
    )
    """``(obs, locality, weights)`` as ``_weights`` last worked them out."""

    @classmethod
    def prior_from(
        cls,
        intercept: float,
        slope: float,
        rel_sd: float,
        typical_x: float,
        noise_rel_sd: float | None = None,
        weight_rel_sd: float | None = None,
        locality: float = 0.0,
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
            locality=locality,
        )
        post._fit()
        return post

    def scale(self, x: float) -> float:
        return self.s0 + self.s1 * max(x, 0.0)

    def copy(self) -> LinearPosterior:
        """An independent copy, fitted as this one is (no refit). Field by field: a completion
        copies two of these, and ``dataclasses.replace`` reads the fields' definitions each time."""
        return LinearPosterior(
            prior=self.prior,
            floor=self.floor,
            obs=list(self.obs),
            lower=list(self.lower),
            held=list(self.held),
            locality=self.locality,
            s0=self.s0,
            s1=self.s1,
            mu0=self.mu0,
            mu1=self.mu1,
            p00=self.p00,
            p01=self.p01,
            p11=self.p11,
            a=self.a,
            b=self.b,
        )

    def fitted(self) -> Fit:
        return (self.mu0, self.mu1, self.p00, self.p01, self.p11, self.a, self.b, self.s0, self.s1)

    def _fit(self, weights: list[float] | None = None) -> None:
        """Posterior of the weights from the prior and the kept observations; the noise is estimated
        from the residuals around the posterior line (plus the prior's pseudo-observations). The
        conjugate update would also charge the prior's own error to the noise, and a declaration
        2x off would then look like 2x noise for a long time."""
        mu0, mu1, p00, p01, p11, a, b = self.prior
        r0, r1 = p00 * mu0 + p01 * mu1, p01 * mu0 + p11 * mu1
        if weights is None:
            weights = self._weights()
        s0, s1 = self.s0, self.s1
        scales: list[float] = []
        for (x, y, _), w in zip(self.obs, weights, strict=True):
            s = s0 + s1 * max(x, 0.0)  # self.scale(x)
            scales.append(s)
            f0, f1, t = 1.0 / s, x / s, y / s
            p00, p01, p11 = p00 + w * f0 * f0, p01 + w * f0 * f1, p11 + w * f1 * f1
            r0, r1 = r0 + w * f0 * t, r1 + w * f1 * t
        det = p00 * p11 - p01 * p01
        mu0, mu1 = (p11 * r0 - p01 * r1) / det, (-p01 * r0 + p00 * r1) / det
        # Memory and time neither start below zero nor shrink with size: project the posterior
        # mean onto w0 >= 0, w1 >= 0 (the conditional mean of the other weight given the clamp).
        if mu0 < 0.0:
            mu0, mu1 = 0.0, mu1 + (p01 / p11) * mu0
        if mu1 < 0.0:
            mu0, mu1 = max(mu0 + (p01 / p00) * mu1, 0.0), 0.0
        for (x, y, bound), w, s in zip(self.obs, weights, scales, strict=True):
            if bound > 0.0:  # a lower bound moves the line up; it says nothing about the spread
                continue
            resid = (y - (mu0 + mu1 * x)) / s
            b += 0.5 * w * resid * resid
            a += 0.5 * w
        self.mu0, self.mu1, self.p00, self.p01, self.p11, self.a, self.b = mu0, mu1, p00, p01, p11, a, b

    def _weights(self) -> list[float]:
        """Each kept observation's weight: 1, or by its distance from the latest measured size.
        Remembered for as long as the observations are the same (a refit's two fits, the
        evidence of the profile they make)."""
        weighed = self._weighed
        if weighed is not None and weighed[1] == self.locality and weighed[0] == self.obs:
            return weighed[2]
        anchor = next((x for x, _, bound in reversed(self.obs) if bound <= 0.0), None)
        if self.locality <= 0.0 or anchor is None:
            weights = [1.0] * len(self.obs)
        else:
            ln_anchor, width = math.log(max(anchor, 1e-9)), self.locality
            weights = [
                math.exp(-0.5 * ((math.log(max(x, 1e-9)) - ln_anchor) / width) ** 2) for x, _, _ in self.obs
            ]
        self._weighed = (list(self.obs), self.locality, weights)
        return weights

    def _refit(self) -> None:
        del self.obs[:-MAX_OBSERVATIONS]
        weights = self._weights()  # the same observations for both fits
        self._fit(weights)
        # Re-anchor the noise reference on what we now believe, and refit once with it.
        self.s0, self.s1 = max(self.mu0, self.floor), max(self.mu1, 0.0)
        self._fit(weights)

    def update(self, x: float, y: float, stall_margin: float = 0.0) -> None:
        """An exact observation: ``y`` measured at ``x``.

        It is the evidence that releases the floors held since the last one, and it drops every
        lower bound it contradicts (a bound at a size ``<= x`` that ``y`` does not exceed: that
        censored observation was noise, a stall or a neighbour). With ``stall_margin`` it also
        drops a bound at a larger size ``xb`` that is above ``stall_margin * y * xb / x``, what the
        line (non-negative weights) allows there by that factor (``STALL_MARGIN``)."""
        x, y = float(x), float(y)
        self.held.clear()
        self.lower = [
            (xb, bound) for xb, bound in self.lower if not _contradicted(x, y, xb, bound, stall_margin)
        ]
        self.obs = [o for o in self.obs if not (o[2] > 0.0 and _contradicted(x, y, o[0], o[2], stall_margin))]
        self.obs.append((x, y, 0.0))
        self._refit()

    def observe_censored(self, x: float, bound: float) -> None:
        """The value at ``x`` exceeded ``bound`` (an OOM above a memory cap, a timeout).

        A Tobit-style update that can only tighten: the predictive at sizes ``>= x`` is conditioned
        on exceeding the bound (kept in ``lower``); the regression gets a pseudo-observation at the
        larger of ``CENSORED_INFLATION * bound`` and the median of that conditioned predictive (so
        it never pulls the line down where the model already expected more), and the predictive from
        before is held as a floor at sizes ``>= x``, because refitting the line with one more point
        can pivot it or narrow it. Hence ``upper(x', q)`` does not decrease for any ``x' >= x`` and
        any ``q``."""
        x, bound = float(x), max(float(bound), 1e-9)
        fit = self.fitted()
        self.held.append((x, *fit))
        self._add_lower(x, bound)
        m, sd, dof = _loc_scale(fit, x)
        median = _t_quantile(m, sd, 0.0, dof, 0.5, self.lower_bound(x))
        self.obs.append((x, max(CENSORED_INFLATION * bound, median), bound))
        self._refit()

    def _add_lower(self, x: float, bound: float) -> None:
        if any(xb <= x and b >= bound for xb, b in self.lower):
            return  # already implied: the value exceeded more at a size no larger
        self.lower = sorted([(xb, b) for xb, b in self.lower if not (xb >= x and b <= bound)] + [(x, bound)])

    def lower_bound(self, x: float) -> float | None:
        """The largest bound the value at ``x`` is known to exceed, or None."""
        best: float | None = None
        for xb, bound in self.lower:
            if xb <= x and (best is None or bound > best):
                best = bound
        return best

    @property
    def dof(self) -> float:
        return 2.0 * self.a

    def mean(self, x: float) -> float:
        return self.mu0 + self.mu1 * x

    def sd(self, x: float) -> float:
        """Scale of the Student-t predictive at ``x``."""
        return _loc_scale(self.fitted(), x)[1]

    def rel_sd(self, x: float) -> float:
        """Predictive scale relative to the reference scale at ``x``."""
        return self.sd(x) / self.scale(x)

    def quantile(self, x: float, q: float) -> float:
        """The regression's own predictive quantile (Student-t, no censored bounds)."""
        m, sd, dof = _loc_scale(self.fitted(), x)
        return m + t_ppf(dof, q) * sd

    def cdf(self, x: float, y: float) -> float:
        m, sd, dof = _loc_scale(self.fitted(), x)
        return _t_cdf(m, sd, dof, y, None)

    def upper(self, x: float, q: float, ppf: TPpf = t_ppf) -> float:
        """The quantile the planner uses: the largest over the current fit and the floors held at
        ``x``, each conditioned on the lower bounds, of the quantile at ``x`` and at 1. Quantiles
        of a regression are convex in ``x`` (a line plus the norm of an affine function), so their
        running maximum over ``[1, x]`` is ``max(q(1), q(x))``: a larger subjob never needs less."""
        return self.upper_curve(x)(q, ppf)

    def upper_curve(self, x: float) -> Callable[[float, TPpf], float]:
        """``q -> upper(x, q, ppf)``, with what does not depend on ``q`` (the bounds, and each fit's
        location and scale at ``x`` and at 1) worked out once: a root search over ``q`` at one
        size asks for many quantiles. The same arithmetic, so the same numbers, as ``upper``."""
        lx, l1 = self.lower_bound(x), self.lower_bound(1.0)
        parts = []
        for fit in (self.fitted(), *(h[1:] for h in self.held if x >= h[0])):
            mx, sx, dof = _loc_scale(fit, x)  # type: ignore[arg-type]
            m1, s1, _ = _loc_scale(fit, 1.0)  # type: ignore[arg-type]
            parts.append((mx, sx, m1, s1, dof))

        def at(q: float, ppf: TPpf = t_ppf) -> float:
            best = -math.inf
            for mx, sx, m1, s1, dof in parts:
                t_q = ppf(dof, q)
                best = max(best, _t_quantile(mx, sx, t_q, dof, q, lx), _t_quantile(m1, s1, t_q, dof, q, l1))
            return best

        return at

    def upper_cdf(self, x: float, y: float) -> float:
        """P(value <= y) consistent with ``upper``: a maximum of quantiles is a minimum of cdfs."""
        lx, l1 = self.lower_bound(x), self.lower_bound(1.0)
        fits: list[Fit] = [self.fitted()]
        fits += [h[1:] for h in self.held if x >= h[0]]  # type: ignore[misc]
        return min(min(_t_cdf(*_loc_scale(f, x), y, lx), _t_cdf(*_loc_scale(f, 1.0), y, l1)) for f in fits)

    def to_list(self) -> list[float]:
        head = [*self.prior, self.floor, self.s0, self.s1]
        counts = [
            _FORMAT_V2,
            float(len(self.obs)),
            float(len(self.lower)),
            float(len(self.held)),
            self.locality,
        ]
        out = [*head, *counts]
        # Each tuple's floats as they are (extended, not unpacked and boxed again one by one).
        for o in self.obs:
            out.extend(o)
        for lo in self.lower:
            out.extend(lo)
        for h in self.held:
            out.extend(h)
        return out

    @classmethod
    def from_list(cls, v: list[float]) -> LinearPosterior:
        obs: list[tuple[float, float, float]] = []
        lower: list[tuple[float, float]] = []
        held: list[tuple[float, ...]] = []
        locality = 0.0
        if len(v) > 10 and v[10] == _FORMAT_V2:
            n_obs, n_lower, n_held, locality = int(v[11]), int(v[12]), int(v[13]), v[14]
            i = 15
            obs = [(v[j], v[j + 1], v[j + 2]) for j in range(i, i + 3 * n_obs, 3)]
            i += 3 * n_obs
            lower = [(v[j], v[j + 1]) for j in range(i, i + 2 * n_lower, 2)]
            i += 2 * n_lower
            held = [tuple(v[j : j + 10]) for j in range(i, i + 10 * n_held, 10)]
        else:  # the earlier layout: (x, y, censored flag) triples, a censored y was 1.15 x the cap
            for j in range(10, len(v) - 2, 3):
                x, y, censored = v[j], v[j + 1], v[j + 2] > 0.5
                bound = y / CENSORED_INFLATION if censored else 0.0
                obs.append((x, y, bound))
                if censored:
                    lower.append((x, bound))
        post = cls(prior=tuple(v[:7]), floor=v[7], s0=v[8], s1=v[9], obs=obs, held=held, locality=locality)  # type: ignore[arg-type]
        for x, bound in lower:
            post._add_lower(x, bound)
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


PROVEN_KEPT = 8
"""Proven (size, cap) pairs a profile keeps (the largest sizes win)."""

UNKNOWN_MEMORY = MemoryDecl(base_mib=1024.0, per_unit_mib=0.0, rel_sd=2.0)
"""The prior of a job that declares no memory: wide, and no bound (the job measures first)."""


def _add_proven(proven: list[tuple[int, float]], size: int, cap: float) -> None:
    """Adds "size ``<= size`` fits ``cap``" unless a pair with a size no smaller and a cap no larger
    implies it; drops the pairs it implies; keeps the ``PROVEN_KEPT`` largest sizes."""
    if any(s >= size and c <= cap for s, c in proven):
        return
    proven[:] = [(s, c) for s, c in proven if not (s <= size and c >= cap)]
    proven.append((size, cap))
    proven.sort(key=lambda sc: -sc[0])
    del proven[PROVEN_KEPT:]


def _pair(v: list[float]) -> tuple[float, float] | None:
    return (float(v[0]), float(v[1])) if len(v) == 2 else None


def _add_bound(bounds: list[tuple[int, float]], size: int, limit: float) -> None:
    """Adds "size ``>= size`` exceeded ``limit``" unless a bound at a size no larger with a limit no
    smaller implies it; drops the bounds it implies."""
    if any(s <= size and lim >= limit for s, lim in bounds):
        return
    bounds[:] = [(s, lim) for s, lim in bounds if not (s >= size and lim <= limit)]
    bounds.append((size, limit))


@dataclass
class JobProfile:
    """A job's memory and time model. Pure; serialized to ``ProfileState`` in the job state."""

    mem: LinearPosterior
    time: LinearPosterior
    speed: dict[str, SpeedEstimate] = field(default_factory=dict)
    oom_bounds: list[tuple[int, float]] = field(default_factory=list)
    """(size, cap): size ``>= k`` exceeded ``cap`` MiB once; never plan it again under that cap."""
    timeout_bounds: list[tuple[int, float]] = field(default_factory=list)
    """(size, seconds x compute share): size ``>= k`` overran a window this long on a slice with this
    compute share; not planned again into a window no longer at that share (scaled by the share for
    others, as the time model does before it learns a profile's speed), until a completion at a size
    ``>= k`` runs within it (durations are noisy: a stalled host, a slow neighbour can cause one
    timeout). A learned speed does not move the bound: on the very slice it overran, it is a fact."""
    observations: int = 0
    mem_bound: tuple[float, float] | None = None
    """(base, per unit) MiB: the declared peak ``base + per_unit * k`` the job vouches for (None: it
    declared none, or a measurement contradicted it)."""
    proven: list[tuple[int, float]] = field(default_factory=list)
    """(size, cap): a subjob of this size completed within ``cap`` MiB of usable memory, so any size
    no larger fits a cap no smaller (only the non-dominated pairs, at most ``PROVEN_KEPT``)."""
    declared: tuple[float, float] | None = None
    """(base, per unit) MiB the job declared, kept when a measurement contradicts it (``mem_bound``
    is then None): until its peaks are evidence enough (``mem_evidence``) it is planned no lower."""
    _evidence: Evidence | None = field(default=None, repr=False, compare=False)
    """``evidence()``, worked out once per calibration (None: not yet)."""
    _memo: dict[tuple[object, ...], float] | None = field(default=None, repr=False, compare=False)
    """Predictions already made, once ``freeze`` made the profile read-only (None: not remembered)."""

    def freeze(self) -> JobProfile:
        """Make the profile read-only: from now on its predictions are remembered (a planner asks the
        same ones for every offer, grant and re-plan until the next calibration), and updating it
        raises. A ``copy`` is a profile of its own, to update."""
        if self._memo is None:
            self._memo = {}
        return self

    def _updating(self) -> None:
        if self._memo is not None:
            raise RuntimeError("a frozen profile is read-only: update a copy")
        self._evidence = None

    def _remembered(self, key: tuple[object, ...], compute: Callable[[], float]) -> float:
        memo = self._memo
        if memo is None:
            return compute()
        got = memo.get(key)
        if got is None:
            if len(memo) >= MEMO_LIMIT:
                memo.clear()
            got = memo[key] = compute()
        return got

    @classmethod
    def from_declaration(cls, mem: MemoryDecl | None, time: TimeDecl, typical_units: int) -> JobProfile:
        """The prior a job starts from. ``mem`` is its declared peak memory, a bound it vouches for
        (``mem_bound``); ``None``, or a declaration of nothing (0 MiB at every size), gives a wide
        prior and no bound: the job is ``measuring`` until a first subjob's peak is measured."""
        bound: tuple[float, float] | None = None
        if mem is not None and (mem.base_mib > 0 or mem.per_unit_mib > 0):
            bound = (float(mem.base_mib), float(mem.per_unit_mib))
        else:
            mem = UNKNOWN_MEMORY
        return cls(
            mem_bound=bound,
            declared=bound,
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
                locality=MEMORY_LOCALITY,
            ),
            time=LinearPosterior.prior_from(
                time.warmup_s, time.per_unit_s, time.rel_sd, typical_units, min(time.rel_sd, TIME_NOISE_PRIOR)
            ),
        )

    # --- predictions ------------------------------------------------------------------------------

    @property
    def measuring(self) -> bool:
        """No declared bound and no measured peak yet: the job's memory is unknown, so its next
        subjob is a measuring one (the smallest size, on the largest slice: see the planner)."""
        return self.mem_bound is None and not self.proven and not any(b == 0.0 for _, _, b in self.mem.obs)

    def mem_ceiling(self, k: int) -> float:
        """The most memory a subjob of size ``k`` is planned for whatever the learned profile says:
        the declared bound at ``k`` and the caps of completed subjobs no smaller (``inf``: none)."""
        ceiling = math.inf
        if self.mem_bound is not None:
            ceiling = self.mem_bound[0] + self.mem_bound[1] * k
        for size, cap in self.proven:
            if size >= k and cap < ceiling:
                ceiling = cap
        return ceiling

    def mem_quantile(self, k: int, q: float) -> float:
        """The ``q`` quantile of peak memory at ``k``, non-decreasing in ``k`` (``LinearPosterior.upper``),
        never below the evidence bound of a declared job (``mem_evidence``) and never above the
        ceiling at ``k`` (``mem_ceiling``)."""
        return self._remembered(("mq", k, q), lambda: self._mem_quantile(k, q))

    def _mem_quantile(self, k: int, q: float) -> float:
        learned = max(self.mem.upper(k, q), 0.0)
        if self.evidence()[0] >= EVIDENCE_MIN_DOF:
            learned = max(learned, self.mem_evidence(k, q))
        elif self.mem_bound is not None:
            learned = math.inf  # too few peaks to leave the declaration: planned at its ceiling
        elif self.declared is not None:
            learned = max(learned, self._declared_at(k))  # it needed more than it declared: not less
        return min(learned, self.mem_ceiling(k))

    def mem_fit_probability(self, k: int, cap_mib: float) -> float:
        """P(peak <= cap) consistent with ``mem_quantile``: its q at which the quantile is the cap
        (1 where the ceiling at ``k`` is within the cap)."""
        if cap_mib < 0.0:
            return 0.0
        if self.mem_ceiling(k) <= cap_mib:
            return 1.0
        return self._remembered(("mp", k, cap_mib), lambda: self._mem_fit_probability(k, cap_mib))

    def _mem_fit_probability(self, k: int, cap_mib: float) -> float:
        p = self.mem.upper_cdf(k, cap_mib)
        if self.evidence()[0] >= EVIDENCE_MIN_DOF:
            p = min(p, self.mem_evidence_cdf(k, cap_mib))
        elif self.mem_bound is not None or (self.declared is not None and cap_mib < self._declared_at(k)):
            p = 0.0  # planned at its ceiling, or at least at what it declared: neither fits the cap
        return p

    def _declared_at(self, k: int) -> float:
        """The job's declared peak at ``k`` (``declared``; the caller checks it has one)."""
        assert self.declared is not None
        return self.declared[0] + self.declared[1] * k

    def evidence(self) -> Evidence:
        """(dof, n, mean, sd, largest, largest OOM, OOMs) of ``u = ln(peak / s(k))`` over the kept
        measured peaks, ``s`` the regression's reference line (its posterior mean as of the latest
        measured peak: an OOM since then does not move it), each peak weighed as the regression
        weighs it (its locality). ``n`` is the effective number of peaks (``(sum w)^2 / sum w^2``)
        and ``dof`` what is left of it once the line is fitted (one parameter per distinct size, at
        most two). ``largest`` is over the peaks the regression weighs at least half (far ones
        differ from the line by its shape as much as by the data). Every OOM the profile keeps
        (``oom_bounds``) is a peak above its cap by the measured spread (at most
        ``CENSORED_INFLATION``, the regression's own pseudo-value), whatever completed at its size
        since: ``largest OOM`` is the largest of them, ``OOMs`` their number. All 0 without a
        measured peak."""
        ev = self._evidence
        if ev is None:
            ev = (0.0, 0.0, 0.0, math.inf, -math.inf, -math.inf, 0.0)
            obs = self.mem.obs
            exact = [(x, y) for x, y, bound in obs if bound <= 0.0]
            if exact:
                scale = self._evidence_scale()
                weights = [
                    w for w, (_, _, bound) in zip(self.mem._weights(), obs, strict=True) if bound <= 0.0
                ]
                us = [math.log(max(y, 1e-9) / scale(x)) for x, y in exact]
                sw = sum(weights)
                n = sw * sw / max(sum(w * w for w in weights), 1e-300)
                dof = max(n - min(len({x for x, _ in exact}), 2), 0.0)
                mean = sum(w * u for w, u in zip(weights, us, strict=True)) / sw
                sd = math.inf
                if dof > 0.0:
                    ss = sum(w * (u - mean) ** 2 for w, u in zip(weights, us, strict=True)) / sw
                    sd = math.sqrt(ss * n / dof)
                top = max(u for u, w in zip(us, weights, strict=True) if w >= 0.5)
                above = min(sd, math.log(CENSORED_INFLATION))
                ooms = [
                    math.log(max(cap, 1e-9) / scale(float(size))) + above for size, cap in self.oom_bounds
                ]
                ev = (dof, n, mean, sd, top, max(ooms, default=-math.inf), float(len(ooms)))
            self._evidence = ev
        return ev

    def _evidence_scale(self) -> Callable[[float], float]:
        """The regression's reference line as of its latest exact observation (``s(x)``)."""
        s0, s1 = self.mem.s0, self.mem.s1
        if self.mem.held:
            s0, s1 = self.mem.held[0][8], self.mem.held[0][9]
        return lambda x: s0 + s1 * max(x, 0.0)

    def mem_evidence(self, k: int, q: float) -> float:
        """The lowest ``q`` quantile of peak memory at ``k`` that the observed peaks support
        (``inf``: too few to leave the ceiling). Peaks are taken relative to the regression's line
        ``s`` (``u = ln(peak / s(k))``, ``evidence``); with ``dof`` degrees of freedom left once the
        line is fitted and ``m`` OOMs, it is ``s(k)`` times ``exp`` of

        - the largest peak ``U`` when ``dof / (dof + m + 1) >= q``: a new peak exchangeable with the
          ``dof + m`` others exceeds the largest measured one with probability ``(m + 1) / (dof + m
          + 1)`` at most, whatever their distribution (the OOMs, above their caps, the largest);
        - ``max(U, U_oom)`` when ``dof / (dof + 1) >= q``: the largest of ``dof`` peaks and the OOMs;
        - otherwise, from ``EVIDENCE_MIN_DOF`` on, ``max(U, U_oom, mean(u) + t_dof(q) sd(u)
          sqrt(1 + 1/n))``, the log-normal predictive (a Student-t on the log scale: exact for
          peaks that vary log-normally between subjobs, at any number of them);
        - ``inf`` with fewer.

        Never below the largest peak seen near the latest size (scaled to ``k`` by the line)."""
        dof, n, mean, sd, top, top_oom, m = self.evidence()
        if dof < EVIDENCE_MIN_DOF:
            return math.inf
        u = top
        if dof < q * (dof + m + 1.0) - 1e-9:
            u = max(top, top_oom)
        if dof < q * (dof + 1.0) - 1e-9:
            u = max(u, mean + t_ppf(dof, q) * sd * math.sqrt(1.0 + 1.0 / n))
        return min(self._evidence_scale()(k) * math.exp(min(u, EXP_MAX)), HUGE_MIB)

    def mem_evidence_cdf(self, k: int, y: float) -> float:
        """P(peak <= y) consistent with ``mem_evidence``: the largest q whose bound is within ``y``."""
        dof, n, mean, sd, top, top_oom, m = self.evidence()
        if dof < EVIDENCE_MIN_DOF:
            return 0.0
        v = math.log(max(y, 1e-300) / self._evidence_scale()(k))
        if v < top:
            return 0.0
        p = dof / (dof + m + 1.0)  # the largest measured peak holds up to this q
        if v < top_oom:
            return p
        p = dof / (dof + 1.0)  # and with the OOMs, up to this one
        if sd > 0.0:
            z = (v - mean) / (sd * math.sqrt(1.0 + 1.0 / n))
            p = max(p, float(stdtr(dof, z)))
        elif v >= mean:
            p = 1.0
        return p

    def evidence_needed(self, q: float) -> int:
        """Degrees of freedom the distribution-free bound needs at ``q`` (``dof / (dof + 1) >= q``)."""
        return max(math.ceil(q / max(1.0 - q, 1e-12) - 1e-9), 0)

    def slowdown(self, profile: str, share: float) -> tuple[float, float]:
        """(mean, sd) of log(duration on this profile / full-speed duration)."""
        est = self.speed.get(profile, SpeedEstimate())
        return -math.log(share) + est.mean, math.sqrt(est.var)

    def duration_mean(self, k: int, profile: str, share: float) -> float:
        mu, _ = self.slowdown(profile, share)
        return max(self.time.mean(k), 0.0) * math.exp(mu)

    def _duration_at(self, k: int, q: float, z: float, slow: tuple[float, float], ppf: TPpf) -> float:
        mu, sd = slow
        return max(self.time.upper(k, q, ppf), 0.0) * math.exp(mu + z * sd)

    def duration_quantile(self, k: int, q: float, profile: str, share: float) -> float:
        """The ``q`` quantile of the full-speed duration times the ``q`` quantile of the profile's
        slowdown (conservative: both tails at once)."""
        return self._remembered(
            ("dq", k, q, profile, share),
            lambda: self._duration_at(k, q, _z_cached(q), self.slowdown(profile, share), t_ppf),
        )

    def duration_above(self, k: int, q: float, profile: str, share: float, length_s: float) -> bool:
        """A sufficient test, in a few operations, that ``duration_quantile(k, q, ...) > length_s``
        for ``q >= 0.5``: the time regression's mean at ``k`` (the location every quantile at or
        above the median adds a non-negative spread to, and conditioning on a lower bound only
        raises) times the slowdown's quantile, the same floating-point operations as the quantile's,
        is at most the quantile. ``False`` says nothing: the quantile must then be computed. A planner
        probing sizes far past what fits a window rules them out without a quantile."""
        if q < 0.5:
            return False
        mu, sd = self.slowdown(profile, share)
        z = _z_cached(q)
        return max(self.time.mu0 + self.time.mu1 * k, 0.0) * math.exp(mu + z * sd) > length_s

    def time_fit_probability(self, k: int, length_s: float, profile: str, share: float) -> float:
        """P(duration <= length) consistent with ``duration_quantile`` (``_time_fit_probability``)."""
        return self._remembered(
            ("tp", k, length_s, profile, share),
            lambda: self._time_fit_probability(k, length_s, profile, share),
        )

    def _time_fit_probability(self, k: int, length_s: float, profile: str, share: float) -> float:
        """P(duration <= length) consistent with ``duration_quantile``: the quantile is increasing in
        q, so the q at which it equals the length is found on the normal z of q by the Illinois
        method (regula falsi that halves a stale end: a handful of steps instead of 40 halvings),
        keeping the end where the quantile fits."""
        if length_s <= 0:
            return 0.0
        mu, sd = self.slowdown(profile, share)
        upper = self.time.upper_curve(k)

        def excess(u: float) -> float:
            # ``_duration_at(k, ndtr(u), u, ...)``; each step asks for a new q: the t quantiles
            # are not cached
            return max(upper(float(ndtr(u)), _t_ppf_raw), 0.0) * math.exp(mu + u * sd) - length_s

        lo, hi = -Z_MAX, Z_MAX
        f_lo, f_hi = excess(lo), excess(hi)
        if f_lo > 0.0:
            return 0.0
        if f_hi <= 0.0:
            return 1.0
        side = 0
        for _ in range(100):
            if hi - lo <= 1e-8:
                break
            u = hi - f_hi * (hi - lo) / (f_hi - f_lo)
            if not lo < u < hi:
                u = 0.5 * (lo + hi)
            f_u = excess(u)
            if f_u <= 0.0:
                lo, f_lo = u, f_u
                if side < 0:
                    f_hi *= 0.5
                side = -1
            else:
                hi, f_hi = u, f_u
                if side > 0:
                    f_lo *= 0.5
                side = 1
        return float(ndtr(lo))

    def max_size_under_bounds(self, mem_cap_mib: float, length_s: float, share: float) -> int | None:
        """Largest size allowed by past OOMs and timeouts for a slice with this much memory and a
        window this long at this compute share (None: unbounded)."""
        limit: int | None = None
        for size, cap in self.oom_bounds:
            if mem_cap_mib <= cap:
                limit = size - 1 if limit is None else min(limit, size - 1)
        for size, bound_len in self.timeout_bounds:
            if length_s * share <= bound_len:
                limit = size - 1 if limit is None else min(limit, size - 1)
        return limit

    # --- calibration ------------------------------------------------------------------------------

    def observe(
        self,
        k: int,
        peak_mem_mib: float,
        duration_s: float,
        profile: str,
        share: float,
        cap_mib: float = 0.0,
    ) -> None:
        """A completed subjob: both measurements are exact observations; ``cap_mib`` (the usable
        memory it ran under, 0: unknown) proves that size fits that cap (``proven``)."""
        self._updating()
        self.observe_memory(k, peak_mem_mib, cap_mib)
        self.observe_duration(k, duration_s, profile, share)
        self.observations += 1

    def observe_memory(self, k: int, peak_mem_mib: float, cap_mib: float = 0.0) -> None:
        self._updating()
        self._contradict(k, peak_mem_mib, strict=True)
        if cap_mib > 0.0 and peak_mem_mib <= cap_mib:
            _add_proven(self.proven, k, cap_mib)
        self.mem.update(k, peak_mem_mib)

    def _contradict(self, k: int, mib: float, *, strict: bool) -> None:
        """The job needed more than ``mib`` at size ``k`` (``strict``: it needed exactly ``mib``, a
        measured peak): drop the ceilings that said it would not."""
        if self.mem_bound is not None:
            at_k = self.mem_bound[0] + self.mem_bound[1] * k
            if (mib > at_k) if strict else (mib >= at_k):
                self.mem_bound = None
        self.proven = [
            (size, cap)
            for size, cap in self.proven
            if not (size >= k and ((mib > cap) if strict else (mib >= cap)))
        ]

    def observe_duration(self, k: int, duration_s: float, profile: str, share: float) -> None:
        self._updating()
        predicted_full = max(self.time.mean(k), 1e-6)
        est = self.speed.setdefault(profile, SpeedEstimate())
        log_ratio = math.log(max(duration_s, 1e-6) / predicted_full) + math.log(share)
        est.update(log_ratio)
        # a size >= k finished within a length a timeout said it could not, or a smaller one so
        # fast that the line cannot reach it (STALL_MARGIN): that timeout was noise or a stall
        done = duration_s * share
        self.timeout_bounds = [
            (s, lim) for s, lim in self.timeout_bounds if not _contradicted(k, done, s, lim, STALL_MARGIN)
        ]
        mu, _ = self.slowdown(profile, share)
        self.time.update(k, duration_s / math.exp(mu), STALL_MARGIN)

    def observe_oom(self, k: int, cap_mib: float, peak_seen_mib: float = 0.0) -> None:
        """Peak memory at size ``k`` exceeded ``cap_mib`` (censored from below)."""
        self._updating()
        self._contradict(k, cap_mib, strict=False)
        self._contradict(k, peak_seen_mib, strict=True)
        _add_bound(self.oom_bounds, k, cap_mib)
        self.mem.observe_censored(k, max(cap_mib, peak_seen_mib))
        self.observations += 1

    def observe_timeout(self, k: int, cap_s: float, profile: str, share: float) -> None:
        """Duration at size ``k`` exceeded ``cap_s`` on this profile (censored from below)."""
        self._updating()
        mu, _ = self.slowdown(profile, share)
        _add_bound(self.timeout_bounds, k, cap_s * share)
        self.time.observe_censored(k, cap_s / math.exp(mu))
        self.observations += 1

    def copy(self) -> JobProfile:
        """An independent copy to update (what ``from_state(self.to_state())`` gives, without
        refitting)."""
        return JobProfile(
            mem=self.mem.copy(),
            time=self.time.copy(),
            speed={k: SpeedEstimate(mean=v.mean, var=v.var, n=v.n) for k, v in self.speed.items()},
            oom_bounds=list(self.oom_bounds),
            timeout_bounds=list(self.timeout_bounds),
            observations=self.observations,
            mem_bound=self.mem_bound,
            proven=list(self.proven),
            declared=self.declared,
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
            mem_bound=list(self.mem_bound) if self.mem_bound is not None else [],
            proven=list(self.proven),
            mem_declared=list(self.declared) if self.declared is not None else [],
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
            mem_bound=_pair(state.mem_bound),
            proven=[(int(k), float(c)) for k, c in state.proven],
            declared=_pair(state.mem_declared) or _pair(state.mem_bound),
        )
