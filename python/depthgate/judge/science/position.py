"""Position science beside the gate (issue #13): effective length per depth, control-normalised
accuracy and repeat stability (pass^k).

Every function takes the scored records of :func:`depthgate.judge.scoring.score_records` (columns
``arm``, ``case_id``, ``length``, ``position``, ``seed``, ``outcome``; other columns are ignored) and
scores runs as the gate does: ``pass`` = 1, ``fail`` and ``system_fail`` = 0 (a system failure is the
system's fault, never missing data), ``missing`` = no observation. The unit is the **case**: seeds are
averaged within a case first and every accuracy below is case-weighted (``research/stats_gate.md`` §1),
so a case with one valid seed weighs as much as a case with five.

* :func:`effective_length` (:mod:`depthgate.judge.science.length`) — per (arm, depth) the longest
  length up to which the depth's accuracy stays at or above a threshold (NoLiMa: a share of the arm's
  *base score*, the same task at short lengths, :mod:`depthgate.judge.science.base_score`; RULER: an absolute
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
:func:`depthgate.judge.gate.stable_seed`, so a result is identical in every process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import polars as pl
from statsmodels.stats.proportion import proportion_confint

from depthgate.exceptions import InputError
from depthgate.judge.science.position_records import (
    SLICE,
    TOL,
    case_rates,
    control_of,
    control_rates,
    runs_frame,
    sort_slices,
    wilson_design_interval,
)
from depthgate.judge.tables import ARMS, BASELINE, position_sort_key
from depthgate.spec.positions import spacing_rank, split_position_label

__all__ = [
    "control_normalised_accuracy",
    "eligible_cases",
    "pass_hat_k",
    "spacing_accuracy",
]


# --------------------------------------------------------------------------------------------------
# Control-normalised accuracy


def eligible_cases(
    scored_controls: pl.DataFrame, *, arm: str = BASELINE, min_control_pass: float = 0.5
) -> tuple[str, ...]:
    """Cases whose evidence-only control passes for ``arm``: pass rate over usable seeds (``pass`` or
    ``fail``) >= ``min_control_pass`` (0.5: a majority of seeds, a tie counting as a pass, the rule by
    which :func:`depthgate.judge.science.classify_failures` calls a case ``task_or_model``).

    For a *gate* on control-normalised accuracy use the **baseline's** control (the default): selecting
    on the candidate's own control would drop exactly the cases a candidate broke everywhere, hiding a
    regression. Gate on ``scored.filter(pl.col("case_id").is_in(cases))`` with
    ``GatePlan(planned_cases=cases)`` (intersected with the frozen case set), so the excluded cases are
    not counted as missing."""
    rates, by_arm = control_rates(scored_controls)
    wanted = arm if by_arm else ""
    return tuple(sorted(c for (a, c), r in rates.items() if a == wanted and r >= min_control_pass - TOL))


def control_normalised_accuracy(
    scored: pl.DataFrame,
    scored_controls: pl.DataFrame,
    *,
    min_control_pass: float = 0.5,
    alpha: float = 0.05,
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
    apply to both arms. ``accuracy_lower``/``_upper``, ``accuracy_eligible_lower``/``_upper`` and
    ``accuracy_eligible_baseline_lower``/``_upper``: the two-sided (1 - ``alpha``) Wilson interval of
    each accuracy on its cases, clustered by case (issue #24; null without cases).
    """
    if not 0.0 < min_control_pass <= 1.0:
        raise InputError(
            f"min_control_pass {min_control_pass!r} out of range", field="min_control_pass", fix="(0, 1]"
        )
    rates = case_rates(runs_frame(scored))
    control, by_arm = control_rates(scored_controls)

    def status(arm: str, case: str) -> str:
        value = control_of(control, by_arm, arm, case)
        if value is None:
            return "none"
        return "yes" if value >= min_control_pass - TOL else "no"

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
            pl.col("rate").filter(cond).alias(f"_rates_{name}"),
            pl.col("valid").filter(cond).alias(f"_valid_{name}"),
        ]

    out = joined.group_by(SLICE).agg(
        pl.len().cast(pl.Int64).alias("n_cases"),
        pl.col("rate").mean().alias("accuracy"),
        pl.col("rate").alias("_rates_all"),
        pl.col("valid").alias("_valid_all"),
        *mean_where(pl.col("own") == "yes", "eligible"),
        *mean_where(pl.col("own") == "no", "ineligible"),
        (pl.col("own") == "none").sum().cast(pl.Int64).alias("n_no_control"),
        *mean_where(pl.col("base") == "yes", "eligible_baseline"),
    )
    out = out.with_columns(
        *_interval_columns(out, "all", "accuracy", alpha),
        *_interval_columns(out, "eligible", "accuracy_eligible", alpha),
        *_interval_columns(out, "eligible_baseline", "accuracy_eligible_baseline", alpha),
    )
    return sort_slices(out).select(
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
        "accuracy_lower",
        "accuracy_upper",
        "accuracy_eligible_lower",
        "accuracy_eligible_upper",
        "accuracy_eligible_baseline_lower",
        "accuracy_eligible_baseline_upper",
    )


def _interval_columns(out: pl.DataFrame, group: str, name: str, alpha: float) -> list[pl.Series]:
    """``{name}_lower``/``{name}_upper``: the two-sided (1 - alpha) Wilson interval of each row's
    case-weighted accuracy over the cases of ``group``, on the design-effect-adjusted sample size
    (clustered by case: :func:`wilson_design_interval`, R = mean valid seeds per case); null without
    cases."""
    lows: list[float | None] = []
    highs: list[float | None] = []
    for rates, valid in zip(out[f"_rates_{group}"].to_list(), out[f"_valid_{group}"].to_list(), strict=True):
        if not rates:
            lows.append(None)
            highs.append(None)
            continue
        # sorted: the same float sums in every process (the aggregated list's order is not fixed)
        lo, hi, _ = wilson_design_interval(
            np.sort(np.asarray(rates, dtype=np.float64)), float(np.mean(valid)), alpha
        )
        lows.append(lo)
        highs.append(hi)
    return [
        pl.Series(f"{name}_lower", lows, dtype=pl.Float64),
        pl.Series(f"{name}_upper", highs, dtype=pl.Float64),
    ]


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
        .group_by([*SLICE, "case_id"])
        .agg(pl.len().alias("valid"), pl.col("y").sum().alias("passes"))
        .with_columns(
            (pl.col("passes") / pl.col("valid")).alias("rate"), (pl.col("valid") == k).alias("complete")
        )
    )
    out = per_case.group_by(SLICE).agg(
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
    return sort_slices(
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
        rates.group_by(SLICE), key=lambda kv: (str(kv[0][0]), int(kv[0][1]), _spacing_key(str(kv[0][2])))
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
