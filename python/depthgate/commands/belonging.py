"""Records that do not belong to their run folder are refused (issue #21, item 3).

A run folder is one manifest (its ``run_id`` and ``manifest_digest``), two arms and each arm's
layouts. A record copied in from another run, or one for a layout the folder never built, or under an
arm that is neither ``baseline`` nor ``candidate``, would be scored as if it were this run's data:
``gate`` and ``report`` would rewrite the reports over it and ``merge`` would join it. Each is refused
by name (the file, the field, the first offending values and how many), exit 20.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import polars as pl

from depthgate.exceptions import InputError

__all__ = ["check_records_belong"]


def _listed(values: Iterable[object], *, first: int = 3) -> str:
    values = sorted({str(v) for v in values})
    shown = ", ".join(values[:first])
    return shown if len(values) <= first else f"{shown} … ({len(values)} in all)"


def check_records_belong(
    records: pl.DataFrame,
    *,
    run_id: str,
    manifest_digest: str | None,
    layout_ids: Mapping[str, Iterable[str]],
    folder: Path,
    fix: str,
) -> None:
    """Refuse any record of ``records`` (read from ``folder``) whose ``run_id`` is not ``run_id``, whose
    ``manifest_digest`` is not ``manifest_digest`` (when given), whose ``arm`` is not a key of
    ``layout_ids`` or whose ``layout_id`` is not among that arm's layouts."""
    if records.height == 0:
        return

    def refuse(bad: pl.DataFrame, field: str, what: str) -> None:
        if bad.height:
            raise InputError(f"{bad.height} {what}", file=str(folder), field=field, fix=fix)

    foreign = records.filter(pl.col("run_id") != run_id)
    refuse(
        foreign,
        "run_id",
        f"record(s) belong to another run ({_listed(foreign['run_id'])}), not {run_id!r} of manifest.json",
    )
    if manifest_digest is not None and "manifest_digest" in records.columns:
        other = records.filter(pl.col("manifest_digest") != manifest_digest)
        refuse(
            other,
            "manifest_digest",
            f"record(s) were written under another manifest ({_listed(other['manifest_digest'])})",
        )
    arms = sorted(layout_ids)
    stray = records.filter(~pl.col("arm").is_in(arms))
    refuse(
        stray,
        "arm",
        f"record(s) under an arm this run does not have ({_listed(stray['arm'])}; the arms are "
        f"{', '.join(arms)})",
    )
    for arm, ids in layout_ids.items():
        known = sorted({str(i) for i in ids})
        unknown = records.filter((pl.col("arm") == arm) & ~pl.col("layout_id").is_in(known))
        refuse(
            unknown,
            "layout_id",
            f"{arm} record(s) for layouts this run never built ({_listed(unknown['layout_id'])}; not in "
            f"{arm}/layouts.parquet)",
        )
