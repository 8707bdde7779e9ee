"""Pre-registered sequential gating (issue #26): the boundary of every look and the decision of a slice
at a look.

The plan names looks as information fractions t_1 < ... < t_K = 1 of the planned cases (a look at t_k
holds the first ceil(t_k n) cases of the run's frozen case order, every seed on both arms) and a
boundary family:

* ``"obrien-fleming"``: the Lan-DeMets alpha-spending function of O'Brien-Fleming type, one-sided,
  alpha(t) = 2 (1 - Phi(z_{1 - alpha/2} / sqrt t)). Each look's nominal level alpha_k solves
  P(no earlier crossing, crossing at look k) = alpha(t_k) - alpha(t_{k-1}) for a Brownian motion
  observed at the t_k (the canonical joint distribution of group-sequential z-statistics), computed by
  recursive numerical integration on a fixed grid, so the levels are identical in every process. The
  gate's own slice statistic is then used unchanged at the look's level: non-inferiority is shown when
  the slice's one-sided (1 - alpha_k) lower bound is > -M; a regression is confirmed when the
  regression family's adjusted q <= alpha_k (the same spending on the regression side).
* ``"power-4"``: the same recursion with the Kim-DeMets power spending function alpha t^4, which spends
  less before the last look than O'Brien-Fleming (four equal looks at .05: .0002, .0030, .0148, .0467
  against .00009, .0055, .0219, .0427), so the last look's level stays closer to the fixed design's;
* ``"power-5"``: alpha t^5, which spends less again; with many late looks (eight, at 30, 40, ..., 100 %
  of the cases) it keeps the power within .02 of the fixed design where power-4 does not (.027), and
  sends .69 of the fixed design's requests at delta = 0 (docs/gate-calibration.md §8.7);
* ``"haybittle-peto"``: every interim look at the fixed nominal level .001 (z 3.09), the last look at
  the level that spends what is left (.0494 after three interim looks);
* ``"confidence-sequence"``: an anytime-valid test by betting on the paired per-case differences
  d_i in [-1, 1] (Waudby-Smith & Ramdas 2023, predictable aGRAPA bets): the wealth of a bettor against
  H0: delta <= -M is a non-negative supermartingale under H0, so by Ville's inequality stopping when it
  reaches 1/alpha at any time holds alpha whatever the looks. Kept for comparison: it loses power
  against the fixed design (docs/gate-calibration.md §8 measures how much).

The simulation that chose between them is ``scripts/sequential_calibration.py``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
from statsmodels.stats.multitest import multipletests

from depthgate.judge.bounds import slice_statistics
from depthgate.judge.sequential.levels import (
    GRID_STEP,
    FloatArray,
    z_upper,
)

__all__ = [
    "LookDecision",
    "betting_wealth",
    "expected_share",
    "look_outcome",
    "regression_q",
    "slice_decision",
]


def expected_share(
    fractions: Sequence[float], upper: Sequence[float], lower: Sequence[float], drift: float
) -> float:
    """The expected share of the cases a slice uses, normal approximation: the NI statistic Z_k of look
    k is W(t_k)/sqrt(t_k) for a Brownian motion W with ``drift`` (the full-information z, (delta + M) /
    sd * sqrt n); the slice stops at look k when Z_k > z(``upper[k]``) (non-inferiority) or Z_k <
    -z(``lower[k]``) (regression confirmed at that one-sided level on the other side of -M)."""
    share = 0.0
    t_prev = 0.0
    grid: FloatArray | None = None
    density: FloatArray | None = None
    alive = 1.0
    for t, up, low in zip(fractions, upper, lower, strict=True):
        dt = t - t_prev
        sd_t = math.sqrt(t)
        hi, lo = z_upper(up) * sd_t, -z_upper(low) * sd_t
        new_grid = np.arange(lo, hi, GRID_STEP) + GRID_STEP / 2
        mean_shift = drift * dt
        if grid is None or density is None:
            new_density = np.exp(-0.5 * (new_grid - mean_shift) ** 2 / dt) / math.sqrt(2.0 * math.pi * dt)
        else:
            kernel = np.exp(-0.5 * (new_grid[:, None] - grid[None, :] - mean_shift) ** 2 / dt)
            new_density = kernel @ density * GRID_STEP / math.sqrt(2.0 * math.pi * dt)
        still = float(np.sum(new_density) * GRID_STEP) if t < 1.0 else 0.0
        share += (alive - still) * t
        alive, grid, density, t_prev = still, new_grid, new_density, t
    return share


# --------------------------------------------------------------------------------------------------
# one slice at one look


@dataclass(frozen=True)
class LookDecision:
    """One slice at one look: its statistics and what the look decided (``"PASS"``: non-inferiority
    shown; ``"FAIL_REGRESSION"``: set by :func:`regression_q` over the family; None: continue)."""

    n_cases: int
    delta: float
    lower: float
    p_ni: float
    p_reg: float
    decision: str | None


def betting_wealth(differences: npt.ArrayLike, margin: float, *, against: str = "inferior") -> FloatArray:
    """The running wealth of a bettor against H0 on the mean of per-case ``differences`` in [-1, 1], in
    case order (predictable aGRAPA bets on x = (d + 1) / 2, capped at 3/4 of the largest fair bet).

    ``against = "inferior"``: H0 delta <= -M (wealth grows when the candidate is non-inferior);
    ``"regression"``: H0 delta >= -M. Under H0 the wealth is a non-negative supermartingale."""
    x = (np.asarray(differences, dtype=np.float64) + 1.0) / 2.0
    m = (1.0 - margin) / 2.0
    sign = 1.0 if against == "inferior" else -1.0
    cap = 0.75 / (m if sign > 0 else 1.0 - m)
    wealth = np.empty(x.size)
    w, total, squares, count = 1.0, 0.5, 0.25, 1.0  # one prior pseudo-case at d = 0 with variance 1/4
    for i, xi in enumerate(x):
        mean = total / count
        var = max(squares / count - mean * mean, 1e-4)
        edge = sign * (mean - m)
        bet = 0.0 if edge <= 0 else min(cap, edge / (var + edge * edge))
        w *= 1.0 + bet * sign * (xi - m)
        wealth[i] = w
        total += xi
        squares += xi * xi
        count += 1.0
    return wealth


def slice_decision(
    baseline: npt.ArrayLike,
    candidate: npt.ArrayLike,
    margin: float,
    level: float,
    reps: int,
    seed: int,
    *,
    boundary: str = "obrien-fleming",
    seeds_planned: int | None = None,
) -> LookDecision:
    """The slice at one look from its (cases, seeds) 0/1 arrays (the look's cases, in the frozen case
    order). O'Brien-Fleming: the gate's slice statistic at the look's nominal ``level``; PASS iff its
    lower bound is > -M. Confidence sequence: PASS iff the betting wealth against delta <= -M has reached
    1 / ``level``; p-values are 1 / (running maximum of the wealth), anytime-valid."""
    yb = np.asarray(baseline, dtype=np.float64)
    yc = np.asarray(candidate, dtype=np.float64)
    d_case = np.nanmean(yc, axis=1) - np.nanmean(yb, axis=1)
    if boundary == "confidence-sequence":
        up = float(np.max(betting_wealth(d_case, margin)))
        down = float(np.max(betting_wealth(d_case, margin, against="regression")))
        p_ni, p_reg = min(1.0, 1.0 / up), min(1.0, 1.0 / down)
        shown = p_ni <= level
        return LookDecision(
            len(d_case), float(d_case.mean()), math.nan, p_ni, p_reg, "PASS" if shown else None
        )
    st = slice_statistics(yb, yc, margin, level, reps, seed, seeds_planned=seeds_planned)
    shown = st.lower > -margin
    return LookDecision(st.n_cases, st.delta, st.lower, st.p_ni, st.p_reg, "PASS" if shown else None)


def look_outcome(
    q_reg: float,
    level: float,
    shown: bool,
    p_reg: float,
    futility: float | None,
    *,
    regression_level: float | None = None,
) -> str | None:
    """What one interim look decides for a slice, in this order: ``"FAIL_REGRESSION"`` (its
    family-adjusted regression q <= the look's ``regression_level``, :func:`regression_levels`; the
    look's ``level`` when None), ``"PASS"`` (non-inferiority shown at the look's ``level``),
    ``"FUTILITY"`` (its own, unadjusted regression p-value <= ``futility``: the upper bound of delta lies
    below -M, so non-inferiority cannot reasonably be shown; the slice FAILs as not shown, no regression
    is claimed), or None (continue). The regression is tested first, at a level it can reach, so
    futility closes only a slice whose regression this look cannot confirm (issue #36, F2). Futility is
    non-binding: it only ever stops a slice as a FAIL, so the size of the non-inferiority test (the PASS
    boundary) is untouched; its price is the chance that an A/A slice that would have passed is stopped,
    measured in docs/gate-calibration.md §8."""
    if q_reg <= (level if regression_level is None else regression_level):
        return "FAIL_REGRESSION"
    if shown:
        return "PASS"
    if futility is not None and p_reg <= futility:
        return "FUTILITY"
    return None


def regression_q(p_values: Sequence[float], level: float, method: str = "BY") -> list[float]:
    """The regression family's adjusted q-values at one look (BY or Holm over every planned slice; a
    slice already decided, or not tested, enters with p = 1). A slice's regression is confirmed at the
    look when its q <= the look's level."""
    if not p_values:
        return []
    name = {"BY": "fdr_by", "holm": "holm", "BH": "fdr_bh"}[method]
    return [
        float(q) for q in multipletests(np.asarray(p_values, dtype=np.float64), alpha=level, method=name)[1]
    ]
