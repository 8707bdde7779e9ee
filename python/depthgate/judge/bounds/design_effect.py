"""The design effect of the Newcombe-RS bound when few runs disagree (issue #22, items 1 and 3).

Newcombe-RS deflates the n R paired runs of a slice by the design effect D = Var_cluster / Var_srs,
estimated from the spread of the per-case differences. When only a handful of runs are discordant, that
estimate says nothing about clustering: one or two discordant runs in different cases give D ≈ 1 (runs as
good as independent) although a loss that sits in a few broken cases (a share M/μ of the cases drops to
0) is perfectly clustered, D = R. When the sample happens to hold none or one of those cases, both the
bootstrap and D ≈ 1 pass a slice whose true loss is M: at μ .99 → .96 (M .03), n 40, R 5 the gate showed
non-inferiority in .18–.23 of such slices (α .05).

The estimate is therefore shrunk toward the worst case R with the weight of :data:`PRIOR_RUNS`
discordant runs: D = (m D̂ + m₀ R) / (m + m₀), m = b + c the discordant runs. With no discordant run this
is R (as before); with many it is D̂. m₀ = 6 was chosen by simulation (docs/gate-calibration.md §6;
since §9 m₀ is at least 3 % of the slice's runs, :data:`PRIOR_SHARE`):

* size: it brings the sparse broken-loss cells to α (μ .9, M .05, n 40, R 5: .082 → .058 ± .009; every
  case .99, M .03, n 40, R 5: .20 → .01) and the calibration grid holds in every cell;
* monotone: counted in runs, one more failed candidate run never raises the bound (no violation in 4,000
  random single-run flips, and the hypothesis property in tests/test_gate_error_control.py); weighting
  by discordant *cases* (k₀ = 3, the first version) did (154 of 3,000 flips, by up to .005), because a
  regression in a new case moved D toward D̂ by a whole case's weight;
* power: ≤ .03 lower where discordance is plentiful (μ .85, M .1, n 40, R 3: .65 → .63 in the same draws).
"""

from __future__ import annotations

__all__ = ["PRIOR_RUNS", "PRIOR_SHARE", "RS_LEVEL", "prior_runs", "rs_alpha", "shrunk_design_effect"]

#: Prior weight, in discordant runs, of the worst-case design effect R (module docstring).
PRIOR_RUNS = 6.0

#: ... and at least this share of the slice's runs (docs/gate-calibration.md §9). Where a loss sits in a
#: few broken cases (about 5-10 of them, whatever n is), D̂ and the mean rise together when the sample
#: happens to hold fewer of them, so the error of D̂ does not shrink with n; a prior of six runs alone let
#: .055-.067 of such regressions through at n 100-300, R 3-5 (4,000 slices per cell, α .05). Up to
#: 200 runs (n 40, R 5) the weight stays six runs.
PRIOR_SHARE = 0.03

#: The Newcombe-RS lower bound (R >= 2) is taken at level RS_LEVEL x alpha: together with PRIOR_SHARE it
#: brings those cells to α + 2 MC-SE (§9). Its p_NI is the inverted bound's divided by RS_LEVEL, so the
#: bound exceeds −M exactly when p_NI < alpha.
RS_LEVEL = 0.9


def prior_runs(total_runs: float | None = None) -> float:
    """m₀: max(PRIOR_RUNS, PRIOR_SHARE x the slice's runs); PRIOR_RUNS when the total is not given."""
    return PRIOR_RUNS if total_runs is None else max(PRIOR_RUNS, PRIOR_SHARE * float(total_runs))


def rs_alpha(alpha: float, runs_per_case: float) -> float:
    """The one-sided level of the Newcombe-RS lower bound: RS_LEVEL x alpha with two or more runs per
    case, alpha with one (Newcombe-10, untouched)."""
    return alpha * RS_LEVEL if runs_per_case > 1 else alpha


def shrunk_design_effect(
    estimate: float, discordant_runs: float, runs_per_case: float, total_runs: float | None = None
) -> float:
    """(m D̂ + m₀ R) / (m + m₀), clipped to [1, R] (R when R <= 1); m₀ = :func:`prior_runs` (total_runs)."""
    r = max(float(runs_per_case), 1.0)
    d_hat = min(max(float(estimate), 1.0), r)
    m = max(float(discordant_runs), 0.0)
    m0 = prior_runs(total_runs)
    return min(max((m * d_hat + m0 * r) / (m + m0), 1.0), r)
