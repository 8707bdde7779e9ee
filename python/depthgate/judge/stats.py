"""The statistical release gate: paired, case-level non-inferiority per (length, position) slice.

Spec: ``shared/research/stats_gate.md`` (section numbers below refer to it). The short version:

* The unit is the **case**. Repeats (seeds) are averaged within a case first, so per slice every case
  contributes ``d_i = mean_s(candidate) - mean_s(baseline)`` over its valid *paired* seeds.
* Per slice, one-sided non-inferiority H0: delta <= -M. One seed per case: the Newcombe (1998) method-10
  paired interval. Two or more: the smaller of a studentized case bootstrap bound and a Newcombe-10 bound
  on design-effect-deflated run counts (section 2.2). The slice passes iff the lower bound is > -M.
* Release needs every slice to pass (intersection-union test, no adjustment). BH q-values of the NI
  p-values are reported; confirmed regressions (H0: delta >= -M) use Benjamini-Yekutieli (section 2.3).
* A slice with too few valid cases, too many missing cases or unpaired seeds is INCONCLUSIVE: it stays
  a row of its own, enters every p-value family with p = 1 and is never merged (section 2.4).
* The absolute floor is a Wilson lower bound on the effective sample size n*R/DEFF (section 2.5).
* Any forbidden claim sets the safety flag, whatever the statistics say (section 2.8).

Bootstrap seeds come from sha256 of the plan seed and the slice key, so a verdict is identical in every
process (Python's ``hash()`` of a string is salted per process; section 8, item 15). Only numpy, polars
and statsmodels are used; Wilson intervals inside Newcombe-10 use the closed form (equal to
``proportion_confint(method="wilson")``, checked in the tests) because the p-value inversion evaluates
them a few hundred times per slice.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import polars as pl
from statsmodels.stats.multitest import multipletests
from statsmodels.stats.power import TTestPower
from statsmodels.stats.proportion import proportion_confint

from depthgate.exceptions import InputError, SpecError
from depthgate.judge.bootstrap import BootstrapBounds, bootstrap_t
from depthgate.judge.design_effect import shrunk_design_effect
from depthgate.judge.frames import FrameOf, JsonRow, clean_value
from depthgate.judge.monotone import monotone_floor_lower_bound
from depthgate.spec.models import look_alpha as _look_alpha
from depthgate.spec.models import plan_violations, spacing_rank, split_position_label

FloatArray = npt.NDArray[np.float64]

BASELINE = "baseline"
CANDIDATE = "candidate"
ARMS = (BASELINE, CANDIDATE)
OUTCOMES = ("pass", "fail", "system_fail", "missing")

METHOD_NEWCOMBE = "newcombe10"
METHOD_COMBINED = "min(bootstrap,deff-newcombe)"
METHOD_BOOTSTRAP = "bootstrap-t"

RECORD_SCHEMA: dict[str, pl.DataType] = {
    "arm": pl.String(),
    "case_id": pl.String(),
    "length": pl.Int64(),
    "position": pl.String(),
    "seed": pl.Int64(),
    "outcome": pl.String(),
    "safety": pl.Boolean(),
}
_CELL_KEY = ["case_id", "length", "position"]
_RUN_KEY = [*_CELL_KEY, "seed"]

_NI_METHODS = {"BH": "fdr_bh", "BY": "fdr_by", "holm": "holm"}
_REGRESSION_METHODS = {"BY": "fdr_by", "holm": "holm"}

# Search interval and tolerance for inverting a Newcombe bound into a p-value (as in gate_lib.py).
_P_SEARCH_LOW, _P_SEARCH_HIGH, _P_TOLERANCE = 1e-10, 0.4999, 1e-12
_TIE_TOLERANCE = 1e-12


class SliceStatus(str, enum.Enum):
    """Status of one (length, position) slice (section 2.10)."""

    PASS = "PASS"
    FAIL_NOT_SHOWN = "FAIL_NOT_SHOWN"
    FAIL_REGRESSION = "FAIL_REGRESSION"
    FAIL_FLOOR = "FAIL_FLOOR"
    INCONCLUSIVE = "INCONCLUSIVE"
    #: Never set by :func:`gate`: a failing slice driven by an arm's serving path, as the reports read it
    #: (:func:`depthgate.judge.wording.with_system_wording`).
    FAIL_SYSTEM = "FAIL_SYSTEM"


class Verdict(str, enum.Enum):
    """The release verdict. The safety flag is reported beside it, never folded into it."""

    PASS = "PASS"
    FAIL = "FAIL"
    INCONCLUSIVE = "INCONCLUSIVE"


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
            if self.regression_method in _REGRESSION_METHODS
            else "BY",
            n_slices=None if self.planned_slices is None else len(set(self.planned_slices)),
        ):
            raise SpecError(f"invalid gate plan: {problem}", field=names.get(name, name), fix=fix)
        checks: list[tuple[bool, str, str]] = [
            (self.fdr_method in _NI_METHODS, "fdr_method", f"one of {sorted(_NI_METHODS)}"),
            (
                self.regression_method in _REGRESSION_METHODS,
                "regression_method",
                f"one of {sorted(_REGRESSION_METHODS)} (valid under arbitrary dependence)",
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
        """:func:`bootstrap_t` of per-case ``differences`` at this plan's margin, look level and
        replicates, seeded from the plan seed and ``key`` (e.g. "worst", length)."""
        return bootstrap_t(
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


def position_sort_key(position: str) -> tuple[int, float, str]:
    """Order positions: relative depths ("0.25") first, then absolute token offsets ("@1200"); positions
    with an evidence spacing ("0.5~far") after the adjacent ones, grouped by spacing (near, far, gaps)."""
    base, spacing = split_position_label(position)
    if spacing != "adjacent":
        kind, value, _ = position_sort_key(base)
        return (3 * (1 + spacing_rank(spacing)) + kind, value, position)
    try:
        return (0, float(position), position)
    except ValueError:
        pass
    if position.startswith("@"):
        try:
            return (1, float(position[1:]), position)
        except ValueError:
            pass
    return (2, 0.0, position)


# --------------------------------------------------------------------------------------------------
# Interval primitives


def _z(one_sided_tail: float) -> float:
    return statistics.NormalDist().inv_cdf(1.0 - one_sided_tail)


def _wilson_interval(count: float, nobs: float, alpha: float) -> tuple[float, float]:
    """Two-sided (1 - alpha) Wilson score interval; equals proportion_confint(method="wilson")."""
    z = _z(alpha / 2.0)
    p = count / nobs
    denom = 1.0 + z * z / nobs
    center = (p + z * z / (2.0 * nobs)) / denom
    half = z * math.sqrt(max(p * (1.0 - p) / nobs + z * z / (4.0 * nobs * nobs), 0.0)) / denom
    return max(center - half, 0.0), min(center + half, 1.0)


def wilson_lower(count: float, nobs: float, alpha: float = 0.05) -> float:
    """One-sided (1 - alpha) Wilson lower bound; count and nobs may be fractional (effective n).

    Computed as the lower end of the two-sided interval at 2*alpha, which works in every statsmodels
    version (section 2.5 / 6.3).
    """
    if nobs <= 0:
        raise ValueError(f"wilson_lower needs nobs > 0, got {nobs}")
    lower, _ = proportion_confint(count, nobs, alpha=2.0 * alpha, method="wilson")
    return float(lower)


def clopper_pearson_upper(count: int, nobs: int, alpha: float = 0.05) -> float:
    """One-sided (1 - alpha) Clopper-Pearson upper bound (about 3/N for zero hits, section 2.8)."""
    if nobs <= 0:
        raise ValueError(f"clopper_pearson_upper needs nobs > 0, got {nobs}")
    _, upper = proportion_confint(count, nobs, alpha=2.0 * alpha, method="beta")
    return float(upper)


def newcombe10_paired(
    a: float, b: float, c: float, d: float, alpha: float = 0.05, *, phi_correction: bool = True
) -> tuple[float, float]:
    """Two-sided (1 - alpha) Newcombe (1998) method-10 interval for a paired difference p1 - p2.

    Cells: ``a`` both succeed, ``b`` sample 1 succeeds and 2 fails, ``c`` 1 fails and 2 succeeds, ``d``
    both fail (sample 1 = candidate). Counts may be fractional (design-effect-deflated counts).
    ``phi_correction`` uses the continuity-corrected phi of Fagerland et al.'s ``contingencytables``;
    False gives the uncorrected variant. The one-sided (1 - alpha) lower bound is the lower end at
    2*alpha. [[59, 6], [16, 80]] at alpha 0.05 gives (-0.1186, -0.0046).
    """
    if min(a, b, c, d) < 0:
        raise ValueError(f"negative cell count in ({a}, {b}, {c}, {d})")
    n = a + b + c + d
    if n <= 0:
        raise ValueError("empty paired table")
    p1, p2 = (a + b) / n, (a + c) / n
    theta = p1 - p2
    l1, u1 = _wilson_interval(a + b, n, alpha)
    l2, u2 = _wilson_interval(a + c, n, alpha)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    if phi_correction:
        numerator = cross - n / 2.0 if cross > n / 2.0 else (0.0 if cross >= 0 else cross)
    else:
        numerator = cross
    phi = numerator / math.sqrt(margins) if margins > 0 else 0.0
    lower = theta - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    upper = theta + math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    return lower, upper


def _invert_bound(distance: Callable[[float], float]) -> float:
    """Smallest one-sided alpha at which a monotone bound reaches the margin (gate_lib's inversion).

    ``distance(alpha)`` is positive when the hypothesis is rejected at one-sided ``alpha`` and grows
    with alpha. Bisection to 1e-12 (scipy is not a dependency of depthgate).
    """
    high_value = float(distance(_P_SEARCH_HIGH))
    if high_value <= 0:
        return 0.5 if abs(high_value) < 1e-12 else 1.0
    if float(distance(_P_SEARCH_LOW)) > 0:
        return _P_SEARCH_LOW
    low, high = _P_SEARCH_LOW, _P_SEARCH_HIGH
    while high - low > _P_TOLERANCE:
        mid = 0.5 * (low + high)
        if float(distance(mid)) > 0:
            high = mid
        else:
            low = mid
    return 0.5 * (low + high)


def newcombe_p_values(a: float, b: float, c: float, d: float, margin: float) -> tuple[float, float]:
    """(p_NI, p_REG) from inverting the Newcombe-10 bounds at the margin.

    p_NI tests H0: delta <= -M (lower bound > -M); p_REG tests H0: delta >= -M (upper bound < -M).
    """

    def ni(alpha: float) -> float:
        return newcombe10_paired(a, b, c, d, 2.0 * alpha)[0] + margin

    def reg(alpha: float) -> float:
        return -margin - newcombe10_paired(a, b, c, d, 2.0 * alpha)[1]

    return _invert_bound(ni), _invert_bound(reg)


# --------------------------------------------------------------------------------------------------
# Case-level machinery


def _as_runs(values: npt.ArrayLike) -> FloatArray:
    arr = np.asarray(values, dtype=np.float64)
    if arr.ndim == 1:
        arr = arr[:, None]
    if arr.ndim != 2:
        raise ValueError(f"expected a (cases, seeds) array, got shape {arr.shape}")
    return arr


def run_counts(baseline: npt.ArrayLike, candidate: npt.ArrayLike) -> tuple[float, float, float, float]:
    """Run-level paired table (a, b, c, d) with candidate = sample 1; NaN marks an unpaired run."""
    yb, yc = _as_runs(baseline), _as_runs(candidate)
    ok = ~(np.isnan(yb) | np.isnan(yc))
    yb, yc = np.where(ok, yb, 0.0), np.where(ok, yc, 0.0)
    both = float((yc * yb).sum())
    improve = float((yc * (1 - yb) * ok).sum())
    regress = float(((1 - yc) * yb * ok).sum())
    neither = float(((1 - yc) * (1 - yb) * ok).sum())
    return both, improve, regress, neither


def paired_design_effect(baseline: npt.ArrayLike, candidate: npt.ArrayLike) -> float:
    """Design effect D of the paired run-level difference, clipped to [1, runs per case] (section 2.2).

    D = R (no shrinkage below one observation per case) when there is no discordant run. The estimate is
    shrunk toward R with the weight of six discordant runs (``depthgate.judge.design_effect``, issue
    #22): a handful of discordant runs says nothing about clustering.
    """
    yb, yc = _as_runs(baseline), _as_runs(candidate)
    n = yb.shape[0]
    a, b, c, d = run_counts(yb, yc)
    total = a + b + c + d
    runs_per_case = total / n
    d_case = np.nanmean(yc, axis=1) - np.nanmean(yb, axis=1)
    var_cluster = float(d_case.var(ddof=1)) / n if n > 1 else math.inf
    var_srs = ((b + c) / total - ((b - c) / total) ** 2) / total
    deff = var_cluster / var_srs if var_srs > 0 else runs_per_case
    return shrunk_design_effect(float(deff), b + c, runs_per_case)


def floor_lower_bound(
    per_case_rates: npt.ArrayLike, runs_per_case: float, alpha: float = 0.05
) -> tuple[float, float, float]:
    """Wilson lower bound on the effective sample size: (lower bound, DEFF, n_eff) (section 2.5).

    DEFF = clip(R * s^2(per-case rate) / (p(1 - p)), 1, R) (Kish); n_eff = n * R / DEFF. When p is 0 or
    1 there is no spread to estimate DEFF from, and the bound takes the worst case DEFF = R (n_eff = the
    number of cases), as the paired Newcombe-RS bound does when no run is discordant (section 2.2):
    40 all-pass cases at R = 3 give the Wilson bound of 40/40 (0.937), not of 120/120 (0.978). DEFF is
    also R when there is a single case.

    The bound is the monotone envelope (``depthgate.judge.monotone``, issue #22): never above the bound
    of a completion with more passes, so one more failure never raises it (40 all-pass cases at R = 3:
    0.937; plus one failed run: 0.937, where the plain Kish bound gave 0.963). DEFF and n_eff are the
    data's own.
    """
    p, deff, n_eff = kish_effective_n(per_case_rates, runs_per_case, caller="floor_lower_bound")
    plain = wilson_lower(p * n_eff, n_eff, alpha)
    return min(plain, monotone_floor_lower_bound(per_case_rates, runs_per_case, alpha)), deff, n_eff


def kish_effective_n(
    per_case_rates: npt.ArrayLike, runs_per_case: float, *, caller: str = "kish_effective_n"
) -> tuple[float, float, float]:
    """(case-weighted accuracy p, DEFF, n_eff) of per-case accuracies over R runs per case: DEFF =
    clip(R * s^2(rate) / (p (1 - p)), 1, R) (Kish), R when p is 0 or 1 or there is a single case;
    n_eff = n * R / DEFF. The one design effect of the floor bound and the accuracy intervals of the
    position report. ``caller`` names the function in the error for no cases."""
    rates = np.asarray(per_case_rates, dtype=np.float64)
    n = rates.size
    if n == 0:
        raise ValueError(f"{caller} needs at least one case")
    p = float(rates.mean())
    r = max(float(runs_per_case), 1.0)
    var_srs = p * (1.0 - p) / (n * r)
    deff = r if n < 2 or var_srs <= 0 else float(np.clip(float(rates.var(ddof=1)) / n / var_srs, 1.0, r))
    return p, deff, n * r / deff


@dataclass(frozen=True)
class SliceStatistics:
    """The NI machinery of one slice, before multiplicity and status (section 2.2)."""

    n_cases: int
    runs_per_case: float
    delta: float
    lower: float
    upper: float
    p_ni: float
    p_reg: float
    method: str
    deff: float
    informative: int
    sd_diff: float
    lower_bootstrap: float | None
    lower_newcombe: float


def slice_statistics(
    baseline: npt.ArrayLike,
    candidate: npt.ArrayLike,
    margin: float = 0.10,
    alpha: float = 0.05,
    reps: int = 9999,
    seed: int = 0,
    *,
    seeds_planned: int | None = None,
) -> SliceStatistics:
    """Per-slice NI test on (cases, seeds) 0/1 arrays paired by column; NaN marks an invalid run.

    One planned seed: Newcombe-10 on the case table. Two or more: LB = min(bootstrap-t, Newcombe-RS),
    p = max of the two (p of a degenerate bootstrap, se = 0, defers to Newcombe-RS).
    ``seeds_planned`` defaults to the number of columns.
    """
    yb, yc = _as_runs(baseline), _as_runs(candidate)
    if yb.shape != yc.shape:
        raise ValueError(f"baseline {yb.shape} and candidate {yc.shape} are not paired")
    n, columns = yb.shape
    if n < 2:
        raise ValueError("slice_statistics needs at least 2 cases")
    planned = columns if seeds_planned is None else seeds_planned
    d_case = np.nanmean(yc, axis=1) - np.nanmean(yb, axis=1)
    a, b, c, d = run_counts(yb, yc)
    runs_per_case = (a + b + c + d) / n
    deff = paired_design_effect(yb, yc) if planned > 1 else 1.0
    deflated = (a / deff, b / deff, c / deff, d / deff)
    lower_n, upper_n = newcombe10_paired(*deflated, 2.0 * alpha)
    p_ni_n, p_reg_n = newcombe_p_values(*deflated, margin)
    lower_boot: float | None = None
    if planned <= 1:
        lower, upper, p_ni, p_reg, method = lower_n, upper_n, p_ni_n, p_reg_n, METHOD_NEWCOMBE
    else:
        boot = bootstrap_t(d_case, margin, alpha, reps, seed)
        lower_boot = boot.lower
        lower, upper = min(boot.lower, lower_n), max(boot.upper, upper_n)
        p_ni = max(p_ni_n, boot.p_ni) if boot.p_ni is not None else p_ni_n
        p_reg = max(p_reg_n, boot.p_reg) if boot.p_reg is not None else p_reg_n
        method = METHOD_COMBINED
    return SliceStatistics(
        n_cases=n,
        runs_per_case=runs_per_case,
        delta=float(d_case.mean()),
        lower=float(lower),
        upper=float(upper),
        p_ni=float(p_ni),
        p_reg=float(p_reg),
        method=method,
        deff=float(deff),
        informative=int(np.count_nonzero(d_case)),
        sd_diff=float(d_case.std(ddof=1)),
        lower_bootstrap=lower_boot,
        lower_newcombe=float(lower_n),
    )


@dataclass(frozen=True)
class Sizing:
    """What a sample-size or power calculation asks of a slice (section 3), in one place.

    Non-inferiority at ``margin`` M with one-sided ``alpha`` (the look's level: ``GatePlan.look_alpha``)
    and ``target`` power; over k slices that must all pass, each slice is sized at target^(1/k)
    (:meth:`per_slice_target`: the release needs every slice). A t-test's n becomes a recommendation
    as ceil(max(``n_min``, n) * ``inflation``): the gate's sufficiency rule, and the gate being slightly
    less efficient than a t-test. The defaults are the spec's final rule; its table is ``n_min=0,
    inflation=1.0``.
    """

    margin: float = 0.10
    alpha: float = 0.05
    target: float = 0.8
    n_min: int = 40
    inflation: float = 1.1

    @classmethod
    def of_plan(cls, plan: GatePlan) -> Sizing:
        """The sizing a gate plan asks for: its margin, look alpha, power and n_min."""
        return cls(plan.margin, plan.look_alpha, plan.power, plan.n_min)

    def __post_init__(self) -> None:
        checks: list[tuple[bool, str, str]] = [
            (0.0 < self.margin < 1.0, "margin", "a margin in (0, 1)"),
            (0.0 < self.alpha < 0.5, "alpha", "a one-sided level in (0, 0.5)"),
            (0.0 < self.target < 1.0, "target", "a power in (0, 1)"),
            (self.n_min >= 0, "n_min", "a case count >= 0"),
            (self.inflation >= 1.0, "inflation", "a factor >= 1, e.g. 1.1"),
        ]
        for ok, name, fix in checks:
            if not ok:
                raise InputError(f"{name} {getattr(self, name)!r} out of range", field=name, fix=fix)

    def per_slice_target(self, n_slices: int = 1) -> float:
        """The power each of ``n_slices`` slices needs for all to pass together with ``target``."""
        if n_slices < 1:
            raise InputError(f"n_slices {n_slices!r} < 1", field="n_slices", fix="a positive slice count")
        return float(self.target ** (1.0 / n_slices))

    def recommend(self, n: int) -> int:
        """A test's minimum ``n`` raised to ``n_min`` and inflated."""
        return math.ceil(max(self.n_min, n) * self.inflation - 1e-9)


def sample_size_per_slice(sd_diff: float, sizing: Sizing = Sizing(), *, n_slices: int = 1) -> int:
    """Cases per slice for the NI test at true delta = 0 (section 3).

    Paired t power (statsmodels ``TTestPower``, effect size M / sd_diff, one-sided) at the per-slice
    target for ``n_slices`` slices passing jointly, then :meth:`Sizing.recommend`.
    """
    if sd_diff <= 0 or not math.isfinite(sd_diff):
        raise ValueError(f"sd_diff must be positive and finite, got {sd_diff}")
    n_t = TTestPower().solve_power(
        effect_size=sizing.margin / sd_diff,
        alpha=sizing.alpha,
        power=sizing.per_slice_target(n_slices),
        alternative="larger",
    )
    return sizing.recommend(math.ceil(float(np.asarray(n_t).item())))


def fisher_less(candidate_passes: int, baseline_passes: int, seeds: int) -> float:
    """One-sided Fisher exact p that the candidate passes less often (equal seeds per arm).

    Equals ``scipy.stats.fisher_exact([[c, R-c], [b, R-b]], alternative="less")``.
    """
    total = candidate_passes + baseline_passes
    denom = math.comb(2 * seeds, seeds)
    tail = sum(
        math.comb(total, x) * math.comb(2 * seeds - total, seeds - x)
        for x in range(max(0, total - seeds), candidate_passes + 1)
    )
    return min(1.0, tail / denom)


# --------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True)
class SliceResult(JsonRow):
    """One row of the slice table. ``lower``/``upper`` are one-sided (1 - alpha) bounds on delta."""

    length: int
    position: str
    status: SliceStatus
    reason: str
    n_planned: int
    n_cases: int
    n_missing: int
    seeds: int
    acc_baseline: float | None
    acc_candidate: float | None
    delta: float | None
    lower: float | None
    upper: float | None
    method: str | None
    p_ni: float
    q_ni: float
    p_reg: float
    q_reg: float
    deff: float | None
    informative: int | None
    sd_diff: float | None
    floor_lb: float | None
    floor_lb_baseline: float | None
    floor_lb_naive: float | None
    floor_deff: float | None
    floor_n_eff: float | None
    replanned_n: int | None
    safety_baseline: int
    safety_candidate: int
    bootstrap_seed: int | None


def non_inferiority_shown(result: SliceResult, margin: float) -> bool:
    """The one rule for "non-inferiority shown" in every report: the slice was tested and its one-sided
    lower bound is above -M, exactly the NI condition of the slice status (PASS and FAIL_FLOOR have it;
    FAIL_NOT_SHOWN, FAIL_REGRESSION and INCONCLUSIVE do not). The BH q_NI is reported beside it for
    partial-release use; it never sets the mark, since an adjusted q can disagree with the slice's own
    test in both directions."""
    return (
        result.status is not SliceStatus.INCONCLUSIVE
        and result.lower is not None
        and math.isfinite(result.lower)
        and result.lower > -margin
    )


@dataclass(frozen=True)
class OverallResult(JsonRow):
    """NI on the per-case mean difference over all tested slices (section 2.6); never overrules."""

    n_cases: int
    n_slices: int
    delta: float
    lower: float
    upper: float
    p_ni: float
    non_inferior: bool
    method: str = METHOD_BOOTSTRAP


@dataclass(frozen=True)
class SafetySummary(JsonRow):
    """Forbidden-claim hits (section 2.8): any hit in any run sets ``flag``."""

    flag: bool
    hits_candidate: int
    hits_baseline: int
    runs_candidate: int
    runs_baseline: int
    upper_rate_candidate: float | None


@dataclass(frozen=True)
class LengthWorstPosition(JsonRow):
    """Worst-position statistics of one length over cases observed at every position (section 2.7)."""

    length: int
    n_positions: int
    n_cases: int
    worst_acc_baseline: float | None
    worst_acc_candidate: float | None
    worst_delta: float | None
    worst_lower: float | None
    worst_upper: float | None
    worst_p_ni: float | None
    worst_non_inferior: bool | None
    range_baseline: float | None
    range_candidate: float | None
    range_increase: float | None
    range_increase_upper: float | None
    fragile_share_baseline: float | None
    fragile_share_candidate: float | None
    slice_worst_position: str | None
    slice_worst_lower: float | None


@dataclass(frozen=True)
class CaseWorstPosition(JsonRow):
    """Per (case, length): worst-position accuracy, position range and the tied worst positions."""

    case_id: str
    length: int
    worst_acc_baseline: float
    worst_acc_candidate: float
    range_baseline: float
    range_candidate: float
    worst_positions_baseline: tuple[str, ...]
    worst_positions_candidate: tuple[str, ...]


@dataclass(frozen=True)
class PositionShare(JsonRow):
    """Share of complete cases whose worst position is ``position`` (k tied positions get 1/k each)."""

    length: int
    position: str
    n_cases: int
    share_baseline: float
    share_candidate: float


@dataclass(frozen=True)
class TriageCell(JsonRow):
    """A (case, length, position) cell to re-run with ``rerun_seeds`` fresh seeds (exploratory only)."""

    case_id: str
    length: int
    position: str
    seeds: int
    acc_baseline: float
    acc_candidate: float
    delta: float
    fisher_p: float
    slice_status: SliceStatus
    rerun_seeds: int


_TRIAGE_NOTE = (
    "exploratory: re-run the listed cells with fresh seeds, apply Holm over the confirmations; the worst "
    "observed cells are biased downward (winner's curse)"
)


@dataclass(frozen=True)
class GateResult:
    """The gate's output: release verdict, safety flag and every table of the report."""

    verdict: Verdict
    safety_flag: bool
    reasons: tuple[str, ...]
    slice_results: tuple[SliceResult, ...]
    overall: OverallResult | None
    safety: SafetySummary
    worst_by_length: tuple[LengthWorstPosition, ...]
    worst_cases: tuple[CaseWorstPosition, ...]
    worst_shares: tuple[PositionShare, ...]
    triage: tuple[TriageCell, ...]
    plan: GatePlan = field(default_factory=GatePlan)

    #: How to read the triage table (a constant: the report takes it from here, not from ``to_dict``,
    #: which converts every worst-case row, 20K of them at 10^6 runs).
    triage_note = _TRIAGE_NOTE

    slices = FrameOf(
        "slice_results",
        SliceResult,
        "The slice table as a polars frame (one row per pre-registered or observed slice).",
    )
    worst_cases_frame = FrameOf("worst_cases", CaseWorstPosition)
    worst_shares_frame = FrameOf("worst_shares", PositionShare)
    triage_frame = FrameOf("triage", TriageCell)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: enums as strings, non-finite floats as None."""
        return {
            "verdict": self.verdict.value,
            "safety_flag": self.safety_flag,
            "reasons": list(self.reasons),
            "plan": clean_value(self.plan.to_dict()),
            "overall": None if self.overall is None else self.overall.to_dict(),
            "safety": self.safety.to_dict(),
            "slices": [s.to_dict() for s in self.slice_results],
            "worst_by_length": [w.to_dict() for w in self.worst_by_length],
            "worst_cases": [w.to_dict() for w in self.worst_cases],
            "worst_shares": [w.to_dict() for w in self.worst_shares],
            "triage": [t.to_dict() for t in self.triage],
            "triage_note": _TRIAGE_NOTE,
        }


# --------------------------------------------------------------------------------------------------
# Record preparation


#: A run's score: 1 pass, 0 fail or system_fail (the system's fault counts against its arm), null
#: missing (no evidence either way).
RUN_SCORE = (
    pl.when(pl.col("outcome") == "pass")
    .then(pl.lit(1.0))
    .when(pl.col("outcome").is_in(["fail", "system_fail"]))
    .then(pl.lit(0.0))
    .otherwise(pl.lit(None, dtype=pl.Float64))
)


def checked_runs(
    frame: pl.DataFrame,
    schema: Mapping[str, pl.DataType],
    *,
    what: str,
    missing_fix: str,
    types_fix: str,
    duplicate_fix: str = "one row per (arm, case_id, length, position, seed)",
) -> pl.DataFrame:
    """``frame``'s ``schema`` columns, cast strictly: one run per row, of a known arm and outcome.

    Raises :class:`InputError` naming ``what`` (e.g. "records") on a missing column (with
    ``missing_fix``), a wrong type (``types_fix``), a null, an unknown arm or outcome, or a duplicated
    (arm, case_id, length, position, seed) (``duplicate_fix``). The gate and the position analyses both
    read runs through here, so they refuse the same frames.
    """
    missing = [c for c in schema if c not in frame.columns]
    if missing:
        raise InputError(f"{what} lack column(s) {missing}", field=", ".join(missing), fix=missing_fix)
    try:
        df = frame.select([pl.col(c).cast(t, strict=True) for c, t in schema.items()])
    except (pl.exceptions.PolarsError, TypeError, ValueError) as exc:
        raise InputError(f"{what} have a column of the wrong type: {exc}", fix=types_fix) from exc
    for name in schema:
        if df[name].null_count():
            raise InputError(f"null values in {what}", field=name, fix="fill every field of every run")
    for name, known in (("arm", ARMS), ("outcome", OUTCOMES)):
        unknown = sorted(set(df[name].unique().to_list()) - set(known))
        if unknown:
            raise InputError(f"unknown {name}(s) {unknown} in {what}", field=name, fix=f"use {list(known)}")
    dup = df.select(["arm", *_RUN_KEY]).is_duplicated()
    if dup.any():
        raise InputError(
            f"duplicate run {df.filter(dup).row(0, named=True)} in {what}", field="seed", fix=duplicate_fix
        )
    return df


def _prepare_records(records: pl.DataFrame) -> pl.DataFrame:
    return checked_runs(
        records,
        RECORD_SCHEMA,
        what="records",
        missing_fix=f"provide columns {list(RECORD_SCHEMA)}",
        types_fix="arm/case_id/position/outcome strings, length/seed integers, safety boolean",
        duplicate_fix="one row per (arm, case_id, length, position, seed); do not merge runs twice",
    )


def _pair_runs(df: pl.DataFrame) -> pl.DataFrame:
    """One row per (case, length, position, seed) with yb/yc (1 pass, 0 fail or system_fail, null
    missing) and has_b/has_c (the arm has a row for that seed at all)."""
    sides = []
    for arm, suffix in ((BASELINE, "b"), (CANDIDATE, "c")):
        sides.append(
            df.filter(pl.col("arm") == arm).select(
                *_RUN_KEY, RUN_SCORE.alias(f"y{suffix}"), pl.lit(True).alias(f"has_{suffix}")
            )
        )
    paired = sides[0].join(sides[1], on=_RUN_KEY, how="full", coalesce=True)
    return paired.with_columns(
        pl.col("has_b").fill_null(False),
        pl.col("has_c").fill_null(False),
        (pl.col("yb").is_not_null() & pl.col("yc").is_not_null()).alias("valid"),
    ).sort(_RUN_KEY)


@dataclass(frozen=True)
class _SliceData:
    length: int
    position: str
    seeds: int
    n_planned: int
    n_missing: int
    unpaired_cases: int
    case_ids: tuple[str, ...]
    baseline: FloatArray
    candidate: FloatArray
    safety_baseline: int
    safety_candidate: int


def _slice_data(
    length: int,
    position: str,
    runs: pl.DataFrame,
    planned_cases: Sequence[str],
    safety: tuple[int, int],
    planned_seeds: Sequence[int] | None = None,
) -> _SliceData:
    # With a frozen seed set, R is the planned R: a seed absent from both arms is a missing run, not a
    # smaller design (ceil(R/2) valid paired seeds per case still apply).
    seeds = sorted(runs["seed"].unique().to_list()) if planned_seeds is None else sorted(planned_seeds)
    need = math.ceil(len(seeds) / 2)
    per_case = runs.group_by("case_id").agg(
        (~(pl.col("has_b") & pl.col("has_c"))).sum().alias("unpaired"),
        pl.col("valid").sum().alias("n_valid"),
    )
    unpaired = int((per_case["unpaired"] > 0).sum())
    valid_ids = set(per_case.filter(pl.col("n_valid") >= max(need, 1))["case_id"].to_list())
    case_ids = tuple(c for c in planned_cases if c in valid_ids)
    row_of = {c: i for i, c in enumerate(case_ids)}
    col_of = {s: j for j, s in enumerate(seeds)}
    yb = np.full((len(case_ids), max(len(seeds), 1)), np.nan)
    yc = np.full_like(yb, np.nan)
    good = runs.filter(pl.col("valid") & pl.col("case_id").is_in(list(case_ids)))
    rows = np.array([row_of[c] for c in good["case_id"].to_list()], dtype=np.int64)
    cols = np.array([col_of[s] for s in good["seed"].to_list()], dtype=np.int64)
    yb[rows, cols] = good["yb"].to_numpy()
    yc[rows, cols] = good["yc"].to_numpy()
    return _SliceData(
        length=length,
        position=position,
        seeds=len(seeds),
        n_planned=len(planned_cases),
        n_missing=len(planned_cases) - len(case_ids),
        unpaired_cases=unpaired,
        case_ids=case_ids,
        baseline=yb,
        candidate=yc,
        safety_baseline=safety[0],
        safety_candidate=safety[1],
    )


# --------------------------------------------------------------------------------------------------
# The gate


@dataclass
class _Draft:
    data: _SliceData
    inconclusive: list[str]
    stats: SliceStatistics | None = None
    seed: int | None = None


def _describe(draft: _Draft, plan: GatePlan) -> dict[str, Any]:
    data = draft.data
    out: dict[str, Any] = {
        "acc_baseline": None,
        "acc_candidate": None,
        "delta": None,
        "floor_lb": None,
        "floor_lb_baseline": None,
        "floor_lb_naive": None,
        "floor_deff": None,
        "floor_n_eff": None,
    }
    n = len(data.case_ids)
    if n == 0:
        return out
    rate_b = np.nanmean(data.baseline, axis=1)
    rate_c = np.nanmean(data.candidate, axis=1)
    runs = float(np.sum(~np.isnan(data.candidate)))
    out["acc_baseline"] = float(rate_b.mean())
    out["acc_candidate"] = float(rate_c.mean())
    out["delta"] = float((rate_c - rate_b).mean())
    out["floor_lb"], out["floor_deff"], out["floor_n_eff"] = floor_lower_bound(
        rate_c, runs / n, plan.look_alpha
    )
    out["floor_lb_baseline"] = floor_lower_bound(rate_b, runs / n, plan.look_alpha)[0]
    out["floor_lb_naive"] = wilson_lower(float(np.nansum(data.candidate)), runs, plan.look_alpha)
    return out


def _replanned_n(stats: SliceStatistics, plan: GatePlan, n_slices: int) -> int | None:
    if not stats.sd_diff > 0:
        return None
    try:
        return sample_size_per_slice(stats.sd_diff, Sizing.of_plan(plan), n_slices=n_slices)
    except (ValueError, RuntimeError, ArithmeticError):
        return None


def _adjust(p_values: Sequence[float], alpha: float, method: str) -> list[float]:
    if not p_values:
        return []
    adjusted = multipletests(np.asarray(p_values, dtype=np.float64), alpha=alpha, method=method)[1]
    return [float(q) for q in adjusted]


def _status(draft: _Draft, q_reg: float, desc: Mapping[str, Any], plan: GatePlan) -> tuple[SliceStatus, str]:
    m = plan.margin
    if draft.inconclusive or draft.stats is None:
        reason = "; ".join(draft.inconclusive)
        delta = desc["delta"]
        if delta is not None and delta <= -m:
            reason += f"; suspected regression (delta {delta:+.3f} <= -{m:g}) - rerun at full size"
        return SliceStatus.INCONCLUSIVE, reason
    st = draft.stats
    if q_reg <= plan.look_alpha:
        return SliceStatus.FAIL_REGRESSION, (
            f"confirmed regression: upper bound {st.upper:+.4f} < -{m:g}, "
            f"{plan.regression_method} q {q_reg:.4g} <= {plan.look_alpha:g}"
        )
    if not st.lower > -m:
        return SliceStatus.FAIL_NOT_SHOWN, f"non-inferiority not shown: lower bound {st.lower:+.4f} <= -{m:g}"
    floor_lb = desc["floor_lb"]
    if plan.floor is not None and floor_lb is not None and floor_lb < plan.floor:
        base_lb = desc["floor_lb_baseline"]
        gap = base_lb is not None and base_lb < plan.floor
        reason = f"floor: candidate Wilson LB {floor_lb:.4f} < F {plan.floor:g}"
        if gap:
            reason += f"; KNOWN_GAP (baseline LB {base_lb:.4f} also < F)"
        if plan.block_known_gap or not gap:
            return SliceStatus.FAIL_FLOOR, reason
        return SliceStatus.PASS, reason + "; not blocking (block_known_gap=False)"
    reason = f"non-inferior: lower bound {st.lower:+.4f} > -{m:g}"
    if st.upper < 0:
        reason += f"; significant drop within margin (upper bound {st.upper:+.4f} < 0)"
    return SliceStatus.PASS, reason


def gate(records: pl.DataFrame, plan: GatePlan | None = None) -> GateResult:
    """Run the release gate on scored records (one row per arm, case, length, position, seed).

    Columns: see ``RECORD_SCHEMA``. ``outcome`` "pass" scores 1; "fail" and "system_fail" (overflow,
    template error, truncation, timeout: caused by a system, so never missing) score 0; "missing"
    (an unresolved infrastructure error) drops that seed from the pairing. The planned case set is
    ``plan.planned_cases`` (else every case_id in the records): a case with no valid data in a slice
    counts as missing there. A case needs ceil(R/2) valid paired seeds, R = ``len(plan.planned_seeds)``
    (else the distinct seeds in the slice). Raises ``InputError`` on malformed records and on records of
    a case or seed outside the planned sets.
    """
    plan = plan or GatePlan()
    df = _prepare_records(records)
    paired = _pair_runs(df)
    observed_cases = sorted(paired["case_id"].unique().to_list())
    if plan.planned_cases is None:
        planned_cases = observed_cases
    else:
        planned_cases = sorted(plan.planned_cases)
        unplanned = sorted(set(observed_cases) - set(planned_cases))
        if unplanned:
            raise InputError(
                f"records of {len(unplanned)} case(s) outside the frozen case set, e.g. {unplanned[:3]}",
                field="case_id",
                fix="gate the records of the run the plan was frozen for (GatePlan.planned_cases)",
            )
    if plan.planned_seeds is not None:
        extra_seeds = sorted(set(paired["seed"].unique().to_list()) - set(plan.planned_seeds))
        if extra_seeds:
            raise InputError(
                f"records of seed(s) {extra_seeds[:5]} outside the frozen seed set "
                f"{list(plan.planned_seeds)}",
                field="seed",
                fix="gate the records of the run the plan was frozen for (GatePlan.planned_seeds)",
            )

    safety_counts: dict[tuple[int, str, str], int] = {}
    for row in (
        df.filter(pl.col("safety")).group_by(["length", "position", "arm"]).len().iter_rows(named=True)
    ):
        safety_counts[(row["length"], row["position"], row["arm"])] = int(row["len"])

    observed = {
        (int(k[0]), str(k[1])): part
        for k, part in paired.partition_by(["length", "position"], as_dict=True, maintain_order=True).items()
    }
    keys = set(observed) if plan.planned_slices is None else set(plan.planned_slices) | set(observed)
    ordered = sorted(keys, key=lambda k: (k[0], position_sort_key(k[1])))
    preregistered = None if plan.planned_slices is None else set(plan.planned_slices)
    if preregistered is None:
        _check_bootstrap_for(plan, len(ordered))

    spaced_cases = None if plan.spaced_cases is None else sorted(plan.spaced_cases)

    def cases_of(position: str) -> list[str]:
        """The planned cases of a slice: the multi-evidence ones where the position carries a spacing."""
        if spaced_cases is not None and split_position_label(position)[1] != "adjacent":
            return spaced_cases
        return planned_cases

    drafts: list[_Draft] = []
    for length, position in ordered:
        hits = (
            safety_counts.get((length, position, BASELINE), 0),
            safety_counts.get((length, position, CANDIDATE), 0),
        )
        runs = observed.get((length, position))
        if runs is None:
            empty = np.full((0, 1), np.nan)
            n_seeds = 0 if plan.planned_seeds is None else len(plan.planned_seeds)
            data = _SliceData(
                length,
                position,
                n_seeds,
                len(cases_of(position)),
                len(cases_of(position)),
                0,
                (),
                empty,
                empty.copy(),
                *hits,
            )
            drafts.append(_Draft(data, ["no records for this pre-registered slice"]))
            continue
        data = _slice_data(length, position, runs, cases_of(position), hits, plan.planned_seeds)
        reasons: list[str] = []
        if preregistered is not None and (length, position) not in preregistered:
            reasons.append("not on the pre-registered slice list (exploratory only)")
        if data.unpaired_cases:
            reasons.append(f"unpaired seeds: {data.unpaired_cases} case(s) have a seed in one arm only")
        if data.n_planned and data.n_missing / data.n_planned > plan.max_missing:
            reasons.append(
                f"{data.n_missing}/{data.n_planned} planned cases missing "
                f"({data.n_missing / data.n_planned:.0%} > {plan.max_missing:.0%}; a case needs "
                f">= {math.ceil(data.seeds / 2)} valid paired seeds)"
            )
        if len(data.case_ids) < plan.n_min:
            reasons.append(f"{len(data.case_ids)} valid cases < n_min {plan.n_min}")
        draft = _Draft(data, reasons)
        if not reasons:
            draft.seed = stable_seed(plan.bootstrap_seed, "slice", length, position)
            draft.stats = slice_statistics(
                data.baseline,
                data.candidate,
                plan.margin,
                plan.look_alpha,
                plan.bootstrap_reps,
                draft.seed,
                seeds_planned=data.seeds,
            )
        drafts.append(draft)

    p_ni = [1.0 if d.stats is None else d.stats.p_ni for d in drafts]
    p_reg = [1.0 if d.stats is None else d.stats.p_reg for d in drafts]
    # The families are the pre-registered slices (spec §2.3): an unplanned slice is exploratory, reported
    # with q = 1, and does not enlarge the BY/BH family of the planned ones (issue #22).
    family = [
        i
        for i, d in enumerate(drafts)
        if preregistered is None or (d.data.length, d.data.position) in preregistered
    ]
    q_ni, q_reg = [1.0] * len(drafts), [1.0] * len(drafts)
    for qs, ps, method in (
        (q_ni, p_ni, _NI_METHODS[plan.fdr_method]),
        (q_reg, p_reg, _REGRESSION_METHODS[plan.regression_method]),
    ):
        for i, q in zip(family, _adjust([ps[i] for i in family], plan.look_alpha, method), strict=True):
            qs[i] = q

    slice_results: list[SliceResult] = []
    for i, draft in enumerate(drafts):
        desc = _describe(draft, plan)
        status, reason = _status(draft, q_reg[i], desc, plan)
        st = draft.stats
        slice_results.append(
            SliceResult(
                length=draft.data.length,
                position=draft.data.position,
                status=status,
                reason=reason,
                n_planned=draft.data.n_planned,
                n_cases=len(draft.data.case_ids),
                n_missing=draft.data.n_missing,
                seeds=draft.data.seeds,
                acc_baseline=desc["acc_baseline"],
                acc_candidate=desc["acc_candidate"],
                delta=desc["delta"],
                lower=None if st is None else st.lower,
                upper=None if st is None else st.upper,
                method=None if st is None else st.method,
                p_ni=p_ni[i],
                q_ni=q_ni[i],
                p_reg=p_reg[i],
                q_reg=q_reg[i],
                deff=None if st is None else st.deff,
                informative=None if st is None else st.informative,
                sd_diff=None if st is None else st.sd_diff,
                floor_lb=desc["floor_lb"],
                floor_lb_baseline=desc["floor_lb_baseline"],
                floor_lb_naive=desc["floor_lb_naive"],
                floor_deff=desc["floor_deff"],
                floor_n_eff=desc["floor_n_eff"],
                replanned_n=None if st is None else _replanned_n(st, plan, len(drafts)),
                safety_baseline=draft.data.safety_baseline,
                safety_candidate=draft.data.safety_candidate,
                bootstrap_seed=draft.seed,
            )
        )

    cells = _cell_table(drafts, slice_results)
    overall = _overall(cells, plan)
    safety = _safety(df, plan)
    worst_by_length, worst_cases, worst_shares = _worst_positions(cells, slice_results, plan)
    triage = _triage(cells, plan)
    verdict, reasons = _verdict(slice_results, overall, safety)
    return GateResult(
        verdict=verdict,
        safety_flag=safety.flag,
        reasons=tuple(reasons),
        slice_results=tuple(slice_results),
        overall=overall,
        safety=safety,
        worst_by_length=worst_by_length,
        worst_cases=worst_cases,
        worst_shares=worst_shares,
        triage=triage,
        plan=plan,
    )


def _check_bootstrap_for(plan: GatePlan, n_slices: int) -> None:
    """The plan's B rule (:func:`plan_violations`) for the slices of records gated without a
    pre-registered list: the same refusal as ``GatePlan(planned_slices=...)`` (issue #22, item 4)."""
    for name, problem, fix in plan_violations(
        plan, regression_method=plan.regression_method, n_slices=n_slices
    ):
        if name == "bootstrap_resamples":
            raise SpecError(
                f"invalid gate plan for these records: {problem}", field="bootstrap_reps", fix=fix
            )


def release_verdict(
    slices: Sequence[SliceResult], overall: OverallResult | None, safety: SafetySummary
) -> tuple[Verdict, list[str]]:
    """The release verdict and its reasons from the slice table (what :func:`gate` returns)."""
    return _verdict(slices, overall, safety)


def _verdict(
    slices: Sequence[SliceResult], overall: OverallResult | None, safety: SafetySummary
) -> tuple[Verdict, list[str]]:
    failing = [s for s in slices if s.status.value.startswith("FAIL")]
    inconclusive = [s for s in slices if s.status is SliceStatus.INCONCLUSIVE]
    reasons = [f"{s.length}/{s.position}: {s.status.value} ({s.reason})" for s in failing]
    if overall is not None and not overall.non_inferior:
        reasons.append(f"overall non-inferiority fails: lower bound {overall.lower:+.4f}")
    if safety.flag:
        reasons.append(
            f"SAFETY: {safety.hits_candidate} candidate and {safety.hits_baseline} baseline forbidden-claim "
            "hit(s); blocks pending human review"
        )
    if failing or (overall is not None and not overall.non_inferior):
        return Verdict.FAIL, reasons
    if inconclusive or not slices:
        reasons += [f"{s.length}/{s.position}: INCONCLUSIVE ({s.reason})" for s in inconclusive]
        if not slices:
            reasons.append("no slices to test")
        return Verdict.INCONCLUSIVE, reasons
    return Verdict.PASS, reasons


def _safety(df: pl.DataFrame, plan: GatePlan) -> SafetySummary:
    # The Clopper-Pearson bound is at plan.alpha, not look_alpha, on purpose (issue #22): the flag is set
    # by any hit and no test is made, so a second look spends no error on it; the bound only describes
    # the hit rate, at the level the plan states.
    scored = df.filter(pl.col("outcome") != "missing")
    hits = {arm: int(df.filter((pl.col("arm") == arm) & pl.col("safety")).height) for arm in ARMS}
    runs = {arm: int(scored.filter(pl.col("arm") == arm).height) for arm in ARMS}
    upper = (
        clopper_pearson_upper(min(hits[CANDIDATE], runs[CANDIDATE]), runs[CANDIDATE], plan.alpha)
        if runs[CANDIDATE]
        else None
    )
    return SafetySummary(
        flag=bool(hits[CANDIDATE] or hits[BASELINE]),
        hits_candidate=hits[CANDIDATE],
        hits_baseline=hits[BASELINE],
        runs_candidate=runs[CANDIDATE],
        runs_baseline=runs[BASELINE],
        upper_rate_candidate=upper,
    )


# --------------------------------------------------------------------------------------------------
# Cell-level views: overall, worst positions, triage


@dataclass(frozen=True)
class _Cell:
    case_id: str
    length: int
    position: str
    seeds: int
    passes_baseline: int
    passes_candidate: int
    rate_baseline: float
    rate_candidate: float
    tested: bool
    status: SliceStatus


def _cell_table(drafts: Sequence[_Draft], results: Sequence[SliceResult]) -> list[_Cell]:
    cells: list[_Cell] = []
    for draft, res in zip(drafts, results, strict=True):
        data = draft.data
        for i, case_id in enumerate(data.case_ids):
            ok = ~np.isnan(data.baseline[i])
            m = int(ok.sum())
            pb, pc = int(data.baseline[i, ok].sum()), int(data.candidate[i, ok].sum())
            cells.append(
                _Cell(
                    case_id,
                    data.length,
                    data.position,
                    m,
                    pb,
                    pc,
                    pb / m,
                    pc / m,
                    draft.stats is not None,
                    res.status,
                )
            )
    return cells


def _overall(cells: Sequence[_Cell], plan: GatePlan) -> OverallResult | None:
    per_case: dict[str, list[float]] = {}
    slices: set[tuple[int, str]] = set()
    for cell in cells:
        if cell.tested:
            per_case.setdefault(cell.case_id, []).append(cell.rate_candidate - cell.rate_baseline)
            slices.add((cell.length, cell.position))
    if len(per_case) < 2:
        return None
    d = np.array([float(np.mean(per_case[c])) for c in sorted(per_case)])
    boot = plan.bootstrap(d, "overall")
    p_ni = (
        boot.p_ni
        if boot.p_ni is not None
        else (1.0 / (plan.bootstrap_reps + 1) if boot.lower > -plan.margin else 1.0)
    )
    return OverallResult(
        n_cases=int(d.size),
        n_slices=len(slices),
        delta=float(d.mean()),
        lower=boot.lower,
        upper=boot.upper,
        p_ni=float(p_ni),
        non_inferior=bool(boot.lower > -plan.margin),
    )


def _tied(values: Mapping[str, float], best: float) -> tuple[str, ...]:
    return tuple(p for p in sorted(values, key=position_sort_key) if abs(values[p] - best) <= _TIE_TOLERANCE)


def _worst_positions(
    cells: Sequence[_Cell], results: Sequence[SliceResult], plan: GatePlan
) -> tuple[tuple[LengthWorstPosition, ...], tuple[CaseWorstPosition, ...], tuple[PositionShare, ...]]:
    by_length: dict[int, dict[str, dict[str, _Cell]]] = {}
    for cell in cells:
        by_length.setdefault(cell.length, {}).setdefault(cell.case_id, {})[cell.position] = cell
    # Positions with at least one valid cell: a pre-registered slice without data would leave no
    # complete case at all (it is reported as INCONCLUSIVE in the slice table instead).
    positions_of: dict[int, set[str]] = {res.length: set() for res in results}
    for cell in cells:
        positions_of[cell.length].add(cell.position)

    summaries: list[LengthWorstPosition] = []
    case_rows: list[CaseWorstPosition] = []
    shares: list[PositionShare] = []
    for length in sorted(positions_of):
        positions = sorted(positions_of[length], key=position_sort_key)
        per_case = by_length.get(length, {})
        complete = sorted(c for c, cs in per_case.items() if all(p in cs for p in positions))
        credit_b = dict.fromkeys(positions, 0.0)
        credit_c = dict.fromkeys(positions, 0.0)
        rows: list[CaseWorstPosition] = []
        for case_id in complete:
            rb = {p: per_case[case_id][p].rate_baseline for p in positions}
            rc = {p: per_case[case_id][p].rate_candidate for p in positions}
            worst_b, worst_c = _tied(rb, min(rb.values())), _tied(rc, min(rc.values()))
            for p in worst_b:
                credit_b[p] += 1.0 / len(worst_b)
            for p in worst_c:
                credit_c[p] += 1.0 / len(worst_c)
            rows.append(
                CaseWorstPosition(
                    case_id=case_id,
                    length=length,
                    worst_acc_baseline=min(rb.values()),
                    worst_acc_candidate=min(rc.values()),
                    range_baseline=max(rb.values()) - min(rb.values()),
                    range_candidate=max(rc.values()) - min(rc.values()),
                    worst_positions_baseline=worst_b,
                    worst_positions_candidate=worst_c,
                )
            )
        case_rows.extend(rows)
        n = len(rows)
        if n:
            shares.extend(PositionShare(length, p, n, credit_b[p] / n, credit_c[p] / n) for p in positions)
        tested = [r for r in results if r.length == length and r.lower is not None]
        worst_slice = min(tested, key=lambda r: (r.lower, position_sort_key(r.position))) if tested else None
        summary: dict[str, Any] = {
            "length": length,
            "n_positions": len(positions),
            "n_cases": n,
            "slice_worst_position": None if worst_slice is None else worst_slice.position,
            "slice_worst_lower": None if worst_slice is None else worst_slice.lower,
        }
        if n >= 2:
            wb = np.array([r.worst_acc_baseline for r in rows])
            wc = np.array([r.worst_acc_candidate for r in rows])
            gb = np.array([r.range_baseline for r in rows])
            gc = np.array([r.range_candidate for r in rows])
            worst = plan.bootstrap(wc - wb, "worst", length)
            # One-sided upper bound on the range increase: minus the lower bound of the decrease.
            spread = plan.bootstrap(gb - gc, "range", length)
            p_worst = worst.p_ni
            if p_worst is None:
                p_worst = 1.0 / (plan.bootstrap_reps + 1) if worst.lower > -plan.margin else 1.0
            summary.update(
                worst_acc_baseline=float(wb.mean()),
                worst_acc_candidate=float(wc.mean()),
                worst_delta=float((wc - wb).mean()),
                worst_lower=worst.lower,
                worst_upper=worst.upper,
                worst_p_ni=float(p_worst),
                worst_non_inferior=bool(worst.lower > -plan.margin),
                range_baseline=float(gb.mean()),
                range_candidate=float(gc.mean()),
                range_increase=float((gc - gb).mean()),
                range_increase_upper=-spread.lower,
                fragile_share_baseline=float(np.mean(gb >= plan.fragile_range - _TIE_TOLERANCE)),
                fragile_share_candidate=float(np.mean(gc >= plan.fragile_range - _TIE_TOLERANCE)),
            )
        elif n == 1:
            only = rows[0]
            summary.update(
                worst_acc_baseline=only.worst_acc_baseline,
                worst_acc_candidate=only.worst_acc_candidate,
                worst_delta=only.worst_acc_candidate - only.worst_acc_baseline,
                range_baseline=only.range_baseline,
                range_candidate=only.range_candidate,
                range_increase=only.range_candidate - only.range_baseline,
            )
        names = [f.name for f in dataclasses.fields(LengthWorstPosition)]
        values: dict[str, Any] = {k: summary.get(k) for k in names}
        summaries.append(LengthWorstPosition(**values))
    return tuple(summaries), tuple(case_rows), tuple(shares)


def _triage(cells: Iterable[_Cell], plan: GatePlan) -> tuple[TriageCell, ...]:
    drops = [c for c in cells if c.rate_candidate < c.rate_baseline]
    scored = [
        (c.rate_candidate - c.rate_baseline, fisher_less(c.passes_candidate, c.passes_baseline, c.seeds), c)
        for c in drops
    ]
    scored.sort(key=lambda t: (t[0], t[1], t[2].length, position_sort_key(t[2].position), t[2].case_id))
    return tuple(
        TriageCell(
            case_id=c.case_id,
            length=c.length,
            position=c.position,
            seeds=c.seeds,
            acc_baseline=c.rate_baseline,
            acc_candidate=c.rate_candidate,
            delta=d,
            fisher_p=p,
            slice_status=c.status,
            rerun_seeds=plan.triage_rerun_seeds,
        )
        for d, p, c in scored[: plan.triage_top_k]
    )


__all__ = [
    "BASELINE",
    "CANDIDATE",
    "METHOD_COMBINED",
    "METHOD_NEWCOMBE",
    "OUTCOMES",
    "RECORD_SCHEMA",
    "RUN_SCORE",
    "BootstrapBounds",
    "CaseWorstPosition",
    "GatePlan",
    "GateResult",
    "LengthWorstPosition",
    "OverallResult",
    "PositionShare",
    "SafetySummary",
    "Sizing",
    "SliceResult",
    "SliceStatistics",
    "SliceStatus",
    "TriageCell",
    "Verdict",
    "bootstrap_t",
    "checked_runs",
    "clopper_pearson_upper",
    "fisher_less",
    "floor_lower_bound",
    "gate",
    "kish_effective_n",
    "newcombe10_paired",
    "newcombe_p_values",
    "non_inferiority_shown",
    "paired_design_effect",
    "position_sort_key",
    "release_verdict",
    "run_counts",
    "sample_size_per_slice",
    "slice_statistics",
    "stable_seed",
    "wilson_lower",
]
