"""The case bootstrap the gate uses: a percentile bound on fixed resamples, monotone by construction
(issue #22, item 3).

**Why not the bootstrap-t.** The studentized bound ``mean - q(t*) se`` (``depthgate.judge.bounds.bootstrap``)
is not monotone in the data: a failed run in a case far *above* the mean shrinks the spread, so se and
the skew-corrected quantile can fall by more than the mean does. In 400 random single-run flips (pass →
fail, candidate) it rose in 22–49 (by up to .25 at n 10, .09 at n 20–40), always in skewed slices far
below −M; the envelope over every completion of the data (the smallest bound over the data with any
set of failed runs restored) is exact but costs a bootstrap per completion.

**The construction.** Draw the resamples' case indices from the seed alone (``Generator.integers``,
``reps`` × n, in blocks), before looking at the data. Each resample mean is a sum of the per-case
differences with non-negative weights, so it is non-decreasing in every difference — also in floats:
rounding is monotone, and numpy's pairwise sum is a fixed tree of additions. The lower bound is an
order statistic of those means (``quantile(..., alpha, method="lower")``), the upper one another
(``1 - alpha``, "higher"), and an order statistic of non-decreasing functions is non-decreasing. The
p-values count resamples on one side of −M, so a failed run can only raise p_NI and lower p_REG:

* LB and UB never rise, p_NI never falls, p_REG never rises when a candidate run fails (or a baseline
  run passes), for every n, R and seed. No degenerate resamples: a mean is defined for every draw, so
  float residue (``depthgate.judge.bounds.residue``) cannot reach a bound either, and all ``reps`` resamples
  count toward the p-value resolution (issue #22, item 4).
* LB > −M ⇔ #{mean* ≤ −M} ≤ ⌊alpha (reps − 1)⌋ ⇔ p_NI ≤ alpha at reps = 999, 9,999 (the plan's B rule
  makes alpha (reps + 1) an integer).

**Its price.** The percentile interval does not correct for skewness as the bootstrap-t does. In the
slice test it is always taken with the Newcombe-RS bound, whose design effect is shrunk toward R when
few runs disagree (``depthgate.judge.bounds.design_effect``); that bound decides the sparse, skewed losses
where the bootstrap-t's skew correction mattered. Size and power on the calibration grid's affected
cells, before and after, are in docs/gate-calibration.md §7.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from depthgate.judge.bounds.bootstrap import BootstrapBounds

__all__ = ["bootstrap_percentile"]

FloatArray = npt.NDArray[np.float64]

# Resample indices are drawn in blocks of this many replicates (memory as bootstrap.py); the draws
# are sequential, so the result does not depend on the block size.
_BLOCK = 2048


def resample_means(differences: npt.ArrayLike, reps: int, seed: int) -> FloatArray:
    """Means of ``reps`` case resamples of ``differences``; the indices depend on (seed, n, reps) only."""
    d = np.asarray(differences, dtype=np.float64)
    n = d.size
    rng = np.random.default_rng(seed)
    blocks: list[FloatArray] = []
    done = 0
    while done < reps:
        size = min(reps - done, _BLOCK)
        blocks.append(d[rng.integers(0, n, size=(size, n), dtype=np.int32)].mean(axis=1))
        done += size
    return np.concatenate(blocks) if blocks else np.zeros(0)


def bootstrap_percentile(
    differences: npt.ArrayLike, margin: float, alpha: float = 0.05, reps: int = 9999, seed: int = 0
) -> BootstrapBounds:
    """One-sided (1 - alpha) percentile bounds of the mean per-case difference over ``reps`` case
    resamples, and p_NI = (1 + #{mean* <= -M}) / (reps + 1), p_REG = (1 + #{mean* >= -M}) / (reps + 1).
    Monotone in every difference (module docstring)."""
    d = np.asarray(differences, dtype=np.float64)
    if d.size < 2:
        raise ValueError("bootstrap_percentile needs at least 2 cases")
    if reps < 1:
        raise ValueError(f"bootstrap_percentile needs reps >= 1, got {reps}")
    means = resample_means(d, reps, seed)
    return BootstrapBounds(
        lower=float(np.quantile(means, alpha, method="lower")),
        upper=float(np.quantile(means, 1.0 - alpha, method="higher")),
        p_ni=(1 + int(np.sum(means <= -margin))) / (reps + 1),
        p_reg=(1 + int(np.sum(means >= -margin))) / (reps + 1),
        degenerate=0,
        used=reps,
    )
