"""Many endpoints behind one arm: :class:`ReplicaPool`.

A matrix arm may name several servers (``endpoints = ["http://…", …]``): replicas of one model. The pool
is one :class:`~depthgate.run.backends.base.Backend` over one backend per endpoint, all of the same kind
and settings (:func:`depthgate.run.backends.make_backend` builds them).

* **Probed before the first request.** :meth:`ReplicaPool.probe_all` reads every endpoint's
  ``/v1/models`` at once: each must serve the system's model (else :class:`BackendRequestError`, exit 20)
  and all must report the same served window (``max_model_len``; "not reported" is a value too), else
  :class:`~depthgate.exceptions.InputError` (exit 20) naming every endpoint and its window. An endpoint
  that cannot be reached at start is drained (below), not fatal: the run starts on the others, and when
  none is reachable every job fails as the runner's circuit breaker expects (INFRA, exit 30, resumable).
* **Sticky routing.** A request goes to the endpoint that ranks first for its :attr:`Request.affinity`
  (the haystack: case × length) by rendezvous (highest-random-weight) hashing of the endpoint URL with
  the key: every position and seed of one haystack lands on one replica, whose prefix cache then holds
  it; removing or adding a replica moves only the keys that rank it first. Under load a replica takes at
  most ``(1 + load_slack) ×`` its share of the requests in flight (consistent hashing with bounded loads),
  the next replica in the key's ranking takes the overflow.
* **Per-endpoint concurrency.** Each replica keeps its own ``concurrency`` slots (the arm's
  ``runtime.concurrency`` is per endpoint here); the run's ``--concurrency`` still caps the whole run.
* **Drain and failover.** A transient failure (:class:`TransientBackendError`: refused connection, a
  server killed mid-request, 5xx, timeout) is re-raised with the endpoint that failed and ``failover``
  set when another healthy endpoint has not failed this request: the runner then retries at once on that
  endpoint (no backoff, no try counted, the circuit breaker not fed). After ``drain_after`` consecutive
  transient failures an endpoint is *drained*: no new requests; its in-flight ones finish or fail. A
  drained endpoint is probed again after ``readmit_after_s`` (doubling up to ``readmit_max_s``) and
  re-admitted when it serves the model with the pool's window (a replica restarted with another window
  is excluded for the rest of the run). When every endpoint is drained, each request first re-probes the
  endpoints (at most once a second each) and otherwise fails without failover, so the runner's breaker
  opens after its limit: INFRA, exit 30, and the rerun resumes.
* **Accounting.** Every :class:`Response` names the endpoint that answered (:attr:`Response.endpoint`),
  every failure the endpoint that failed; :meth:`ReplicaPool.stats` counts per endpoint.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from depthgate.exceptions import (
    BackendRequestError,
    DepthgateError,
    InputError,
    MalformedAnswerError,
    OverLengthError,
    TransientBackendError,
)
from depthgate.run.backends.base import Backend, Request, Response, endpoint_url
from depthgate.spec.limits import summarise_urls

__all__ = ["DRAIN_AFTER", "READMIT_AFTER_S", "ProbedBackend", "ReplicaPool", "rendezvous_order"]

log = logging.getLogger("depthgate.run.backends.pool")

#: Consecutive transient failures after which an endpoint is drained.
DRAIN_AFTER = 3
#: Seconds before a drained endpoint is probed again (doubling after every failed probe).
READMIT_AFTER_S = 30.0
READMIT_MAX_S = 300.0
#: With every endpoint drained, an endpoint is re-probed at most this often (seconds).
_MIN_REPROBE_S = 1.0
#: A replica takes at most (1 + LOAD_SLACK) × its share of the requests in flight.
LOAD_SLACK = 0.25
_MAX_ROUTES_CACHED = 100_000


class ProbedBackend(Backend, Protocol):
    """A backend the pool can hold: it has a URL and a ``probe`` of the served model and window
    (:class:`~depthgate.run.backends.http.OpenAICompletionsBackend`)."""

    base_url: str

    @property
    def served_window(self) -> int | None: ...

    async def probe(self) -> dict[str, Any]: ...


def rendezvous_order(endpoints: Sequence[str], key: str) -> tuple[int, ...]:
    """Indices of ``endpoints`` from the highest to the lowest rendezvous weight for ``key`` (stable
    across processes: blake2b of the endpoint URL and the key)."""
    weights = [
        (hashlib.blake2b(f"{url}\x00{key}".encode(), digest_size=8).digest(), i)
        for i, url in enumerate(endpoints)
    ]
    return tuple(i for _, i in sorted(weights, reverse=True))


@dataclass
class _Replica:
    index: int
    backend: ProbedBackend
    endpoint: str
    healthy: bool = True
    probed: bool = False
    excluded: str | None = None
    streak: int = 0
    load: int = 0
    sent: int = 0
    answered: int = 0
    failed: int = 0
    drains: int = 0
    probing: bool = False
    probe_failures: int = 0
    next_probe: float = 0.0
    last_probe: float = -math.inf


_UNSET: Any = object()


class ReplicaPool:
    """One backend over several replicas of one model (see the module docstring).

    ``replicas``: backends of one kind and settings, one per endpoint (distinct URLs). ``name``: the
    system name. ``drain_after``, ``readmit_after_s``, ``readmit_max_s``, ``load_slack``: see the module
    docstring; ``clock``: monotonic seconds (tests).
    """

    def __init__(
        self,
        replicas: Sequence[ProbedBackend],
        *,
        name: str,
        drain_after: int = DRAIN_AFTER,
        readmit_after_s: float = READMIT_AFTER_S,
        readmit_max_s: float = READMIT_MAX_S,
        load_slack: float = LOAD_SLACK,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not replicas:
            raise ValueError("a replica pool needs at least one backend")
        if drain_after < 1 or readmit_after_s <= 0 or readmit_max_s < readmit_after_s or load_slack < 0:
            raise ValueError("drain_after ≥ 1, 0 < readmit_after_s ≤ readmit_max_s and load_slack ≥ 0")
        urls = [endpoint_url(r.base_url) for r in replicas]
        if len(set(urls)) != len(urls):
            dup = sorted({u for u in urls if urls.count(u) > 1})
            raise InputError(
                f"system {name!r} lists endpoint(s) {dup!r} more than once",
                field=f"{name}.endpoints",
                fix="list each server once",
            )
        first = replicas[0]
        for r in replicas[1:]:
            if (
                type(r) is not type(first)
                or r.accepts_token_ids != first.accepts_token_ids
                or r.count_tolerance != first.count_tolerance
            ):
                raise ValueError("the replicas of a pool must be backends of one kind with one setting")
        self.name = name
        self.accepts_token_ids = first.accepts_token_ids
        self.accepts_id_array = bool(getattr(first, "accepts_id_array", False))
        self.count_tolerance = first.count_tolerance
        self.drain_after = drain_after
        self.readmit_after_s = readmit_after_s
        self.readmit_max_s = readmit_max_s
        self.load_slack = load_slack
        self._clock = clock
        self._replicas = [_Replica(i, r, u) for i, (r, u) in enumerate(zip(replicas, urls, strict=True))]
        self._served_window: Any = _UNSET  # the window every probed replica agreed on
        self._probed = False
        self._probe_lock: asyncio.Lock | None = None
        self._probe_loop: asyncio.AbstractEventLoop | None = None
        self._failed: dict[tuple[str, str, int], set[int]] = {}
        self._routes: dict[str, tuple[int, ...]] = {}

    def __repr__(self) -> str:
        return f"ReplicaPool(name={self.name!r}, endpoints={self.endpoints!r}, window={self.window})"

    # -- what the runner reads ------------------------------------------------------------------------

    @property
    def endpoints(self) -> list[str]:
        """The endpoint URLs, in the order given."""
        return [r.endpoint for r in self._replicas]

    @property
    def replicas(self) -> list[ProbedBackend]:
        return [r.backend for r in self._replicas]

    @property
    def window(self) -> int | None:
        """The window every probed replica has (the configured one before any probe)."""
        for r in self._replicas:
            if r.probed:
                return r.backend.window
        return self._replicas[0].backend.window

    @property
    def healthy(self) -> list[str]:
        """Endpoints that take new requests."""
        return [r.endpoint for r in self._replicas if r.healthy]

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per endpoint: requests ``sent``, ``answered`` (any answer, ok or refused) and ``failed``
        (transient failures), ``drains`` (times drained), whether it is ``healthy`` now, and why it is
        ``excluded`` (a restarted replica that disagrees), if it is."""
        return {
            r.endpoint: {
                "sent": r.sent,
                "answered": r.answered,
                "failed": r.failed,
                "drains": r.drains,
                "healthy": r.healthy,
                "excluded": r.excluded,
            }
            for r in self._replicas
        }

    # -- probing --------------------------------------------------------------------------------------

    async def probe_all(self) -> dict[str, dict[str, Any]]:
        """Probe every endpoint at once (served model, window); refuse replicas that disagree on the
        window (:class:`InputError`, exit 20). Unreachable endpoints are drained. Returns the model card
        of every endpoint that answered."""
        results = await asyncio.gather(*(r.backend.probe() for r in self._replicas), return_exceptions=True)
        cards: dict[str, dict[str, Any]] = {}
        now = self._clock()
        for r, result in zip(self._replicas, results, strict=True):
            r.last_probe = now
            if isinstance(result, TransientBackendError):
                r.probed = False
                self._drain(r, f"unreachable at start ({result.summary})")
            elif isinstance(result, BaseException):
                raise result
            else:
                r.probed = True
                r.healthy, r.streak = r.excluded is None, 0
                cards[r.endpoint] = result
        probed = [r for r in self._replicas if r.probed]
        windows = {r.endpoint: r.backend.served_window for r in probed}
        if len(set(windows.values())) > 1:
            listed = summarise_urls([f"{url} → {_window_text(w)}" for url, w in windows.items()])
            raise InputError(
                f"the endpoints of system {self.name!r} disagree on the served window (max_model_len): "
                f"{listed}; replicas must be identical servers (any of them may answer any job)",
                field=f"{self.name}.endpoints",
                fix="serve every endpoint of the arm with the same model and max_model_len, or drop the "
                "odd ones from endpoints",
            )
        if probed:
            self._served_window = probed[0].backend.served_window
        self._probed = True
        reachable = len(probed)
        log.info(
            "%s: %d of %d endpoint(s) reachable, served window %s",
            self.name,
            reachable,
            len(self._replicas),
            _window_text(None if self._served_window is _UNSET else self._served_window),
        )
        return cards

    async def _ensure_probed(self) -> None:
        if self._probed:
            return
        loop = asyncio.get_running_loop()
        if self._probe_lock is None or self._probe_loop is not loop:
            self._probe_lock, self._probe_loop = asyncio.Lock(), loop
        async with self._probe_lock:
            if not self._probed:
                await self.probe_all()

    async def _reprobe(self, r: _Replica) -> bool:
        """Probe a drained replica; re-admit it when it serves the model with the pool's window."""
        r.probing = True
        r.last_probe = self._clock()
        try:
            await r.backend.probe()
        except TransientBackendError as exc:
            self._probe_failed(r, exc.summary)
            return False
        except BackendRequestError as exc:  # a restarted server that no longer serves the model
            self._exclude(r, exc.summary)
            return False
        except DepthgateError as exc:  # a malformed answer: not a replica we can trust now
            self._probe_failed(r, type(exc).__name__)
            return False
        finally:
            r.probing = False
        window = r.backend.served_window
        if self._served_window is not _UNSET and window != self._served_window:
            self._exclude(
                r,
                f"serves a window of {_window_text(window)}, the pool's is "
                f"{_window_text(self._served_window)}",
            )
            return False
        if self._served_window is _UNSET:
            self._served_window = window
        r.probed = True
        r.healthy = True
        r.streak = 0
        r.probe_failures = 0
        log.warning("%s: endpoint %s is back; re-admitted", self.name, r.endpoint)
        return True

    def _probe_failed(self, r: _Replica, why: str) -> None:
        r.probe_failures += 1
        delay = min(self.readmit_max_s, self.readmit_after_s * 2 ** (r.probe_failures - 1))
        r.next_probe = self._clock() + delay
        log.info("%s: endpoint %s still down (%s); next probe in %.0f s", self.name, r.endpoint, why, delay)

    def _exclude(self, r: _Replica, why: str) -> None:
        r.healthy = False
        r.excluded = why
        log.error("%s: endpoint %s excluded for the rest of the run: %s", self.name, r.endpoint, why)

    def _drain(self, r: _Replica, why: str) -> None:
        if not r.healthy:
            return
        r.healthy = False
        r.drains += 1
        r.next_probe = self._clock() + self.readmit_after_s
        others = sum(1 for x in self._replicas if x.healthy)
        log.warning(
            "%s: endpoint %s drained (%s); %d other endpoint(s) take its jobs",
            self.name,
            r.endpoint,
            why,
            others,
        )

    # -- routing --------------------------------------------------------------------------------------

    def _ranked(self, key: str) -> tuple[int, ...]:
        order = self._routes.get(key)
        if order is None:
            order = rendezvous_order(self.endpoints, key)
            if len(self._routes) < _MAX_ROUTES_CACHED:
                self._routes[key] = order
        return order

    def route(self, request: Request) -> str:
        """The endpoint ``request`` would be sent to now (without sending it)."""
        order = self._ranked(request.affinity or request.layout_id)
        failed = self._failed.get((request.arm, request.layout_id, request.seed), set())
        chosen = self._pick(order, failed) or self._pick(order, set())
        return (chosen or self._replicas[order[0]]).endpoint

    def _pick(self, order: Sequence[int], failed: set[int]) -> _Replica | None:
        """The first healthy replica in ``order`` outside ``failed`` whose load is within its bound."""
        candidates = [self._replicas[i] for i in order if self._replicas[i].healthy and i not in failed]
        if not candidates:
            return None
        healthy = [r for r in self._replicas if r.healthy]
        in_flight = sum(r.load for r in healthy)
        bound = math.ceil((in_flight + 1) * (1.0 + self.load_slack) / len(healthy))
        for r in candidates:
            if r.load < bound:
                return r
        return min(candidates, key=lambda r: r.load)

    async def _readmit_due(self, order: Sequence[int]) -> None:
        """Re-probe, before routing, one drained replica whose cool-down is over (in ``order``)."""
        now = self._clock()
        for i in order:
            r = self._replicas[i]
            if not r.healthy and r.excluded is None and not r.probing and r.next_probe <= now:
                await self._reprobe(r)
                return

    async def _choose(self, request: Request, failed: set[int]) -> _Replica:
        order = self._ranked(request.affinity or request.layout_id)
        await self._readmit_due(order)
        chosen = self._pick(order, failed)
        if chosen is not None:
            return chosen
        # Every healthy replica has failed this request already: the first one takes it again (no
        # failover left; the runner backs off and counts the try).
        again = next((self._replicas[i] for i in order if self._replicas[i].healthy), None)
        if again is not None:
            return again
        # Every replica is drained: try to bring one back before giving up.
        now = self._clock()
        for i in order:
            r = self._replicas[i]
            due = r.excluded is None and not r.probing and now - r.last_probe >= _MIN_REPROBE_S
            if due and await self._reprobe(r):
                return r
        down = summarise_urls([r.endpoint for r in self._replicas])  # never 10,000 URLs per retry
        raise TransientBackendError(
            f"every endpoint of system {self.name!r} is down ({down})",
            summary=f"all {len(self._replicas)} endpoints down: {self.name}",
            fix="restart the servers; the rerun of the same folder sends only the jobs without a result",
        )

    # -- the Backend protocol ---------------------------------------------------------------------------

    async def generate(self, request: Request) -> Response:
        """One attempt at ``request`` on the replica it routes to (see the module docstring)."""
        await self._ensure_probed()
        key = (request.arm, request.layout_id, request.seed)
        failed = self._failed.get(key, set())
        r = await self._choose(request, failed)
        r.load += 1
        r.sent += 1
        try:
            resp = await r.backend.generate(request)
        except TransientBackendError as exc:
            r.failed += 1
            r.streak += 1
            self._failed[key] = failed | {r.index}
            if r.streak >= self.drain_after:
                self._drain(r, f"{r.streak} consecutive failures, last: {exc.summary}")
            failover = any(x.healthy and x.index not in self._failed[key] for x in self._replicas)
            if isinstance(exc, MalformedAnswerError):  # named, with the server's words, on any replica
                raise MalformedAnswerError(
                    f"{r.endpoint}: {exc.message}",
                    summary=exc.summary,
                    reason=exc.reason,
                    excerpt=exc.excerpt,
                    status=exc.status,
                    endpoint=r.endpoint,
                    fix=exc.fix,
                ) from exc
            raise TransientBackendError(
                f"{r.endpoint}: {exc.message}",
                summary=exc.summary,
                retry_after=exc.retry_after,
                status=exc.status,
                endpoint=r.endpoint,
                failover=failover,
                fix=exc.fix,
            ) from exc
        except OverLengthError as exc:
            r.streak = 0
            r.answered += 1
            self._failed.pop(key, None)
            exc.endpoint = r.endpoint
            raise
        finally:
            r.load -= 1
        r.streak = 0
        r.answered += 1
        self._failed.pop(key, None)
        return dataclasses.replace(resp, endpoint=r.endpoint)

    async def aclose(self) -> None:
        results = await asyncio.gather(*(r.backend.aclose() for r in self._replicas), return_exceptions=True)
        for result in results:
            if isinstance(result, BaseException) and not isinstance(result, Exception):
                raise result


def _window_text(window: int | None) -> str:
    return "not reported" if window is None else f"{window} tokens"
