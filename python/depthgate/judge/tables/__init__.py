"""The frames the judge reads and writes: the run-record schema, the two arms, the run score, the
checks and pairing of the records and the order of positions (``records``), and typed rows and columns
of a polars frame (``frames``). Imports nothing else of the judge.
"""

from __future__ import annotations

from depthgate.judge.tables.frames import (
    FiniteRow,
    FrameOf,
    JsonRow,
    clean_value,
    finite_fields,
    require_columns,
)
from depthgate.judge.tables.records import (
    ARMS,
    BASELINE,
    CANDIDATE,
    OUTCOMES,
    RECORD_SCHEMA,
    RUN_SCORE,
    checked_runs,
    pair_runs,
    position_sort_key,
    prepare_records,
)

__all__ = [
    "ARMS",
    "BASELINE",
    "CANDIDATE",
    "OUTCOMES",
    "RECORD_SCHEMA",
    "RUN_SCORE",
    "FiniteRow",
    "FrameOf",
    "JsonRow",
    "checked_runs",
    "clean_value",
    "finite_fields",
    "pair_runs",
    "position_sort_key",
    "prepare_records",
    "require_columns",
]
