"""The analysis plan of a depthgate run (:class:`AnalysisPlan`) and the one validator of a plan's numbers
(:func:`plan_violations`), shared with the gate.

The other spec models live beside it: cases and suites (:mod:`depthgate.spec.cases`), systems
(:mod:`depthgate.spec.system`), positions (:mod:`depthgate.spec.positions`), the matrix
(:mod:`depthgate.spec.matrix`), the manifest (:mod:`depthgate.spec.manifest`), loading
(:mod:`depthgate.spec.loading`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, Literal, TypeAlias

from pydantic import (
    Field,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

# The plan section below is kept as it was written (its own names for the base model and the validation
# error), so the move of AnalysisPlan into its own module stays a move.
from depthgate.spec.base import Frozen as _Frozen
from depthgate.spec.base import StrictFloat, StrictInt
from depthgate.spec.base import violation as _violation
from depthgate.spec.limits import MAX_BOOTSTRAP_RESAMPLES, MAX_LENGTH, length_problem
from depthgate.spec.sequential import BoundaryName, sequential_violations

#: Adjustments of the confirmed-regression family the gate supports (valid under any dependence).
RegressionMethod: TypeAlias = Literal["BY", "holm"]
StopRule: TypeAlias = Literal["fixed", "one_extension", "sequential"]


#: The smallest alpha a plan may give: a bootstrap p-value is at least 1/(B+1), so below
#: 1/(MAX_BOOTSTRAP_RESAMPLES + 1) no slice could ever be confirmed.
MIN_ALPHA = 1.0 / (MAX_BOOTSTRAP_RESAMPLES + 1)
#: The smallest non-inferiority margin. Showing M takes about (z_α + z_β)² · 2p(1 − p) / M² cases per slice:
#: ≈ 1.6 × 10⁸ at M 0.0001 and p 0.85, so a smaller margin is no plan any run can meet, and the planner's
#: 1/M² overflowed for a subnormal one (margin = 5e-324 ended `plan` and `run` in a traceback).
MIN_MARGIN = 1e-4


def look_alpha(alpha: float, stop_rule: str) -> float:
    """The one-sided level every look tests at: alpha for a fixed design, alpha / 2 when one pre-specified
    extension may follow (Bonferroni over the two looks, research/stats_gate.md section 2.4)."""
    return alpha / 2.0 if stop_rule == "one_extension" else alpha


def min_bootstrap_resamples(n_slices: int, alpha: float, method: RegressionMethod = "BY") -> int:
    """The smallest B at which a regression in one of ``n_slices`` slices can be confirmed at ``alpha``.

    A bootstrap p-value is at least 1/(B+1). With one slice at that floor and every other at p = 1, the
    smallest adjusted q is n*c(n)/(B+1) for Benjamini-Yekutieli (c(n) = 1 + 1/2 + ... + 1/n) and
    n/(B+1) for Holm, so B + 1 >= factor/alpha. 20 slices at alpha 0.05 under BY need B >= 1439 (at
    B = 999 the smallest q is 0.072); the spec's B = 9999 serves up to 96 slices.
    """
    return max(99, math.ceil(_smallest_q_factor(n_slices, method) / alpha - 1e-9) - 1)


def _smallest_q_factor(n_slices: int, method: RegressionMethod) -> float:
    """q = factor * p for the one small p-value of a family of ``n_slices`` (all others 1)."""
    if n_slices < 1:
        raise ValueError(f"n_slices must be >= 1, got {n_slices}")
    factor = float(n_slices)
    if method == "BY":
        factor *= math.fsum(1.0 / i for i in range(1, n_slices + 1))
    return factor


#: ``(looks, look_every, boundary, alpha, n_cases) -> level``: the smallest level a look of a sequential
#: plan tests a regression at. The judge computes it (:func:`depthgate.judge.sequential.smallest_look_level`,
#: numeric integration) and passes it in: the spec layer never imports the judge.
LookLevel = Callable[[Sequence[float] | None, int | None, str | None, float, int | None], float]


def regression_test_level(
    plan: AnalysisPlan, n_cases: int | None = None, look_level: LookLevel | None = None
) -> float:
    """The smallest level at which any look of ``plan`` tests a regression, where the B rule is checked:
    look_alpha for a fixed or one-extension plan; under stop_rule "sequential" the smallest of every
    look's regression level and the last look's level (issue #36, F1: the last look re-validated there
    and refused a plan whose requests were all sent). ``n_cases``: the planned cases (a plan of
    ``look_every`` is resolved only with them; ``looks`` are taken as given without them). Without
    ``look_level`` (the matrix, before the judge is involved) the level is ``look_alpha``; the gate plan,
    built before the first request, checks the sequential levels."""
    level = look_alpha(plan.alpha, plan.stop_rule)
    if plan.stop_rule != "sequential" or not 0.0 < plan.alpha < 0.5:
        return level
    if sequential_violations(plan.stop_rule, plan.looks, plan.look_every, plan.boundary, "pass"):
        return level
    if look_level is None or (plan.looks is None and n_cases is None):
        return level
    looks = None if n_cases is not None and plan.looks is None else plan.looks
    return min(level, look_level(looks, plan.look_every, plan.boundary, plan.alpha, n_cases))


def _bootstrap_problems(
    plan: AnalysisPlan,
    n_slices: int,
    n_cases: int | None,
    look_level: LookLevel | None,
    regression_method: RegressionMethod,
) -> list[tuple[str, str, str]]:
    """B against the slice count: the smallest bootstrap p-value, BY-adjusted over ``n_slices``, must be
    able to reach the smallest level a regression is tested at (:func:`regression_test_level`)."""
    bootstrap_resamples, stop_rule = plan.bootstrap_resamples, plan.stop_rule
    level = regression_test_level(plan, n_cases, look_level)
    need = min_bootstrap_resamples(n_slices, level, regression_method)
    if bootstrap_resamples < need:
        floor_p = 1.0 / (bootstrap_resamples + 1)
        factor = _smallest_q_factor(n_slices, regression_method)
        return [
            (
                "bootstrap_resamples",
                f"{bootstrap_resamples} bootstrap resamples cannot confirm a regression among "
                f"{n_slices} slices: the smallest p-value is 1/(B+1) = {floor_p:.2g} and its "
                f"{regression_method}-adjusted q is about {min(1.0, factor * floor_p):.3g} > "
                f"{level:.4g}"
                + (
                    " (the smallest level a look of the sequential plan tests a regression at)"
                    if stop_rule == "sequential"
                    else ""
                ),
                f"set bootstrap_resamples >= {need} (or plan fewer slices)",
            )
        ]
    return []


def plan_violations(
    plan: AnalysisPlan,
    *,
    regression_method: RegressionMethod = "BY",
    n_slices: int | None = None,
    n_cases: int | None = None,
    look_level: LookLevel | None = None,
) -> list[tuple[str, str, str]]:
    """Every rule a plan must meet before anything runs, as (field, problem, fix); empty when valid.

    The single validator of the gate's parameters: :class:`AnalysisPlan` (and :class:`Matrix`, which
    knows the number of slices) calls it, and so does the gate's ``depthgate.judge.gate.GatePlan``
    (an analysis plan with its frozen design), so a plan the matrix accepts is never refused by the gate
    after the requests were sent. The bootstrap size is checked when the slice count is known, whatever
    the repeats: one seed per case uses
    Newcombe-10 p-values, which have no 1/(B+1) floor, but one rule that does not depend on R keeps the
    matrix and the gate in agreement (the default B = 9999 serves up to 96 slices). Under a sequential
    plan B is checked at the smallest level a look tests a regression at (:func:`regression_test_level`),
    so the last look never refuses it after the requests were sent.
    """
    margin, alpha, n_min, floor = plan.margin, plan.alpha, plan.n_min, plan.floor
    max_missing, bootstrap_resamples, stop_rule = plan.max_missing, plan.bootstrap_resamples, plan.stop_rule
    problems: list[tuple[str, str, str]] = []
    if not 0.0 < margin < 1.0:
        problems.append(
            ("margin", f"margin {margin!r} is outside (0, 1)", "give a margin in (0, 1), e.g. 0.10")
        )
    elif margin < MIN_MARGIN:
        problems.append(
            (
                "margin",
                f"margin {margin!r} is below {MIN_MARGIN:g}: showing it would take ~10^8 cases per slice",
                f"give a margin in [{MIN_MARGIN:g}, 1), e.g. 0.10",
            )
        )
    if not 0.0 < alpha < 0.5:
        problems.append(
            (
                "alpha",
                f"alpha {alpha!r} is not a one-sided level in (0, 0.5)",
                "give a one-sided alpha in (0, 0.5), e.g. 0.05",
            )
        )
    elif alpha < MIN_ALPHA:
        # A bootstrap p-value is at least 1/(B+1): a smaller alpha could never be reached with B within
        # its limit (and 1/alpha overflows for a subnormal alpha such as 5e-324).
        problems.append(
            (
                "alpha",
                f"alpha {alpha!r} is below {MIN_ALPHA:.3g}, the smallest level {MAX_BOOTSTRAP_RESAMPLES} "
                "bootstrap resamples (the limit) can confirm",
                f"give a one-sided alpha in [{MIN_ALPHA:.3g}, 0.5), e.g. 0.05",
            )
        )
    if n_min < 2:
        problems.append(
            ("n_min", f"n_min {n_min!r} < 2", "give at least 2 cases per slice (a real plan uses 40)")
        )
    if floor is not None and not 0.0 <= floor < 1.0:
        problems.append(
            ("floor", f"floor {floor!r} is outside [0, 1)", "give an accuracy floor in [0, 1), or none")
        )
    if not 0.0 <= max_missing < 1.0:
        problems.append(
            ("max_missing", f"max_missing {max_missing!r} is outside [0, 1)", "give a share in [0, 1)")
        )
    if bootstrap_resamples < 99:
        problems.append(
            (
                "bootstrap_resamples",
                f"{bootstrap_resamples} bootstrap resamples < 99",
                "use at least 99 (the spec uses 9999)",
            )
        )
    elif bootstrap_resamples > MAX_BOOTSTRAP_RESAMPLES:
        problems.append(
            (
                "bootstrap_resamples",
                f"{bootstrap_resamples} bootstrap resamples is over the limit of {MAX_BOOTSTRAP_RESAMPLES} "
                "(the gate and the report hold every resample of a slice in memory)",
                f"use at most {MAX_BOOTSTRAP_RESAMPLES} (the spec uses 9999)",
            )
        )
    if stop_rule not in ("fixed", "one_extension", "sequential"):
        problems.append(
            ("stop_rule", f"unknown stop rule {stop_rule!r}", "use 'fixed', 'one_extension' or 'sequential'")
        )
    if n_slices is not None and n_slices >= 1 and MIN_ALPHA <= alpha < 0.5:
        problems.extend(_bootstrap_problems(plan, n_slices, n_cases, look_level, regression_method))
    return problems


#: NoLiMa's short lengths (tokens) for the base score (issue #24): the same task, with haystack.
DEFAULT_BASE_LENGTHS = (250, 500, 1000)


def base_length_violations(plan: AnalysisPlan) -> list[tuple[str, str, str]]:
    """The rules of ``base_lengths``, as (field, problem, fix): a list of distinct lengths >= 16 and <=
    the longest supported length, and only where it is used (NoLiMa with ``base_score = "short"``)."""
    if plan.base_lengths is None:
        return []
    if plan.effective_length_rule != "nolima" or plan.base_score != "short":
        return [
            (
                "base_lengths",
                "base_lengths is set but the base score does not use it (RULER rule or "
                'base_score = "control")',
                'drop base_lengths, or use effective_length_rule = "nolima" with base_score = "short"',
            )
        ]
    if not plan.base_lengths:
        return [("base_lengths", "must not be empty", "list short lengths in tokens, e.g. [250, 500, 1000]")]
    for index, length in enumerate(plan.base_lengths):
        problem = "is too small" if length < 16 else length_problem(length)
        if problem is not None:
            return [
                (
                    f"base_lengths[{index}]",
                    f"length {length} {problem}" if length < 16 else problem,
                    f"give short lengths in tokens (>= 16, <= {MAX_LENGTH}), e.g. 500",
                )
            ]
    if len(set(plan.base_lengths)) != len(plan.base_lengths):
        return [("base_lengths", "contains a repeated length", "list each length once")]
    return []


class AnalysisPlan(_Frozen):
    """The frozen statistical plan (research/stats_gate.md). Digested before any run; never changed after.

    Validated once, here and in :class:`Matrix`, by :func:`plan_violations` (the rules the gate applies):
    alpha in (0, 0.5), n_min >= 2, margin in (0, 1), floor in [0, 1), and enough bootstrap resamples to
    confirm a regression among the matrix's slices.
    """

    # "pass": every placed case counts. "control_normalised": only the cases whose *baseline*
    # evidence-only control passes (the model can do the task at all), so "cannot do this task" is kept
    # out of a position verdict; needs the controls (run without --no-controls).
    primary_metric: Literal["pass", "control_normalised"] = "pass"
    margin: StrictFloat = Field(default=0.10, gt=0.0, lt=1.0)
    alpha: StrictFloat = Field(default=0.05, gt=0.0, lt=1.0, description="one-sided; must be < 0.5")
    n_min: StrictInt = Field(default=40, ge=2)
    floor: StrictFloat | None = Field(default=None, ge=0.0, lt=1.0)
    fdr_method: Literal["BH", "BY", "holm"] = "BH"
    stop_rule: StopRule = "fixed"
    # stop_rule "sequential" (issue #26, depthgate.spec.sequential): the pre-registered looks, as
    # fractions of the cases or every K cases, and the boundary family. None (dropped from the dump, so
    # the digests of fixed-design plans do not move) under any other stop rule.
    looks: list[StrictFloat] | None = None
    look_every: StrictInt | None = None
    boundary: BoundaryName | None = None
    max_missing: StrictFloat = Field(default=0.10, ge=0.0, lt=1.0)
    bootstrap_resamples: StrictInt = Field(default=9999, ge=99)
    bootstrap_seed: StrictInt = Field(default=0, ge=0)
    # Position science beside the gate (depthgate.judge.science.effective_length; never changes the
    # verdict): NoLiMa = a share of the arm's evidence-only base score, RULER = an absolute accuracy.
    effective_length_rule: Literal["nolima", "ruler"] = "nolima"
    effective_length_threshold: StrictFloat = Field(default=0.85, gt=0.0, le=1.0)
    # NoLiMa's base score (issue #24): "short" = the same cases, haystack and depths at short lengths
    # (``base_lengths``, default 250/500/1000 tokens), built and sent with the matrix but never gated;
    # "control" = the evidence-only control (the rule before issue #24). Ignored under RULER.
    base_score: Literal["short", "control"] = "short"
    base_lengths: list[StrictInt] | None = None

    @model_validator(mode="after")
    def _check_plan(self) -> AnalysisPlan:
        self.raise_violations()
        for field, problem, fix in base_length_violations(self):
            raise _violation(problem, field=field, fix=fix)
        return self

    def short_base_lengths(self) -> list[int]:
        """The short lengths the matrix adds for NoLiMa's base score: ``base_lengths`` (or the default
        250/500/1000) under the NoLiMa rule with ``base_score = "short"``; empty otherwise."""
        if self.effective_length_rule != "nolima" or self.base_score != "short":
            return []
        return sorted(self.base_lengths if self.base_lengths is not None else DEFAULT_BASE_LENGTHS)

    @model_serializer(mode="wrap")
    def _stable_dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """The effective-length fields are dumped only when set away from their defaults, so the plan
        digests of runs frozen before these fields existed stay valid (a resume or a re-gate of an old
        run folder is not refused as a changed plan)."""
        data: dict[str, Any] = handler(self)
        for name, default in (
            ("effective_length_rule", "nolima"),
            ("effective_length_threshold", 0.85),
            ("base_score", "short"),
            ("base_lengths", None),
        ):
            if data.get(name) == default:
                data.pop(name, None)
        for name in ("looks", "look_every", "boundary"):
            if data.get(name) is None:
                data.pop(name, None)
        return data

    def violations(
        self,
        *,
        n_slices: int | None = None,
        regression_method: RegressionMethod = "BY",
        n_cases: int | None = None,
        look_level: LookLevel | None = None,
    ) -> list[tuple[str, str, str]]:
        """:func:`plan_violations` of this plan (with the slice and case counts when known), then the
        sequential stop rule's (:func:`depthgate.spec.sequential.sequential_violations`)."""
        return plan_violations(
            self,
            n_slices=n_slices,
            regression_method=regression_method,
            n_cases=n_cases,
            look_level=look_level,
        ) + sequential_violations(
            self.stop_rule, self.looks, self.look_every, self.boundary, self.primary_metric
        )

    def raise_violations(
        self,
        *,
        n_slices: int | None = None,
        prefix: str = "",
        regression_method: RegressionMethod = "BY",
        n_cases: int | None = None,
        look_level: LookLevel | None = None,
    ) -> None:
        """Raise the first violation as a validation error on ``prefix + field``."""
        found = self.violations(
            n_slices=n_slices, regression_method=regression_method, n_cases=n_cases, look_level=look_level
        )
        for field, problem, fix in found:
            raise _violation(problem, field=f"{prefix}{field}", fix=fix)
