"""The per-slice non-inferiority machinery of the release gate (research/stats_gate.md §2.2, §2.5):
run-level paired tables, the design effect, the floor bound and :func:`slice_statistics`. Split out of
the gate (issue #23: one job per module)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from depthgate.judge.bounds.design_effect import rs_alpha, shrunk_design_effect
from depthgate.judge.bounds.intervals import invert_bound, newcombe10_paired, newcombe_p_values, wilson_lower
from depthgate.judge.bounds.monotone import monotone_floor_lower_bound
from depthgate.judge.bounds.percentile import bootstrap_percentile
from depthgate.judge.bounds.rs_envelope import RsGrid, rs_grid

__all__ = [
    "METHOD_COMBINED",
    "METHOD_NEWCOMBE",
    "SliceStatistics",
    "floor_lower_bound",
    "kish_effective_n",
    "paired_design_effect",
    "run_counts",
    "slice_lower",
    "slice_statistics",
]

FloatArray = npt.NDArray[np.float64]

METHOD_NEWCOMBE = "newcombe10"
METHOD_COMBINED = "min(bootstrap,deff-newcombe)"


def _as_runs(values: npt.ArrayLike) -> FloatArray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[:, None]
    if arr.ndim != 2:
        raise ValueError(f"expected a (cases, seeds) array, got shape {arr.shape}")
    return arr


def run_counts(baseline: npt.ArrayLike, candidate: npt.ArrayLike) -> tuple[float, float, float, float]:
    """Run-level paired table (a, b, c, d) with candidate = sample 1; NaN marks an unpaired run."""
    yb, yc = _as_runs(baseline), _as_runs(candidate)
    ok = ~(np.isnan(yb) | np.isnan(yc))
    yb, yc = np.where(ok, yb, 0.0), np.where(ok, yc, 0.0)
    both = float((yc * yb).sum())
    improve = float((yc * (1 - yb) * ok).sum())
    regress = float(((1 - yc) * yb * ok).sum())
    neither = float(((1 - yc) * (1 - yb) * ok).sum())
    return both, improve, regress, neither


def paired_design_effect(baseline: npt.ArrayLike, candidate: npt.ArrayLike) -> float:
    """Design effect D of the paired run-level difference, clipped to [1, runs per case] (section 2.2).

    D = R (no shrinkage below one observation per case) when there is no discordant run. The estimate is
    shrunk toward R with the weight of six discordant runs, or 3 % of the runs if more
    (``depthgate.judge.bounds.design_effect``, issue #22): a handful of discordant runs says nothing about
    clustering.
    """
    yb, yc = _as_runs(baseline), _as_runs(candidate)
    n = yb.shape[0]
    a, b, c, d = run_counts(yb, yc)
    total = a + b + c + d
    runs_per_case = total / n
    d_case = np.nanmean(yc, axis=1) - np.nanmean(yb, axis=1)
    var_cluster = float(d_case.var(ddof=1)) / n if n > 1 else math.inf
    var_srs = ((b + c) / total - ((b - c) / total) ** 2) / total
    deff = var_cluster / var_srs if var_srs > 0 else runs_per_case
    return shrunk_design_effect(float(deff), b + c, runs_per_case, total)


def floor_lower_bound(
    per_case_rates: npt.ArrayLike, runs_per_case: float, alpha: float = 0.05
) -> tuple[float, float, float]:
    """Wilson lower bound on the effective sample size: (lower bound, DEFF, n_eff) (section 2.5).

    DEFF = clip(R * s^2(per-case rate) / (p(1 - p)), 1, R) (Kish); n_eff = n * R / DEFF. When p is 0 or
    1 there is no spread to estimate DEFF from, and the bound takes the worst case DEFF = R (n_eff = the
    number of cases), as the paired Newcombe-RS bound does when no run is discordant (section 2.2):
    40 all-pass cases at R = 3 give the Wilson bound of 40/40 (0.937), not of 120/120 (0.978). DEFF is
    also R when there is a single case.

    The bound is the monotone envelope (``depthgate.judge.bounds.monotone``, issue #22): never above the bound
    of a completion with more passes, so one more failure never raises it (40 all-pass cases at R = 3:
    0.937; plus one failed run: 0.937, where the plain Kish bound gave 0.963). DEFF and n_eff are the
    data's own.
    """
    p, deff, n_eff = kish_effective_n(per_case_rates, runs_per_case, caller="floor_lower_bound")
    plain = wilson_lower(p * n_eff, n_eff, alpha)
    return min(plain, monotone_floor_lower_bound(per_case_rates, runs_per_case, alpha)), deff, n_eff


def kish_effective_n(
    per_case_rates: npt.ArrayLike, runs_per_case: float, *, caller: str = "kish_effective_n"
) -> tuple[float, float, float]:
    """(case-weighted accuracy p, DEFF, n_eff) of per-case accuracies over R runs per case: DEFF =
    clip(R * s^2(rate) / (p (1 - p)), 1, R) (Kish), R when p is 0 or 1 or there is a single case;
    n_eff = n * R / DEFF. The one design effect of the floor bound and the accuracy intervals of the
    position report. ``caller`` names the function in the error for no cases."""
    rates = np.asarray(per_case_rates, dtype=np.float64)
    n = rates.size
    if n == 0:
        raise ValueError(f"{caller} needs at least one case")
    p = float(rates.mean())
    r = max(float(runs_per_case), 1.0)
    var_srs = p * (1.0 - p) / (n * r)
    deff = r if n < 2 or var_srs <= 0 else float(np.clip(float(rates.var(ddof=1)) / n / var_srs, 1.0, r))
    return p, deff, n * r / deff


@dataclass(frozen=True)
class SliceStatistics:
    """The NI machinery of one slice, before multiplicity and status (section 2.2)."""

    n_cases: int
    runs_per_case: float
    delta: float
    lower: float
    upper: float
    p_ni: float
    p_reg: float
    method: str
    deff: float
    informative: int
    sd_diff: float
    lower_bootstrap: float | None
    lower_newcombe: float


def _newcombe_rs_lower(
    yb: npt.NDArray[np.float64], yc: npt.NDArray[np.float64], alpha: float, planned: int
) -> tuple[float, float, RsGrid | None, float]:
    """(design effect, Newcombe-RS level, monotone envelope, Newcombe lower bound): the Newcombe side of
    the slice's lower bound, shared by :func:`slice_statistics` and :func:`slice_lower`."""
    a, b, c, d = run_counts(yb, yc)
    deff = paired_design_effect(yb, yc) if planned > 1 else 1.0
    alpha_n = rs_alpha(alpha, planned)  # Newcombe-RS lower bound at RS_LEVEL x alpha (design_effect.py)
    lower_n = newcombe10_paired(a / deff, b / deff, c / deff, d / deff, 2.0 * alpha_n)[0]
    grid = rs_grid(yb, yc, deflate=planned > 1)  # the monotone envelope (judge/bounds/rs_envelope.py)
    if grid is not None:
        lower_n = min(lower_n, grid.lower(2.0 * alpha_n))
    return deff, alpha_n, grid, float(lower_n)


def slice_lower(
    yb: npt.NDArray[np.float64], yc: npt.NDArray[np.float64], alpha: float, reps: int, seed: int
) -> float:
    """``slice_statistics(yb, yc, M, alpha, reps, seed).lower`` without the p-values (they need M and
    cost a bisection each; the bound does not depend on M): the A/A pass-margin simulation calls it
    thousands of times. Complete (cases, seeds) arrays, every column planned."""
    planned = yb.shape[1]
    _, _, _, lower_n = _newcombe_rs_lower(yb, yc, alpha, planned)
    if planned <= 1:
        return lower_n
    boot = bootstrap_percentile(yc.mean(axis=1) - yb.mean(axis=1), 0.10, alpha, reps, seed)
    return float(min(boot.lower, lower_n))


def slice_statistics(
    baseline: npt.ArrayLike,
    candidate: npt.ArrayLike,
    margin: float = 0.10,
    alpha: float = 0.05,
    reps: int = 9999,
    seed: int = 0,
    *,
    seeds_planned: int | None = None,
) -> SliceStatistics:
    """Per-slice NI test on (cases, seeds) 0/1 arrays paired by column; NaN marks an invalid run.

    One planned seed: Newcombe-10 on the case table. Two or more: LB = min(percentile bootstrap on
    fixed resamples, Newcombe-RS), p = max of the two. Both are monotone: a failed candidate run never
    raises LB (``depthgate.judge.bounds.percentile``, issue #22 item 3).
    ``seeds_planned`` defaults to the number of columns.
    """
    yb, yc = _as_runs(baseline), _as_runs(candidate)
    if yb.shape != yc.shape:
        raise ValueError(f"baseline {yb.shape} and candidate {yc.shape} are not paired")
    n, columns = yb.shape
    if n < 2:
        raise ValueError("slice_statistics needs at least 2 cases")
    planned = columns if seeds_planned is None else seeds_planned
    d_case = np.nanmean(yc, axis=1) - np.nanmean(yb, axis=1)
    a, b, c, d = run_counts(yb, yc)
    runs_per_case = (a + b + c + d) / n
    deff, alpha_n, grid, lower_n = _newcombe_rs_lower(yb, yc, alpha, planned)
    deflated = (a / deff, b / deff, c / deff, d / deff)
    upper_n = newcombe10_paired(*deflated, 2.0 * alpha)[1]
    p_ni_n, p_reg_n = newcombe_p_values(*deflated, margin)
    if grid is not None:
        p_ni_n = max(p_ni_n, invert_bound(grid.distance(margin)))
    p_ni_n = min(p_ni_n * alpha / alpha_n, 1.0)  # LB_n > -M exactly when p_ni_n < alpha
    lower_boot: float | None = None
    if planned <= 1:
        lower, upper, p_ni, p_reg, method = lower_n, upper_n, p_ni_n, p_reg_n, METHOD_NEWCOMBE
    else:
        boot = bootstrap_percentile(d_case, margin, alpha, reps, seed)
        lower_boot = boot.lower
        lower, upper = min(boot.lower, lower_n), max(boot.upper, upper_n)
        p_ni = max(p_ni_n, boot.p_ni) if boot.p_ni is not None else p_ni_n
        p_reg = max(p_reg_n, boot.p_reg) if boot.p_reg is not None else p_reg_n
        method = METHOD_COMBINED
    return SliceStatistics(
        n_cases=n,
        runs_per_case=runs_per_case,
        delta=float(d_case.mean()),
        lower=float(lower),
        upper=float(upper),
        p_ni=float(p_ni),
        p_reg=float(p_reg),
        method=method,
        deff=float(deff),
        informative=int(np.count_nonzero(d_case)),
        sd_diff=float(d_case.std(ddof=1)),
        lower_bootstrap=lower_boot,
        lower_newcombe=float(lower_n),
    )
