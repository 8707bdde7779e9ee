"""The gate's plan: its parameters (the pre-registered part of an analysis plan) and the seeds it
derives. Split out of the gate's run (``release``; issue #23: one job per module)."""

from __future__ import annotations

import hashlib
from typing import Any, Literal

import numpy.typing as npt
from pydantic import Field, ValidationError, model_validator

from depthgate.exceptions import SpecError
from depthgate.judge.bounds import BootstrapBounds, bootstrap_percentile
from depthgate.judge.sequential import smallest_look_level
from depthgate.spec.base import violation
from depthgate.spec.loading import spec_error_from_validation
from depthgate.spec.models import AnalysisPlan
from depthgate.spec.models import look_alpha as _look_alpha

__all__ = ["NI_METHODS", "REGRESSION_METHODS", "GatePlan", "stable_seed"]

#: The NI q-value adjustments and the confirmed-regression family's (valid under any dependence).
NI_METHODS = {"BH": "fdr_bh", "BY": "fdr_by", "holm": "holm"}
REGRESSION_METHODS = {"BY": "fdr_by", "holm": "holm"}

# --------------------------------------------------------------------------------------------------
# Plan


class GatePlan(AnalysisPlan):
    """The gate's plan: the frozen :class:`AnalysisPlan` (inherited, so there is one plan type and no
    field is mapped by hand; issue #23) plus the frozen design the gate counts against and the gate's
    own fixed rules.

    ``margin`` M and ``alpha`` are one-sided. ``floor`` is the absolute accuracy floor F (None: no
    floor check; the bound is still reported). ``planned_slices`` is the pre-registered list of
    (length, position); None means every slice present in the records. ``max_missing`` is the largest
    share of planned cases that may be missing. ``fdr_method`` adjusts the reported NI q-values;
    ``regression_method`` adjusts the confirmed-regression family (BY or Holm: valid under any
    dependence). ``block_known_gap``: a floor failure where the baseline also misses the floor still
    blocks (default, section 2.5).

    ``stop_rule`` "one_extension" pre-specifies at most one extension of the run: every look (the first
    and the pooled second) then tests at ``alpha / 2`` (Bonferroni over the two looks, section 2.4), so
    the chance of a wrong PASS over both looks stays <= ``alpha``. :attr:`look_alpha` is the level the
    gate uses for every bound, q-value threshold and the floor.

    ``planned_cases`` and ``planned_seeds`` are the frozen case set and seed set. When given, missing
    data are counted against them (a case absent from every record is missing in every slice; a seed
    absent from both arms is a missing run, R stays the planned R) and records of an unplanned case or
    seed are refused. None keeps the record-based denominators for direct callers.

    The numeric rules are :func:`depthgate.spec.models.plan_violations` (inherited from the analysis
    plan), with the slice count when the slices are planned. An invalid plan raises :class:`SpecError`
    naming the field and the fix.
    """

    regression_method: Literal["BY", "holm"] = "BY"
    planned_slices: tuple[tuple[int, str], ...] | None = None
    block_known_gap: bool = True
    fragile_range: float = Field(default=0.6, gt=0.0, le=1.0)
    triage_top_k: int = Field(default=20, ge=0)
    triage_rerun_seeds: int = Field(default=20, ge=1)
    power: float = Field(default=0.8, gt=0.0, lt=1.0)
    planned_cases: tuple[str, ...] | None = None
    planned_seeds: tuple[int, ...] | None = None
    # The cases planned in a slice whose position carries an evidence spacing ("0.5~far"): the
    # multi-evidence cases, the only ones a spacing moves (single-evidence cases are laid out at adjacent
    # positions only). None: the planned cases, as in every other slice.
    spaced_cases: tuple[str, ...] | None = None

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            error = spec_error_from_validation(exc, file=None)
            raise SpecError(f"invalid gate plan: {error.message}", field=error.field, fix=error.fix) from None

    @model_validator(mode="after")
    def _check_design(self) -> GatePlan:
        n_slices = None if self.planned_slices is None else len(set(self.planned_slices))
        n_cases = None if self.planned_cases is None else len(self.planned_cases)
        self.raise_violations(
            n_slices=n_slices,
            regression_method=self.regression_method,
            n_cases=n_cases,
            look_level=smallest_look_level,
        )
        distinct = "a non-empty list of distinct {}, or None"
        for name, values in (("planned_cases", self.planned_cases), ("planned_seeds", self.planned_seeds)):
            if values is not None and (not values or len(set(values)) != len(values)):
                raise violation(f"invalid value {values!r}", field=name, fix=distinct.format(name[8:]))
        spaced = self.spaced_cases
        if spaced is not None and (
            not spaced
            or len(set(spaced)) != len(spaced)
            or (self.planned_cases is not None and not set(spaced) <= set(self.planned_cases))
        ):
            raise violation(
                f"invalid value {spaced!r}",
                field="spaced_cases",
                fix=distinct.format("planned case ids (the multi-evidence cases)"),
            )
        return self

    def replace(self, **changes: Any) -> GatePlan:
        """This plan with ``changes``, validated again."""
        return GatePlan(**{**dict(self), **changes})

    @property
    def look_alpha(self) -> float:
        """The one-sided level of every test in this analysis: alpha, or alpha / 2 under one_extension."""
        return _look_alpha(self.alpha, self.stop_rule)

    def bootstrap(self, differences: npt.ArrayLike, *key: object) -> BootstrapBounds:
        """:func:`bootstrap_percentile` (monotone: issue #22, item 3) of per-case ``differences`` at this
        plan's margin, look level and replicates, seeded from the plan seed and ``key`` (e.g. "worst",
        length)."""
        return bootstrap_percentile(
            differences,
            self.margin,
            self.look_alpha,
            self.bootstrap_resamples,
            stable_seed(self.bootstrap_seed, *key),
        )

    def to_dict(self) -> dict[str, Any]:
        """The gate's parameters as verdict.json has always written them (same keys, same order)."""
        out: dict[str, Any] = {}
        for name in _DICT_FIELDS:
            value = getattr(self, _DICT_ATTRIBUTES.get(name, name))
            if name == "planned_slices" and value is not None:
                value = [[length, position] for length, position in value]
            elif isinstance(value, tuple):
                value = list(value)
            out[name] = value
        out["look_alpha"] = self.look_alpha
        return out


#: The gate's parameters in verdict.json, in the order the report has always written them.
_DICT_FIELDS = (
    "margin",
    "alpha",
    "n_min",
    "floor",
    "fdr_method",
    "regression_method",
    "max_missing",
    "bootstrap_reps",
    "bootstrap_seed",
    "planned_slices",
    "block_known_gap",
    "fragile_range",
    "triage_top_k",
    "triage_rerun_seeds",
    "power",
    "stop_rule",
    "planned_cases",
    "planned_seeds",
    "spaced_cases",
)
# verdict.json keys that are not the field's name: B has always been written as "bootstrap_reps", and
# renaming the key would change the bytes of every shipped verdict (tests/cli/test_shipped_runs.py).
_DICT_ATTRIBUTES = {"bootstrap_reps": "bootstrap_resamples"}


def stable_seed(base: int, *parts: object) -> int:
    """A 64-bit RNG seed from sha256 of ``base`` and ``parts``: identical in every process."""
    text = "|".join(str(p) for p in (base, *parts))
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
