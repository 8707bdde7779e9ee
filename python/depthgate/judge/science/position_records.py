"""The scored-records helpers of the position science (issue #13): validate records and score runs as
the gate does (``pass`` 1, ``fail``/``system_fail`` 0, ``missing`` no observation), per-case rates, the
evidence-only control rates per (arm, case), and the Wilson interval of a case-weighted accuracy on its
design-effect-adjusted sample size. Shared by :mod:`depthgate.judge.science.position`,
:mod:`depthgate.judge.science.length` and :mod:`depthgate.judge.science.base_score`."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import numpy.typing as npt
import polars as pl
from statsmodels.stats.proportion import proportion_confint

from depthgate.exceptions import InputError
from depthgate.judge.bounds import kish_effective_n
from depthgate.judge.tables import ARMS, RECORD_SCHEMA, RUN_SCORE, checked_runs, position_sort_key

__all__ = [
    "RUN_COLUMNS",
    "SLICE",
    "TOL",
    "USABLE_CONTROL",
    "base_scores_from_controls",
    "case_rates",
    "control_of",
    "control_rates",
    "runs_frame",
    "sort_slices",
    "wilson_design_interval",
]

#: Columns every function here reads from a scored-records frame: the gate's, less the safety flag.
RUN_COLUMNS: dict[str, pl.DataType] = {k: t for k, t in RECORD_SCHEMA.items() if k != "safety"}
SLICE = ["arm", "length", "position"]
TOL = 1e-12
#: Usable control outcomes, as in :func:`depthgate.judge.science.classify_failures`: a control that did
#: not run (system failure, missing) says nothing about whether the model can do the task.
USABLE_CONTROL = ("pass", "fail")

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
        missing_fix="pass the output of depthgate.judge.scoring.score_records",
        types_fix="arm/case_id/position/outcome strings, length/seed integers",
    )
    return df.with_columns(RUN_SCORE.alias("y"))


def case_rates(runs: pl.DataFrame) -> pl.DataFrame:
    """Per (arm, length, position, case): ``valid`` seeds, ``passes`` and ``rate`` = passes / valid
    (cases without a valid seed are dropped). ``runs`` is a :func:`runs_frame`."""
    return (
        runs.filter(pl.col("y").is_not_null())
        .group_by([*SLICE, "case_id"])
        .agg(pl.len().alias("valid"), pl.col("y").sum().alias("passes"))
        .with_columns((pl.col("passes") / pl.col("valid")).alias("rate"))
    )


def sort_slices(df: pl.DataFrame) -> pl.DataFrame:
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


def control_rates(scored_controls: pl.DataFrame) -> tuple[dict[tuple[str, str], float], bool]:
    """Evidence-only control pass rate per (arm, case) over usable seeds; ``by_arm`` False when the
    controls have no ``arm`` column (then the key's arm is "")."""
    for col in ("case_id", "outcome", "control"):
        if col not in scored_controls.columns:
            raise InputError(
                f"scored controls lack {col!r}",
                field=col,
                fix="pass the output of depthgate.judge.science.score_controls",
            )
    by_arm = "arm" in scored_controls.columns
    keys = ["arm", "case_id"] if by_arm else ["case_id"]
    only = scored_controls.filter(
        (pl.col("control") == "evidence_only") & pl.col("outcome").is_in(list(USABLE_CONTROL))
    )
    agg = only.group_by(keys).agg(pl.col("outcome").eq("pass").mean().alias("rate"))
    out: dict[tuple[str, str], float] = {}
    for row in agg.iter_rows(named=True):
        out[(str(row["arm"]) if by_arm else "", str(row["case_id"]))] = float(row["rate"])
    return out, by_arm


def control_of(rates: Mapping[tuple[str, str], float], by_arm: bool, arm: str, case: str) -> float | None:
    return rates.get((arm if by_arm else "", case))


def base_scores_from_controls(scored_controls: pl.DataFrame) -> dict[str, float]:
    """NoLiMa's *base score* per arm: the case-weighted evidence-only control accuracy (each case's pass
    rate over its usable seeds — ``pass``/``fail``; a control that did not run says nothing — then the
    mean over cases). Controls without an ``arm`` column give both arms the same base."""
    rates, by_arm = control_rates(scored_controls)
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
    case — the two-sided twin of :func:`depthgate.judge.bounds.floor_lower_bound`. Returns (low, high,
    DEFF)."""
    p, deff, n_eff = kish_effective_n(rates, runs_per_case, caller="wilson_design_interval")
    low, high = proportion_confint(p * n_eff, n_eff, alpha=alpha, method="wilson")
    return float(low), float(high), deff
