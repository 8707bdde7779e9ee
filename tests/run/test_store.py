"""The run path's layout store (issue #12 item 1): ids and text on disk, one layout read at a time,
identical to the layouts file; the runner sends from it when job rows carry no ids."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl

from depthgate.layout.layouts import BuildOptions, build_layouts, load_tokenizer, parse_positions
from depthgate.run.store import LayoutStore, iter_layout_batches, write_layout_store
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir


def test_store_round_trips_every_layout_in_bounded_batches(tmp_path: Path) -> None:
    path = tmp_path / "layouts.parquet"
    options = BuildOptions(lengths=[256, 512], positions=parse_positions(["0", "0.5", "1"]))
    build_layouts(
        builtin_suite(6), load_tokenizer(tokenizers_dir() / "gpt2" / "tokenizer.json"), options, path
    )
    frame = pl.read_parquet(path)
    batches = list(iter_layout_batches(path, batch_rows=7))
    assert [b.height for b in batches[:-1]] == [7] * (len(batches) - 1)
    assert pl.concat(batches).equals(frame)
    store = write_layout_store(path, tmp_path / "store")
    reopened = LayoutStore(tmp_path / "store")
    assert len(reopened) == frame.height
    for row in frame.iter_rows(named=True):
        ids = reopened.ids(row["layout_id"])
        assert ids.dtype == np.uint32 and ids.tolist() == list(row["token_ids"])
        assert store.text(row["layout_id"]) == row["text"]
