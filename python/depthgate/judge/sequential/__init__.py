"""The group-sequential design of the gate: look fractions, error spending and the nominal levels
per look (``levels``) and the decision of one slice at one look (``looks``). Built on the slice bound
of :mod:`depthgate.judge.bounds`; the gate that replays the looks is :mod:`depthgate.judge.gate`.
"""

from __future__ import annotations

from depthgate.judge.sequential.levels import (
    DEFAULT_BOUNDARY,
    cases_at_looks,
    look_fractions,
    nominal_levels,
    obf_spending,
    regression_levels,
    smallest_look_level,
)
from depthgate.judge.sequential.looks import (
    betting_wealth,
    expected_share,
    look_outcome,
    regression_q,
    slice_decision,
)

__all__ = [
    "DEFAULT_BOUNDARY",
    "betting_wealth",
    "cases_at_looks",
    "expected_share",
    "look_fractions",
    "look_outcome",
    "nominal_levels",
    "obf_spending",
    "regression_levels",
    "regression_q",
    "slice_decision",
    "smallest_look_level",
]
