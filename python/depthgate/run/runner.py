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
  ``server_count_missing`` (no count to verify), ``max_tokens_clamped``, ``empty_completion`` /
  ``malformed_answer`` (a 200 that is not the model's answer: nothing generated, no ``choices`` or
  ``text``, counts that contradict the body; retried first, the server's words kept in ``error``,
  :class:`~depthgate.exceptions.MalformedAnswerError`); or ``infra_error`` (a transient
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
import logging
import os
import time
from collections.abc import Callable, Coroutine, Iterable, Mapping
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

from depthgate.exceptions import InputError
from depthgate.run.backends.base import Backend
from depthgate.run.execute import JobRunner
from depthgate.run.jobs import Job, LayoutSource, check_jobs, interleaved_order, shard_of
from depthgate.run.ledger import RunLedger, RunSummary
from depthgate.run.options import RunOptions

log = logging.getLogger("depthgate.run.runner")

_P = ParamSpec("_P")
_R = TypeVar("_R")


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
    rows = check_jobs(jobs, list(backends), streamed=bool(sources))
    order = interleaved_order(rows, seed_list, run_id, options.order)
    if options.shard is not None:
        index, count = options.shard
        order = [job for job in order if shard_of((*job.slice_key, job.seed), count) == index - 1]

    with RunLedger(Path(out_dir), run_id, order, options, started=started) as ledger:
        run = JobRunner(backends=backends, options=options, sources=sources)
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
    return ledger.summary(run.breaker.tripped, run.breaker.reason)


def _blocking(coroutine_function: Callable[_P, Coroutine[Any, Any, _R]], name: str) -> Callable[_P, _R]:
    """``coroutine_function`` as a call that runs it to the end in an event loop of its own."""

    def blocking(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        return asyncio.run(coroutine_function(*args, **kwargs))

    blocking.__name__ = blocking.__qualname__ = name
    blocking.__doc__ = coroutine_function.__doc__
    return blocking


#: :func:`arun_pairs` in its own event loop (``asyncio.run``).
run_pairs = _blocking(arun_pairs, "run_pairs")
