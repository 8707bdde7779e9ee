"""The statistical bounds of one slice: the Wilson, Clopper-Pearson and Newcombe-10 paired intervals
(``intervals``), the design effect and its shrinkage (``design_effect``), the percentile and studentized
case bootstraps (``percentile``, ``bootstrap``) and their floating-point residue (``residue``), the
Newcombe envelope over a slice's completions (``rs_envelope``), the monotone floor bound (``monotone``)
and :func:`slice_statistics`, the gate's slice bound, which the sequential looks use too
(``slice_bounds``). Pure numerics on arrays; imports nothing else of the judge.
"""

from __future__ import annotations

from depthgate.judge.bounds.bootstrap import BootstrapBounds, bootstrap_t
from depthgate.judge.bounds.design_effect import (
    PRIOR_RUNS,
    RS_LEVEL,
    prior_runs,
    rs_alpha,
    shrunk_design_effect,
)
from depthgate.judge.bounds.intervals import (
    clopper_pearson_upper,
    newcombe10_paired,
    newcombe_p_values,
    wilson_lower,
)
from depthgate.judge.bounds.percentile import bootstrap_percentile, resample_means
from depthgate.judge.bounds.residue import RESIDUE_TOLERANCE, has_spread, snap_differences
from depthgate.judge.bounds.rs_envelope import newcombe10_lower_grid, rs_grid
from depthgate.judge.bounds.slice_bounds import (
    METHOD_COMBINED,
    METHOD_NEWCOMBE,
    SliceStatistics,
    floor_lower_bound,
    kish_effective_n,
    paired_design_effect,
    run_counts,
    slice_lower,
    slice_statistics,
)

__all__ = [
    "METHOD_COMBINED",
    "METHOD_NEWCOMBE",
    "PRIOR_RUNS",
    "RESIDUE_TOLERANCE",
    "RS_LEVEL",
    "BootstrapBounds",
    "SliceStatistics",
    "bootstrap_percentile",
    "bootstrap_t",
    "clopper_pearson_upper",
    "floor_lower_bound",
    "has_spread",
    "kish_effective_n",
    "newcombe10_lower_grid",
    "newcombe10_paired",
    "newcombe_p_values",
    "paired_design_effect",
    "prior_runs",
    "resample_means",
    "rs_alpha",
    "rs_grid",
    "run_counts",
    "shrunk_design_effect",
    "slice_lower",
    "slice_statistics",
    "snap_differences",
    "wilson_lower",
]
