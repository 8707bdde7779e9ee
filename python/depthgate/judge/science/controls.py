"""Scoring the controls and classifying each case's failures.

The evidence-only control tells "the model cannot do this task" from a position loss; the
evidence-absent control tells a model that reads from the prompt from one that invents a value.
"""

from __future__ import annotations

from typing import Any

import polars as pl

from depthgate.exceptions import InputError
from depthgate.judge.scoring import CaseOracle, score_records
from depthgate.spec.cases import Suite

__all__ = ["CATEGORIES", "classify_failures", "score_controls"]

#: Categories of :func:`classify_failures`, in the order they are decided.
CATEGORIES: tuple[str, ...] = (
    "task_or_model",
    "hallucination",
    "position_or_assembly",
    "ok",
    "serving_path",
    "unknown",
)


def score_controls(records: pl.DataFrame, suite: Suite, controls: pl.DataFrame) -> pl.DataFrame:
    """Score control records with the oracle and add ``control``, ``answered_value``, ``hallucinated`` and
    ``hallucination`` ("removed_value": the removed evidence's value; "unsupported_value": a value no
    document left in the prompt supports; null otherwise). Only evidence-absent records can hallucinate."""
    scored = score_records(records, suite, controls)
    kinds = dict(controls.select("layout_id", "control").iter_rows())
    present = {
        r["layout_id"]: {s["evidence_id"] for s in r["evidence_spans"] or [] if s["kind"] == "evidence"}
        for r in controls.select("layout_id", "evidence_spans").iter_rows(named=True)
    }
    cases = {c.id: c for c in suite.cases}
    oracles: dict[str, CaseOracle] = {}
    answered: list[bool] = []
    kind_col: list[str | None] = []
    halluc: list[str | None] = []
    for row in scored.select("layout_id", "case_id", "status", "output_text").iter_rows(named=True):
        control = kinds.get(row["layout_id"])
        kind_col.append(control)
        if row["status"] != "ok":
            answered.append(False)
            halluc.append(None)
            continue
        case = cases[row["case_id"]]
        oracle = oracles.setdefault(case.id, CaseOracle(case))
        docs = present.get(row["layout_id"], set())
        score = oracle.score(row["output_text"] or "", evidence_ids_in_layout=docs)
        value = score.answer is not None and not score.abstained
        answered.append(value)
        if control != "evidence_absent" or not value:
            halluc.append(None)
            continue
        supported = {claim for doc in case.evidence if doc.id in docs for claim in doc.supports}
        # Some required claim answered: the removed evidence's value (all of it, or one of a conflict
        # case's two sources: its other claim is then "missing", yet the value is a removed one).
        if score.outcome == "pass" or len(score.missing_claims) < len(case.required_claims):
            halluc.append("removed_value")
        elif score.forbidden_hits and set(score.forbidden_hits) <= supported:
            halluc.append(None)  # read a document that is still in the prompt
        else:
            halluc.append("unsupported_value")
    return scored.with_columns(
        pl.Series("control", kind_col, dtype=pl.String),
        pl.Series("answered_value", answered, dtype=pl.Boolean),
        pl.Series("hallucination", halluc, dtype=pl.String),
        pl.Series("hallucinated", [h is not None for h in halluc], dtype=pl.Boolean),
    )


def _category(
    only_rate: float | None,
    halluc_rate: float | None,
    runs: int,
    fails: int,
    lost_only: str | None,
    lost_absent: str | None,
) -> tuple[str, str]:
    """(category, detail) of one case, decided in the order of :func:`classify_failures`; ``lost_*``:
    why that control was lost to the serving path (None: it was not)."""
    if only_rate is None and (why := lost_only):
        return "serving_path", f"evidence-only control lost to the serving path ({why})"
    elif only_rate is None:
        return "unknown", "no usable evidence-only control record"
    elif only_rate < 0.5:
        return "task_or_model", f"evidence-only control passes {only_rate:.0%} of seeds"
    elif halluc_rate is not None and halluc_rate > 0.5:
        return (
            "hallucination",
            "the evidence-absent control answers a value no document supports",
        )
    elif fails:
        return "position_or_assembly", f"controls pass; {fails}/{runs} long variants fail"
    elif halluc_rate is None and (why := lost_absent):
        return "serving_path", f"evidence-absent control lost to the serving path ({why})"
    elif halluc_rate is None:
        return "unknown", "no usable evidence-absent control record"
    else:
        return "ok", f"controls pass; {runs} long variants pass"


def classify_failures(scored_matrix: pl.DataFrame, scored_controls: pl.DataFrame) -> pl.DataFrame:
    """One row per case (per arm when ``scored_matrix`` has an ``arm`` column; controls with an ``arm``
    column are matched by arm, otherwise they apply to every arm).

    Decided in order: ``task_or_model`` (the evidence-only control fails in most seeds: the model
    cannot do the task even without position), ``hallucination`` (the evidence-absent control answered
    a value no remaining document supports in most seeds), ``position_or_assembly`` (the controls
    pass but some long variant fails — a fail or a system failure), ``ok``; ``serving_path`` when a
    control needed for the decision was lost to the arm's serving path (every record of it a system
    failure: doubled BOS, clamping, overflow …, named in ``detail``); ``unknown`` when it has no record
    at all (missing).
    """
    for col in ("case_id", "outcome"):
        if col not in scored_matrix.columns:
            raise InputError(
                f"scored matrix lacks {col!r}", field=col, fix="pass the output of score_records"
            )
    for col in ("case_id", "outcome", "control", "hallucinated"):
        if col not in scored_controls.columns:
            raise InputError(
                f"scored controls lack {col!r}", field=col, fix="pass the output of score_controls"
            )
    by_arm = "arm" in scored_matrix.columns
    controls_by_arm = by_arm and "arm" in scored_controls.columns
    keys = ["arm", "case_id"] if by_arm else ["case_id"]
    matrix = scored_matrix.filter(pl.col("outcome") != "missing")
    long = matrix.group_by(keys).agg(
        pl.len().alias("long_runs"),
        pl.col("outcome").is_in(["fail", "system_fail"]).sum().alias("long_fails"),
    )
    ctl_keys = ["arm", "case_id", "control"] if controls_by_arm else ["case_id", "control"]
    usable = scored_controls.filter(pl.col("outcome").is_in(["pass", "fail"]))
    agg = usable.group_by(ctl_keys).agg(
        pl.col("outcome").eq("pass").mean().alias("pass_rate"),
        pl.col("hallucinated").mean().alias("halluc_rate"),
        pl.len().alias("n"),
    )
    only = {
        tuple(r[:-1]): r[-1]
        for r in agg.filter(pl.col("control") == "evidence_only")
        .select([*ctl_keys[:-1], "pass_rate"])
        .iter_rows()
    }
    absent = {
        tuple(r[:-1]): r[-1]
        for r in agg.filter(pl.col("control") == "evidence_absent")
        .select([*ctl_keys[:-1], "halluc_rate"])
        .iter_rows()
    }
    lost = _lost_controls(scored_controls, ctl_keys)
    control_cases = {str(r[0]) for r in scored_controls.select("case_id").unique().iter_rows()}
    wanted: set[tuple[Any, ...]] = {tuple(r) for r in long.select(keys).iter_rows()}
    if controls_by_arm:
        wanted |= {tuple(r) for r in scored_controls.select(keys).unique().iter_rows()}
    elif by_arm:
        wanted |= {(arm, case) for arm in matrix["arm"].unique().to_list() for case in control_cases}
    else:
        wanted |= {(case,) for case in control_cases}
    cases = sorted(wanted, key=lambda k: tuple(str(v) for v in k))
    long_index = {
        tuple(r[:-2]): (r[-2], r[-1]) for r in long.select([*keys, "long_runs", "long_fails"]).iter_rows()
    }
    out: list[dict[str, Any]] = []
    for key in cases:
        ctl_key = key if controls_by_arm or not by_arm else key[1:]
        only_rate = only.get(ctl_key)
        halluc_rate = absent.get(ctl_key)
        runs, fails = long_index.get(key, (0, 0))
        category, detail = _category(
            only_rate,
            halluc_rate,
            runs,
            fails,
            lost.get((*ctl_key, "evidence_only")),
            lost.get((*ctl_key, "evidence_absent")),
        )
        row: dict[str, Any] = dict(zip(keys, key, strict=True))
        row.update(
            {
                "category": category,
                "evidence_only_pass_rate": only_rate,
                "evidence_absent_hallucination_rate": halluc_rate,
                "long_runs": runs,
                "long_fails": fails,
                "detail": detail,
            }
        )
        out.append(row)
    schema: dict[str, Any] = {k: pl.String for k in keys}
    schema.update(
        {
            "category": pl.String,
            "evidence_only_pass_rate": pl.Float64,
            "evidence_absent_hallucination_rate": pl.Float64,
            "long_runs": pl.Int64,
            "long_fails": pl.Int64,
            "detail": pl.String,
        }
    )
    return pl.DataFrame(out, schema=schema, orient="row") if out else pl.DataFrame(schema=schema)


def _lost_controls(scored_controls: pl.DataFrame, keys: list[str]) -> dict[tuple[Any, ...], str]:
    """Per control key (``keys``, ending with ``control``): "reason n, …" of its system-failed records."""
    if "system_fail_reason" not in scored_controls.columns:
        return {}
    failed = scored_controls.filter(pl.col("outcome") == "system_fail")
    out: dict[tuple[Any, ...], list[str]] = {}
    rows = failed.group_by([*keys, "system_fail_reason"]).len().sort([*keys, "system_fail_reason"])
    for row in rows.iter_rows():
        out.setdefault(tuple(row[: len(keys)]), []).append(f"{row[len(keys)] or 'system_fail'} {row[-1]}")
    return {k: ", ".join(v) for k, v in out.items()}
