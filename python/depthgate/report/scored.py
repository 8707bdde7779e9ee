"""The scored runs as the reports read them: the frame with its optional columns filled in, the oracle
counts per (slice, arm) and the runs with a problem (missing claims, wrong citations) per case."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import polars as pl

from depthgate.judge.tables import ARMS, CANDIDATE, position_sort_key, require_columns
from depthgate.report.formatting import reason_kind, slice_key
from depthgate.report.verdict import OracleCounts

_LIST_COLUMNS = ("missing_claims", "forbidden_hits", "wrong_citations", "field_mismatches")


def prepare_scored(scored: pl.DataFrame) -> pl.DataFrame:
    df = scored
    if "length" not in df.columns and "target_tokens" in df.columns:
        df = df.rename({"target_tokens": "length"})
    require_columns(
        df,
        ["arm", "case_id", "length", "position", "outcome"],
        what="scored records",
        fix="pass the frame returned by depthgate.judge.scoring.score_records",
    )
    extra: list[pl.Expr] = []
    if "seed" not in df.columns:
        extra.append(pl.lit(0, dtype=pl.Int64()).alias("seed"))
    if "safety" not in df.columns:
        extra.append(pl.lit(False).alias("safety"))
    if "abstained" not in df.columns:
        extra.append(pl.lit(False).alias("abstained"))
    for name in ("system_fail_reason", "score_reason"):
        if name not in df.columns:
            extra.append(pl.lit(None, dtype=pl.String()).alias(name))
    for name in _LIST_COLUMNS:
        if name not in df.columns:
            extra.append(pl.lit([], dtype=pl.List(pl.String())).alias(name))
    if extra:
        df = df.with_columns(extra)
    return df.with_columns(
        pl.col("length").cast(pl.Int64()),
        pl.col("position").cast(pl.String()),
        pl.col("safety").fill_null(False),
        pl.col("abstained").fill_null(False),
        *[pl.col(name).fill_null([]) for name in _LIST_COLUMNS],
    )


_COUNT_FIELDS = (
    "runs",
    "passed",
    "failed",
    "system_fail",
    "missing",
    "abstained",
    "safety_hits",
    "wrong_hits",
    "missing_claims",
    "wrong_citations",
)


def oracle_counts(scored: pl.DataFrame) -> list[OracleCounts]:
    """Per (slice, arm): runs by outcome, abstentions, safety hits, runs with missing claims or wrong
    citations, and system failures by reason kind."""
    df = prepare_scored(scored)
    keys = ["length", "position", "arm"]
    counts = df.group_by(keys).agg(
        pl.len().alias("runs"),
        (pl.col("outcome") == "pass").sum().alias("passed"),
        (pl.col("outcome") == "fail").sum().alias("failed"),
        (pl.col("outcome") == "system_fail").sum().alias("system_fail"),
        (pl.col("outcome") == "missing").sum().alias("missing"),
        pl.col("abstained").sum().alias("abstained"),
        pl.col("safety").sum().alias("safety_hits"),
        ((pl.col("forbidden_hits").list.len() > 0) & pl.col("safety").not_()).sum().alias("wrong_hits"),
        (pl.col("missing_claims").list.len() > 0).sum().alias("missing_claims"),
        (pl.col("wrong_citations").list.len() > 0).sum().alias("wrong_citations"),
    )
    reasons: dict[tuple[int, str, str], dict[str, int]] = {}
    failed = df.filter(pl.col("outcome") == "system_fail").select(*keys, "system_fail_reason")
    for length, position, arm, reason in failed.iter_rows():
        bucket = reasons.setdefault((length, position, arm), {})
        kind = reason_kind(reason)
        bucket[kind] = bucket.get(kind, 0) + 1
    rows: list[OracleCounts] = []
    for row in counts.iter_rows(named=True):
        if row["arm"] not in ARMS:
            continue
        key = (row["length"], row["position"], row["arm"])
        numbers = {k: int(row[k]) for k in _COUNT_FIELDS}
        rows.append(
            OracleCounts.model_validate(
                {
                    "slice": slice_key(row["length"], row["position"]),
                    "length": row["length"],
                    "position": row["position"],
                    "arm": row["arm"],
                    "system_fail_reasons": dict(sorted(reasons.get(key, {}).items())),
                    **numbers,
                }
            )
        )
    rows.sort(key=lambda r: (r.length, position_sort_key(r.position), ARMS.index(r.arm)))
    return rows


def problem_rows(
    df: pl.DataFrame, column: str, slice_order: Mapping[str, int], limit: int
) -> tuple[list[dict[str, Any]], int]:
    """Runs whose ``column`` list is non-empty, grouped per (arm, slice, case): candidate rows first,
    then slices in report order (failing first), then case id. Returns the first ``limit`` groups and
    the number of groups. Sorted and cut in polars before any row becomes a dict: at 10^6 runs there
    are ~20K groups and converting them all took 1.2 s of a 2 s report (docs/benchmarks-runner-gate.md).
    """
    groups = (
        df.filter(pl.col(column).list.len() > 0)
        .group_by(["arm", "length", "position", "case_id"])
        .agg(
            pl.col(column).explode().unique().sort().alias("ids"),
            pl.len().alias("runs"),
            pl.col("seed").sort().alias("seeds"),
            pl.col("score_reason").sort_by("seed").first().alias("reason"),
        )
    )
    pairs = groups.select("length", "position").unique()
    ranks = pairs.with_columns(
        pl.Series(
            "_rank",
            [
                slice_order.get(slice_key(length, position), len(slice_order))
                for length, position in pairs.iter_rows()
            ],
            dtype=pl.Int64,
        )
    )
    rows = (
        groups.join(ranks, on=["length", "position"], how="left")
        .sort(
            [(pl.col("arm") != CANDIDATE), "_rank", "case_id", "length", "position"],
            maintain_order=True,
        )
        .drop("_rank")
        .head(limit)
        .to_dicts()
    )
    for row in rows:
        row["slice"] = slice_key(row["length"], row["position"])
    return rows, groups.height
