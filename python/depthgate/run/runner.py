"""The paired, resumable runner: send every (arm, layout, seed) job once, in a seeded interleaved order,
with bounded concurrency, and append each finished record atomically.

* **Pairing.** Every layout is run on its arm with the same seed set; the arms must cover the same
  (case, length, position) slices (layout ids differ between arms when tokenizers or templates differ).
* **Order.** Jobs are grouped into pairs — the arms' jobs of one (case, length, position, seed) — the
  pairs shuffled and the arms shuffled inside each pair, with an RNG seeded from the run id: the order is
  random (provider drift cannot pose as a position effect), interleaved (the two arms of a pair are sent
  back to back) and deterministic (the same run id gives the same order, also on resume).
* **Outcomes.** ``ok``; ``system_fail`` with a reason — a refused layout (its ``reason_code``, never sent),
  ``overflow`` (the backend refused the prompt as too long), ``server_count_mismatch`` (the server's
  prompt count differs from the local one), ``server_ids_mismatch`` (the echoed prompt ids differ),
  ``server_count_missing`` (no count to verify), ``max_tokens_clamped``; or ``infra_error`` (a transient
  failure that outlived the retries), which is never scored and is re-run on resume.
* **Durability.** Finished records are buffered and written in batches, each as a new parquet shard
  ``records/part-<seq>-<uuid>.parquet`` (temp file, fsync, ``os.replace``, directory fsync). A shard is
  either wholly there or absent, so a run killed at any instant (SIGKILL included) resumes with nothing
  lost — unwritten records are re-sent — and nothing duplicated: keys already recorded with a final
  status are skipped. :func:`compact` merges the shards into ``records.parquet``.
* **Privacy.** Prompts (text or ids) are never written to records or logs; only the model's output.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import random
import re
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, ParamSpec, Protocol, TypeVar

import numpy as np
import polars as pl

from depthgate.exceptions import (
    BackendRequestError,
    InfraError,
    InputError,
    OverLengthError,
    PlanChangedError,
    TransientBackendError,
)
from depthgate.run.backends.base import Backend, Request, Response, endpoint_url
from depthgate.run.retry import CircuitBreaker, RetryPolicy
from depthgate.spec.files import named_failure
from depthgate.spec.limits import summarise_urls
from depthgate.spec.models import DecodeParams

if TYPE_CHECKING:
    import numpy.typing as npt

__all__ = [
    "FINAL_STATUSES",
    "RECORDS_FILE",
    "RECORD_KEY",
    "RECORD_SCHEMA",
    "Job",
    "RetryPolicy",
    "RunOptions",
    "RunSummary",
    "arun_pairs",
    "compact",
    "endpoint_of",
    "interleaved_order",
    "order_seed",
    "read_records",
    "run_pairs",
    "shard_of",
]

log = logging.getLogger("depthgate.run.runner")

RECORDS_DIR = "records"
RECORDS_FILE = "records.parquet"
LOCK_FILE = ".depthgate-run.lock"
RECORD_KEY = ("arm", "layout_id", "seed")
FINAL_STATUSES = ("ok", "system_fail")
_STATUS_RANK = {"ok": 0, "system_fail": 1, "infra_error": 2}
_SHARD_NAME = re.compile(r"^part-(\d+)-[0-9a-f]{32}\.parquet$")

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
}

Key = tuple[str, str, int]
_P = ParamSpec("_P")
_R = TypeVar("_R")


# --------------------------------------------------------------------------------------------------
# jobs and their order


@dataclass(frozen=True)
class Job:
    """One (arm, layout, seed) request. ``layout`` is the caller's row (never copied, never logged)."""

    arm: str
    seed: int
    layout: Mapping[str, Any]

    @property
    def layout_id(self) -> str:
        return str(self.layout["layout_id"])

    @property
    def key(self) -> Key:
        return (self.arm, self.layout_id, self.seed)

    @property
    def slice_key(self) -> tuple[str, int, str]:
        return (str(self.layout["case_id"]), int(self.layout["target_tokens"]), _position(self.layout))

    def __repr__(self) -> str:
        return f"Job(arm={self.arm!r}, layout_id={self.layout_id!r}, seed={self.seed})"


def _position(layout: Mapping[str, Any]) -> str:
    value = layout["position"]
    return value if isinstance(value, str) else repr(float(value)) if isinstance(value, float) else str(value)


def order_seed(run_id: str) -> int:
    """The 64-bit seed of the job order, derived from the run id (stable across processes)."""
    return int.from_bytes(hashlib.sha256(f"depthgate/order/{run_id}".encode()).digest()[:8], "big")


_REQUIRED = ("layout_id", "case_id", "target_tokens", "position", "status")


class LayoutSource(Protocol):
    """Where a job's token ids and text come from when its row does not carry them
    (:class:`depthgate.run.store.LayoutStore`: read from disk one layout at a time)."""

    def ids(self, layout_id: str) -> Any: ...

    def text(self, layout_id: str) -> str: ...


def _local_tokens(layout: Mapping[str, Any]) -> int | None:
    """The prompt's local token count: its ids if the row holds them, else its ``total_tokens``."""
    ids = layout.get("token_ids")
    if ids is not None:
        return len(ids)
    total = layout.get("total_tokens")
    return int(total) if total is not None else None


def _check_jobs(
    jobs: Iterable[tuple[str, Mapping[str, Any]]], arms: Sequence[str], *, streamed: bool = False
) -> list[tuple[str, Mapping[str, Any]]]:
    rows = list(jobs)
    seen: dict[tuple[str, str], int] = {}
    slices: dict[str, dict[tuple[str, int, str], str]] = defaultdict(dict)
    for index, (arm, layout) in enumerate(rows):
        if arm not in arms:
            raise InputError(
                f"job {index} is for arm {arm!r}, which has no backend (arms: {list(arms)!r})",
                field=f"jobs[{index}]",
                fix="pass a backend for every arm",
            )
        missing = [k for k in _REQUIRED if k not in layout]
        if "token_ids" not in layout and not streamed:
            missing.append("token_ids")
        if missing:
            raise InputError(
                f"layout row {index} lacks {missing!r}",
                field=f"jobs[{index}]",
                fix="pass layout rows from the layout builder",
            )
        layout_id = str(layout["layout_id"])
        if (arm, layout_id) in seen:
            raise InputError(
                f"layout {layout_id!r} appears twice for arm {arm!r} "
                f"(jobs {seen[arm, layout_id]} and {index})",
                field=f"jobs[{index}]",
                fix="pass each layout once per arm; seeds are added by the runner",
            )
        seen[arm, layout_id] = index
        slice_key = (str(layout["case_id"]), int(layout["target_tokens"]), _position(layout))
        if slice_key in slices[arm]:
            raise InputError(
                f"arm {arm!r} has two layouts for case {slice_key[0]!r} at length {slice_key[1]} and "
                f"position {slice_key[2]!r} ({slices[arm][slice_key]!r} and {layout_id!r})",
                field=f"jobs[{index}]",
                fix="pass one layout per (case, length, position) and arm",
            )
        slices[arm][slice_key] = layout_id
    present = [arm for arm in arms if slices.get(arm)]
    for arm in present[1:]:
        first = present[0]
        only_first = set(slices[first]) - set(slices[arm])
        only_other = set(slices[arm]) - set(slices[first])
        if only_first or only_other:
            example = sorted(only_first or only_other)[0]
            raise InputError(
                f"arms {first!r} and {arm!r} are not paired: {len(only_first)} slice(s) only in {first!r}, "
                f"{len(only_other)} only in {arm!r} (e.g. case {example[0]!r}, length {example[1]}, "
                f"position {example[2]!r})",
                field="jobs",
                fix="build every (case, length, position) for both arms; a refused layout is still passed",
            )
    return rows


def shard_of(pair: tuple[str, int, str, int], count: int) -> int:
    """The 0-based shard of a pair (case, length, position, seed) among ``count``: from its content
    only, so both arms of a pair are in the same shard whatever the job order, on every machine."""
    digest = hashlib.sha256("\x1f".join(str(part) for part in pair).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % count


def interleaved_order(
    jobs: Iterable[tuple[str, Mapping[str, Any]]], seeds: Sequence[int], run_id: str, order: str = "shuffled"
) -> list[Job]:
    """All (arm, layout, seed) jobs in the run's randomized, interleaved, deterministic order.

    Pairs (the arms' jobs of one case × length × position × seed) are shuffled, and the arms inside each
    pair, with :func:`order_seed`; the result depends only on the run id and the set of jobs. With
    ``order = "haystack"`` the pairs of one haystack (case × length × seed) stay together: the haystacks
    are shuffled, then the pairs inside each, then the arms inside each pair — still random (no position
    is always sent first) and interleaved, but a server's prefix cache sees each haystack's requests
    back to back.
    """
    units: dict[tuple[str, int, str, int], list[Job]] = defaultdict(list)
    for arm, layout in jobs:
        for seed in seeds:
            job = Job(arm=arm, seed=int(seed), layout=layout)
            units[(*job.slice_key, job.seed)].append(job)
    rng = random.Random(order_seed(run_id))
    keys = sorted(units)
    rng.shuffle(keys)
    if order == "haystack":
        groups: dict[tuple[str, int, int], list[tuple[str, int, str, int]]] = defaultdict(list)
        for key in keys:  # already shuffled: the pairs inside a haystack keep that random order
            groups[(key[0], key[1], key[3])].append(key)
        haystacks = sorted(groups)
        rng.shuffle(haystacks)
        keys = [key for haystack in haystacks for key in groups[haystack]]
    result: list[Job] = []
    for key in keys:
        unit = sorted(units[key], key=lambda j: (j.arm, j.layout_id))
        rng.shuffle(unit)
        result.extend(unit)
    return result


# --------------------------------------------------------------------------------------------------
# records on disk


def _records_dir(out_dir: Path) -> Path:
    return out_dir / RECORDS_DIR


def _shards(out_dir: Path) -> list[Path]:
    folder = _records_dir(out_dir)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if _SHARD_NAME.match(p.name))


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # not supported on every platform / filesystem
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _atomic_write_parquet(frame: pl.DataFrame, target: Path) -> None:
    tmp = target.with_name(f".tmp-{uuid.uuid4().hex}.parquet")
    try:
        frame.write_parquet(tmp)
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
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
    paths = ([out / RECORDS_FILE] if (out / RECORDS_FILE).is_file() else []) + _shards(out)
    if not paths:
        return _frame([])
    frame = pl.concat([_read_one(p) for p in paths], how="vertical")
    return _dedup(frame) if dedup else frame


class _DirLock:
    """An exclusive, non-blocking ``flock`` on ``out_dir``: one writer at a time (released by the OS
    when the process dies, SIGKILL included)."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK_FILE
        self._handle: IO[bytes] | None = None

    def __enter__(self) -> _DirLock:
        self._handle = open(self.path, "a+b")  # held for the lifetime of the run
        try:
            import fcntl
        except ImportError:  # pragma: no cover - not POSIX: no lock
            return self
        try:
            fcntl.flock(self._handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._handle.close()
            self._handle = None
            raise InfraError(
                "another depthgate process is writing to this run folder",
                file=str(self.path.parent),
                fix="wait for it to finish (or stop it), then resume",
            ) from None
        return self

    def __exit__(self, *exc: object) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None


def compact(out_dir: str | os.PathLike[str]) -> Path:
    """Merge the record shards (and an earlier ``records.parquet``) into ``records.parquet``, one record
    per (arm, layout_id, seed) — ``ok`` kept over ``system_fail`` over ``infra_error`` — then remove the
    merged shards. Atomic: readers see the old or the new file, and a crash between the replace and the
    removal only leaves shards that the next read deduplicates away."""
    out = Path(out_dir)
    if not out.is_dir():
        raise InputError("run folder not found", file=str(out), fix="give the folder a run wrote to")
    with _DirLock(out):
        shards = _shards(out)
        merged = read_records(out, dedup=True)
        target = out / RECORDS_FILE
        _atomic_write_parquet(merged, target)
        for shard in shards:
            with contextlib.suppress(FileNotFoundError):
                shard.unlink()
        _fsync_dir(_records_dir(out))
    return target


class _ShardWriter:
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
            _atomic_write_parquet(_frame(rows), target)
        except OSError as exc:
            self.buffer = rows + self.buffer
            raise InfraError(
                f"cannot write records ({exc})", file=str(target), fix="check free disk space and permissions"
            ) from exc
        self.seq += 1
        self.shards_written += 1


# --------------------------------------------------------------------------------------------------
# progress


class _Progress:
    """One progress line per few percent or per minute, where nightly jobs are read: in CI logs.

    On a terminal the line is redrawn in place every 0.5 s; otherwise (a CI log, a file) a new line is
    printed at every 5 % of the jobs or every 60 s, whichever comes first, and at the end: done/total,
    rate, ETA, outcome counts and transient errors per endpoint. A 7.5-minute smoke run used to print
    nothing between its first line and its verdict.
    """

    LOG_EVERY_S = 60.0
    LOG_EVERY_SHARE = 0.05

    def __init__(self, total: int, enabled: bool, stream: IO[str] | None = None) -> None:
        self.stream = stream or sys.stderr
        self.total = total
        self.enabled = enabled and total > 0
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.done = 0
        self.counts: dict[str, int] = defaultdict(int)
        self.errors: dict[str, int] = defaultdict(int)
        self.start = time.monotonic()
        self.last = self.start
        self.last_done = 0

    def error(self, endpoint: str) -> None:
        """A transient failure on ``endpoint`` (retried or not)."""
        self.errors[endpoint] += 1

    def tick(self, status: str) -> None:
        self.done += 1
        self.counts[status] += 1
        if not self.enabled:
            return
        now = time.monotonic()
        final = self.done == self.total
        if self.tty:
            due = now - self.last >= 0.5
        else:
            step = max(1, int(self.total * self.LOG_EVERY_SHARE))
            due = self.done - self.last_done >= step or now - self.last >= self.LOG_EVERY_S
        if due or final:
            self.last, self.last_done = now, self.done
            self._print(final=final)

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else float("inf")
        eta_text = "--" if eta == float("inf") else _duration(eta)
        text = (
            f"depthgate: {self.done}/{self.total} ({100 * self.done / self.total:.0f}%) "
            f"{rate:.2f}/s ETA {eta_text} | ok {self.counts['ok']} system_fail {self.counts['system_fail']} "
            f"infra_error {self.counts['infra_error']}"
        )
        if self.errors:
            # An arm on many replicas: the first few endpoints and how many in all, never the whole list.
            listed = [f"{summarise_urls(e.split())} {n}" for e, n in sorted(self.errors.items())]
            text += " | transient errors: " + summarise_urls(listed)
        return text

    def _print(self, *, final: bool) -> None:
        line = self.line()
        if self.tty:
            self.stream.write("\r" + line + ("\n" if final else ""))
        else:
            self.stream.write(line + "\n")
        self.stream.flush()


def _duration(seconds: float) -> str:
    total = round(seconds)
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


# --------------------------------------------------------------------------------------------------
# the run


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
    counts them as they happen instead (``_Run.on_transient``), so a dead endpoint shows while its
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
        self._lock = _DirLock(out)
        self.counts: dict[str, int] = defaultdict(int)
        self._written: set[tuple[str, str, int]] | None = set() if dedup else None
        self._errors_from_records = errors_from_records

    def __enter__(self) -> RunLedger:
        folder = _records_dir(self.out)
        folder.mkdir(parents=True, exist_ok=True)
        self._lock.__enter__()
        try:
            for stale in folder.glob(".tmp-*.parquet"):  # a temp file of a killed writer: never a record
                stale.unlink(missing_ok=True)
            existing = read_records(self.out, dedup=False)
            _check_same_run(existing, self.run_id, self._options.manifest_digest, self.out)
            done = {
                (a, lid, int(s))
                for a, lid, s, st in existing.select([*RECORD_KEY, "status"]).iter_rows()
                if st in FINAL_STATUSES
            }
            shard_seqs = [int(m.group(1)) for p in _shards(self.out) if (m := _SHARD_NAME.match(p.name))]
            self.writer = _ShardWriter(folder, max(shard_seqs, default=-1) + 1, self._options.batch_size)
            self.pending = [job for job in self._order if job.key not in done]
            # The endpoints that failed a job in an earlier call (its infra_error record): the job's
            # final record carries them on, so a resume keeps every failure count (issue #21).
            self._prior_failed = {
                (str(a), str(lid), int(s)): str(failed)
                for a, lid, s, st, failed in existing.select(
                    [*RECORD_KEY, "status", "failed_endpoints"]
                ).iter_rows()
                if st == "infra_error" and failed and (str(a), str(lid), int(s)) not in done
            }
            self.already = self.total - len(self.pending)
            # None = on; progress lines go to stderr, redrawn on a terminal, one per few percent elsewhere.
            show = True if self._options.progress is None else self._options.progress
            self.meter = _Progress(len(self.pending), show)
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
            rec["failed_endpoints"] = " ".join(
                [prior, *([rec["failed_endpoints"]] if rec.get("failed_endpoints") else [])]
            )
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

    def summary(self, circuit_open: str | None) -> RunSummary:
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
        )


def endpoint_of(backend: Backend) -> str:
    """Where a backend sends: its base URL, ``in-process:<name>`` for an engine in this process, or the
    space-separated URLs of a backend over several endpoints (whose answers name their own endpoint,
    :attr:`Response.endpoint`)."""
    endpoints = getattr(backend, "endpoints", None)
    if endpoints:
        return " ".join(endpoint_url(str(url)) for url in endpoints)
    url = getattr(backend, "base_url", None)
    if not url:
        return f"in-process:{getattr(backend, 'name', type(backend).__name__)}"
    return endpoint_url(str(url))  # never user:password@


#: The :class:`Response` fields recorded as they are, under their own name.
_RESPONSE_COLUMNS = (
    "finish_reason",
    "completion_tokens",
    "prefix_cache_hit_tokens",
    "system_fingerprint",
    "endpoint",
)

#: A job moves at most this many times to another endpoint without counting a try (a pool re-routes a
#: job off a failed endpoint only while an endpoint it has not failed on is healthy: at most one move
#: per endpoint).
_MAX_FAILOVERS = 64


def _ids(ids: Any, *, as_array: bool) -> Sequence[int] | npt.NDArray[Any]:
    # Rows from polars already hold Python ints: no per-token copy (at 128K tokens a
    # `[int(t) for t in ids]` copy was the larger part of the harness cost per request,
    # docs/benchmarks-runner-gate.md). A numpy array (the layout store's uint32 buffer) stays one for
    # a backend that takes it (`accepts_id_array`, the HTTP backends): its list of Python ints was
    # most of a 128K request's memory in flight (issue #12, docs/benchmarks.md).
    if isinstance(ids, np.ndarray) and ids.ndim == 1 and as_array:
        return ids
    if hasattr(ids, "tolist"):
        return list(ids.tolist())
    return ids if isinstance(ids, list) else list(ids)


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


class _Run:
    def __init__(
        self,
        *,
        backends: Mapping[str, Backend],
        options: RunOptions,
        sources: Mapping[str, LayoutSource] | None = None,
    ) -> None:
        self.backends = backends
        self.sources = dict(sources or {})
        self.run_id = options.run_id
        self.manifest_digest = options.manifest_digest
        self.decode = options.decode
        self.retry = options.retry
        self.breaker = CircuitBreaker(options.retry.breaker_after)
        #: Called with the endpoint of every transient failure (the progress line counts them).
        self.on_transient: Callable[[str], None] | None = None
        self.jitter = random.Random()
        # Per arm, what every record of it repeats: the system name and the endpoint (computed once, not
        # per record: endpoint_of parses and rebuilds the URL), the stop strings as a tuple.
        self._system = {arm: str(getattr(b, "name", arm)) for arm, b in backends.items()}
        self._endpoint = {arm: endpoint_of(b) for arm, b in backends.items()}
        self._pooled = {arm: bool(getattr(b, "endpoints", None)) for arm, b in backends.items()}
        self._id_array = {arm: bool(getattr(b, "accepts_id_array", False)) for arm, b in backends.items()}
        self._stop = tuple(options.decode.stop)

    def token_ids(self, job: Job) -> Sequence[int] | npt.NDArray[Any]:
        """The job's prompt ids: from its row, or read from its arm's layout source (one layout, now);
        a numpy array kept as one when the arm's backend takes it (``accepts_id_array``)."""
        as_array = self._id_array.get(job.arm, False)
        if job.layout.get("token_ids") is not None:
            return _ids(job.layout["token_ids"], as_array=as_array)
        return _ids(self.sources[job.arm].ids(job.layout_id), as_array=as_array)

    def text(self, job: Job) -> str | None:
        if "token_ids" in job.layout or job.arm not in self.sources:
            return job.layout.get("text")
        return self.sources[job.arm].text(job.layout_id)

    def record(
        self, job: Job, status: str, *, endpoint: str | None = None, failed: Sequence[str] = (), **fields: Any
    ) -> dict[str, Any]:
        """The job's record: its keys and slice, ``status``, and ``fields`` (record columns); ``failed``:
        the endpoints where an attempt failed transiently, in order."""
        layout = job.layout
        rec: dict[str, Any] = {
            "run_id": self.run_id,
            "manifest_digest": self.manifest_digest,
            "arm": job.arm,
            "system": self._system[job.arm],
            # An arm on several replicas: the replica that answered or failed the job last; none for a
            # job no replica took (never the space-joined list: that is no endpoint, issue #21).
            "endpoint": endpoint or (None if self._pooled[job.arm] else self._endpoint[job.arm]),
            "layout_id": job.layout_id,
            "case_id": str(layout["case_id"]),
            "target_tokens": int(layout["target_tokens"]),
            "position": _position(layout),
            "seed": job.seed,
            "status": status,
            "prompt_tokens_local": _local_tokens(layout),
            "completed_at": datetime.now(timezone.utc),
            "failed_endpoints": " ".join(failed) or None,
        }
        rec.update(fields)
        return rec

    def refused(self, job: Job) -> dict[str, Any]:
        layout = job.layout
        reason = layout.get("reason_code") or f"layout_{layout['status']}"
        return self.record(job, "system_fail", system_fail_reason=str(reason), attempts=0)

    def _check(
        self, job: Job, resp: Response, latency: float, attempts: int, failed: Sequence[str] = ()
    ) -> dict[str, Any]:
        backend = self.backends[job.arm]
        local = _local_tokens(job.layout) or 0
        server = resp.prompt_tokens_server
        completion = resp.completion_tokens
        max_tokens = self.decode.max_tokens
        tolerance = float(getattr(backend, "count_tolerance", 0.0))
        # The count the server must report: the local one, or what the backend knows better (Anthropic's
        # own count_tokens; the local count plus the calibrated chat framing). Every difference is
        # recorded (prompt_tokens_delta), also one within the tolerance.
        expected = local if resp.prompt_tokens_expected is None else resp.prompt_tokens_expected
        delta = None if server is None else server - expected
        reason: str | None = None
        if resp.server_prompt_ids_match is False:
            reason = "server_ids_mismatch"
        elif delta is None:
            reason = "server_count_missing"
        elif abs(delta) > tolerance * expected:
            reason = "server_count_mismatch"
        elif completion is not None and (
            completion > max_tokens or (resp.finish_reason == "length" and completion < max_tokens)
        ):
            reason = "max_tokens_clamped"
        return self.record(
            job,
            "ok" if reason is None else "system_fail",
            failed=failed,
            system_fail_reason=reason,
            output_text=resp.text,
            prompt_tokens_server=server,
            prompt_tokens_expected=expected,
            prompt_tokens_delta=delta,
            latency_s=latency,
            attempts=attempts,
            **{column: getattr(resp, column) for column in _RESPONSE_COLUMNS},
        )

    async def execute(self, job: Job) -> dict[str, Any]:
        """Send one job; retry transient failures; return its record. Raises only for a refusal the
        caller must fix (:class:`BackendRequestError`) or a bug.

        A failure that a backend over several endpoints marks ``failover`` (another healthy endpoint
        takes the job) is retried at once: no backoff, no try of the policy counted, the circuit breaker
        not fed; the record counts it in ``attempts`` and names the endpoint in ``failed_endpoints``."""
        backend = self.backends[job.arm]
        layout = job.layout
        request = Request(
            layout_id=job.layout_id,
            arm=job.arm,
            seed=job.seed,
            token_ids=self.token_ids(job),
            text=self.text(job),
            max_tokens=self.decode.max_tokens,
            temperature=self.decode.temperature,
            stop=self._stop,
            affinity=f"{layout['case_id']}@{layout['target_tokens']}",
        )
        pooled = self._pooled[job.arm]
        attempts = 0
        tries = 0  # attempts the retry policy counts (failovers are not)
        failovers = 0
        failed: list[str] = []
        last: InfraError | None = None
        max_attempts = self.retry.max_attempts
        while tries < max_attempts:
            start = time.perf_counter()
            try:
                resp = await backend.generate(request)
            except OverLengthError as exc:
                self.breaker.success(job.arm)
                return self.record(
                    job,
                    "system_fail",
                    system_fail_reason="overflow",
                    latency_s=time.perf_counter() - start,
                    attempts=attempts + 1,
                    error=exc.summary,
                    endpoint=getattr(exc, "endpoint", None),
                    failed=failed,
                )
            except TransientBackendError as exc:
                attempts += 1
                last = exc
                if exc.endpoint is not None or not pooled:
                    failed.append(exc.endpoint or self._endpoint[job.arm])
                if self.on_transient is not None:  # failovers too: a dead replica shows in the progress
                    self.on_transient(exc.endpoint or self._endpoint[job.arm])
                if exc.failover and failovers < _MAX_FAILOVERS:
                    failovers += 1
                    log.info(
                        "%s layout %s seed %d moves to another endpoint: %s",
                        job.arm,
                        job.layout_id,
                        job.seed,
                        exc.summary,
                    )
                    continue
                tries += 1
                self.breaker.failure(job.arm)
                log.warning(
                    "transient failure on %s layout %s seed %d (attempt %d/%d): %s",
                    job.arm,
                    job.layout_id,
                    job.seed,
                    tries,
                    max_attempts,
                    exc.summary,
                )
                if self.breaker.open:
                    break  # the endpoint is down: stop retrying, the rerun resumes this job
                if tries < max_attempts:
                    await asyncio.sleep(self.retry.delay(tries, exc.retry_after, self.jitter))
                continue
            except BackendRequestError:
                raise
            except InfraError as exc:  # malformed answer, closed backend: no retry now, re-run on resume
                attempts += 1
                last = exc
                break
            self.breaker.success(job.arm)
            return self._check(job, resp, time.perf_counter() - start, attempts + 1, failed)
        summary = getattr(last, "summary", None) or (type(last).__name__ if last else "unknown")
        return self.record(
            job,
            "infra_error",
            attempts=attempts,
            error=str(summary)[:300],
            endpoint=failed[-1] if failed else None,
            failed=failed,
        )


async def arun_pairs(
    jobs: Iterable[tuple[str, Mapping[str, Any]]],
    backends: Mapping[str, Backend],
    out_dir: str | os.PathLike[str],
    options: RunOptions,
    sources: Mapping[str, LayoutSource] | None = None,
) -> RunSummary:
    """Run every (arm, layout) job with every seed against its arm's backend; append records to
    ``out_dir/records/``; resume where an earlier call with the same run id stopped.

    ``jobs`` are ``(arm, layout row)`` pairs; a row has at least ``layout_id``, ``case_id``,
    ``target_tokens``, ``position``, ``token_ids``, ``text`` and ``status`` (rows with a status other
    than ``"ok"`` are recorded as ``system_fail`` with their ``reason_code``, not sent). ``backends``:
    one backend per arm (the caller closes them). ``sources``: per arm, where the ids and text of rows
    without ``token_ids`` are read at send time (:class:`depthgate.run.store.LayoutStore`), so the
    jobs hold only small columns and memory stays O(jobs in flight). A transient failure is retried by
    ``options.retry``; one still failing is recorded as ``infra_error`` (re-run on resume). After
    ``options.retry.breaker_after`` consecutive transient failures on one arm the run stops sending
    (:attr:`RunSummary.circuit_open` names the arm); nothing sent is lost and the rerun resumes.

    :func:`arun_pairs` runs in the caller's event loop; :func:`run_pairs` runs it in one of its own.
    """
    started = time.monotonic()
    run_id, concurrency = options.run_id, options.concurrency
    seed_list = [int(s) for s in (options.decode.seeds if options.seeds is None else options.seeds)]
    if not seed_list or len(set(seed_list)) != len(seed_list):
        raise InputError(
            "seeds must be a non-empty list of distinct integers", field="seeds", fix="e.g. seeds=[0, 1]"
        )
    rows = _check_jobs(jobs, list(backends), streamed=bool(sources))
    order = interleaved_order(rows, seed_list, run_id, options.order)
    if options.shard is not None:
        index, count = options.shard
        order = [job for job in order if shard_of((*job.slice_key, job.seed), count) == index - 1]

    with RunLedger(Path(out_dir), run_id, order, options, started=started) as ledger:
        run = _Run(backends=backends, options=options, sources=sources)
        run.on_transient = ledger.meter.error
        log.info(
            "run %s: %d jobs, %d already recorded, %d to send (concurrency %d)",
            run_id,
            len(order),
            ledger.already,
            len(ledger.pending),
            concurrency,
        )

        sendable = ledger.sendable(run.refused)

        semaphore = asyncio.Semaphore(concurrency)
        tasks: set[asyncio.Task[None]] = set()
        fatal: list[BaseException] = []

        async def one(job: Job) -> None:
            try:
                rec = await run.execute(job)
            except asyncio.CancelledError:
                raise
            except BaseException as exc:
                if not fatal:
                    fatal.append(exc)
                for task in tasks:
                    if task is not asyncio.current_task():
                        task.cancel()
                return
            ledger.finish(rec)

        def released(task: asyncio.Task[None]) -> None:
            # Released here, not inside the coroutine: a task cancelled before it starts runs no code.
            tasks.discard(task)
            semaphore.release()

        async def flusher() -> None:
            while True:
                await asyncio.sleep(options.flush_seconds)
                ledger.writer.flush()

        flush_task = asyncio.create_task(flusher())
        try:
            for job in sendable:
                await semaphore.acquire()
                if fatal or run.breaker.open:
                    semaphore.release()
                    break
                task = asyncio.create_task(one(job))
                tasks.add(task)
                task.add_done_callback(released)
            if tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
        finally:
            flush_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flush_task
            for task in list(tasks):
                task.cancel()
            if tasks:
                await asyncio.gather(*list(tasks), return_exceptions=True)
        if fatal:
            raise fatal[0]
    return ledger.summary(run.breaker.tripped)


def _check_same_run(existing: pl.DataFrame, run_id: str, manifest_digest: str, out: Path) -> None:
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


def _blocking(coroutine_function: Callable[_P, Coroutine[Any, Any, _R]], name: str) -> Callable[_P, _R]:
    """``coroutine_function`` as a call that runs it to the end in an event loop of its own."""

    def blocking(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return asyncio.run(coroutine_function(*args, **kwargs))

    blocking.__name__ = blocking.__qualname__ = name
    blocking.__doc__ = coroutine_function.__doc__
    return blocking


#: :func:`arun_pairs` in its own event loop (``asyncio.run``).
run_pairs = _blocking(arun_pairs, "run_pairs")
