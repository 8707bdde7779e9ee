"""NoLiMa's base score (issue #24): the arm's accuracy on the *same task* at short lengths.

NoLiMa normalises its threshold by the model's score on the same cases, with the same haystack
construction, at short lengths (250, 500 and 1K tokens). depthgate builds those layouts beside the matrix
(``plan.base_lengths``; they are sent with the run but never gated) and reads the base score here:

* per arm, each case's pass rate over its short-length runs (every base length, depth and seed that was
  sent), then the mean over cases (case-weighted, as every accuracy of the position science);
* its two-sided (1 - alpha) Wilson interval on the design-effect-adjusted sample size, clustered by case
  (:func:`depthgate.judge.science.wilson_design_interval`: DEFF = clip(R s^2 / (p (1 - p)), 1,
  R), R = mean runs per case);
* the per-case rates, which :func:`depthgate.judge.science.effective_length` resamples with the
  cases, so the effective-length interval carries the base score's own uncertainty.

A short layout that could not be built or sent (``system_fail`` with no attempt: refused at build, say
``cannot_reach_exact_length`` when a case's anchored units overshoot 250 tokens, or by the pre-send
guard) measures nothing about the model: it is left out of the base and counted (``not_sent``). Every
other system failure counts as a fail, as in the gate.

The evidence-only control stays available as a named alternative base (``base_score = "control"``):
:func:`control_base` gives it the same interval.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import polars as pl

from depthgate.exceptions import InputError
from depthgate.judge.science.position_records import TOL, USABLE_CONTROL, runs_frame, wilson_design_interval
from depthgate.judge.tables import ARMS, JsonRow

__all__ = ["AboveBase", "BaseScore", "above_base", "control_base", "short_base"]


@dataclass(frozen=True)
class BaseScore(JsonRow):
    """The base score of one arm. ``source``: ``"short"`` (the same task at ``lengths``) or
    ``"control"`` (the evidence-only control; ``lengths`` empty). ``accuracy`` is case-weighted over
    ``n_cases`` cases with ``runs`` scored runs; ``lower``/``upper`` its Wilson interval clustered by
    case (``design_effect``); ``not_sent``: short runs left out (never sent); ``per_length``: (length,
    accuracy, cases) at each short length, for the reader."""

    arm: str
    source: str
    lengths: tuple[int, ...]
    n_cases: int
    runs: int
    not_sent: int
    accuracy: float
    lower: float
    upper: float
    design_effect: float
    per_length: tuple[tuple[int, float, int], ...]


@dataclass(frozen=True)
class AboveBase(JsonRow):
    """A grid length at which an arm's accuracy (every depth pooled, case-weighted: the base's own mix of
    depths) exceeds the arm's base score by more than the base's interval (``accuracy > base_upper``):
    the base under-states what the arm does there, so a threshold taken from it is too lenient
    (NoLiMa's rule assumes accuracy falls with length)."""

    arm: str
    length: int
    n_cases: int
    accuracy: float
    base: float
    base_upper: float


def _not_sent(base_records: pl.DataFrame) -> pl.Expr:
    if "attempts" not in base_records.columns:
        return pl.lit(False)
    return (pl.col("outcome") == "system_fail") & (pl.col("attempts").fill_null(0) == 0)


def short_base(
    base_records: pl.DataFrame, *, alpha: float = 0.05
) -> tuple[dict[str, BaseScore], dict[str, dict[str, float]]]:
    """Per arm, the base score from the scored records at the short lengths, and each case's rate
    (``{arm: {case_id: rate}}``, for the bootstrap). Arms with no sent short run are left out."""
    mask = base_records.select(_not_sent(base_records).alias("x"))["x"]
    sent = base_records.filter(~mask)
    skipped = base_records.filter(mask)
    runs = runs_frame(sent, what="scored records at the base lengths")
    scores: dict[str, BaseScore] = {}
    rates_by_arm: dict[str, dict[str, float]] = {}
    lengths = tuple(sorted(int(x) for x in base_records["length"].unique().to_list()))
    for arm in ARMS:
        own = runs.filter((pl.col("arm") == arm) & pl.col("y").is_not_null())
        if own.height == 0:
            continue
        per_case = own.group_by("case_id").agg(pl.len().alias("valid"), pl.col("y").mean().alias("rate"))
        per_case = per_case.sort("case_id")
        rates = per_case["rate"].to_numpy().astype(np.float64)
        runs_per_case = float(per_case["valid"].mean())  # type: ignore[arg-type]
        lo, hi, deff = wilson_design_interval(rates, runs_per_case, alpha)
        per_length = []
        for length in lengths:
            # one rate per case at this length (its depths and seeds pooled), then the mean over cases
            # sorted by case: the same float sum in every process (group_by's order is not fixed)
            at = (
                own.filter(pl.col("length") == length)
                .group_by("case_id")
                .agg(pl.col("y").mean())
                .sort("case_id")
            )
            if at.height:
                per_length.append((length, float(at["y"].mean()), at.height))  # type: ignore[arg-type]
        scores[arm] = BaseScore(
            arm=arm,
            source="short",
            lengths=lengths,
            n_cases=per_case.height,
            runs=own.height,
            not_sent=skipped.filter(pl.col("arm") == arm).height,
            accuracy=float(rates.mean()),
            lower=lo,
            upper=hi,
            design_effect=deff,
            per_length=tuple(per_length),
        )
        rates_by_arm[arm] = dict(zip(per_case["case_id"].to_list(), rates.tolist(), strict=True))
    return scores, rates_by_arm


def control_base(
    scored_controls: pl.DataFrame, rates: Mapping[tuple[str, str], float], by_arm: bool, *, alpha: float
) -> dict[str, BaseScore]:
    """The evidence-only control as a base score (``base_score = "control"``), with the same clustered
    Wilson interval: per arm each case's pass rate over its usable seeds, the mean over cases."""
    if "control" not in scored_controls.columns:
        raise InputError("scored controls lack 'control'", field="control", fix="pass score_controls' output")
    only = scored_controls.filter(
        (pl.col("control") == "evidence_only") & pl.col("outcome").is_in(list(USABLE_CONTROL))
    )
    out: dict[str, BaseScore] = {}
    for arm in ARMS:
        key = arm if by_arm else ""
        vals = np.array([v for (a, _), v in sorted(rates.items()) if a == key], dtype=np.float64)
        if vals.size == 0:
            continue
        own = only.filter(pl.col("arm") == arm) if by_arm else only
        runs_per_case = own.height / vals.size if own.height else 1.0
        lo, hi, deff = wilson_design_interval(vals, runs_per_case, alpha)
        out[arm] = BaseScore(
            arm=arm,
            source="control",
            lengths=(),
            n_cases=int(vals.size),
            runs=own.height,
            not_sent=0,
            accuracy=float(vals.mean()),
            lower=lo,
            upper=hi,
            design_effect=deff,
            per_length=(),
        )
    return out


def above_base(
    points: list[tuple[str, int, int, float]], bases: Mapping[str, BaseScore]
) -> tuple[AboveBase, ...]:
    """The (arm, length, cases, pooled accuracy) points whose accuracy exceeds the arm's base score's
    upper bound."""
    out = []
    for arm, length, n_cases, accuracy in points:
        base = bases.get(arm)
        if base is not None and accuracy > base.upper + TOL:
            out.append(AboveBase(arm, length, n_cases, accuracy, base.accuracy, base.upper))
    return tuple(out)
