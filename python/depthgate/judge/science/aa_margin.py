"""The margin at which an A/A release passes (issue #22, item 5).

The noise floor used to recommend the smallest margin that the *point* difference |Δ| of an A/A slice
does not breach. The gate does not compare |Δ| with M: a slice passes when its one-sided *lower bound*
exceeds −M, and the release needs every slice (and the bound sits well below Δ). A fresh A/A release
gated at that recommendation FAILed .53–.63 of the time.

Here the recommendation is the smallest margin (0.01 steps) at which a simulated A/A release of the
same design passes with the plan's target probability (``GatePlan.power``, 0.8 by default), reported
with that probability:

1. **Flip rate, upper bound, clustered by case.** The pooled flip rate φ̂ of the A/A run is replaced by
   its one-sided (1 − α) Clopper–Pearson upper bound on the case-clustered effective sample size (the
   exact binomial bound at n_eff = N / D, count φ̂ n_eff; D the Kish design effect of the per-case flip
   rates, shrunk toward R when few runs flip: ``depthgate.judge.bounds.design_effect``). A cluster is one case
   *across every slice* (issue #39 item 5): the slices of a matrix are the same cases shifted, and a case
   that flips at one depth tends to flip at the others, so R is slices × seeds. With no flip the design
   effect cannot be estimated and is R: n_eff is the number of cases (12 cases × 10 slices, no flip:
   upper bound 1 − 0.05^(1/12) = 0.221, where clusters of one slice each said 1 − 0.05^(1/120) = 0.025).
2. **Simulated A/A releases.** Per slice, cases are resampled from the A/A run's own cases (their flip
   rates scaled so that the mean is the upper bound, so flips stay clustered in the unstable cases;
   uniform when no run flipped), each run flips with its case's rate, a flip goes either way with
   probability 1/2 (A/A exchangeability), and an unflipped pair passes in both arms with the case's
   pass rate. Slices are drawn independently (the real slices share cases and pass together more
   often: conservative).
3. **The pass curve.** The gate's slice lower bound does not depend on M, so one simulation gives
   P(every slice's bound > −M) for every M at once: the recommendation is the smallest M on the grid
   with that probability >= the target.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from statsmodels.stats.proportion import proportion_confint

from depthgate.judge.bounds import shrunk_design_effect, slice_lower
from depthgate.judge.gate import stable_seed

__all__ = ["AaCase", "AaMargin", "aa_release_margin", "clustered_flip_upper"]

FloatArray = npt.NDArray[np.float64]
_STEP = 0.01


@dataclass(frozen=True)
class AaCase:
    """One case of one A/A slice: ``runs`` paired runs, ``flips`` of them differ, ``passes`` the passing
    outcomes over both arms (2 x runs outcomes)."""

    runs: int
    flips: int
    passes: int


def clustered_flip_upper(cases: Sequence[AaCase], alpha: float) -> tuple[float, float]:
    """(upper bound, design effect): one-sided (1 − alpha) Clopper–Pearson upper bound of the pooled
    flip rate on the case-clustered effective sample size (module docstring, step 1)."""
    runs = np.array([c.runs for c in cases], dtype=np.float64)
    flips = np.array([c.flips for c in cases], dtype=np.float64)
    total = float(runs.sum())
    if total <= 0:
        return 1.0, 1.0
    rate = float(flips.sum()) / total
    r = total / len(cases)
    per_case = flips / np.maximum(runs, 1.0)
    var_srs = rate * (1.0 - rate) / total
    d_hat = float(per_case.var(ddof=1)) / len(cases) / var_srs if var_srs > 0 and len(cases) > 1 else r
    deff = shrunk_design_effect(d_hat, float(flips.sum()), r)
    n_eff = total / deff
    _, upper = proportion_confint(rate * n_eff, n_eff, alpha=2.0 * alpha, method="beta")
    return float(min(max(upper, rate), 1.0)), float(deff)


@dataclass(frozen=True)
class AaMargin:
    """:func:`aa_release_margin` output. ``margin``: the recommendation; ``pass_probability``: the
    simulated P(A/A release passes) at it; ``target``: the probability asked for; ``flip_rate_upper``
    and ``deff``: step 1; ``sims``: simulated releases; ``curve``: (margin, pass probability) on the
    grid up to the recommendation; ``binding_slice``: the slice index with the lowest bound most often."""

    margin: float
    pass_probability: float
    target: float
    flip_rate: float
    flip_rate_upper: float
    deff: float
    sims: int
    curve: tuple[tuple[float, float], ...]
    binding_slice: int


def aa_release_margin(
    slices: Sequence[Sequence[AaCase]],
    *,
    seeds: int,
    alpha: float,
    target: float,
    sims: int = 200,
    bootstrap_resamples: int = 999,
    seed: int = 0,
    n_cases: int | None = None,
    clusters: Sequence[AaCase] | None = None,
) -> AaMargin:
    """The smallest margin at which a simulated A/A release of these ``slices`` (each a list of its
    cases) at ``seeds`` runs per case passes with probability >= ``target`` (module docstring).
    ``n_cases``: cases per simulated slice (default: the slice's own count); ``clusters``: each case's
    runs summed over every slice, for the upper bound (default: each (slice, case) its own cluster)."""
    everything = [c for cases in slices for c in cases]
    upper, deff = clustered_flip_upper(list(clusters) if clusters is not None else everything, alpha)
    total_runs = sum(c.runs for c in everything)
    rate = sum(c.flips for c in everything) / total_runs if total_runs else 0.0
    rng = np.random.default_rng(stable_seed(seed, "aa_release_margin"))
    worst = np.empty(sims)
    binding = np.zeros(len(slices), dtype=np.int64)
    for i in range(sims):
        lows = []
        for s, cases in enumerate(slices):
            yb, yc = _draw_slice(rng, cases, n_cases or len(cases), seeds, upper, rate)
            lows.append(slice_lower(yb, yc, alpha, bootstrap_resamples, stable_seed(seed, "aa", i, s)))
        worst[i] = -min(lows)
        binding[int(np.argmin(lows))] += 1
    grid = [round(_STEP * k, 10) for k in range(1, 100)]
    curve: list[tuple[float, float]] = []
    chosen, prob = grid[-1], float(np.mean(worst < grid[-1]))
    for m in grid:
        p = float(np.mean(worst < m))  # passes iff every slice's lower bound > -m
        curve.append((m, p))
        if p >= target:
            chosen, prob = m, p
            break
    return AaMargin(
        margin=chosen,
        pass_probability=prob,
        target=target,
        flip_rate=rate,
        flip_rate_upper=upper,
        deff=deff,
        sims=sims,
        curve=tuple(curve),
        binding_slice=int(np.argmax(binding)),
    )


def _draw_slice(
    rng: np.random.Generator, cases: Sequence[AaCase], n: int, seeds: int, upper: float, rate: float
) -> tuple[FloatArray, FloatArray]:
    """One simulated A/A slice (module docstring, step 2): (baseline, candidate) of shape (n, seeds)."""
    pick = rng.integers(0, len(cases), size=n)
    flip_rates = np.array([cases[j].flips / max(cases[j].runs, 1) for j in pick])
    pass_rates = np.array([cases[j].passes / max(2 * cases[j].runs, 1) for j in pick])
    phi = np.minimum(flip_rates * (upper / rate), 1.0) if rate > 0 else np.full(n, upper)
    flipped = rng.random((n, seeds)) < phi[:, None]
    up = rng.random((n, seeds)) < 0.5
    both = (rng.random((n, seeds)) < pass_rates[:, None]).astype(np.float64)
    yb = np.where(flipped, np.where(up, 0.0, 1.0), both)
    yc = np.where(flipped, np.where(up, 1.0, 0.0), both)
    return yb, yc


def ceil_step(value: float) -> float:
    """``value`` rounded up to the 0.01 grid."""
    return round(math.ceil(value / _STEP - 1e-9) * _STEP, 10)
