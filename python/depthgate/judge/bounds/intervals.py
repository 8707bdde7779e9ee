"""Interval primitives of the release gate (research/stats_gate.md §2.2, §2.5, §2.8): Wilson,
Clopper–Pearson, the Newcombe (1998) method-10 paired interval and its inversion into p-values. Split out
of the gate (issue #23: one job per module).
Wilson intervals inside Newcombe-10 use the closed form (equal to ``proportion_confint(method="wilson")``,
checked in the tests) because the p-value inversion evaluates them a few hundred times per slice."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable

from statsmodels.stats.proportion import proportion_confint

__all__ = [
    "clopper_pearson_upper",
    "invert_bound",
    "newcombe10_paired",
    "newcombe_p_values",
    "wilson_lower",
]

# Search interval and tolerance for inverting a Newcombe bound into a p-value (as in gate_lib.py).
_P_SEARCH_LOW, _P_SEARCH_HIGH, _P_TOLERANCE = 1e-10, 0.4999, 1e-12


def _z(one_sided_tail: float) -> float:
    return statistics.NormalDist().inv_cdf(1.0 - one_sided_tail)


def _wilson_interval(count: float, nobs: float, alpha: float) -> tuple[float, float]:
    """Two-sided (1 - alpha) Wilson score interval; equals proportion_confint(method="wilson")."""
    z = _z(alpha / 2.0)
    p = count / nobs
    denom = 1.0 + z * z / nobs
    center = (p + z * z / (2.0 * nobs)) / denom
    half = z * math.sqrt(max(p * (1.0 - p) / nobs + z * z / (4.0 * nobs * nobs), 0.0)) / denom
    return max(center - half, 0.0), min(center + half, 1.0)


def wilson_lower(count: float, nobs: float, alpha: float = 0.05) -> float:
    """One-sided (1 - alpha) Wilson lower bound; count and nobs may be fractional (effective n).

    Computed as the lower end of the two-sided interval at 2*alpha, which works in every statsmodels
    version (section 2.5 / 6.3).
    """
    if nobs <= 0:
        raise ValueError(f"wilson_lower needs nobs > 0, got {nobs}")
    lower, _ = proportion_confint(count, nobs, alpha=2.0 * alpha, method="wilson")
    return float(lower)


def clopper_pearson_upper(count: int, nobs: int, alpha: float = 0.05) -> float:
    """One-sided (1 - alpha) Clopper-Pearson upper bound (about 3/N for zero hits, section 2.8)."""
    if nobs <= 0:
        raise ValueError(f"clopper_pearson_upper needs nobs > 0, got {nobs}")
    _, upper = proportion_confint(count, nobs, alpha=2.0 * alpha, method="beta")
    return float(upper)


def newcombe10_paired(
    a: float, b: float, c: float, d: float, alpha: float = 0.05, *, phi_correction: bool = True
) -> tuple[float, float]:
    """Two-sided (1 - alpha) Newcombe (1998) method-10 interval for a paired difference p1 - p2.

    Cells: ``a`` both succeed, ``b`` sample 1 succeeds and 2 fails, ``c`` 1 fails and 2 succeeds, ``d``
    both fail (sample 1 = candidate). Counts may be fractional (design-effect-deflated counts).
    ``phi_correction`` uses the continuity-corrected phi of Fagerland et al.'s ``contingencytables``;
    False gives the uncorrected variant. The one-sided (1 - alpha) lower bound is the lower end at
    2*alpha. [[59, 6], [16, 80]] at alpha 0.05 gives (-0.1186, -0.0046).
    """
    if min(a, b, c, d) < 0:
        raise ValueError(f"negative cell count in ({a}, {b}, {c}, {d})")
    n = a + b + c + d
    if n <= 0:
        raise ValueError("empty paired table")
    p1, p2 = (a + b) / n, (a + c) / n
    theta = p1 - p2
    l1, u1 = _wilson_interval(a + b, n, alpha)
    l2, u2 = _wilson_interval(a + c, n, alpha)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    if phi_correction:
        numerator = cross - n / 2.0 if cross > n / 2.0 else (0.0 if cross >= 0 else cross)
    else:
        numerator = cross
    phi = numerator / math.sqrt(margins) if margins > 0 else 0.0
    lower = theta - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    upper = theta + math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    return lower, upper


def invert_bound(distance: Callable[[float], float]) -> float:
    """Smallest one-sided alpha at which a monotone bound reaches the margin (gate_lib's inversion).

    ``distance(alpha)`` is positive when the hypothesis is rejected at one-sided ``alpha`` and grows
    with alpha. Bisection to 1e-12 (scipy is not a dependency of depthgate).
    """
    high_value = float(distance(_P_SEARCH_HIGH))
    if high_value <= 0:
        return 0.5 if abs(high_value) < 1e-12 else 1.0
    if float(distance(_P_SEARCH_LOW)) > 0:
        return _P_SEARCH_LOW
    low, high = _P_SEARCH_LOW, _P_SEARCH_HIGH
    while high - low > _P_TOLERANCE:
        mid = 0.5 * (low + high)
        if float(distance(mid)) > 0:
            high = mid
        else:
            low = mid
    return 0.5 * (low + high)


def newcombe_p_values(a: float, b: float, c: float, d: float, margin: float) -> tuple[float, float]:
    """(p_NI, p_REG) from inverting the Newcombe-10 bounds at the margin.

    p_NI tests H0: delta <= -M (lower bound > -M); p_REG tests H0: delta >= -M (upper bound < -M).
    """

    def ni(alpha: float) -> float:
        return newcombe10_paired(a, b, c, d, 2.0 * alpha)[0] + margin

    def reg(alpha: float) -> float:
        return -margin - newcombe10_paired(a, b, c, d, 2.0 * alpha)[1]

    return invert_bound(ni), invert_bound(reg)
