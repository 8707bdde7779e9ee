"""The one retry policy of a run, and the circuit breaker that stops a run against a dead endpoint.

Backends make exactly one attempt per call and raise :class:`~depthgate.run.backends.base.
TransientBackendError` (with the server's ``Retry-After`` when it sent one); the runner alone retries,
with this policy. Before, the HTTP client and the runner each retried with their own backoff formula,
up to 4 × 3 = 12 attempts per job and ~90 s per job against an unreachable endpoint.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from depthgate.exceptions import InputError

__all__ = ["CircuitBreaker", "RetryPolicy"]


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a transient failure is retried.

    ``max_attempts``: tries per job (1 = no retry). The delay before try ``k + 1`` is the server's
    ``Retry-After`` (capped at ``max_retry_after_s``) or, without one, exponential backoff with jitter:
    uniform in ``[cap/2, cap]`` with ``cap = min(backoff_max_s, backoff_base_s · 2^(k-1))``.
    ``breaker_after``: consecutive transient failures on one backend (across jobs) after which the
    circuit opens and the run stops sending (0 = never); the rerun resumes where it stopped.
    """

    max_attempts: int = 4
    backoff_base_s: float = 0.5
    backoff_max_s: float = 30.0
    max_retry_after_s: float = 120.0
    breaker_after: int = 20

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise InputError(
                f"max_attempts must be ≥ 1, got {self.max_attempts}",
                field="max_attempts",
                fix="use 1 (no retry) or more",
            )
        if not (0 <= self.backoff_base_s <= self.backoff_max_s) or self.max_retry_after_s < 0:
            raise InputError(
                "backoff times must satisfy 0 ≤ backoff_base_s ≤ backoff_max_s and max_retry_after_s ≥ 0",
                field="backoff_base_s",
                fix="e.g. backoff_base_s = 0.5, backoff_max_s = 30",
            )
        if self.breaker_after < 0:
            raise InputError(
                f"breaker_after must be ≥ 0, got {self.breaker_after}",
                field="breaker_after",
                fix="0 disables the circuit breaker; e.g. 20",
            )

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds to wait after failed try number ``attempt`` (1-based)."""
        if retry_after is not None:
            return float(min(max(retry_after, 0.0), self.max_retry_after_s))
        cap = min(self.backoff_max_s, self.backoff_base_s * (2 ** (attempt - 1)))
        return float(cap * (0.5 + 0.5 * rng.random()))


class CircuitBreaker:
    """Counts consecutive transient failures per backend; :meth:`open` once one reaches the limit.

    A success on a backend resets its count. Once open, a breaker stays open for the rest of the call:
    the run stops sending and the rerun (after the endpoint is fixed) resumes the jobs not yet recorded.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._streak: dict[str, int] = {}
        self.tripped: str | None = None
        #: Why it opened, when not by the streak (an engine that died: :meth:`trip`).
        self.reason: str | None = None

    def success(self, backend: str) -> None:
        self._streak[backend] = 0

    def failure(self, backend: str) -> None:
        streak = self._streak.get(backend, 0) + 1
        self._streak[backend] = streak
        if self.limit and streak >= self.limit and self.tripped is None:
            self.tripped = backend

    def trip(self, backend: str, reason: str) -> None:
        """Open at once for ``backend``: no retry can help (its engine's worker died)."""
        if self.tripped is None:
            self.tripped = backend
            self.reason = reason

    @property
    def open(self) -> bool:
        return self.tripped is not None

    def streak(self, backend: str) -> int:
        return self._streak.get(backend, 0)
