"""Records on disk: the record schema, immutable parquet shards written atomically (temp file, fsync,
``os.replace``, directory fsync), reading them back deduplicated, and :func:`compact`, which merges them
into ``records.parquet``. A shard is either wholly there or absent, so a run killed at any instant
resumes with nothing lost and nothing duplicated."""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import polars as pl

from depthgate.exceptions import InfraError, InputError
from depthgate.run.lock import DirLock
from depthgate.spec.files import atomic_write, named_failure

RECORDS_DIR = "records"
RECORDS_FILE = "records.parquet"

RECORD_KEY = ("arm", "layout_id", "seed")
FINAL_STATUSES = ("ok", "system_fail")
_STATUS_RANK = {"ok": 0, "system_fail": 1, "infra_error": 2}
SHARD_NAME = re.compile(r"^part-(\d+)-[0-9a-f]{32}\.parquet$")

RECORD_SCHEMA: dict[str, pl.DataType] = {
    "run_id": pl.String(),
    "manifest_digest": pl.String(),
    "arm": pl.String(),
    "system": pl.String(),
    "endpoint": pl.String(),
    "layout_id": pl.String(),
    "case_id": pl.String(),
    "target_tokens": pl.Int64(),
    "position": pl.String(),
    "seed": pl.Int64(),
    "status": pl.String(),
    "system_fail_reason": pl.String(),
    "output_text": pl.String(),
    "finish_reason": pl.String(),
    "prompt_tokens_local": pl.Int64(),
    "prompt_tokens_server": pl.Int64(),
    "prompt_tokens_expected": pl.Int64(),
    "prompt_tokens_delta": pl.Int64(),
    "completion_tokens": pl.Int64(),
    "latency_s": pl.Float64(),
    "attempts": pl.Int64(),
    "prefix_cache_hit_tokens": pl.Int64(),
    "system_fingerprint": pl.String(),
    "completed_at": pl.Datetime("us", "UTC"),
    "error": pl.String(),
    # Endpoints where an attempt of this job failed transiently before this record, space-separated, in
    # order (a job moved off a dead replica names it here; its `endpoint` is the one that answered).
    "failed_endpoints": pl.String(),
    # The endpoints that failed this job in earlier calls into the folder (a killed or INFRA-stopped
    # run), carried over by the resume that answered it (issue #37): counted apart from this call's.
    "earlier_failed_endpoints": pl.String(),
}


def records_dir(out_dir: Path) -> Path:
    return out_dir / RECORDS_DIR


def shard_paths(out_dir: Path) -> list[Path]:
    folder = records_dir(out_dir)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if SHARD_NAME.match(p.name))


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not supported on every platform / filesystem
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _write_durably(frame: pl.DataFrame, target: Path) -> None:
    """A record file whole or not at all, on disk (file and folder fsynced) before it is counted."""
    atomic_write(target, frame.write_parquet, fsync=True)
    _fsync_dir(target.parent)


def _frame(rows: Sequence[Mapping[str, Any]]) -> pl.DataFrame:
    # Column by column: polars builds each typed column from one list (row orientation converted every
    # value through a row buffer first).
    return pl.DataFrame({col: [row.get(col) for row in rows] for col in RECORD_SCHEMA}, schema=RECORD_SCHEMA)


def _read_one(path: Path) -> pl.DataFrame:
    with named_failure(
        InfraError,
        "cannot read a record file",
        file=path,
        fix="move the file aside if it is not a depthgate record shard, then resume",
    ):
        frame = pl.read_parquet(path)
        # A column of another type (seed as text) fails in the cast: named like an unreadable file.
        return frame.select(
            [
                pl.col(c).cast(t) if c in frame.columns else pl.lit(None, dtype=t).alias(c)
                for c, t in RECORD_SCHEMA.items()
            ]
        )


def _dedup(frame: pl.DataFrame) -> pl.DataFrame:
    """One record per (arm, layout_id, seed): ok over system_fail over infra_error, then the earliest."""
    rank = pl.col("status").replace_strict(_STATUS_RANK, default=3, return_dtype=pl.Int64())
    return (
        frame.with_columns(rank.alias("__rank"))
        .sort(["__rank", "completed_at"], nulls_last=True)
        .unique(subset=list(RECORD_KEY), keep="first", maintain_order=True)
        .drop("__rank")
        .sort(list(RECORD_KEY))
    )


def read_records(out_dir: str | os.PathLike[str], *, dedup: bool = True) -> pl.DataFrame:
    """Every record in ``out_dir`` (``records.parquet`` plus shards not yet compacted). ``dedup``: one
    record per (arm, layout_id, seed), the final one preferred (see :func:`compact`)."""
    out = Path(out_dir)
    paths = ([out / RECORDS_FILE] if (out / RECORDS_FILE).is_file() else []) + shard_paths(out)
    if not paths:
        return _frame([])
    frame = pl.concat([_read_one(p) for p in paths], how="vertical")
    return _dedup(frame) if dedup else frame


def compact(out_dir: str | os.PathLike[str]) -> Path:
    """Merge the record shards (and an earlier ``records.parquet``) into ``records.parquet``, one record
    per (arm, layout_id, seed) — ``ok`` kept over ``system_fail`` over ``infra_error`` — then remove the
    merged shards. Atomic: readers see the old or the new file, and a crash between the replace and the
    removal only leaves shards that the next read deduplicates away."""
    out = Path(out_dir)
    if not out.is_dir():
        raise InputError("run folder not found", file=str(out), fix="give the folder a run wrote to")
    with DirLock(out):
        shards = shard_paths(out)
        merged = read_records(out, dedup=True)
        target = out / RECORDS_FILE
        _write_durably(merged, target)
        for shard in shards:
            with contextlib.suppress(FileNotFoundError):
                shard.unlink()
        _fsync_dir(records_dir(out))
    return target


class ShardWriter:
    """Buffers finished records and writes them as new, immutable parquet shards."""

    def __init__(self, folder: Path, next_seq: int, batch_size: int) -> None:
        self.folder = folder
        self.seq = next_seq
        self.batch_size = batch_size
        self.buffer: list[dict[str, Any]] = []
        self.shards_written = 0

    def add(self, record: dict[str, Any]) -> None:
        self.buffer.append(record)
        if len(self.buffer) >= self.batch_size:
            self.flush()

    def flush(self) -> None:
        # Called from the event loop thread only, with no await inside: one flush at a time.
        if not self.buffer:
            return
        rows, self.buffer = self.buffer, []
        target = self.folder / f"part-{self.seq:06d}-{uuid.uuid4().hex}.parquet"
        try:
            _write_durably(_frame(rows), target)
        except OSError as exc:
            self.buffer = rows + self.buffer
            raise InfraError(
                f"cannot write records ({exc})", file=str(target), fix="check free disk space and permissions"
            ) from exc
        self.seq += 1
        self.shards_written += 1
