"""The studentized case bootstrap of the release gate (research/stats_gate.md §2.2), moved out of
the gate's run when issue #22 changed how degenerate resamples are
handled: float residue is merged before degeneracy is decided (``depthgate.judge.bounds.residue``), and a
degenerate draw is replaced by a further draw of the same stream, so the bounds and p-values rest on
``reps`` usable resamples and the p-value floor is 1/(reps + 1), the resolution the plan's B rule
(``depthgate.spec.models.min_bootstrap_resamples``) assumes."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from depthgate.judge.bounds.residue import has_spread, snap_differences

__all__ = ["BootstrapBounds", "bootstrap_t"]

FloatArray = npt.NDArray[np.float64]

# Bootstrap case indices are drawn in blocks of this many replicates (memory: block x n_cases int32
# indices plus as many float64 values, 12 MB at 500 cases). The draws are sequential, so the result does
# not depend on the block size.
_BOOTSTRAP_BLOCK = 2048
# At most this many draws per requested resample while topping up degenerate ones (a resample misses
# every differing case with probability <= 1/2 for n >= 2 cases, so the cap is never reached in practice).
_MAX_DRAWS = 20


@dataclass(frozen=True)
class BootstrapBounds:
    """Studentized case bootstrap: one-sided (1 - alpha) bounds and p-values (None: the bootstrap-t is
    undefined, se = 0 or no resample with spread; the caller defers to another bound).

    ``degenerate`` counts the draws without spread (every drawn case has the same difference, float
    residue merged), which are left out of the t* distribution and replaced by further draws; ``used`` is
    the number of resamples the bounds rest on (``reps``, unless the sample has no spread at all).
    """

    lower: float
    upper: float
    p_ni: float | None
    p_reg: float | None
    degenerate: int = 0
    used: int = 0


def _resampled_t(d: FloatArray, mean: float, rng: np.random.Generator, size: int) -> FloatArray:
    """t* = (mean* - mean) / se* of ``size`` case resamples of ``d``, the resamples with spread only.

    n case indices per resample, int32: 15 % faster draws than int64 at 500 cases (a slice never has
    2^31 cases). Spread is tested on the drawn values, not on se* > 0: the mean of n equal floats can
    differ from them in the last bit, which leaves a tiny positive se*.
    """
    n = d.size
    sample = d[rng.integers(0, n, size=(size, n), dtype=np.int32)]
    means = sample.mean(axis=1)
    sds = sample.std(axis=1, ddof=1) / math.sqrt(n)
    spread = sample.min(axis=1) < sample.max(axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        t_star = np.where(sds > 0, (means - mean) / sds, np.sign(means - mean) * np.inf)
    kept: FloatArray = np.nan_to_num(t_star[spread], nan=0.0, posinf=np.inf, neginf=-np.inf)
    return kept


def bootstrap_t(
    differences: npt.ArrayLike, margin: float, alpha: float = 0.05, reps: int = 9999, seed: int = 0
) -> BootstrapBounds:
    """Bootstrap-t over cases (section 2.2): resample cases ``reps`` times, t* = (mean* - mean)/se*.

    **Resampling** draws ``n`` case indices with replacement per replicate (``Generator.integers`` seeded
    with ``seed``, so deterministic). That is the same bootstrap distribution as the spec's Appendix A
    ``gate_lib.boot_t``, which draws multinomial case counts, but a different random stream: numpy's
    multinomial draws one binomial per case per replicate and took 92 % of gate + report on 10^6 rows
    (docs/benchmarks-runner-gate.md: 15.4 s CPU before, 3.4 s now). Bounds move by Monte Carlo noise
    only: 2.04e-4 at most on the benchmark's 20 slices at 9,999 replicates, where one bound's Monte
    Carlo SD over seeds is 0.5-1.3e-4. ``gate_lib.boot_t`` with
    this one draw changed gives the same numbers for the same seed (tests/test_stats.py).

    **Degenerate resamples** (every drawn case has the same difference, so se* = 0 and t* is undefined)
    are left out: the bounds and p-values use the t* distribution *conditional on a resample with
    spread*. Spec Appendix A set t* = +-inf there, which near the ceiling (one or two discordant cases,
    all against the candidate: more than alpha of the resamples draw none of them) made the lower bound
    -inf at any n (research/stats_gate.md, Erratum). Conditioning mirrors how the gate uses the
    statistic: a sample without spread never reaches the studentized bound (se = 0 returns the mean and
    p = None), the Newcombe-RS bound that every slice also takes the minimum with covers it. Under the
    null at the margin degenerate resamples are rare, so the size is unchanged (docs/gate-calibration.md).

    Quantiles use method "higher"/"lower". p_NI = (1 + #{t* >= (mean + M)/se}) / (used + 1); p_REG
    symmetric.
    """
    d = snap_differences(differences)  # float residue is not spread (judge/bounds/residue.py, issue #22)
    n = d.size
    if n < 2:
        raise ValueError("bootstrap_t needs at least 2 cases")
    rng = np.random.default_rng(seed)
    mean = float(d.mean())
    se = float(d.std(ddof=1)) / math.sqrt(n) if has_spread(d) else 0.0
    if se <= 0:
        return BootstrapBounds(lower=mean, upper=mean, p_ni=None, p_reg=None, degenerate=reps, used=0)
    # ``reps`` *usable* resamples (issue #22, item 4): degenerate draws are replaced by further draws of
    # the same stream, so the p-value floor is 1/(reps + 1), the resolution the plan's B check assumed.
    t_blocks: list[FloatArray] = []
    used = drawn = 0
    while used < reps and drawn < _MAX_DRAWS * reps:
        size = min(reps - used, _BOOTSTRAP_BLOCK)
        block = _resampled_t(d, mean, rng, size)
        t_blocks.append(block)
        used += int(block.size)
        drawn += size
    t_all = np.concatenate(t_blocks)
    if used == 0:
        return BootstrapBounds(lower=mean, upper=mean, p_ni=None, p_reg=None, degenerate=drawn, used=0)
    q_high = float(np.quantile(t_all, 1.0 - alpha, method="higher"))
    q_low = float(np.quantile(t_all, alpha, method="lower"))
    t_obs = (mean + margin) / se
    return BootstrapBounds(
        lower=mean - q_high * se,
        upper=mean - q_low * se,
        p_ni=(1 + int(np.sum(t_all >= t_obs))) / (used + 1),
        p_reg=(1 + int(np.sum(t_all <= t_obs))) / (used + 1),
        degenerate=drawn - used,
        used=used,
    )
