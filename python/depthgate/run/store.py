"""The run path's layout store: token ids and prompt text on disk, read one layout at a time.

The runner sends jobs in one seeded, interleaved order over the whole matrix, so any layout may be
needed next. Holding every layout of both arms as Python lists cost ≈ 59 bytes per token before the
first request (50 cases × 32K → 1.34 GB; the nightly would need ≈ 40 GB). Instead each arm's ids and
texts are written once, in bounded batches, to two flat files with an offsets index:

* ``ids.u32``: every layout's token ids, little-endian uint32, back to back;
* ``text.utf8``: every layout's prompt text, UTF-8, back to back;
* ``index.parquet``: ``layout_id`` → row, and the byte offsets of both.

:meth:`LayoutStore.ids` reads one layout's ids with one positioned read into a fresh numpy array (no
memory map: mapped pages would count toward the process's RSS as they are touched), so memory is the
index (≈ 100 bytes per layout) plus the layouts in flight, whatever the matrix size. The page cache
holds what the OS can spare.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import polars as pl

from depthgate.exceptions import InfraError
from depthgate.layout.sink import ROW_GROUP_ROWS
from depthgate.spec.files import atomic_write

__all__ = ["LayoutStore", "iter_layout_batches", "write_layout_store"]

IDS_FILE = "ids.u32"
TEXT_FILE = "text.utf8"
INDEX_FILE = "index.parquet"

#: Layouts per batch when streaming a layouts.parquet: at 128K tokens ≈ 64 × (0.5 MB ids + 0.5 MB text).
#: The same as the file's row group (``ROW_GROUP_ROWS``), so each batch decodes one row group.
BATCH_ROWS = ROW_GROUP_ROWS


def iter_layout_batches(path: str | os.PathLike[str], batch_rows: int = BATCH_ROWS) -> Iterator[pl.DataFrame]:
    """The rows of a layouts parquet file in order, ``batch_rows`` at a time (slice pushdown: only the
    row groups a batch needs are read)."""
    lazy = pl.scan_parquet(Path(path))
    total = int(lazy.select(pl.len()).collect().item())
    for start in range(0, total, batch_rows):
        yield lazy.slice(start, batch_rows).collect()


def write_layout_store(layouts: str | os.PathLike[str], folder: str | os.PathLike[str]) -> LayoutStore:
    """Write the store of one arm's ``layouts.parquet`` into ``folder`` (atomically: the index is
    written last and renamed into place, so a killed write leaves no store) and open it."""
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    index: list[pl.DataFrame] = []
    # Both flat files are written in one pass over the layouts, each through its own atomic write.
    atomic_write(
        out / IDS_FILE,
        lambda ids_tmp: atomic_write(
            out / TEXT_FILE, lambda text_tmp: index.append(_write_flat(layouts, ids_tmp, text_tmp))
        ),
    )
    atomic_write(out / INDEX_FILE, index[0].write_parquet)
    return LayoutStore(out)


def _write_flat(layouts: str | os.PathLike[str], ids_tmp: Path, text_tmp: Path) -> pl.DataFrame:
    """Write every layout's ids and text back to back into the two files; the offsets index."""
    layout_ids: list[str] = []
    id_offsets: list[int] = [0]
    text_offsets: list[int] = [0]
    with ids_tmp.open("wb") as ids_fh, text_tmp.open("wb") as text_fh:
        for batch in iter_layout_batches(layouts):
            # Column-wise: the batch's ids leave polars as one flat uint32 buffer. Row by row
            # (``iter_rows``) they became Python int lists first, ≈ 36 bytes per token (300 MB for
            # one batch of 64 layouts of 128K) before a byte was written.
            ids = batch["token_ids"]
            lengths = ids.list.len().fill_null(0).cast(pl.Int64).to_numpy()
            # Empty and null lists add nothing; a null id inside a list (a tampered row, refused by the
            # pre-send gate and never sent) is written as 0 so every later offset stays right.
            flat = ids.explode(empty_as_null=False, keep_nulls=False).cast(pl.UInt32, strict=False)
            ids_fh.write(np.ascontiguousarray(flat.fill_null(0).to_numpy(), dtype="<u4").tobytes())
            for n in lengths:
                id_offsets.append(id_offsets[-1] + 4 * int(n))
            for layout_id, text in batch.select("layout_id", "text").iter_rows():
                data = (text or "").encode("utf-8")
                text_fh.write(data)
                layout_ids.append(str(layout_id))
                text_offsets.append(text_offsets[-1] + len(data))
    return pl.DataFrame(
        {
            "layout_id": layout_ids,
            "ids_start": id_offsets[:-1],
            "ids_end": id_offsets[1:],
            "text_start": text_offsets[:-1],
            "text_end": text_offsets[1:],
        },
        schema={
            "layout_id": pl.String,
            "ids_start": pl.Int64,
            "ids_end": pl.Int64,
            "text_start": pl.Int64,
            "text_end": pl.Int64,
        },
    )


class LayoutStore:
    """Read-only access to one arm's layouts by ``layout_id`` (see the module docstring)."""

    def __init__(self, folder: str | os.PathLike[str]) -> None:
        self.folder = Path(folder)
        index_path = self.folder / INDEX_FILE
        if not index_path.is_file():
            raise InfraError(
                "the layout store has no index",
                file=str(self.folder),
                fix="remove the folder; the next run rebuilds it from layouts.parquet",
            )
        index = pl.read_parquet(index_path)
        self._row = {str(lid): i for i, lid in enumerate(index["layout_id"].to_list())}
        self._ids = index.select("ids_start", "ids_end").to_numpy()
        self._text = index.select("text_start", "text_end").to_numpy()
        self._ids_path = self.folder / IDS_FILE
        self._text_path = self.folder / TEXT_FILE

    def __len__(self) -> int:
        return len(self._row)

    def __contains__(self, layout_id: object) -> bool:
        return layout_id in self._row

    def _span(self, table: np.ndarray, layout_id: str) -> tuple[int, int]:
        try:
            row = self._row[layout_id]
        except KeyError:
            raise InfraError(
                f"layout {layout_id} is not in the store",
                file=str(self.folder),
                fix="remove the folder; the next run rebuilds it from layouts.parquet",
            ) from None
        return int(table[row, 0]), int(table[row, 1])

    def ids(self, layout_id: str) -> np.ndarray:
        """The layout's token ids (uint32), read with one positioned read."""
        start, end = self._span(self._ids, layout_id)
        with self._ids_path.open("rb") as fh:
            fh.seek(start)
            data = fh.read(end - start)
        return np.frombuffer(data, dtype="<u4").astype(np.uint32, copy=False)

    def text(self, layout_id: str) -> str:
        start, end = self._span(self._text, layout_id)
        with self._text_path.open("rb") as fh:
            fh.seek(start)
            return fh.read(end - start).decode("utf-8")
