"""`build` streams (issue #12): bounded parts in memory, bounded row groups on disk, and the run path
reads one row group at a time — the properties behind a flat peak RSS, checked without timing.

The row groups are read from the parquet footer itself (a small Thrift compact-protocol reader below:
polars does not expose row-group metadata and pyarrow is not a dependency)."""

from __future__ import annotations

import io
import struct
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import polars as pl
import pytest

from depthgate.exceptions import InputError
from depthgate.layout import layouts
from depthgate.layout import sink as layout_sink
from depthgate.layout.layouts import (
    BuildOptions,
    build_layouts,
    load_tokenizer,
    parse_positions,
    read_layouts,
)
from depthgate.layout.sink import ROW_GROUP_ROWS
from depthgate.run.store import LayoutStore, iter_layout_batches, write_layout_store
from depthgate.spec.suites import builtin_suite
from fixtures_paths import tokenizers_dir

# --------------------------------------------------------------------------------------------------
# parquet footer: FileMetaData.row_groups[*].num_rows (Thrift compact protocol)


def _varint(buf: io.BytesIO) -> int:
    shift = result = 0
    while True:
        byte = buf.read(1)[0]
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result
        shift += 7


def _zigzag(buf: io.BytesIO) -> int:
    n = _varint(buf)
    return (n >> 1) ^ -(n & 1)


def _value(buf: io.BytesIO, kind: int) -> Any:
    if kind in (1, 2):
        return kind == 1
    if kind == 3:
        return buf.read(1)[0]
    if kind in (4, 5, 6):
        return _zigzag(buf)
    if kind == 7:
        return struct.unpack("<d", buf.read(8))[0]
    if kind == 8:
        return buf.read(_varint(buf))
    if kind in (9, 10):
        head = buf.read(1)[0]
        size, elem = head >> 4, head & 0x0F
        if size == 15:
            size = _varint(buf)
        return [_value(buf, elem) for _ in range(size)]
    if kind == 11:
        size = _varint(buf)
        if size == 0:
            return {}
        types = buf.read(1)[0]
        return {_value(buf, types >> 4): _value(buf, types & 0x0F) for _ in range(size)}
    if kind == 12:
        return _struct(buf)
    raise ValueError(f"thrift type {kind}")


def _struct(buf: io.BytesIO) -> dict[int, Any]:
    fields: dict[int, Any] = {}
    last = 0
    while True:
        head = buf.read(1)[0]
        if head == 0:
            return fields
        delta, kind = head >> 4, head & 0x0F
        last = last + delta if delta else _zigzag(buf)
        fields[last] = _value(buf, kind)


def row_group_rows(path: Path) -> list[int]:
    data = path.read_bytes()
    assert data[-4:] == b"PAR1"
    size = struct.unpack("<i", data[-8:-4])[0]
    meta = _struct(io.BytesIO(data[-8 - size : -8]))
    assert sum(rg[3] for rg in meta[4]) == meta[3]  # the groups' rows add up to the file's
    return [int(rg[3]) for rg in meta[4]]


# --------------------------------------------------------------------------------------------------


def _tokenizer() -> layouts.Tokenizer:
    return load_tokenizer(tokenizers_dir() / "gpt2" / "tokenizer.json")


OPTIONS = BuildOptions(lengths=[256, 512], positions=parse_positions(["0", "0.5", "1"]), verification="fast")


class _CountingSink(layout_sink.LayoutSink):
    """The build's sink, remembered with the size of every chunk it was given."""

    made: ClassVar[list[_CountingSink]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.chunks: list[int] = []
        _CountingSink.made.append(self)

    def add(self, frame: pl.DataFrame) -> None:
        self.chunks.append(int(frame.estimated_size()))
        super().add(frame)


def test_build_spills_each_chunk_and_writes_bounded_row_groups(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    suite = builtin_suite(30)  # 4 chunks of ≤ 8 cases × 2 lengths × 3 depths
    whole = tmp_path / "whole.parquet"
    build_layouts(suite, _tokenizer(), OPTIONS, whole)  # held in memory, one write

    _CountingSink.made = []
    monkeypatch.setattr(layout_sink, "LayoutSink", _CountingSink)
    monkeypatch.setattr(layout_sink, "SINK_BUDGET_BYTES", 1)  # spill after every chunk
    monkeypatch.setattr(layout_sink, "ROW_GROUP_ROWS", 16)
    streamed = tmp_path / "streamed.parquet"
    build_layouts(suite, _tokenizer(), OPTIONS, streamed)

    (sink,) = _CountingSink.made
    assert len(sink.chunks) >= 4 and sink.parts == len(sink.chunks)
    # never more than one chunk in memory: the streaming property
    assert sink.peak_held_bytes == max(sink.chunks)
    assert sink.peak_held_bytes < sum(sink.chunks) / 2
    # the streamed file is the held one, row for row, every layout token-exact
    a, b = pl.read_parquet(whole), pl.read_parquet(streamed)
    assert a.height == len([c for c in suite.cases if c.decisive]) * 2 * 3
    assert a.equals(b)
    tok = _tokenizer()
    for ids, text in b.select("token_ids", "text").iter_rows():
        assert np.array_equal(tok.encode(text), np.asarray(ids, dtype=np.uint32))
    # bounded row groups on disk, in both paths, every one full but the last
    groups = row_group_rows(streamed)
    assert len(groups) == -(-b.height // 16) and max(groups) == 16
    groups = row_group_rows(whole)
    assert len(groups) == -(-a.height // ROW_GROUP_ROWS) and max(groups) <= ROW_GROUP_ROWS


def test_the_run_path_reads_one_row_group_per_batch(tmp_path: Path) -> None:
    path = tmp_path / "layouts.parquet"
    build_layouts(builtin_suite(30), _tokenizer(), OPTIONS, path)
    groups = row_group_rows(path)
    batches = [b.height for b in iter_layout_batches(path)]
    assert len(groups) > 1 and batches == groups  # batch i is row group i
    store = write_layout_store(path, tmp_path / "store")
    frame = pl.read_parquet(path)
    reopened = LayoutStore(tmp_path / "store")
    assert len(reopened) == len(store) == frame.height
    for layout_id, ids, text in frame.select("layout_id", "token_ids", "text").iter_rows():
        assert reopened.ids(layout_id).tolist() == list(ids)
        assert reopened.text(layout_id) == text


def test_read_layouts_reads_only_the_columns_asked_for(tmp_path: Path) -> None:
    path = tmp_path / "layouts.parquet"
    build_layouts(builtin_suite(3), _tokenizer(), OPTIONS, path)
    small = read_layouts(path, columns=["layout_id", "position"])
    assert small.columns == ["layout_id", "position"]
    assert small["layout_id"].to_list() == read_layouts(path)["layout_id"].to_list()
    with pytest.raises(InputError, match="missing columns \\['nope'\\]"):
        read_layouts(path, columns=["layout_id", "nope"])
    pl.read_parquet(path).drop("text").write_parquet(tmp_path / "bad.parquet")
    with pytest.raises(InputError, match="missing columns \\['text'\\]"):
        read_layouts(tmp_path / "bad.parquet", columns=["layout_id"])


def test_store_offsets_survive_empty_null_and_tampered_id_lists(tmp_path: Path) -> None:
    path = tmp_path / "layouts.parquet"
    build_layouts(builtin_suite(3), _tokenizer(), OPTIONS, path)
    frame = pl.read_parquet(path)
    ids = frame["token_ids"].to_list()
    ids[0], ids[1], ids[2] = [], None, [7, None, 9]  # refused rows the store still holds
    tampered = frame.with_columns(pl.Series("token_ids", ids, dtype=pl.List(pl.UInt32)))
    tampered.write_parquet(tmp_path / "tampered.parquet", row_group_size=5)
    store = write_layout_store(tmp_path / "tampered.parquet", tmp_path / "store")
    layout_ids = frame["layout_id"].to_list()
    assert store.ids(layout_ids[0]).tolist() == [] and store.ids(layout_ids[1]).tolist() == []
    assert store.ids(layout_ids[2]).tolist() == [7, 0, 9]
    for layout_id, row_ids in zip(layout_ids[3:], ids[3:], strict=True):
        assert store.ids(layout_id).tolist() == row_ids  # every later offset is right
