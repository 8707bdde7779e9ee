"""Floating-point residue in per-case differences (issue #22, item 2).

A per-case difference is a rational number: c̄ − b̄ over R seeds in a slice, or the mean of such
differences over the slices of the overall statistic. In floats two cases with the *same* rational
difference can differ in the last bits: 2/3 − 1/3 = 0.3333333333333333 but 1 − 2/3 =
0.33333333333333337, and the overall mean ((1 − 2/3) + (1/3 − 2/3)) / 10 is 5.6e-18, not 0. A bootstrap
that decides "no spread" by exact equality then studentizes resamples of zeros and ±ε: se* ≈ 1e-18,
t* ≈ 1e14, and the lower bound becomes ≈ −8e13.

:func:`snap_differences` merges values closer than :data:`RESIDUE_TOLERANCE` into one representative
(the most frequent value of the group, ties to the smallest), so that degeneracy is decided on values
that are exactly equal when their rationals are. Distinct rationals of the gate's designs are far
apart: with R seeds and k slices per case two distinct overall differences differ by at least
1 / (k · lcm(1..R)) (≥ 1e-6 for every design the matrix admits), six orders of magnitude above the
tolerance, while float residue of such sums is below 1e-15. Data without residue pass unchanged (bit for
bit: every group is a single value).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["RESIDUE_TOLERANCE", "has_spread", "snap_differences"]

FloatArray = npt.NDArray[np.float64]

#: Two per-case differences closer than this are the same rational number (module docstring).
RESIDUE_TOLERANCE = 1e-9


def snap_differences(values: npt.ArrayLike, tolerance: float = RESIDUE_TOLERANCE) -> FloatArray:
    """``values`` with every group of values within ``tolerance`` of its sorted neighbour replaced by
    the group's most frequent value (ties: the smallest). Unchanged when no two distinct values are that
    close. NaN and infinities are returned as they are."""
    arr = np.asarray(values, dtype=np.float64)
    out = arr.copy()
    finite = np.isfinite(arr)
    if finite.sum() < 2:
        return out
    uniq, inverse, counts = np.unique(arr[finite], return_inverse=True, return_counts=True)
    if uniq.size < 2 or bool(np.all(np.diff(uniq) > tolerance)):
        return out
    group = np.concatenate(([0], np.cumsum(np.diff(uniq) > tolerance)))
    rep = np.empty(int(group[-1]) + 1, dtype=np.float64)
    for g in range(rep.size):
        members = np.nonzero(group == g)[0]
        rep[g] = uniq[members[int(np.argmax(counts[members]))]]
    out[finite] = rep[group[inverse]]
    return out


def has_spread(values: npt.ArrayLike, tolerance: float = RESIDUE_TOLERANCE) -> bool:
    """True when the values are not all the same rational number (largest minus smallest > tolerance)."""
    arr = np.asarray(values, dtype=np.float64)
    return bool(arr.size > 1 and float(arr.max() - arr.min()) > tolerance)
