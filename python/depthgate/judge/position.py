"""Position science beside the gate (issue #13): effective length per depth, control-normalised
accuracy and repeat stability (pass^k).

Every function takes the scored records of :func:`depthgate.judge.oracle.score_records` (columns
``arm``, ``case_id``, ``length``, ``position``, ``seed``, ``outcome``; other columns are ignored) and
scores runs as the gate does: ``pass`` = 1, ``fail`` and ``system_fail`` = 0 (a system failure is the
system's fault, never missing data), ``missing`` = no observation. The unit is the **case**: seeds are
averaged within a case first and every accuracy below is case-weighted (``research/stats_gate.md`` §1),
so a case with one valid seed weighs as much as a case with five.

* :func:`effective_length` — per (arm, depth) the longest length up to which the depth's accuracy stays
  at or above a threshold (NoLiMa: a share of the arm's evidence-only *base score*; RULER: an absolute
  accuracy), with a paired case-bootstrap interval for each arm and for candidate − baseline, and the
  accuracy-by-length curves with interval bands for the report chart.
* :func:`control_normalised_accuracy` — per slice, raw accuracy beside the accuracy among the cases
  whose evidence-only control passes, so "the model cannot do this task" is told apart from "the model
  loses it at this depth".
* :func:`pass_hat_k` — per slice, the mean beside pass^k (the share of cases all of whose k seeds pass).
* :func:`spacing_accuracy` — with evidence spacing (issue #13 item 5: position labels ``"0.5~far"``), per
  (arm, length, depth, spacing) the accuracy, its change from the adjacent spacing at the same depth, and
  the MEASURED token gap between the decisive documents from the layouts.

Only numpy, polars and statsmodels are used; bootstrap seeds go through
:func:`depthgate.judge.stats.stable_seed`, so a result is identical in every process.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
import polars as pl
from statsmodels.stats.proportion import proportion_confint

from depthgate.exceptions import InputError
from depthgate.judge.frames import FrameOf, JsonRow
from depthgate.judge.stats import (
    ARMS,
    BASELINE,
    CANDIDATE,
    RECORD_SCHEMA,
    RUN_SCORE,
    checked_runs,
    kish_effective_n,
    position_sort_key,
    stable_seed,
)
from depthgate.spec.positions import spacing_rank, split_position_label

__all__ = [
    "RUN_COLUMNS",
    "AccuracyPoint",
    "ELRule",
    "EffectiveLength",
    "EffectiveLengthDelta",
    "EffectiveLengthResult",
    "base_scores_from_controls",
    "case_rates",
    "control_normalised_accuracy",
    "effective_length",
    "eligible_cases",
    "pass_hat_k",
    "runs_frame",
    "spacing_accuracy",
    "wilson_design_interval",
]

FloatArray = npt.NDArray[np.float64]
ELRule = Literal["nolima", "ruler"]

#: Columns every function here reads from a scored-records frame: the gate's, less the safety flag.
RUN_COLUMNS: dict[str, pl.DataType] = {k: t for k, t in RECORD_SCHEMA.items() if k != "safety"}
_SLICE = ["arm", "length", "position"]
_TOL = 1e-12
#: Usable control outcomes, as in :func:`depthgate.judge.controls.classify_failures`: a control that did
#: not run (system failure, missing) says nothing about whether the model can do the task.
_USABLE_CONTROL = ("pass", "fail")


# --------------------------------------------------------------------------------------------------
# Records


def runs_frame(scored: pl.DataFrame, *, what: str = "scored records") -> pl.DataFrame:
    """Validate scored records and score each run: the :data:`RUN_COLUMNS` plus ``y`` (Float64: 1 pass,
    0 fail or system_fail, null missing). Raises ``InputError`` on a missing column, a wrong type, a
    null, an unknown arm or outcome, or a duplicated (arm, case, length, position, seed)."""
    df = checked_runs(
        scored,
        RUN_COLUMNS,
        what=what,
        missing_fix="pass the output of depthgate.judge.oracle.score_records",
        types_fix="arm/case_id/position/outcome strings, length/seed integers",
    )
    return df.with_columns(RUN_SCORE.alias("y"))


def case_rates(runs: pl.DataFrame) -> pl.DataFrame:
    """Per (arm, length, position, case): ``valid`` seeds, ``passes`` and ``rate`` = passes / valid
    (cases without a valid seed are dropped). ``runs`` is a :func:`runs_frame`."""
    return (
        runs.filter(pl.col("y").is_not_null())
        .group_by([*_SLICE, "case_id"])
        .agg(pl.len().alias("valid"), pl.col("y").sum().alias("passes"))
        .with_columns((pl.col("passes") / pl.col("valid")).alias("rate"))
    )


def _sort_slices(df: pl.DataFrame) -> pl.DataFrame:
    """Rows by length, then position (relative depths, then offsets), then arm (baseline first)."""
    if df.height == 0:
        return df
    positions = sorted(set(df["position"].to_list()), key=position_sort_key)
    p_rank = {p: i for i, p in enumerate(positions)}
    a_rank = {a: i for i, a in enumerate(ARMS)}
    return (
        df.with_columns(
            pl.col("position").replace_strict(p_rank, return_dtype=pl.Int64).alias("_p"),
            pl.col("arm").replace_strict(a_rank, default=len(ARMS), return_dtype=pl.Int64).alias("_a"),
        )
        .sort(["length", "_p", "_a"])
        .drop("_p", "_a")
    )


def _control_rates(scored_controls: pl.DataFrame) -> tuple[dict[tuple[str, str], float], bool]:
    """Evidence-only control pass rate per (arm, case) over usable seeds; ``by_arm`` False when the
    controls have no ``arm`` column (then the key's arm is "")."""
    for col in ("case_id", "outcome", "control"):
        if col not in scored_controls.columns:
            raise InputError(
                f"scored controls lack {col!r}",
                field=col,
                fix="pass the output of depthgate.judge.controls.score_controls",
            )
    by_arm = "arm" in scored_controls.columns
    keys = ["arm", "case_id"] if by_arm else ["case_id"]
    only = scored_controls.filter(
        (pl.col("control") == "evidence_only") & pl.col("outcome").is_in(list(_USABLE_CONTROL))
    )
    agg = only.group_by(keys).agg(pl.col("outcome").eq("pass").mean().alias("rate"))
    out: dict[tuple[str, str], float] = {}
    for row in agg.iter_rows(named=True):
        out[(str(row["arm"]) if by_arm else "", str(row["case_id"]))] = float(row["rate"])
    return out, by_arm


def _control_of(rates: Mapping[tuple[str, str], float], by_arm: bool, arm: str, case: str) -> float | None:
    return rates.get((arm if by_arm else "", case))


def base_scores_from_controls(scored_controls: pl.DataFrame) -> dict[str, float]:
    """NoLiMa's *base score* per arm: the case-weighted evidence-only control accuracy (each case's pass
    rate over its usable seeds — ``pass``/``fail``; a control that did not run says nothing — then the
    mean over cases). Controls without an ``arm`` column give both arms the same base."""
    rates, by_arm = _control_rates(scored_controls)
    arms = ARMS if not by_arm else tuple(a for a in ARMS if any(k[0] == a for k in rates))
    out: dict[str, float] = {}
    for arm in arms:
        vals = [v for (a, _), v in rates.items() if a == (arm if by_arm else "")]
        if vals:
            out[arm] = float(np.mean(vals))
    return out


def wilson_design_interval(
    rates: npt.ArrayLike, runs_per_case: float, alpha: float = 0.05
) -> tuple[float, float, float]:
    """Two-sided (1 - alpha) Wilson interval of a case-weighted accuracy on the effective sample size
    n * R / DEFF, DEFF = clip(R * s^2(rate) / (p (1 - p)), 1, R) (Kish), R when p is 0 or 1 or there is one
    case — the two-sided twin of :func:`depthgate.judge.stats.floor_lower_bound`. Returns (low, high,
    DEFF)."""
    p, deff, n_eff = kish_effective_n(rates, runs_per_case, caller="wilson_design_interval")
    low, high = proportion_confint(p * n_eff, n_eff, alpha=alpha, method="wilson")
    return float(low), float(high), deff


# --------------------------------------------------------------------------------------------------
# Effective length


@dataclass(frozen=True)
class EffectiveLength(JsonRow):
    """Effective length of one (arm, position).

    ``estimate`` is the longest grid length L such that the case-weighted accuracy at L *and at every
    shorter grid length* is >= ``threshold_abs``; 0 means "below the grid" (the shortest length already
    misses the threshold) and ``at_grid_top`` means every length passes, so the true value is >= the
    longest length (censored). ``steps`` is the same in grid steps (0 = below the grid, k = up to the
    k-th length). ``lower``/``upper`` (tokens) and ``lower_steps``/``upper_steps`` are the two-sided
    (1 - alpha) case-bootstrap percentile interval, reported as grid values (see
    :func:`effective_length`). ``distribution`` is the bootstrap mass on each grid value
    ((length, share) pairs, 0 = below the grid).
    """

    arm: str
    position: str
    rule: str
    threshold: float
    base_score: float | None
    threshold_abs: float
    n_cases: int
    grid: tuple[int, ...]
    estimate: int
    steps: int
    at_grid_top: bool
    lower: int
    upper: int
    lower_steps: int
    upper_steps: int
    distribution: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class EffectiveLengthDelta(JsonRow):
    """Paired difference candidate − baseline of one position's effective length, from the same case
    resamples: in tokens (``estimate``, ``lower``, ``upper``) and in grid steps (``*_steps``; on a
    doubling grid one step is a factor of two). ``share_shorter``/``share_longer``: bootstrap share of
    resamples in which the candidate's effective length is shorter/longer than the baseline's."""

    position: str
    estimate: int
    lower: int
    upper: int
    estimate_steps: int
    lower_steps: int
    upper_steps: int
    share_shorter: float
    share_longer: float


@dataclass(frozen=True)
class AccuracyPoint(JsonRow):
    """One point of an accuracy-by-length curve (report chart): case-weighted ``accuracy`` over
    ``n_cases`` with ``runs`` valid runs; ``lower``/``upper`` the case-bootstrap percentile band (the same
    resamples as the effective-length interval), ``wilson_lower``/``wilson_upper`` the Wilson interval on
    the design-effect-adjusted sample size; ``threshold_abs`` the arm's threshold; ``meets``: accuracy >=
    threshold."""

    arm: str
    position: str
    length: int
    n_cases: int
    runs: int
    accuracy: float | None
    lower: float | None
    upper: float | None
    wilson_lower: float | None
    wilson_upper: float | None
    threshold_abs: float
    meets: bool


_EL_CONVENTION = (
    "first crossing: the longest length L such that accuracy at L and at every shorter length of the "
    "grid is >= the threshold (0 = below the grid); intervals are grid values of the case-bootstrap "
    "distribution (inverted CDF, never interpolated)"
)


@dataclass(frozen=True)
class EffectiveLengthResult:
    """Output of :func:`effective_length`. ``rows`` per (arm, position), ``deltas`` per position (both
    arms present), ``curve`` per (arm, position, length). ``base_scores``: the per-arm base score used
    (NoLiMa; None for RULER)."""

    rule: str
    threshold: float
    alpha: float
    reps: int
    seed: int
    bootstrap_seed: int
    n_cases: int
    base_scores: dict[str, float] | None
    base_resampled: bool
    rows: tuple[EffectiveLength, ...]
    deltas: tuple[EffectiveLengthDelta, ...]
    curve: tuple[AccuracyPoint, ...]
    convention: str = _EL_CONVENTION

    frame = FrameOf("rows", EffectiveLength)
    deltas_frame = FrameOf("deltas", EffectiveLengthDelta)
    curve_frame = FrameOf("curve", AccuracyPoint)

    def row(self, arm: str, position: str) -> EffectiveLength:
        for r in self.rows:
            if r.arm == arm and r.position == position:
                return r
        raise KeyError((arm, position))

    def delta(self, position: str) -> EffectiveLengthDelta:
        for d in self.deltas:
            if d.position == position:
                return d
        raise KeyError(position)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready (non-finite floats as None)."""
        return {
            "rule": self.rule,
            "threshold": self.threshold,
            "alpha": self.alpha,
            "reps": self.reps,
            "seed": self.seed,
            "bootstrap_seed": self.bootstrap_seed,
            "n_cases": self.n_cases,
            "base_scores": self.base_scores,
            "base_resampled": self.base_resampled,
            "convention": self.convention,
            "rows": [r.to_dict() for r in self.rows],
            "deltas": [d.to_dict() for d in self.deltas],
            "curve": [p.to_dict() for p in self.curve],
        }


def _first_crossing(acc: FloatArray, thr: FloatArray) -> npt.NDArray[np.int64]:
    """Leading grid steps at or above the threshold: acc (B, L), thr (B,) -> (B,) ints in 0..L.
    A NaN accuracy (no case observed at that length in the resample) counts as missing the threshold."""
    with np.errstate(invalid="ignore"):
        meets = acc >= (thr[:, None] - _TOL)
    steps: npt.NDArray[np.int64] = np.cumprod(meets, axis=1).sum(axis=1).astype(np.int64)
    return steps


def _grid_interval(values: npt.NDArray[Any], alpha: float) -> tuple[int, int]:
    """Two-sided percentile interval of a discrete bootstrap distribution, as support points: the
    smallest v with F(v) >= alpha/2 and the smallest v with F(v) >= 1 - alpha/2 (inverted CDF). It holds
    at least 1 - alpha of the bootstrap mass and is never interpolated between grid values."""
    lo = np.quantile(values, alpha / 2.0, method="inverted_cdf")
    hi = np.quantile(values, 1.0 - alpha / 2.0, method="inverted_cdf")
    return int(lo), int(hi)


def _weighted_acc(weights: FloatArray, rates: FloatArray) -> FloatArray:
    """Case-weighted accuracy per resample: weights (B, n) counts, rates (n, L) with NaN = unobserved."""
    observed = ~np.isnan(rates)
    num = weights @ np.where(observed, rates, 0.0)
    den = weights @ observed.astype(np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(den > 0, num / np.where(den > 0, den, 1.0), np.nan)


def effective_length(
    scored: pl.DataFrame,
    *,
    rule: ELRule,
    threshold: float,
    base_scores: Mapping[str, float] | None = None,
    scored_controls: pl.DataFrame | None = None,
    reps: int = 2000,
    seed: int = 0,
    alpha: float = 0.05,
    fallback_base: float | None = None,
) -> EffectiveLengthResult:
    """Effective length per (arm, depth) with case-bootstrap intervals, the paired candidate − baseline
    difference, and accuracy-by-length curves.

    **Definitions.** ``rule="nolima"``: a length is effective when its accuracy is >= ``threshold`` x the
    arm's base score (NoLiMa: 0.85 of the evidence-only control accuracy, the arm's score without any
    haystack). ``rule="ruler"``: when its accuracy is >= ``threshold`` (RULER: 0.856, Llama-2-7B's
    accuracy at 4K). NoLiMa's base comes from ``base_scores`` (fixed numbers per arm) or from
    ``scored_controls`` (the output of ``score_controls``; the base is then recomputed in every bootstrap
    resample on the resampled cases, so the interval carries the base score's own uncertainty). Give
    exactly one of the two for NoLiMa and neither for RULER.

    **Monotone convention (first crossing).** The estimate is the longest grid length L such that the
    case-weighted accuracy at L and at *every shorter* length is >= the threshold; 0 when the shortest
    length already misses it, the longest length (``at_grid_top``, a censored value) when none does.
    "Longest length that passes anywhere" would let one lucky long length after a failing shorter one
    define the effective length, although the model is not usable up to it; first crossing reads "every
    length up to L works", is what both papers mean on their (nearly monotone) curves, and is a monotone
    functional of the curve (raising any accuracy never shortens it), which keeps the bootstrap
    percentile interval well behaved. A length with no observed case counts as missing the threshold.

    **Intervals.** Cases are resampled ``reps`` times with replacement (the unit of the design; seeds
    stay inside their case), *the same resample for both arms and every depth*, so the difference
    interval is paired. The effective length takes values on the grid {0, L1, ..., Lk}, so its interval
    is reported as grid values: [smallest v with F*(v) >= alpha/2, smallest v with F*(v) >= 1 - alpha/2]
    of the bootstrap distribution F* (it holds at least 1 - alpha of the bootstrap mass; an interpolated
    11,264 tokens was never measured). Differences are reported in tokens and in grid steps the same way.
    ``distribution`` gives the bootstrap mass per grid value for a reader who wants more than two
    numbers. With few cases or a threshold near a plateau the interval is wide: that is the information.

    Calibration (tests/test_position_sim.py, 60 cases x 2 seeds, 4 lengths, B = 500): in A/A runs the
    95 % difference interval covered 0 in all 1,200 position-replicates, also with the threshold sitting
    on the curve (the point difference then spreads over -2..+2 grid steps, and so does the interval:
    on a discrete grid a 95 % interval is conservative); a planted two-step loss (32K -> 8K) was found
    (interval below 0) in 0.875 ± 0.023 of the runs.

    The grid of a position is every length at which it has records in either arm. Bootstrap seed:
    ``stable_seed(seed, "effective_length")``.

    ``fallback_base``: with ``scored_controls``, the fixed base score of an arm that has no usable
    evidence-only control (all of them lost to its serving path, say) instead of refusing; the other
    arm keeps its own base from its own controls — an arm's numbers never depend on the other arm's
    records (issue #21).
    """
    if rule not in ("nolima", "ruler"):
        raise InputError(f"unknown effective-length rule {rule!r}", field="rule", fix="'nolima' or 'ruler'")
    if not (0.0 < threshold <= 1.0) or not math.isfinite(threshold):
        raise InputError(
            f"effective-length threshold {threshold!r} out of range",
            field="threshold",
            fix="a share in (0, 1]: NoLiMa 0.85 of the base score, RULER an accuracy such as 0.856",
        )
    if not 0.0 < alpha < 1.0:
        raise InputError(f"alpha {alpha!r} out of range", field="alpha", fix="a level in (0, 1)")
    if reps < 1:
        raise InputError(f"reps {reps!r} < 1", field="reps", fix="a positive resample count, e.g. 2000")
    if rule == "ruler" and (base_scores is not None or scored_controls is not None):
        raise InputError(
            "the RULER rule takes an absolute threshold, not a base score",
            field="base_scores",
            fix="drop base_scores/scored_controls, or use rule='nolima'",
        )
    if rule == "nolima" and (base_scores is None) == (scored_controls is None):
        raise InputError(
            "the NoLiMa rule needs the arms' base scores, from exactly one source",
            field="base_scores",
            fix="pass base_scores={'baseline': ..., 'candidate': ...} or scored_controls",
        )

    runs = runs_frame(scored)
    rates = case_rates(runs)
    cases = sorted(runs["case_id"].unique().to_list())
    n = len(cases)
    if n == 0:
        raise InputError("no records", fix="pass the scored records of a run")
    index = {c: i for i, c in enumerate(cases)}
    arms = [a for a in ARMS if a in set(runs["arm"].unique().to_list())]
    positions = sorted(set(runs["position"].unique().to_list()), key=position_sort_key)
    grids: dict[str, tuple[int, ...]] = {}
    for pos in positions:
        lens = runs.filter(pl.col("position") == pos)["length"].unique().to_list()
        grids[pos] = tuple(sorted(int(x) for x in lens))

    # (arm, position) -> (n, L) per-case rates (NaN: no valid seed), runs per (length)
    matrices: dict[tuple[str, str], FloatArray] = {}
    run_counts: dict[tuple[str, str], npt.NDArray[np.int64]] = {}
    for arm in arms:
        for pos in positions:
            grid = grids[pos]
            col = {length: j for j, length in enumerate(grid)}
            mat = np.full((n, len(grid)), np.nan)
            cnt = np.zeros((n, len(grid)), dtype=np.int64)
            part = rates.filter((pl.col("arm") == arm) & (pl.col("position") == pos))
            for case, length, rate, valid in part.select("case_id", "length", "rate", "valid").iter_rows():
                mat[index[case], col[int(length)]] = float(rate)
                cnt[index[case], col[int(length)]] = int(valid)
            matrices[(arm, pos)] = mat
            run_counts[(arm, pos)] = cnt

    # Base scores: fixed, or per-case control rates resampled with the cases.
    base_fixed: dict[str, float] | None = None
    base_case: dict[str, FloatArray] = {}
    if rule == "nolima":
        if base_scores is not None:
            base_fixed = {}
            for arm in arms:
                if arm not in base_scores:
                    raise InputError(
                        f"no base score for arm {arm!r}",
                        field="base_scores",
                        fix=f"give a base score for each of {arms}",
                    )
                value = float(base_scores[arm])
                if not 0.0 < value <= 1.0:
                    raise InputError(
                        f"base score {value!r} of arm {arm!r} out of range",
                        field="base_scores",
                        fix="an accuracy in (0, 1]",
                    )
                base_fixed[arm] = value
        else:
            assert scored_controls is not None
            control, by_arm = _control_rates(scored_controls)
            for arm in arms:
                vec = np.full(n, np.nan)
                for case, i in index.items():
                    rate = _control_of(control, by_arm, arm, case)
                    if rate is not None:
                        vec[i] = rate
                if np.all(np.isnan(vec)) and fallback_base is not None:
                    base_fixed = {**(base_fixed or {}), arm: float(fallback_base)}
                    continue
                if np.all(np.isnan(vec)):
                    raise InputError(
                        f"no usable evidence-only control for arm {arm!r} on the matrix's cases",
                        field="scored_controls",
                        fix="run the controls (controls = true) or pass base_scores",
                    )
                base_case[arm] = vec

    boot_seed = stable_seed(seed, "effective_length")
    rng = np.random.default_rng(boot_seed)
    weights = rng.multinomial(n, np.full(n, 1.0 / n), size=reps).astype(np.float64)
    ones = np.ones((1, n))

    def thresholds(arm: str, w: FloatArray) -> FloatArray:
        if rule == "ruler":
            return np.full(w.shape[0], threshold)
        if base_fixed is not None and arm in base_fixed:
            return np.full(w.shape[0], threshold * base_fixed[arm])
        base = _weighted_acc(w, base_case[arm][:, None])[:, 0]
        return threshold * base

    bases: dict[str, float] | None = None
    if rule == "nolima":
        bases = {arm: float(thresholds(arm, ones)[0] / threshold) for arm in arms}

    rows: list[EffectiveLength] = []
    curve: list[AccuracyPoint] = []
    boot_steps: dict[tuple[str, str], npt.NDArray[np.int64]] = {}
    point_steps: dict[tuple[str, str], int] = {}
    for pos in positions:
        grid = grids[pos]
        values = np.array([0, *grid], dtype=np.int64)
        for arm in arms:
            mat = matrices[(arm, pos)]
            thr_point = float(thresholds(arm, ones)[0])
            acc_point = _weighted_acc(ones, mat)
            k_point = int(_first_crossing(acc_point, np.array([thr_point]))[0])
            acc_boot = _weighted_acc(weights, mat)
            k_boot = _first_crossing(acc_boot, thresholds(arm, weights))
            boot_steps[(arm, pos)] = k_boot
            point_steps[(arm, pos)] = k_point
            lo_k, hi_k = _grid_interval(k_boot, alpha)
            mass = np.bincount(k_boot, minlength=len(values)) / reps
            rows.append(
                EffectiveLength(
                    arm=arm,
                    position=pos,
                    rule=rule,
                    threshold=threshold,
                    base_score=None if bases is None else bases[arm],
                    threshold_abs=thr_point,
                    n_cases=int(np.sum(np.any(~np.isnan(mat), axis=1))),
                    grid=grid,
                    estimate=int(values[k_point]),
                    steps=k_point,
                    at_grid_top=k_point == len(grid),
                    lower=int(values[lo_k]),
                    upper=int(values[hi_k]),
                    lower_steps=lo_k,
                    upper_steps=hi_k,
                    distribution=tuple(
                        (int(v), float(m)) for v, m in zip(values, mass, strict=True) if m > 0
                    ),
                )
            )
            cnt = run_counts[(arm, pos)]
            for j, length in enumerate(grid):
                observed = ~np.isnan(mat[:, j])
                k = int(observed.sum())
                acc = float(acc_point[0, j]) if k else None
                band = acc_boot[:, j]
                band = band[~np.isnan(band)]
                lo = hi = None
                if k and band.size:
                    lo = float(np.quantile(band, alpha / 2.0))
                    hi = float(np.quantile(band, 1.0 - alpha / 2.0))
                w_lo = w_hi = None
                runs_j = int(cnt[:, j].sum())
                if k:
                    w_lo, w_hi, _ = wilson_design_interval(mat[observed, j], runs_j / k, alpha)
                curve.append(
                    AccuracyPoint(
                        arm=arm,
                        position=pos,
                        length=int(length),
                        n_cases=k,
                        runs=runs_j,
                        accuracy=acc,
                        lower=lo,
                        upper=hi,
                        wilson_lower=w_lo,
                        wilson_upper=w_hi,
                        threshold_abs=thr_point,
                        meets=acc is not None and acc >= thr_point - _TOL,
                    )
                )

    deltas: list[EffectiveLengthDelta] = []
    if BASELINE in arms and CANDIDATE in arms:
        for pos in positions:
            values = np.array([0, *grids[pos]], dtype=np.int64)
            kb, kc = boot_steps[(BASELINE, pos)], boot_steps[(CANDIDATE, pos)]
            tokens = values[kc] - values[kb]
            steps = kc - kb
            lo_t, hi_t = _grid_interval(tokens, alpha)
            lo_s, hi_s = _grid_interval(steps, alpha)
            pb, pc = point_steps[(BASELINE, pos)], point_steps[(CANDIDATE, pos)]
            deltas.append(
                EffectiveLengthDelta(
                    position=pos,
                    estimate=int(values[pc] - values[pb]),
                    lower=lo_t,
                    upper=hi_t,
                    estimate_steps=pc - pb,
                    lower_steps=lo_s,
                    upper_steps=hi_s,
                    share_shorter=float(np.mean(tokens < 0)),
                    share_longer=float(np.mean(tokens > 0)),
                )
            )

    return EffectiveLengthResult(
        rule=rule,
        threshold=threshold,
        alpha=alpha,
        reps=reps,
        seed=seed,
        bootstrap_seed=boot_seed,
        n_cases=n,
        base_scores=bases,
        base_resampled=rule == "nolima" and base_fixed is None,
        rows=tuple(rows),
        deltas=tuple(deltas),
        curve=tuple(curve),
    )


# --------------------------------------------------------------------------------------------------
# Control-normalised accuracy


def eligible_cases(
    scored_controls: pl.DataFrame, *, arm: str = BASELINE, min_control_pass: float = 0.5
) -> tuple[str, ...]:
    """Cases whose evidence-only control passes for ``arm``: pass rate over usable seeds (``pass`` or
    ``fail``) >= ``min_control_pass`` (0.5: a majority of seeds, a tie counting as a pass, the rule by
    which :func:`depthgate.judge.controls.classify_failures` calls a case ``task_or_model``).

    For a *gate* on control-normalised accuracy use the **baseline's** control (the default): selecting
    on the candidate's own control would drop exactly the cases a candidate broke everywhere, hiding a
    regression. Gate on ``scored.filter(pl.col("case_id").is_in(cases))`` with
    ``GatePlan(planned_cases=cases)`` (intersected with the frozen case set), so the excluded cases are
    not counted as missing."""
    rates, by_arm = _control_rates(scored_controls)
    wanted = arm if by_arm else ""
    return tuple(sorted(c for (a, c), r in rates.items() if a == wanted and r >= min_control_pass - _TOL))


def control_normalised_accuracy(
    scored: pl.DataFrame, scored_controls: pl.DataFrame, *, min_control_pass: float = 0.5
) -> pl.DataFrame:
    """Per (arm, length, position): raw accuracy beside the accuracy among cases whose evidence-only
    control passes, so "cannot do the task" and "loses it at this depth" are told apart.

    Columns: ``arm``, ``length``, ``position``; ``n_cases`` and ``accuracy`` (raw, case-weighted, every
    case with a valid seed); ``n_eligible`` and ``accuracy_eligible`` (cases whose *own arm's*
    evidence-only control passes, see :func:`eligible_cases`; null when none); ``n_ineligible`` and
    ``accuracy_ineligible`` (control fails: the task or the model, not the position); ``n_no_control``
    (no usable control record: counted in neither group); ``n_eligible_baseline`` and
    ``accuracy_eligible_baseline`` (cases whose *baseline* control passes: the same case set for both
    arms, the paired population a control-normalised gate tests). Controls without an ``arm`` column
    apply to both arms.
    """
    if not 0.0 < min_control_pass <= 1.0:
        raise InputError(
            f"min_control_pass {min_control_pass!r} out of range", field="min_control_pass", fix="(0, 1]"
        )
    rates = case_rates(runs_frame(scored))
    control, by_arm = _control_rates(scored_controls)

    def status(arm: str, case: str) -> str:
        value = _control_of(control, by_arm, arm, case)
        if value is None:
            return "none"
        return "yes" if value >= min_control_pass - _TOL else "no"

    rows = rates.select("arm", "case_id").unique()
    flags = pl.DataFrame(
        {
            "arm": rows["arm"],
            "case_id": rows["case_id"],
            "own": [status(a, c) for a, c in rows.iter_rows()],
            "base": [status(BASELINE, c) for c in rows["case_id"].to_list()],
        },
        schema={"arm": pl.String, "case_id": pl.String, "own": pl.String, "base": pl.String},
    )
    joined = rates.join(flags, on=["arm", "case_id"], how="left")

    def mean_where(cond: pl.Expr, name: str) -> list[pl.Expr]:
        return [
            cond.sum().cast(pl.Int64).alias(f"n_{name}"),
            pl.col("rate").filter(cond).mean().alias(f"accuracy_{name}"),
        ]

    out = joined.group_by(_SLICE).agg(
        pl.len().cast(pl.Int64).alias("n_cases"),
        pl.col("rate").mean().alias("accuracy"),
        *mean_where(pl.col("own") == "yes", "eligible"),
        *mean_where(pl.col("own") == "no", "ineligible"),
        (pl.col("own") == "none").sum().cast(pl.Int64).alias("n_no_control"),
        *mean_where(pl.col("base") == "yes", "eligible_baseline"),
    )
    return _sort_slices(out).select(
        "arm",
        "length",
        "position",
        "n_cases",
        "accuracy",
        "n_eligible",
        "accuracy_eligible",
        "n_ineligible",
        "accuracy_ineligible",
        "n_no_control",
        "n_eligible_baseline",
        "accuracy_eligible_baseline",
    )


# --------------------------------------------------------------------------------------------------
# Repeat stability


def pass_hat_k(
    scored: pl.DataFrame, *, seeds: Sequence[int] | None = None, alpha: float = 0.05
) -> pl.DataFrame:
    """Per (arm, length, position): the mean beside pass^k, k = the number of seeds.

    ``seeds`` is the planned seed set (default: every seed in the records). Columns: ``arm``, ``length``,
    ``position``, ``k``; ``n_cases`` and ``accuracy`` (case-weighted mean over every case with a valid
    seed); ``n_complete`` (cases with a valid outcome for all k seeds: pass^k is defined on them only; a
    missing seed is not a pass); ``accuracy_complete`` (the mean on the same complete cases, the
    like-for-like comparison); ``pass_hat_k`` (share of complete cases all of whose k seeds pass) with
    its two-sided (1 - alpha) Wilson interval ``pass_hat_k_lower``/``pass_hat_k_upper`` (one binary
    outcome per case, so cases are the sample); ``pass_at_k`` (share of complete cases with at least one
    pass). ``accuracy_complete - pass_hat_k`` is the repeat instability: 0 when every case is
    deterministic. With k = 1, pass^k equals the accuracy.
    """
    runs = runs_frame(scored)
    planned = sorted({int(s) for s in (seeds if seeds is not None else runs["seed"].unique().to_list())})
    if not planned:
        raise InputError("no seeds", field="seeds", fix="pass the planned seed set or records with seeds")
    k = len(planned)
    outside = runs.filter(~pl.col("seed").is_in(planned))
    if outside.height:
        raise InputError(
            f"records of seed(s) {sorted(set(outside['seed'].to_list()))[:5]} outside the seed set {planned}",
            field="seeds",
            fix="pass the run's planned seed set",
        )
    per_case = (
        runs.filter(pl.col("y").is_not_null())
        .group_by([*_SLICE, "case_id"])
        .agg(pl.len().alias("valid"), pl.col("y").sum().alias("passes"))
        .with_columns(
            (pl.col("passes") / pl.col("valid")).alias("rate"), (pl.col("valid") == k).alias("complete")
        )
    )
    out = per_case.group_by(_SLICE).agg(
        pl.len().cast(pl.Int64).alias("n_cases"),
        pl.col("rate").mean().alias("accuracy"),
        pl.col("complete").sum().cast(pl.Int64).alias("n_complete"),
        pl.col("rate").filter(pl.col("complete")).mean().alias("accuracy_complete"),
        (pl.col("complete") & (pl.col("passes") == k)).sum().cast(pl.Int64).alias("_all"),
        (pl.col("complete") & (pl.col("passes") > 0)).sum().cast(pl.Int64).alias("_any"),
    )
    rows: list[dict[str, Any]] = []
    for r in out.iter_rows(named=True):
        m = int(r["n_complete"])
        lo = hi = phk = pak = None
        if m:
            phk = r["_all"] / m
            pak = r["_any"] / m
            lo_, hi_ = proportion_confint(r["_all"], m, alpha=alpha, method="wilson")
            lo, hi = float(lo_), float(hi_)
        rows.append(
            {
                "arm": r["arm"],
                "length": int(r["length"]),
                "position": r["position"],
                "k": k,
                "n_cases": int(r["n_cases"]),
                "accuracy": float(r["accuracy"]),
                "n_complete": m,
                "accuracy_complete": None
                if r["accuracy_complete"] is None
                else float(r["accuracy_complete"]),
                "pass_hat_k": phk,
                "pass_hat_k_lower": lo,
                "pass_hat_k_upper": hi,
                "pass_at_k": pak,
            }
        )
    schema: dict[str, Any] = {
        "arm": pl.String,
        "length": pl.Int64,
        "position": pl.String,
        "k": pl.Int64,
        "n_cases": pl.Int64,
        "accuracy": pl.Float64,
        "n_complete": pl.Int64,
        "accuracy_complete": pl.Float64,
        "pass_hat_k": pl.Float64,
        "pass_hat_k_lower": pl.Float64,
        "pass_hat_k_upper": pl.Float64,
        "pass_at_k": pl.Float64,
    }
    return _sort_slices(
        pl.DataFrame(rows, schema=schema, orient="row") if rows else pl.DataFrame(schema=schema)
    )


# --------------------------------------------------------------------------------------------------
# Evidence spacing


def _spacing_key(position: str) -> tuple[tuple[int, float, str], int, str]:
    base, spacing = split_position_label(position)
    return position_sort_key(base), spacing_rank(spacing), spacing


def spacing_accuracy(scored: pl.DataFrame, layouts: pl.DataFrame | None = None) -> pl.DataFrame | None:
    """Per (arm, length, depth, spacing), when any position label carries a spacing (``"0.5~far"``);
    None otherwise.

    Columns: ``arm``, ``length``, ``depth`` (the position without its spacing), ``spacing``, ``position``
    (the slice's label); ``n_cases`` and ``accuracy`` (case-weighted, every case with a valid seed);
    ``n_multi`` and ``accuracy_multi`` (only the cases with two or more decisive documents, the ones whose
    prompt the spacing changes; from ``layouts``, else null); ``vs_adjacent`` (``accuracy_multi`` — or
    ``accuracy`` without layouts — minus the same at the adjacent spacing, same arm, length and depth;
    null when the matrix has no adjacent spacing); ``gap_median``, ``gap_min``, ``gap_max``: the measured
    ``evidence_gap_tokens`` of the slice's ok layouts, per arm when ``layouts`` has an ``arm`` column (the
    arms may tokenize differently). ``layouts``: ``case_id``, ``target_tokens``, ``position``, ``status``,
    ``evidence_gap_tokens`` and optionally ``arm``."""
    runs = runs_frame(scored)
    positions = sorted(set(runs["position"].unique().to_list()), key=_spacing_key)
    if not any(split_position_label(p)[1] != "adjacent" for p in positions):
        return None
    rates = case_rates(runs)
    multi: set[str] = set()
    gaps: dict[tuple[str, int, str], list[int]] = {}
    if layouts is not None and layouts.height:
        ok = layouts.filter((pl.col("status") == "ok") & pl.col("evidence_gap_tokens").is_not_null())
        multi = set(ok["case_id"].unique().to_list())
        if "arm" not in ok.columns:
            ok = ok.with_columns(pl.lit("").alias("arm"))
        for arm, length, position, gap in ok.select(
            "arm", "target_tokens", "position", "evidence_gap_tokens"
        ).iter_rows():
            gaps.setdefault((str(arm), int(length), str(position)), []).append(int(gap))
    rows: list[dict[str, Any]] = []
    acc: dict[tuple[str, int, str, str], float | None] = {}
    for (arm, length, position), part in sorted(
        rates.group_by(_SLICE), key=lambda kv: (str(kv[0][0]), int(kv[0][1]), _spacing_key(str(kv[0][2])))
    ):
        depth, spacing = split_position_label(str(position))
        arm_, length_ = str(arm), int(length)
        m = part.filter(pl.col("case_id").is_in(sorted(multi))) if layouts is not None else None
        g = sorted(gaps.get((arm_, length_, str(position)), gaps.get(("", length_, str(position)), [])))
        accuracy = float(np.mean(part["rate"].to_numpy()))
        accuracy_multi = float(np.mean(m["rate"].to_numpy())) if m is not None and m.height else None
        rows.append(
            {
                "arm": arm_,
                "length": length_,
                "depth": depth,
                "spacing": spacing,
                "position": str(position),
                "n_cases": part.height,
                "accuracy": accuracy,
                "n_multi": None if m is None else m.height,
                "accuracy_multi": accuracy_multi,
                "gap_median": float(np.median(g)) if g else None,
                "gap_min": g[0] if g else None,
                "gap_max": g[-1] if g else None,
            }
        )
        acc[(arm_, length_, depth, spacing)] = accuracy if m is None else accuracy_multi
    for row in rows:
        own = acc.get((row["arm"], row["length"], row["depth"], row["spacing"]))
        adjacent = acc.get((row["arm"], row["length"], row["depth"], "adjacent"))
        row["vs_adjacent"] = None if own is None or adjacent is None else own - adjacent
    schema: dict[str, Any] = {
        "arm": pl.String,
        "length": pl.Int64,
        "depth": pl.String,
        "spacing": pl.String,
        "position": pl.String,
        "n_cases": pl.Int64,
        "accuracy": pl.Float64,
        "n_multi": pl.Int64,
        "accuracy_multi": pl.Float64,
        "gap_median": pl.Float64,
        "gap_min": pl.Int64,
        "gap_max": pl.Int64,
        "vs_adjacent": pl.Float64,
    }
    a_rank = {a: i for i, a in enumerate(ARMS)}
    rows.sort(
        key=lambda r: (
            r["length"],
            position_sort_key(r["depth"]),
            spacing_rank(r["spacing"]),
            a_rank.get(r["arm"], len(ARMS)),
        )
    )
    return pl.DataFrame(rows, schema=schema, orient="row")
