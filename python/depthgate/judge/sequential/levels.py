"""The boundaries of a sequential plan: each look's nominal level on the non-inferiority side and on the
regression side, from the plan's spending family (Lan-DeMets O'Brien-Fleming, Kim-DeMets power,
Haybittle-Peto) by the recursive integration of Armitage, McPherson and Rowe, and the smallest level any
look tests at. Numerics only: no statistics of a slice, so the gate plan can check a plan's bootstrap size
at these levels when it is frozen, before any request (issue #36, F1), without importing the gate.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Sequence
from functools import lru_cache
from statistics import NormalDist
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt

__all__ = [
    "BOUNDARIES",
    "DEFAULT_BOUNDARY",
    "GRID_STEP",
    "HAYBITTLE_PETO_INTERIM",
    "REGRESSION_SPENDING",
    "Boundary",
    "FloatArray",
    "cases_at_looks",
    "look_fractions",
    "nominal_levels",
    "obf_spending",
    "regression_levels",
    "smallest_look_level",
    "z_upper",
]

Boundary = Literal["obrien-fleming", "haybittle-peto", "power-4", "power-5", "confidence-sequence"]
BOUNDARIES: tuple[str, ...] = get_args(Boundary)
#: Haybittle-Peto: the nominal one-sided level of every interim look (the textbook p < .001, z 3.09).
HAYBITTLE_PETO_INTERIM = 0.001
#: The spending family of the regression side (H0: delta >= -M, confirmed when the family's q <= the
#: look's regression level), alpha t: the non-inferiority families spend almost nothing early (power-5 at
#: eight looks: 1.2e-4 at 30 % of the cases), a level no bootstrap p-value of a BY family can reach
#: (q >= n c(n) / (B + 1)), so futility closed a slice losing badly before its regression could be
#: confirmed (issue #36, F2). The two sides test disjoint hypotheses, so each spends its own alpha; the
#: regression side's levels (eight looks from 30 %: .015, .011, ..., .021 at the last) are reachable at
#: every look once B serves the smallest (:func:`depthgate.spec.models.plan_violations`).
REGRESSION_SPENDING = "power-1"
#: The family a plan gets when it names none: the one whose power stays within .02 of the fixed design in
#: every simulated cell (docs/gate-calibration.md §8.6; O'Brien-Fleming fell .032 short).
DEFAULT_BOUNDARY = "power-4"
FloatArray = npt.NDArray[np.float64]

#: Grid of the recursive integration (Armitage-McPherson-Rowe): step and lower cut of the Brownian
#: motion's value; the mass below -10 sd is < 1e-23.
GRID_STEP = 0.005
_GRID_SDS = 10.0
_NORMAL = 0.5 * math.sqrt(2.0)


_ERFC = np.vectorize(math.erfc, otypes=[np.float64])


def _phi_upper(x: npt.ArrayLike) -> FloatArray:
    """1 - Phi(x), elementwise (erfc: accurate far in the tail)."""
    return np.asarray(0.5 * _ERFC(np.asarray(x, dtype=np.float64) * _NORMAL), dtype=np.float64)


def z_upper(p: float) -> float:
    """The z with 1 - Phi(z) = p."""
    return -NormalDist().inv_cdf(p)


def _solve(f: Callable[[float], float], low: float, high: float) -> float:
    """The root of a decreasing ``f`` on [low, high] by bisection (to 1e-10)."""
    for _ in range(200):
        mid = 0.5 * (low + high)
        if f(mid) > 0:
            low = mid
        else:
            high = mid
        if high - low < 1e-10:
            break
    return 0.5 * (low + high)


def obf_spending(t: float, alpha: float) -> float:
    """The one-sided Lan-DeMets O'Brien-Fleming-type alpha spent by information fraction ``t``."""
    if t <= 0.0:
        return 0.0
    spent = float(2.0 * _phi_upper(z_upper(alpha / 2.0) / math.sqrt(min(t, 1.0))))
    return min(alpha, spent)


def look_fractions(looks: Sequence[float] | None, every: int | None, n_cases: int) -> tuple[float, ...]:
    """The looks as information fractions ending at 1: ``looks`` as given, or a look every ``every``
    cases of ``n_cases`` (the last look at all of them)."""
    if looks is not None:
        out = tuple(float(t) for t in looks)
    elif every is not None and every >= 1:
        marks = [*range(every, n_cases, every), n_cases]
        out = tuple(m / n_cases for m in marks)
    else:
        raise ValueError("give looks (fractions) or every (cases per look)")
    if not out or out[-1] != 1.0 or any(b <= a for a, b in itertools.pairwise(out)) or out[0] <= 0:
        raise ValueError(f"looks {list(out)} must increase strictly in (0, 1] and end at 1")
    return out


def cases_at_looks(fractions: Sequence[float], n_cases: int) -> tuple[int, ...]:
    """How many of the frozen case order each look holds: ceil(t n), at least 2, strictly increasing
    (a look that would add no case is the next look's)."""
    counts: list[int] = []
    for t in fractions:
        c = min(n_cases, max(2, math.ceil(t * n_cases - 1e-9)))
        if counts and c <= counts[-1]:
            continue
        counts.append(c)
    if counts[-1] != n_cases:
        counts.append(n_cases)
    return tuple(counts)


def _excess(crossing: Callable[[float], float], target: float, bound: float) -> float:
    return crossing(bound) - target


def _power_rho(family: str) -> float:
    """The exponent of a Kim-DeMets power spending family alpha t^rho named ``power-<rho>`` (plans name
    power-4 or power-5, BOUNDARIES; any exponent is for the calibration script's frontier)."""
    return float(family.removeprefix("power-"))


def _spent(family: str, t: float, alpha: float) -> float:
    """The alpha a spending family has spent by information fraction ``t`` (Haybittle-Peto spends
    everything left at the last look; its interim bounds are fixed, not spent)."""
    if family.startswith("power-"):
        return alpha * float(min(t, 1.0) ** _power_rho(family))
    if family == "haybittle-peto":
        return alpha
    return obf_spending(t, alpha)


@lru_cache(maxsize=256)
def _spending_levels(fractions: tuple[float, ...], alpha: float, family: str) -> tuple[float, ...]:
    levels: list[float] = []
    spent_before = 0.0
    # Sub-density of W(t) on the grid over the paths that have not crossed yet (None before look 1).
    grid = np.zeros(1)
    density: FloatArray | None = None
    t_prev = 0.0
    for t in fractions:
        target = _spent(family, t, alpha) - spent_before
        dt = t - t_prev
        sd_t = math.sqrt(t)
        prior = density

        def crossing(b: float, g: FloatArray = grid, f: FloatArray | None = prior, dt: float = dt) -> float:
            if f is None:
                return float(_phi_upper(b / math.sqrt(dt)))
            return float(np.sum(f * _phi_upper((b - g) / math.sqrt(dt))) * GRID_STEP)

        if family == "haybittle-peto" and t < 1.0:
            bound = z_upper(HAYBITTLE_PETO_INTERIM) * sd_t
        elif target <= 1e-15:
            bound = 40.0 * sd_t
        else:
            bound = _solve(functools.partial(_excess, crossing, target), -_GRID_SDS * sd_t, 40.0 * sd_t)
        levels.append(float(_phi_upper(bound / sd_t)))
        spent_before += crossing(bound)
        new_grid = np.arange(-_GRID_SDS * sd_t, bound, GRID_STEP)
        if prior is None:
            new_density = np.exp(-0.5 * new_grid**2 / dt) / math.sqrt(2.0 * math.pi * dt)
        else:
            kernel = np.exp(-0.5 * (new_grid[:, None] - grid[None, :]) ** 2 / dt) / math.sqrt(
                2.0 * math.pi * dt
            )
            new_density = kernel @ prior * GRID_STEP
        grid, density, t_prev = new_grid, new_density, t
    return tuple(levels)


def nominal_levels(
    fractions: Sequence[float], alpha: float, boundary: str = "obrien-fleming"
) -> tuple[float, ...]:
    """The one-sided nominal level of every look. O'Brien-Fleming: from the spending function (the
    levels spend at most ``alpha`` in total); confidence sequence: ``alpha`` at every look (the
    wealth's running maximum is compared with 1/alpha, Ville's inequality holds it at any look)."""
    key = tuple(float(t) for t in fractions)
    if boundary in ("obrien-fleming", "haybittle-peto") or boundary.startswith("power-"):
        return _spending_levels(key, float(alpha), boundary)
    if boundary == "confidence-sequence":
        return tuple(float(alpha) for _ in key)
    raise ValueError(f"unknown boundary {boundary!r}; use one of {list(BOUNDARIES)}")


def regression_levels(fractions: Sequence[float], alpha: float, boundary: str) -> tuple[float, ...]:
    """The one-sided level of every look's regression confirmation: :data:`REGRESSION_SPENDING` (alpha t)
    for the spending families, whatever the non-inferiority side spends; ``alpha`` at every look for the
    confidence sequence (its regression p-value is anytime-valid)."""
    if boundary == "confidence-sequence":
        return nominal_levels(fractions, alpha, boundary)
    if boundary not in BOUNDARIES:
        raise ValueError(f"unknown boundary {boundary!r}; use one of {list(BOUNDARIES)}")
    return nominal_levels(fractions, alpha, REGRESSION_SPENDING)


def smallest_look_level(
    looks: Sequence[float] | None,
    every: int | None,
    boundary: str | None,
    alpha: float,
    n_cases: int | None = None,
) -> float:
    """The smallest level at which a look of a sequential plan tests a regression: the smallest
    regression level, or the last look's level where :func:`gate` re-validates the plan (never smaller
    today). The bootstrap rule is checked there when the plan is frozen, so no look refuses a plan after
    requests were sent (issue #36, F1). Without ``n_cases`` the looks are the fractions as given (the
    matrix before its suite is built; ceil moves each by less than 1/n)."""
    if n_cases is None:
        fractions = look_fractions(looks, None, 0)
    else:
        counts = cases_at_looks(look_fractions(looks, every, n_cases), n_cases)
        fractions = tuple(c / n_cases for c in counts)
    name = boundary or DEFAULT_BOUNDARY
    return min(*regression_levels(fractions, alpha, name), nominal_levels(fractions, alpha, name)[-1])
