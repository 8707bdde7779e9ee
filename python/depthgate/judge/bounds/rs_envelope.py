"""The Newcombe bound of a slice as a monotone envelope (issue #22, item 3).

Newcombe-RS deflates the run-level table (a, b, c, d) by the design effect D estimated from the spread
of the per-case differences d_i (``depthgate.judge.bounds.design_effect``). A failed candidate run can *lower*
that estimate (a regression in a new case looks less clustered), and the wider table then gives a
higher bound: 21 of 20,000 random single-run flips near the ceiling raised it, by up to .003 (10 cases
x 4 seeds: −.3013 → −.2981), and tests/test_gate_error_control.py's property found such flips.

**The envelope.** The bound used is the smallest Newcombe-RS bound over the data and every completion
of them (any set of failed candidate runs restored), where a completion's spread is replaced by an
upper bound. A completion restoring i runs whose baseline passed (c → a) and j whose baseline failed
(d → b) has the table (a + i, b + j, c − i, d − j), the sum S1 = Σ d_i + (i + j)/R and a sum of squares
S2 = Σ d_i² + (the gains of the restored runs). Restoring the t-th failed run of case i gains
(d_i + t/R)² − (d_i + (t − 1)/R)²; the sum of the i + j largest gains over all cases bounds every
completion's gain from above. The bound falls with S2 at a fixed table (a larger spread, a larger D, a
smaller deflated table: Wilson widens and the correlation term shrinks), so the minimum over the
(c + 1)(d + 1) grid of (i, j) is at most the minimum over the true completions, and never above the
data's own bound (i = j = 0 is the data, gain 0).

**Why it is monotone.** One more failed run (c → a reversed, or d → b reversed) adds one failure to
the grid and one gain g to the multiset: the worse data's grid point (i + 1, j) (or (i, j + 1)) has
the better data's table at (i, j), the same S1, and a gain sum over one more run that is at least the
better data's plus g, which the worse data's S2 lacks — so a spread at least as large and a bound at
most as large. Every point of the better data's grid has such a point in the worse data's grid.

The design effect of R = 1 slices is 1, so the envelope is over the counts alone (Newcombe-10 itself
was monotone in every table of up to 40 cases checked exhaustively; the envelope makes that hold for
every table). Slices with invalid (NaN) runs use the plain bound: their cases have different run
counts, so a restoration does not fix S1. Cost: a vectorized Newcombe-10 over the grid ((c + 1)(d + 1)
points; about 10^4 at 300 cases near 90 %).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np
import numpy.typing as npt

from depthgate.judge.bounds.design_effect import prior_runs

__all__ = ["RsGrid", "rs_grid"]

FloatArray = npt.NDArray[np.float64]


def _wilson(count: FloatArray, nobs: FloatArray, z: float) -> tuple[FloatArray, FloatArray]:
    p = count / nobs
    denom = 1.0 + z * z / nobs
    center = (p + z * z / (2.0 * nobs)) / denom
    half = z * np.sqrt(np.maximum(p * (1.0 - p) / nobs + z * z / (4.0 * nobs * nobs), 0.0)) / denom
    return np.maximum(center - half, 0.0), np.minimum(center + half, 1.0)


def newcombe10_lower_grid(
    a: FloatArray, b: FloatArray, c: FloatArray, d: FloatArray, alpha: float
) -> FloatArray:
    """Lower end of the two-sided (1 - alpha) Newcombe-10 interval (continuity-corrected phi),
    vectorized; the same formula as ``depthgate.judge.bounds.newcombe10_paired``."""
    z = statistics.NormalDist().inv_cdf(1.0 - alpha / 2.0)
    n = a + b + c + d
    p1, p2 = (a + b) / n, (a + c) / n
    l1, _ = _wilson(a + b, n, z)
    _, u2 = _wilson(a + c, n, z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    numerator = np.where(cross > n / 2.0, cross - n / 2.0, np.where(cross >= 0, 0.0, cross))
    with np.errstate(divide="ignore", invalid="ignore"):
        phi = np.where(margins > 0, numerator / np.sqrt(np.where(margins > 0, margins, 1.0)), 0.0)
    x, y = p1 - l1, u2 - p2
    out: FloatArray = (p1 - p2) - np.sqrt(np.maximum(x * x - 2 * phi * x * y + y * y, 0.0))
    return out


class RsGrid:
    """The deflated tables of every (i, j) completion of a slice (module docstring)."""

    def __init__(self, tables: tuple[FloatArray, FloatArray, FloatArray, FloatArray]) -> None:
        self.tables = tables

    def lower(self, alpha_two_sided: float) -> float:
        """The envelope: the smallest two-sided (1 - alpha) Newcombe lower bound over the grid."""
        return float(newcombe10_lower_grid(*self.tables, alpha_two_sided).min())

    def distance(self, margin: float) -> Callable[[float], float]:
        """``alpha -> lower(2 alpha) + margin``, for inverting the envelope into p_NI."""
        return lambda alpha: self.lower(2.0 * alpha) + margin


def _gain_prefix(d_case: FloatArray, failures: npt.NDArray[np.int64], runs: int) -> FloatArray:
    """Prefix sums of the gains in Σ d_i² of restoring failed runs, largest gains first."""
    gains = [
        (di + t / runs) ** 2 - (di + (t - 1) / runs) ** 2
        for di, f in zip(d_case.tolist(), failures.tolist(), strict=True)
        for t in range(1, int(f) + 1)
    ]
    ordered = np.sort(np.asarray(gains, dtype=np.float64))[::-1]
    return np.concatenate(([0.0], np.cumsum(ordered)))


def rs_grid(yb: FloatArray, yc: FloatArray, *, deflate: bool) -> RsGrid | None:
    """The completion grid of complete (cases, seeds) 0/1 arrays (None when a run is NaN).
    ``deflate`` False: no design effect (R = 1 slices), the grid of counts only."""
    if bool(np.isnan(yb).any() or np.isnan(yc).any()):
        return None
    n, runs = yb.shape
    a0 = float((yc * yb).sum())
    b0 = float((yc * (1 - yb)).sum())
    c0 = float(((1 - yc) * yb).sum())
    d0 = float(((1 - yc) * (1 - yb)).sum())
    i = np.arange(int(c0) + 1, dtype=np.float64)[:, None]
    j = np.arange(int(d0) + 1, dtype=np.float64)[None, :]
    a, b, c, d = (np.broadcast_to(x, (i.size, j.size)) for x in (a0 + i, b0 + j, c0 - i, d0 - j))
    if not deflate or runs <= 1 or n < 2:
        return RsGrid((a, b, c, d))
    d_case = yc.mean(axis=1) - yb.mean(axis=1)
    prefix = _gain_prefix(d_case, (runs - yc.sum(axis=1)).astype(np.int64), runs)
    k = (i + j).astype(np.int64)
    s1 = float(d_case.sum()) + (i + j) / runs
    s2 = float((d_case * d_case).sum()) + prefix[k]
    total = float(n * runs)
    var_cluster = np.maximum(s2 - s1 * s1 / n, 0.0) / (n - 1) / n
    m = b + c
    var_srs = (m / total - ((b - c) / total) ** 2) / total
    with np.errstate(divide="ignore", invalid="ignore"):
        d_hat = np.where(var_srs > 0, var_cluster / np.where(var_srs > 0, var_srs, 1.0), float(runs))
    d_hat = np.clip(d_hat, 1.0, float(runs))
    m0 = prior_runs(total)  # a constant of the slice: one more failure does not move it
    deff = np.clip((m * d_hat + m0 * runs) / (m + m0), 1.0, float(runs))
    return RsGrid((a / deff, b / deff, c / deff, d / deff))
