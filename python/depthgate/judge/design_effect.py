"""The design effect of the Newcombe-RS bound when few cases disagree (issue #22, item 1).

Newcombe-RS deflates the n R paired runs of a slice by the design effect D = Var_cluster / Var_srs,
estimated from the spread of the per-case differences. When only a handful of cases have a discordant
run, that estimate says nothing about clustering: one or two discordant runs in different cases give
D ≈ 1 (runs as good as independent) although a loss that sits in a few broken cases (a share M/μ of
the cases drops to 0) is perfectly clustered, D = R. When the sample happens to hold none or one of
those cases, both the bootstrap and D ≈ 1 pass a slice whose true loss is M: at μ .99 → .96 (M .03),
n 40, R 5 the gate showed non-inferiority in .18–.23 of such slices (α .05).

The estimate is therefore shrunk toward the worst case R with the weight of :data:`PRIOR_CASES`
discordant cases: D = (k D̂ + k₀ R) / (k + k₀), k = the cases with a discordant run. With no discordant
case this is R (as before); with many it is D̂. k₀ = 3 was chosen by simulation (docs/gate-calibration.md
§6): it brings the sparse broken-loss cells to α (e.g. μ .9, M .05, n 40, R 5: .082 → .050; every case
.99, M .03, n 40, R 5: .202 → .021) and costs ≤ .03 of power where discordance is plentiful (μ .85, M .1,
n 40, R 3).
"""

from __future__ import annotations

__all__ = ["PRIOR_CASES", "shrunk_design_effect"]

#: Prior weight, in discordant cases, of the worst-case design effect R (module docstring).
PRIOR_CASES = 3.0


def shrunk_design_effect(estimate: float, discordant_cases: int, runs_per_case: float) -> float:
    """(k D̂ + k₀ R) / (k + k₀), clipped to [1, R] (R when R <= 1)."""
    r = max(float(runs_per_case), 1.0)
    d_hat = min(max(float(estimate), 1.0), r)
    k = max(int(discordant_cases), 0)
    return min(max((k * d_hat + PRIOR_CASES * r) / (k + PRIOR_CASES), 1.0), r)
