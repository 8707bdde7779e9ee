"""The sequential stop rule's part of the analysis plan (issue #26): which combinations are refused.

``[plan] stop_rule = "sequential"`` pre-registers the looks, as information fractions
(``looks = [0.25, 0.5, 0.75, 1.0]``) or as a look every K cases (``look_every = K``), and the boundary
family (``boundary = "power-4"``, the default: Kim-DeMets alpha t^4 spending; ``"obrien-fleming"``,
``"haybittle-peto"`` or ``"confidence-sequence"``: docs/gate-calibration.md §8 measures each). The statistics
are ``depthgate.judge.sequential``; this module only checks the plan before anything runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal, get_args

__all__ = ["BOUNDARY_NAMES", "MAX_LOOKS", "BoundaryName", "sequential_violations"]

BoundaryName = Literal["obrien-fleming", "power-4", "power-5", "haybittle-peto", "confidence-sequence"]
BOUNDARY_NAMES: tuple[str, ...] = get_args(BoundaryName)
#: More looks buy almost nothing under O'Brien-Fleming spending and cost a gate evaluation each.
MAX_LOOKS = 20


def sequential_violations(
    stop_rule: str,
    looks: Sequence[float] | None,
    look_every: int | None,
    boundary: str | None,
    primary_metric: str,
) -> list[tuple[str, str, str]]:
    """Every rule of the sequential fields, as (field, problem, fix); empty when valid."""
    given = [
        name
        for name, value in (("looks", looks), ("look_every", look_every), ("boundary", boundary))
        if value is not None
    ]
    if stop_rule != "sequential":
        if given:
            why = (
                "one_extension is a two-look rule of its own (alpha / 2 at each look) and cannot take "
                "pre-registered looks"
                if stop_rule == "one_extension"
                else f"stop_rule {stop_rule!r} has a single look"
            )
            return [
                (
                    given[0],
                    f"{given[0]} applies only to stop_rule = 'sequential': {why}",
                    f'set stop_rule = "sequential", or remove {", ".join(given)}',
                )
            ]
        return []
    problems: list[tuple[str, str, str]] = []
    if (looks is None) == (look_every is None):
        problems.append(
            (
                "looks",
                "stop_rule 'sequential' needs exactly one of looks (fractions) or look_every (cases)",
                "e.g. looks = [0.25, 0.5, 0.75, 1.0], or look_every = 10",
            )
        )
    if looks is not None:
        values = [float(t) for t in looks]
        ok = (
            1 <= len(values) <= MAX_LOOKS
            and values[-1] == 1.0
            and values[0] > 0.0
            and all(b > a for a, b in itertools.pairwise(values))
        )
        if not ok:
            problems.append(
                (
                    "looks",
                    f"looks {values} are not 1 to {MAX_LOOKS} strictly increasing fractions in (0, 1] "
                    "ending at 1.0",
                    "e.g. looks = [0.25, 0.5, 0.75, 1.0]",
                )
            )
    if look_every is not None and look_every < 1:
        problems.append(("look_every", f"look_every {look_every} < 1", "give a positive number of cases"))
    if boundary is not None and boundary not in BOUNDARY_NAMES:
        problems.append(("boundary", f"unknown boundary {boundary!r}", f"use one of {list(BOUNDARY_NAMES)}"))
    if primary_metric == "control_normalised":
        problems.append(
            (
                "stop_rule",
                "stop_rule 'sequential' cannot gate the primary metric control_normalised: the cases it "
                "counts come from the controls, which run after the matrix, so no look could be taken",
                'use primary_metric = "pass" with a sequential plan, or stop_rule = "fixed"',
            )
        )
    return problems
