"""Where built layouts go: one parquet file written with bounded memory (:class:`LayoutSink`), in row
groups of :data:`ROW_GROUP_ROWS` rows that the run path reads one at a time. Shared by the layout
builder (:mod:`depthgate.layout.layouts`) and the controls (:mod:`depthgate.run.controls`); both read
these names through the module, so a test can shrink them."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import polars as pl

# Built layouts held in memory before they are written out (see :class:`LayoutSink`): a build up to
# this size is written to parquet once, a larger one as row groups to the open file each time the
# budget fills. Memory stays bounded by this budget plus one chunk, whatever the size of the matrix
# (512 MB before issue #12, 128 MB before issue #21).
SINK_BUDGET_BYTES = 0

#: Rows per parquet row group of a layouts file. A reader decodes whole row groups, so the run path's
#: batched reads (:func:`depthgate.run.store.iter_layout_batches`, 64 rows) hold one row group at a
#: time: at 128K tokens ≈ 64 × 1 MB of ids and text. With polars' default (one row group of up to
#: 512² rows) reading the first 64 layouts of a 10,000-layout 128K file decoded all of it (≈ 10 GB).
ROW_GROUP_ROWS = 64


class LayoutSink:
    """Streams built chunks into one parquet file with bounded memory (issues #12, #21).

    Chunks are held in memory up to ``budget`` bytes; a build that fits is written to parquet once, by
    polars. Past the budget the held rows are written at once as row groups of ``row_group_rows``
    rows to the open file (pyarrow's ``ParquetWriter``: polars has no row-group writer), and the
    last ``< row_group_rows`` rows stay held for the next write, so every row group but the file's
    last is full. Memory is the budget plus one chunk, whatever the build's size: the former design
    spilled to Arrow IPC parts and merged them in one pass of polars' streaming sink, whose peak grew
    with the data (+0.64 GB for 350 layouts of 128K, docs/benchmarks.md, issue #21). ``parts``: the
    writes past the budget; ``schema``: the columns of an empty file; ``peak_held_bytes``: the most
    ever held at once (for tests).
    """

    def __init__(
        self,
        tmp_dir: Path,
        schema: Mapping[str, Any],
        budget: int | None = None,
        row_group_rows: int = ROW_GROUP_ROWS,
    ) -> None:
        self._tmp_dir = tmp_dir
        self._schema = dict(schema)
        self._budget = SINK_BUDGET_BYTES if budget is None else budget
        self._row_group_rows = row_group_rows
        self._held: list[pl.DataFrame] = []
        self._held_bytes: int = 0
        self._parts = 0
        self._writer: Any = None
        self._staged = tmp_dir / "sink.parquet"
        self.peak_held_bytes: int = 0

    @property
    def parts(self) -> int:
        return self._parts

    def add(self, frame: pl.DataFrame) -> None:
        self._held.append(frame)
        self._held_bytes += int(frame.estimated_size())
        self.peak_held_bytes = max(self.peak_held_bytes, self._held_bytes)
        if self._held_bytes > self._budget:
            self._spill()

    def _write(self, frame: pl.DataFrame) -> None:
        import pyarrow.parquet as pq

        table = frame.to_arrow()
        if self._writer is None:
            small = [name for name in frame.columns if name not in ("token_ids", "text")]
            # No dictionary or statistics for the ids and the text: a dictionary of 128K-token rows
            # is never smaller, and building it was most of a write's memory.
            self._writer = pq.ParquetWriter(
                self._staged, table.schema, compression="zstd", use_dictionary=small, write_statistics=small
            )
        self._writer.write_table(table, row_group_size=self._row_group_rows)

    def _spill(self) -> None:
        frame = pl.concat(self._held, rechunk=False)
        full = frame.height - frame.height % self._row_group_rows
        if full:
            self._write(frame.slice(0, full))
        # The rest (< one row group) waits for the next chunk: every row group but the last is full,
        # so the run path's batches of ROW_GROUP_ROWS rows read one row group each.
        rest = frame.slice(full)
        self._held = [rest] if rest.height else []
        self._held_bytes = int(rest.estimated_size()) if rest.height else 0
        self._parts += 1

    def finish(self, path: Path) -> None:
        """Write everything added so far to the parquet file ``path``."""
        if self._writer is None:
            frames = self._held or [pl.DataFrame(schema=self._schema)]
            pl.concat(frames, rechunk=False).write_parquet(path, row_group_size=self._row_group_rows)
            self._held, self._held_bytes = [], 0
            return
        if self._held:
            self._write(pl.concat(self._held, rechunk=False))
            self._held, self._held_bytes = [], 0
        self._writer.close()
        self._writer = None
        os.replace(self._staged, path)
