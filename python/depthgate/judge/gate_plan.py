"""The gate's plan: its parameters (the pre-registered part of an analysis plan) and the seeds it
derives. Moved out of ``depthgate.judge.stats`` (issue #23: one job per module), which re-exports it."""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass
from typing import Any, Literal

import numpy.typing as npt

from depthgate.exceptions import SpecError
from depthgate.judge.bootstrap import BootstrapBounds
from depthgate.judge.percentile import bootstrap_percentile
from depthgate.spec.models import look_alpha as _look_alpha
from depthgate.spec.models import plan_violations

__all__ = ["NI_METHODS", "REGRESSION_METHODS", "GatePlan", "stable_seed"]

#: The NI q-value adjustments and the confirmed-regression family's (valid under any dependence).
NI_METHODS = {"BH": "fdr_bh", "BY": "fdr_by", "holm": "holm"}
REGRESSION_METHODS = {"BY": "fdr_by", "holm": "holm"}

# --------------------------------------------------------------------------------------------------
# Plan


@dataclass(frozen=True)
class GatePlan:
    """Parameters of the gate (the pre-registered part of an analysis plan).

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

    The numeric rules are :func:`depthgate.spec.models.plan_violations`, the same function that
    validates the matrix's ``AnalysisPlan`` before a run is frozen.
    """

    margin: float = 0.10
    alpha: float = 0.05
    n_min: int = 40
    floor: float | None = None
    fdr_method: Literal["BH", "BY", "holm"] = "BH"
    regression_method: Literal["BY", "holm"] = "BY"
    max_missing: float = 0.10
    bootstrap_reps: int = 9999
    bootstrap_seed: int = 0
    planned_slices: tuple[tuple[int, str], ...] | None = None
    block_known_gap: bool = True
    fragile_range: float = 0.6
    triage_top_k: int = 20
    triage_rerun_seeds: int = 20
    power: float = 0.8
    stop_rule: Literal["fixed", "one_extension", "sequential"] = "fixed"
    planned_cases: tuple[str, ...] | None = None
    planned_seeds: tuple[int, ...] | None = None
    # The cases planned in a slice whose position carries an evidence spacing ("0.5~far"): the
    # multi-evidence cases, the only ones a spacing moves (single-evidence cases are laid out at adjacent
    # positions only). None: the planned cases, as in every other slice.
    spaced_cases: tuple[str, ...] | None = None

    @property
    def bootstrap_resamples(self) -> int:
        """:attr:`bootstrap_reps` under the analysis plan's name (:func:`plan_violations` reads it)."""
        return self.bootstrap_reps

    def __post_init__(self) -> None:
        names = {"bootstrap_resamples": "bootstrap_reps"}
        for name, problem, fix in plan_violations(
            self,
            regression_method=self.regression_method
            if self.regression_method in REGRESSION_METHODS
            else "BY",
            n_slices=None if self.planned_slices is None else len(set(self.planned_slices)),
        ):
            raise SpecError(f"invalid gate plan: {problem}", field=names.get(name, name), fix=fix)
        checks: list[tuple[bool, str, str]] = [
            (self.fdr_method in NI_METHODS, "fdr_method", f"one of {sorted(NI_METHODS)}"),
            (
                self.regression_method in REGRESSION_METHODS,
                "regression_method",
                f"one of {sorted(REGRESSION_METHODS)} (valid under arbitrary dependence)",
            ),
            (0.0 < self.fragile_range <= 1.0, "fragile_range", "a range in (0, 1]"),
            (self.triage_top_k >= 0, "triage_top_k", "a non-negative count"),
            (self.triage_rerun_seeds >= 1, "triage_rerun_seeds", "a positive seed count"),
            (0.0 < self.power < 1.0, "power", "a power in (0, 1)"),
            (
                self.planned_cases is None
                or (len(self.planned_cases) > 0 and len(set(self.planned_cases)) == len(self.planned_cases)),
                "planned_cases",
                "a non-empty list of distinct case ids, or None",
            ),
            (
                self.planned_seeds is None
                or (len(self.planned_seeds) > 0 and len(set(self.planned_seeds)) == len(self.planned_seeds)),
                "planned_seeds",
                "a non-empty list of distinct seeds, or None",
            ),
            (
                self.spaced_cases is None
                or (
                    len(self.spaced_cases) > 0
                    and len(set(self.spaced_cases)) == len(self.spaced_cases)
                    and (self.planned_cases is None or set(self.spaced_cases) <= set(self.planned_cases))
                ),
                "spaced_cases",
                "a non-empty list of distinct planned case ids (the multi-evidence cases), or None",
            ),
        ]
        for ok, name, fix in checks:
            if not ok:
                raise SpecError(f"invalid gate plan value {getattr(self, name)!r}", field=name, fix=fix)

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
            self.bootstrap_reps,
            stable_seed(self.bootstrap_seed, *key),
        )

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        if self.planned_slices is not None:
            out["planned_slices"] = [[length, position] for length, position in self.planned_slices]
        for name in ("planned_cases", "planned_seeds", "spaced_cases"):
            value = getattr(self, name)
            out[name] = None if value is None else list(value)
        out["look_alpha"] = self.look_alpha
        return out


def stable_seed(base: int, *parts: object) -> int:
    """A 64-bit RNG seed from sha256 of ``base`` and ``parts``: identical in every process."""
    text = "|".join(str(p) for p in (base, *parts))
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "big")
