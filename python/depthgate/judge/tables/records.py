"""The gate's input: the record schema, the run score and the checks and pairing of the records,
and the order of positions. Split out of the gate (issue #23: one job per module)."""

from __future__ import annotations

from collections.abc import Mapping

import polars as pl

from depthgate.exceptions import InputError
from depthgate.spec.positions import PositionLabel

__all__ = [
    "ARMS",
    "BASELINE",
    "CANDIDATE",
    "CELL_KEY",
    "OUTCOMES",
    "RECORD_SCHEMA",
    "RUN_KEY",
    "RUN_SCORE",
    "checked_runs",
    "pair_runs",
    "position_sort_key",
    "prepare_records",
]

BASELINE = "baseline"
CANDIDATE = "candidate"
ARMS = (BASELINE, CANDIDATE)
OUTCOMES = ("pass", "fail", "system_fail", "missing")


RECORD_SCHEMA: dict[str, pl.DataType] = {
    "arm": pl.String(),
    "case_id": pl.String(),
    "length": pl.Int64(),
    "position": pl.String(),
    "seed": pl.Int64(),
    "outcome": pl.String(),
    "safety": pl.Boolean(),
}
CELL_KEY = ["case_id", "length", "position"]
RUN_KEY = [*CELL_KEY, "seed"]


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
    dup = df.select(["arm", *RUN_KEY]).is_duplicated()
    if dup.any():
        raise InputError(
            f"duplicate run {df.filter(dup).row(0, named=True)} in {what}", field="seed", fix=duplicate_fix
        )
    return df


def prepare_records(records: pl.DataFrame) -> pl.DataFrame:
    return checked_runs(
        records,
        RECORD_SCHEMA,
        what="records",
        missing_fix=f"provide columns {list(RECORD_SCHEMA)}",
        types_fix="arm/case_id/position/outcome strings, length/seed integers, safety boolean",
        duplicate_fix="one row per (arm, case_id, length, position, seed); do not merge runs twice",
    )


def pair_runs(df: pl.DataFrame) -> pl.DataFrame:
    """One row per (case, length, position, seed) with yb/yc (1 pass, 0 fail or system_fail, null
    missing) and has_b/has_c (the arm has a row for that seed at all)."""
    sides = []
    for arm, suffix in ((BASELINE, "b"), (CANDIDATE, "c")):
        sides.append(
            df.filter(pl.col("arm") == arm).select(
                *RUN_KEY, RUN_SCORE.alias(f"y{suffix}"), pl.lit(True).alias(f"has_{suffix}")
            )
        )
    paired = sides[0].join(sides[1], on=RUN_KEY, how="full", coalesce=True)
    return paired.with_columns(
        pl.col("has_b").fill_null(False),
        pl.col("has_c").fill_null(False),
        (pl.col("yb").is_not_null() & pl.col("yc").is_not_null()).alias("valid"),
    ).sort(RUN_KEY)


def position_sort_key(position: str) -> tuple[int, float, str]:
    """Order positions: relative depths ("0.25") first, then absolute token offsets ("@1200"), then
    conversation turns ("@turn:3", by K); positions with an evidence spacing ("0.5~far") after the
    adjacent ones, grouped by spacing (near, far, gaps) — :meth:`PositionLabel.sort_key`."""
    return PositionLabel.parse(position).sort_key()
