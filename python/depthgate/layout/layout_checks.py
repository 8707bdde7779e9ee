"""Checks of built layouts without a server: the full re-encode of a layouts file
(:func:`check_layouts`: every layout's ids equal ``encode(text)`` and its evidence spans hold their
text). The pre-send checks against a system's contract are :func:`depthgate.layout.presend.guard_layouts`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from depthgate import _core
from depthgate.exceptions import InputError
from depthgate.layout.layouts import Tokenizer, read_layouts


@dataclass(frozen=True)
class CheckSummary:
    checked: int
    refused: int
    violations: list[dict[str, str]]

    @property
    def ok(self) -> bool:
        return not self.violations


_ROW_FIELDS = ("layout_id", "text", "token_ids", "evidence_spans", "add_special_tokens", "target_tokens")


def _column_fits(name: str, dtype: pl.DataType) -> bool:
    if name == "text":
        return dtype == pl.String
    if not isinstance(dtype, pl.List):
        return False
    inner = dtype.inner
    if name == "token_ids":
        return inner is not None and inner.is_integer()
    return isinstance(inner, (pl.Struct, pl.Null))  # evidence_spans


def _check_layout_columns(frame: pl.DataFrame, path: Path) -> None:
    """The columns ``check`` reads must have their layout types; anything else is not a layouts file."""
    expected = {
        "token_ids": "a list of token ids",
        "evidence_spans": "a list of span structs",
        "text": "a string",
    }
    for name, what in expected.items():
        if name in frame.columns and not _column_fits(name, frame.schema[name]):
            raise InputError(
                f"column {name} is {frame.schema[name]}, not {what}",
                file=str(path),
                field=name,
                fix="pass a layouts.parquet written by `depthgate build` (rebuild it)",
            )


def _row_problem(row: dict[str, Any]) -> tuple[str, str] | None:
    """Why one ok row cannot be re-verified at all (null fields, ids that are not u32), or None."""
    for name in _ROW_FIELDS:
        if row.get(name) is None:
            return "field_missing", f"{name} is null; the layout was tampered with or truncated: rebuild it"
    try:
        ids = np.asarray(row["token_ids"], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        return "ids_out_of_range", "token_ids hold a null or non-integer id: rebuild the layout"
    bad = ids[(ids < 0) | (ids > 0xFFFFFFFF)]
    if bad.size:
        return (
            "ids_out_of_range",
            f"token_ids hold {bad.size} id(s) outside 0..2^32-1 (first {int(bad[0])}): rebuild the layout",
        )
    return None


def check_layouts(path: str | Path, tokenizer: Tokenizer, *, batch_rows: int = 64) -> CheckSummary:
    """Re-verify every ok layout of a file from scratch (full re-encode): ids == encode(text), the
    length contract, spans on the final offsets, span hashes. The tokenizer digest must match too:
    a layout built under another tokenizer is stale by definition."""
    frame = read_layouts(path)
    _check_layout_columns(frame, Path(path))
    violations: list[dict[str, str]] = []
    ok = frame.filter(pl.col("status") == "ok")
    refused = frame.height - ok.height
    if "tokenizer_digest" in ok.columns:
        stale = ok.filter(pl.col("tokenizer_digest") != tokenizer.digest)
        for layout_id in stale["layout_id"].to_list():
            violations.append(
                {
                    "layout_id": layout_id,
                    "code": "stale_tokenizer",
                    "detail": "built under a different tokenizer (digest differs); rebuild",
                }
            )
    for start in range(0, ok.height, batch_rows):
        part = ok.slice(start, batch_rows)
        stored = []
        flat: list[np.ndarray[Any, np.dtype[np.uint32]]] = []
        for row in part.iter_rows(named=True):
            problem = _row_problem(row)
            if problem is not None:  # a tampered or truncated row: a violation, not a crash
                violations.append(
                    {"layout_id": str(row["layout_id"]), "code": problem[0], "detail": problem[1]}
                )
                continue
            spans = list(row["evidence_spans"])  # the core reads evidence_id as its unit id
            stored.append(
                {
                    "layout_id": row["layout_id"],
                    "text": row["text"],
                    "add_special_tokens": row["add_special_tokens"],
                    "target_tokens": row["target_tokens"],
                    "spans": spans,
                }
            )
            flat.append(np.asarray(row["token_ids"], dtype=np.uint32))
        lengths = np.array([0] + [len(x) for x in flat], dtype=np.uint64)
        ids = np.concatenate(flat) if flat else np.zeros(0, dtype=np.uint32)
        result = json.loads(
            _core.verify_layouts(tokenizer._core, json.dumps(stored), ids, np.cumsum(lengths))
        )
        for layout, found in zip(stored, result, strict=True):
            for v in found:
                violations.append(
                    {"layout_id": layout["layout_id"], "code": v["code"], "detail": v["detail"]}
                )
    return CheckSummary(checked=ok.height, refused=refused, violations=violations)
