"""The jobs a frozen run folder plans, for the commands that compare them with the records: the gate's
infra summary and a shard's lost jobs (:mod:`depthgate.commands.pipeline`), and ``merge``, which checks
that the shards it joins cover them (:mod:`depthgate.commands.merge`)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import polars as pl

from depthgate.commands.checks import ARMS
from depthgate.layout.layouts import read_layouts
from depthgate.run.jobs import shard_of

__all__ = ["planned_jobs", "shard_jobs"]


def planned_jobs(run: Path, seeds: Sequence[int]) -> pl.DataFrame:
    """Every (arm, layout, seed) job the frozen run plans: the arms' layouts × the seed set."""
    frames = [
        # Only the small columns: never every layout's ids and text (10 GB at 10,000 × 128K).
        read_layouts(
            run / arm / "layouts.parquet", columns=["layout_id", "case_id", "target_tokens", "position"]
        ).with_columns(pl.lit(arm).alias("arm"))
        for arm in ARMS
    ]
    layouts = pl.concat(frames).with_columns(pl.col("position").cast(pl.String))
    return layouts.join(
        pl.DataFrame({"seed": [int(s) for s in seeds]}, schema={"seed": pl.Int64}), how="cross"
    )


def shard_jobs(planned: pl.DataFrame, shard: tuple[int, int]) -> pl.DataFrame:
    """The planned jobs (arm, layout_id, seed, case_id, target_tokens, position) of shard ``(i, N)``."""
    index, count = shard
    keep = [
        shard_of((str(c), int(t), str(p), int(s)), count) == index - 1
        for c, t, p, s in planned.select("case_id", "target_tokens", "position", "seed").iter_rows()
    ]
    return planned.filter(pl.Series(keep, dtype=pl.Boolean))
