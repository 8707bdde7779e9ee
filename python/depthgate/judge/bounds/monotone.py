"""Lower bounds that never rise when a run fails (issue #22, item 3).

The floor bound is a Wilson bound on n_eff = n R / DEFF with the Kish design effect estimated from the
spread of the per-case accuracies. DEFF is not monotone in the data: 40 all-pass cases at R = 3 have no
spread, so DEFF = R (worst case) and the bound is Wilson(40/40) = 0.937; one failed run gives a spread
from which DEFF ≈ 1.008 is estimated, and the bound of 119 passes in 120 runs is 0.963 — one more
failure *raised* the bound, and a floor of 0.95 FAILs the perfect slice and PASSes the worse one.

The fix is the **monotone envelope**: the bound of the data is the smallest Kish-Wilson bound over every
data set with at least as many passes in every case (the data themselves included). Adding a failure
only enlarges that set, so the envelope never rises; it is never above the plain bound, so it is at
least as conservative. It is exact and cheap: the Kish-Wilson bound depends on the data through
S1 = Σ k_i and S2 = Σ k_i² (k_i = passes of case i), it rises with S1 and falls with S2 (more spread, a
larger DEFF, a smaller n_eff), and among the completions with a given S1 the largest S2 comes from
filling the cases with the most passes first. The envelope is therefore the minimum along that one
path, O(n R) closed-form Wilson bounds. Near the ceiling it stays at the all-pass bound Wilson(n/n)
until the failures themselves pull the bound lower; away from the ceiling it equals the plain bound.
"""

from __future__ import annotations

import math
import statistics

import numpy as np
import numpy.typing as npt

__all__ = ["monotone_floor_lower_bound"]

FloatArray = npt.NDArray[np.float64]


def _wilson_lower(p: FloatArray, nobs: FloatArray, alpha: float) -> FloatArray:
    """One-sided (1 - alpha) Wilson lower bound, vectorized (the closed form of proportion_confint's
    "wilson" at 2 alpha, as ``depthgate.judge.bounds._wilson_interval``)."""
    z = statistics.NormalDist().inv_cdf(1.0 - alpha)
    denom = 1.0 + z * z / nobs
    center = (p + z * z / (2.0 * nobs)) / denom
    half = z * np.sqrt(np.maximum(p * (1.0 - p) / nobs + z * z / (4.0 * nobs * nobs), 0.0)) / denom
    out: FloatArray = np.maximum(center - half, 0.0)
    return out


def _kish_wilson(s1: FloatArray, s2: FloatArray, n: int, r: int, alpha: float) -> FloatArray:
    """Kish-Wilson floor bound of every (S1, S2) state: n cases of r runs, S1 passes, S2 = Σ k_i²."""
    p = s1 / (n * r)
    mean_sq = s2 / (r * r)
    var = np.maximum(mean_sq - n * p * p, 0.0) / (n - 1) if n > 1 else np.zeros_like(p)
    srs = p * (1.0 - p)
    with np.errstate(divide="ignore", invalid="ignore"):
        deff = np.where(srs > 0, np.clip(r * var / np.where(srs > 0, srs, 1.0), 1.0, r), float(r))
    if n < 2:
        deff = np.full_like(p, float(r))
    n_eff = n * r / deff
    return _wilson_lower(p, n_eff, alpha)


def monotone_floor_lower_bound(per_case_rates: npt.ArrayLike, runs_per_case: float, alpha: float) -> float:
    """The smallest Kish-Wilson floor bound over the data and every completion of it with more passes
    (module docstring). ``per_case_rates`` are pass shares of ``runs_per_case`` runs (rounded to whole
    runs: a case's share is taken on the grid of R runs, rounding its pass count down)."""
    rates = np.asarray(per_case_rates, dtype=np.float64)
    n = int(rates.size)
    r = max(1, round(float(runs_per_case)))
    k = np.clip(np.floor(rates * r + 1e-9), 0, r).astype(np.int64)
    order = np.sort(k)[::-1]
    steps: list[int] = []  # the pass count of the case raised at each step, largest cases first
    for value in order:
        steps.extend(range(int(value), r))
    s1 = float(k.sum())
    s2 = float((k * k).sum())
    if steps:
        current = np.asarray(steps, dtype=np.float64)
        s1_path = s1 + np.arange(0, len(steps) + 1, dtype=np.float64)
        s2_path = s2 + np.concatenate(([0.0], np.cumsum(2.0 * current + 1.0)))
    else:
        s1_path, s2_path = np.array([s1]), np.array([s2])
    bounds = _kish_wilson(s1_path, s2_path, n, r, alpha)
    return float(min(bounds.min(), math.inf))
