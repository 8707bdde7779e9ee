"""Command-line value parsers and path resolution shared by every command.

A path written in a matrix is relative to the matrix file, never to the working directory: a nightly
job started from another folder must read the same files.
"""

from __future__ import annotations

import argparse
from pathlib import Path

__all__ = ["csv_ints", "csv_list", "resolve_relative"]


def csv_ints(value: str) -> list[int]:
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r}: expected comma-separated token counts, e.g. 1024,4096"
        ) from None


def csv_list(value: str) -> list[str]:
    return [v.strip() for v in value.split(",") if v.strip()]


def resolve_relative(value: str | Path, base_dir: Path | None) -> Path:
    """``value`` as a path; a relative one is taken relative to ``base_dir`` (the matrix's folder)."""
    path = Path(value)
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    return path
