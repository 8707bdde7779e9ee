"""The seventh fault of ``depthgate faults``: the embedded engine dies mid-run (issue #35).

What is injected: the clean layouts are sent to a fresh embedded worker
(:class:`~depthgate.run.backends.llamacpp_worker.LlamaWorkerBackend`); while the second request is being
evaluated the worker process is sent ``SIGSEGV`` — the same death a segfault in a kernel gives (SIGILL
and SIGKILL take the same path; the CLI tests inject all three on a real run).

Caught when all of this holds:

* the request in flight ends as ``infra_error`` whose error names the signal
  (``engine_crash: worker died by SIGSEGV …``), never as a model answer;
* the run stops sending on the arm (its circuit opens with the crash as the reason) and keeps the
  record finished before the crash;
* a rerun of the same folder on a fresh worker sends only the jobs without a final record and ends with
  every layout answered exactly as the clean reference run answered it (nothing lost, nothing doubled).
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import signal
import threading
from pathlib import Path
from typing import Any

import polars as pl

from depthgate.run.backends.base import Backend, EmbeddedBackendAdapter, Request, Response
from depthgate.spec.system import DecodeParams

__all__ = ["CRASH_SIGNAL", "SignalOnRequest", "inject_engine_crash"]

CRASH_SIGNAL = signal.SIGSEGV
# How long into the second request the signal is sent: inside its prompt evaluation (a 512-token prompt
# takes ≥ 0.4 s on the embedded model on 2 cores), so the worker dies mid-request, not between two.
_DELAY_S = 0.15


class SignalOnRequest:
    """A backend that sends ``sig`` to the engine's worker ``delay_s`` after request number ``nth`` goes
    out (1-based): a real signal to a real process, mid-request."""

    def __init__(self, inner: EmbeddedBackendAdapter, pid: int, nth: int, sig: signal.Signals) -> None:
        self._inner = inner
        self._pid = pid
        self._nth = nth
        self._sig = sig
        self._sent = 0
        self.name = inner.name
        self.accepts_token_ids = inner.accepts_token_ids
        self.count_tolerance = inner.count_tolerance

    @property
    def window(self) -> int | None:
        return self._inner.window

    async def generate(self, request: Request) -> Response:
        self._sent += 1
        if self._sent == self._nth:
            threading.Timer(_DELAY_S, os.kill, (self._pid, self._sig)).start()
        return await self._inner.generate(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def _run(out: Path, layouts: pl.DataFrame, backend: Backend, max_tokens: int) -> Any:
    from depthgate.run.options import RunOptions
    from depthgate.run.runner import run_pairs

    return run_pairs(
        [("system", row) for row in layouts.iter_rows(named=True)],
        {"system": backend},
        out,
        RunOptions(
            run_id="faults-engine-crash",
            manifest_digest=hashlib.sha256(b"depthgate-faults/engine-crash").hexdigest(),
            decode=DecodeParams(max_tokens=max_tokens, seeds=[0]),
            concurrency=1,
            seeds=[0],
            progress=False,
        ),
    )


def inject_engine_crash(
    work: Path,
    layouts: pl.DataFrame,
    *,
    model_path: Path,
    tokenizer: Any,
    n_ctx: int,
    max_tokens: int,
    n_threads: int | None = None,
) -> tuple[bool, str, str]:
    """Run the fault; ``(caught, reason, detail)``. The reference is a clean run of the same ``layouts`` on
    a fresh worker first (``work/engine-crash-reference``)."""
    from depthgate.run.backends.llamacpp_worker import LlamaWorkerBackend
    from depthgate.run.records import read_records

    if layouts.height < 3:
        return False, "too_few_layouts", f"{layouts.height} layouts; the fault needs ≥ 3"
    out = work / "engine-crash"

    def fresh() -> LlamaWorkerBackend:
        return LlamaWorkerBackend(model_path, n_ctx=n_ctx, tokenizer=tokenizer, n_threads=n_threads)

    with fresh() as clean:
        _run(work / "engine-crash-reference", layouts, EmbeddedBackendAdapter(clean, owns=False), max_tokens)
    reference = read_records(work / "engine-crash-reference")
    if set(reference["status"].to_list()) != {"ok"}:
        return False, "clean_reference_failed", f"clean run statuses {reference['status'].to_list()}"
    worker = fresh()
    killer = SignalOnRequest(EmbeddedBackendAdapter(worker, name="gemma"), worker.pid, 2, CRASH_SIGNAL)
    try:
        first = _run(out, layouts, killer, max_tokens)
    finally:
        asyncio.run(killer.aclose())
    records = read_records(out)
    lost = records.filter(pl.col("status") == "infra_error")
    errors = sorted(set(lost["error"].to_list()))
    name = CRASH_SIGNAL.name
    detail = (
        f"{name} sent mid-request 2 of {layouts.height}: errors {errors}, stopped: {first.circuit_reason}"
    )
    if not (lost.height >= 1 and all(name in str(e) and str(e).startswith("engine_crash") for e in errors)):
        return False, "crash_not_named", detail
    if first.circuit_open is None or name not in str(first.circuit_reason):
        return False, "run_not_stopped", detail
    if records.filter(pl.col("status") == "ok").height < 1:
        return False, "finished_record_lost", detail

    with fresh() as again:
        resumed = _run(out, layouts, EmbeddedBackendAdapter(again, name="gemma", owns=False), max_tokens)
    final = read_records(out).filter(pl.col("status") == "ok")
    want = dict(zip(reference["layout_id"].to_list(), reference["output_text"].to_list(), strict=True))
    got = dict(zip(final["layout_id"].to_list(), final["output_text"].to_list(), strict=True))
    detail += f"; resume sent {resumed.written} of {layouts.height}"
    if final.height != layouts.height or got != want:
        return False, "resume_differs", detail + f"; {final.height} ok records after the resume"
    if resumed.written != layouts.height - first.ok:
        return False, "resume_resent", detail
    return True, "engine_crash", detail
