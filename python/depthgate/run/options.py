"""How one call of the runner runs (:class:`RunOptions`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from depthgate.exceptions import InputError
from depthgate.run.retry import RetryPolicy
from depthgate.spec.system import DecodeParams


@dataclass(frozen=True)
class RunOptions:
    """How one call of :func:`run_pairs` runs.

    ``run_id``, ``manifest_digest``: written to every record; a folder holding another run or digest
    is refused. ``decode``: ``max_tokens``, ``temperature``, ``stop`` and the default seed set.
    ``seeds``: the seed set run on every layout of every arm (``None``: ``decode.seeds``).
    ``concurrency``: requests in flight at most (a backend may serialize further). ``progress``: a
    progress line on stderr (``None`` or ``True``: on; redrawn on a terminal, a line per 5 % or
    minute in a log). ``retry``: the one retry policy
    and circuit breaker (:class:`~depthgate.run.retry.RetryPolicy`). ``batch_size``, ``flush_seconds``:
    records are written as a shard every ``batch_size`` records or ``flush_seconds``, whichever comes
    first, and at the end. A crash loses (and the rerun re-sends) at most that much finished work: for
    slow requests ``flush_seconds`` bounds it; ``batch_size`` only matters for fast ones, where each
    shard's fixed cost (a polars frame, a parquet file, two fsyncs) was ≈ 70 % of the runner's own CPU
    per request with batches of 64 (docs/benchmarks-runner-gate.md). ``order``: the matrix's request
    order, ``"shuffled"`` or ``"haystack"`` (:func:`interleaved_order`).
    """

    run_id: str
    manifest_digest: str
    decode: DecodeParams
    concurrency: int = 4
    seeds: Sequence[int] | None = None
    progress: bool | None = True
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    batch_size: int = 512
    flush_seconds: float = 5.0
    shard: tuple[int, int] | None = None
    order: str = "shuffled"

    def __post_init__(self) -> None:
        if self.shard is not None and not 1 <= self.shard[0] <= self.shard[1]:
            raise InputError(
                f"shard {self.shard[0]}/{self.shard[1]} is not i/N with 1 <= i <= N",
                field="--shard",
                fix="e.g. --shard 1/3 … --shard 3/3",
            )
        if self.concurrency < 1 or self.batch_size < 1:
            raise InputError(
                "concurrency and batch_size must be ≥ 1",
                field="concurrency",
                fix="use positive integers",
            )
        if not self.run_id or not self.manifest_digest:
            raise InputError("run_id and manifest_digest must be non-empty", field="run_id", fix="pass both")
