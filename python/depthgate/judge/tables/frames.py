"""Checks on the frames handed to the judging and reporting steps."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, overload

import numpy as np
import polars as pl

from depthgate.exceptions import InputError

__all__ = [
    "FiniteRow",
    "FrameOf",
    "JsonRow",
    "clean_value",
    "dataclass_frame",
    "dataclass_row",
    "finite_fields",
    "require_columns",
]


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


def finite_fields(obj: Any, *, skip: Iterable[str] = ()) -> dict[str, Any]:
    """A dataclass's fields (less ``skip``) as a dict, non-finite floats as None and every other value as
    it is: the power and noise tables' JSON rows (unlike :func:`dataclass_row`, tuples stay tuples)."""
    left_out = set(skip)
    return {
        f.name: None if isinstance(v := getattr(obj, f.name), float) and not math.isfinite(v) else v
        for f in dataclasses.fields(obj)
        if f.name not in left_out
    }


def dataclass_frame(rows: Sequence[Any], cls: type[Any]) -> pl.DataFrame:
    """Dataclass rows as a frame; an empty frame still has ``cls``'s columns."""
    if not rows:
        return pl.DataFrame({f.name: [] for f in dataclasses.fields(cls)})
    return pl.DataFrame([dataclass_row(r) for r in rows], infer_schema_length=None)


class JsonRow:
    """Base of the result dataclasses whose JSON form is their fields, cleaned (:func:`dataclass_row`):
    one ``to_dict`` instead of a copy of it in every row class."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: enums by value, non-finite floats as None, tuples as lists."""
        return dataclass_row(self)


class FiniteRow:
    """Base of the power and noise rows whose JSON form is their fields with non-finite floats as None
    (:func:`finite_fields`; tuples stay tuples, unlike :class:`JsonRow`)."""

    def to_dict(self) -> dict[str, Any]:
        """The fields, non-finite floats as None."""
        return finite_fields(self)


class FrameOf:
    """A read-only attribute of a result dataclass: its tuple of dataclass rows ``attr`` as a polars
    frame (:func:`dataclass_frame`, so an empty tuple still gives ``row_type``'s columns).

    ``slices = FrameOf("slice_results", SliceResult)`` in a class body stands for the four-line property
    the results repeated once per table. Unannotated, so ``dataclasses`` does not take it for a field.
    """

    def __init__(self, attr: str, row_type: type[Any], doc: str | None = None) -> None:
        self.attr = attr
        self.row_type = row_type
        self.__doc__ = doc or f"``{attr}`` as a polars frame (columns of {row_type.__name__})."

    @overload
    def __get__(self, obj: None, owner: type[Any] | None = None) -> FrameOf: ...

    @overload
    def __get__(self, obj: object, owner: type[Any] | None = None) -> pl.DataFrame: ...

    def __get__(self, obj: object | None, owner: type[Any] | None = None) -> FrameOf | pl.DataFrame:
        if obj is None:
            return self
        return dataclass_frame(getattr(obj, self.attr), self.row_type)
