"""Checks on the frames handed to the judging and reporting steps."""

from __future__ import annotations

from collections.abc import Iterable

import polars as pl

from depthgate.exceptions import InputError

__all__ = ["require_columns"]


def require_columns(frame: pl.DataFrame, columns: Iterable[str], *, what: str, fix: str) -> None:
    """Raise :class:`InputError` naming every one of ``columns`` that ``frame`` (``what``, e.g. "records")
    lacks, with ``fix``; return quietly when it has them all."""
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise InputError(f"{what} lack column(s) {missing}", field=", ".join(missing), fix=fix)
