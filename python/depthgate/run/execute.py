"""Sending one job: the request built from its layout, the run's one retry policy and circuit breaker,
failover between replicas, and the record with every check of the answer (counts, echoed ids, clamped
output). Both engines send through :class:`JobRunner`."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import numpy.typing as npt


from depthgate.exceptions import (
    BackendRequestError,
    EngineCrashError,
    InfraError,
    MalformedAnswerError,
    OverLengthError,
    TransientBackendError,
)
from depthgate.run.backends.base import Backend, Request, Response, endpoint_url
from depthgate.run.jobs import Job, LayoutSource, layout_position, local_tokens
from depthgate.run.options import RunOptions
from depthgate.run.retry import CircuitBreaker

log = logging.getLogger("depthgate.run.runner")


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


class JobRunner:
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
            "position": layout_position(layout),
            "seed": job.seed,
            "status": status,
            "prompt_tokens_local": local_tokens(layout),
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
        local = local_tokens(job.layout) or 0
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

    def _unanswered(
        self, job: Job, last: InfraError | None, attempts: int, failed: Sequence[str]
    ) -> dict[str, Any]:
        """The record of a job whose tries all failed. The last one got an answer that is not the
        model's (issue #37, item 2): a system failure named by it (``malformed_answer``,
        ``empty_completion``) with the server's own words (a safe excerpt) in ``error``, never scored as
        the model's answer, never lost data. Else ``infra_error`` (re-run on resume)."""
        if isinstance(last, MalformedAnswerError):
            said = f"; the server said: {last.excerpt}" if last.excerpt else ""
            return self.record(
                job,
                "system_fail",
                system_fail_reason=last.reason,
                attempts=attempts,
                error=f"{last.summary}{said}"[:400],
                endpoint=last.endpoint or (failed[-1] if failed else None),
                failed=failed,
            )
        summary = getattr(last, "summary", None) or (type(last).__name__ if last else "unknown")
        return self.record(
            job,
            "infra_error",
            attempts=attempts,
            error=str(summary)[:300],
            endpoint=failed[-1] if failed else None,
            failed=failed,
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
                if not isinstance(exc, MalformedAnswerError):  # a server that answers is not down
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
            except EngineCrashError as exc:  # the worker is gone: this job is lost, the arm stops here
                attempts += 1
                last = exc
                self.breaker.trip(job.arm, exc.message)
                log.error("%s", exc.message)
                break
            except InfraError as exc:  # malformed answer, closed backend: no retry now, re-run on resume
                attempts += 1
                last = exc
                break
            self.breaker.success(job.arm)
            return self._check(job, resp, time.perf_counter() - start, attempts + 1, failed)
        return self._unanswered(job, last, attempts, failed)
