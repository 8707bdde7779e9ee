"""Checks on the frames handed to the judging and reporting steps."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import polars as pl

from depthgate.exceptions import InputError

__all__ = ["clean_value", "dataclass_frame", "dataclass_row", "require_columns"]


def require_columns(frame: pl.DataFrame, columns: Iterable[str], *, what: str, fix: str) -> None:
    """Raise :class:`InputError` naming every one of ``columns`` that ``frame`` (``what``, e.g. "records")
    lacks, with ``fix``; return quietly when it has them all."""
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise InputError(f"{what} lack column(s) {missing}", field=", ".join(missing), fix=fix)


def clean_value(value: Any) -> Any:
    """A JSON-ready copy: enums by value, non-finite floats as None, numpy scalars as Python numbers,
    tuples as lists, mapping keys as strings."""
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (np.floating, np.integer)):
        return clean_value(value.item())
    if isinstance(value, Mapping):
        return {str(k): clean_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean_value(v) for v in value]
    return value


def dataclass_row(obj: Any) -> dict[str, Any]:
    """One dataclass instance as a JSON-ready dict (field order kept)."""
    return {f.name: clean_value(getattr(obj, f.name)) for f in dataclasses.fields(obj)}


def dataclass_frame(rows: Sequence[Any], cls: type[Any]) -> pl.DataFrame:
    """Dataclass rows as a frame; an empty frame still has ``cls``'s columns."""
    if not rows:
        return pl.DataFrame({f.name: [] for f in dataclasses.fields(cls)})
    return pl.DataFrame([dataclass_row(r) for r in rows], infer_schema_length=None)
