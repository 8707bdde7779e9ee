"""The records side of one call of either engine (asyncio in :mod:`depthgate.run.runner`, Ray in
:mod:`depthgate.run.ray_engine`): the locked run folder, the jobs without a final record, the shard
writer, the counts and the progress line, and the :class:`RunSummary` the call returns."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import polars as pl

from depthgate.exceptions import PlanChangedError
from depthgate.run.jobs import Job
from depthgate.run.lock import DirLock
from depthgate.run.options import RunOptions
from depthgate.run.progress import Progress
from depthgate.run.records import (
    FINAL_STATUSES,
    RECORD_KEY,
    SHARD_NAME,
    ShardWriter,
    read_records,
    records_dir,
    shard_paths,
)


@dataclass(frozen=True)
class RunSummary:
    """What one call of :func:`run_pairs` did. ``already_done``: jobs skipped because a final record
    existed; ``ok``/``system_fail``/``infra_error``: records written by this call."""

    run_id: str
    out_dir: Path
    total: int
    already_done: int
    ok: int
    system_fail: int
    infra_error: int
    shards_written: int
    elapsed_s: float
    circuit_open: str | None = None
    #: Why the circuit opened when not by consecutive transient failures (an engine crash), else None.
    circuit_reason: str | None = None

    @property
    def written(self) -> int:
        return self.ok + self.system_fail + self.infra_error

    @property
    def complete(self) -> bool:
        """Every job has a final record (nothing left to re-run)."""
        return self.already_done + self.ok + self.system_fail == self.total


class RunLedger:
    """The records side of one call of either engine (asyncio here, Ray in ``ray_engine``): the run
    folder, locked; the jobs that still have no final record; the shard writer; per-status counts
    and the progress line. Use as a context manager: the lock is held and the shards are flushed on
    exit, whatever happened. ``dedup``: drop a second record of a job (Ray re-runs a batch after an
    actor died; its first answer counts). It is off for the asyncio engine, which never sends a job
    twice, because its key set would grow with the matrix (10^6 jobs: ≈ 200 MB).
    ``errors_from_records``: the progress line counts transient errors per endpoint from each record's
    ``failed_endpoints`` (the Ray engine, whose retries happen in actor processes); the asyncio engine
    counts them as they happen instead (``JobRunner.on_transient``), so a dead endpoint shows while its
    jobs are still retrying."""

    def __init__(
        self,
        out: Path,
        run_id: str,
        order: Sequence[Job],
        options: RunOptions,
        *,
        started: float | None = None,
        dedup: bool = False,
        errors_from_records: bool = False,
    ) -> None:
        self.started = time.monotonic() if started is None else started
        self.out, self.run_id, self.total = out, run_id, len(order)
        self._order, self._options = order, options
        self._lock = DirLock(out)
        self.counts: dict[str, int] = defaultdict(int)
        self._written: set[tuple[str, str, int]] | None = set() if dedup else None
        self._errors_from_records = errors_from_records

    def __enter__(self) -> RunLedger:
        folder = records_dir(self.out)
        folder.mkdir(parents=True, exist_ok=True)
        self._lock.__enter__()
        try:
            # A temp file of a killed writer is never a record (``.tmp-*.parquet``: before issue #38).
            for stale in [*folder.glob(".*.tmp"), *folder.glob(".tmp-*.parquet")]:
                stale.unlink(missing_ok=True)
            existing = read_records(self.out, dedup=False)
            check_same_run(existing, self.run_id, self._options.manifest_digest, self.out)
            done = {
                (a, lid, int(s))
                for a, lid, s, st in existing.select([*RECORD_KEY, "status"]).iter_rows()
                if st in FINAL_STATUSES
            }
            shard_seqs = [int(m.group(1)) for p in shard_paths(self.out) if (m := SHARD_NAME.match(p.name))]
            self.writer = ShardWriter(folder, max(shard_seqs, default=-1) + 1, self._options.batch_size)
            self.pending = [job for job in self._order if job.key not in done]
            # The endpoints that failed a job in earlier calls (its infra_error record, and the calls
            # before that one): the job's final record carries them on as `earlier_failed_endpoints`,
            # so a resume keeps every failure count (issue #21) and tells them apart (issue #37).
            self._prior_failed = {
                (str(a), str(lid), int(s)): " ".join(str(f) for f in (earlier, failed) if f)
                for a, lid, s, st, failed, earlier in existing.select(
                    [*RECORD_KEY, "status", "failed_endpoints", "earlier_failed_endpoints"]
                ).iter_rows()
                if st == "infra_error" and (failed or earlier) and (str(a), str(lid), int(s)) not in done
            }
            self.already = self.total - len(self.pending)
            # None = on; progress lines go to stderr, redrawn on a terminal, one per few percent elsewhere.
            show = True if self._options.progress is None else self._options.progress
            self.meter = Progress(len(self.pending), show)
        except BaseException:
            self._lock.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            if hasattr(self, "writer"):
                self.writer.flush()
        finally:
            self._lock.__exit__(None, None, None)

    def finish(self, rec: dict[str, Any]) -> None:
        """Record one final answer (or refusal) of a job."""
        if self._written is not None:
            key = (str(rec["arm"]), str(rec["layout_id"]), int(rec["seed"]))
            if key in self._written:
                return
            self._written.add(key)
        self.writer.add(rec)
        self.counts[rec["status"]] += 1
        if self._errors_from_records:
            for endpoint in str(rec.get("failed_endpoints") or "").split():
                self.meter.error(endpoint)
        prior = self._prior_failed.pop((str(rec["arm"]), str(rec["layout_id"]), int(rec["seed"])), None)
        if prior:
            rec["earlier_failed_endpoints"] = prior
        self.meter.tick(rec["status"])

    def sendable(self, refused: Callable[[Job], dict[str, Any]]) -> list[Job]:
        """The pending jobs to send. A job whose layout was refused at build (status other than ok) is
        recorded here, as ``refused(job)``, without a request: both engines record refusals alike."""
        out: list[Job] = []
        for job in self.pending:
            if str(job.layout["status"]) != "ok":
                self.finish(refused(job))
            else:
                out.append(job)
        return out

    def summary(self, circuit_open: str | None, circuit_reason: str | None = None) -> RunSummary:
        return RunSummary(
            run_id=self.run_id,
            out_dir=self.out,
            total=self.total,
            already_done=self.already,
            ok=self.counts["ok"],
            system_fail=self.counts["system_fail"],
            infra_error=self.counts["infra_error"],
            shards_written=self.writer.shards_written,
            elapsed_s=time.monotonic() - self.started,
            circuit_open=circuit_open,
            circuit_reason=circuit_reason,
        )


def check_same_run(existing: pl.DataFrame, run_id: str, manifest_digest: str, out: Path) -> None:
    if existing.is_empty():
        return
    run_ids = sorted(set(existing.get_column("run_id").drop_nulls().to_list()))
    if run_ids != [run_id]:
        raise PlanChangedError(
            f"the folder holds records of run(s) {run_ids!r}, not of run {run_id!r}",
            file=str(out),
            fix="resume with the same run id, or write the new run to a new folder",
        )
    digests = sorted(set(existing.get_column("manifest_digest").drop_nulls().to_list()))
    if digests != [manifest_digest]:
        raise PlanChangedError(
            f"run {run_id!r} was started with manifest digest(s) {digests!r}, not {manifest_digest!r}: the "
            "matrix, plan, cases or systems changed",
            file=str(out),
            fix="restore the original inputs to resume, or start a new run id in a new folder",
        )
