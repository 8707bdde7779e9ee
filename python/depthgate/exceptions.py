"""The one exception tree of depthgate, and the exit code each family maps to.

Every error a user can cause names the input (file), the field and the fix. Errors raised in the Rust
core are translated into these classes once, at the binding boundary (``rust/depthgate-py/src/errors.rs``).
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING, ClassVar, TypedDict

if TYPE_CHECKING:  # typing.Unpack is Python 3.11; annotations are not evaluated, so 3.10 imports this
    from typing import Unpack


class ExitCode(enum.IntEnum):
    """Process exit codes. Documented in README.md; CI jobs branch on them."""

    PASS = 0
    FAIL = 10
    INCONCLUSIVE = 11
    SAFETY = 12
    FAIL_SYSTEM = 13
    BAD_INPUT = 20
    VERIFY_FAILED = 21
    TOKENIZER_MISMATCH = 22
    INFRA = 30
    ROUND_OPEN = 31


class DepthgateError(Exception):
    """Base of every depthgate error."""

    exit_code: ExitCode = ExitCode.INFRA

    def __init__(
        self, message: str, *, file: str | None = None, field: str | None = None, fix: str | None = None
    ) -> None:
        self.message = message
        self.file = file
        self.field = field
        self.fix = fix
        super().__init__(self._compose())

    def _compose(self) -> str:
        parts = []
        if self.file:
            parts.append(str(self.file))
        if self.field:
            parts.append(f"field {self.field!r}")
        head = ": ".join(parts)
        text = f"{head}: {self.message}" if head else self.message
        if self.fix:
            text += f" (fix: {self.fix})"
        return text


class InputError(DepthgateError, ValueError):
    """Bad input: a file, field or argument the user must change."""

    exit_code = ExitCode.BAD_INPUT


class TokenizerLoadError(InputError):
    """A tokenizer file that cannot be read or parsed."""


class TemplateError(InputError):
    """A chat template that cannot be loaded, raises while rendering, or cannot frame a context slot."""


class SpecError(InputError):
    """An invalid layout spec, case, matrix or analysis plan."""


class PlanChangedError(InputError):
    """The frozen analysis plan or case set changed under an existing run id."""


class VerificationError(DepthgateError):
    """A layout or record violates the token-exact contract (re-check found a violation)."""

    exit_code = ExitCode.VERIFY_FAILED


class TokenizerMismatchError(DepthgateError):
    """The server tokenizes a built prompt differently from the arm's tokenizer (checked before the
    first request, :mod:`depthgate.run.parity`): nothing was sent."""

    exit_code = ExitCode.TOKENIZER_MISMATCH


class InfraError(DepthgateError, RuntimeError):
    """Infrastructure failure: unreachable endpoint, crashed backend, missing credentials."""

    exit_code = ExitCode.INFRA


class RoundOpenError(DepthgateError):
    """``depthgate gate`` on the merge of a sharded sequential run before its last round: nothing is lost,
    the open slices' next look is simply not sent yet (no verdict; the message says which round and
    which slices are open, ``fix`` the next round's commands)."""

    exit_code = ExitCode.ROUND_OPEN


class BackendError(InfraError):
    """A backend returned an error that is not the caller's input (5xx, timeouts, crashes)."""


class Where(TypedDict, total=False):
    """Where a :class:`~depthgate.exceptions.DepthgateError` points: the file, the field and the fix
    (the keyword arguments every error below passes on as they are)."""

    file: str | None
    field: str | None
    fix: str | None


class RequestFacts(Where, total=False):
    """What a failed request says of itself, safe for records and logs (never server-supplied text):
    ``summary``, a short description; ``status``, the HTTP status when there was one; ``endpoint``, the
    endpoint that failed, when a backend over several endpoints
    (:class:`~depthgate.run.backends.pool.ReplicaPool`) says which."""

    summary: str | None
    status: int | None
    endpoint: str | None


class RequestFailure(DepthgateError):
    """Base of the three ways one request fails (below), which the runner records with the same facts
    (:class:`RequestFacts`). ``summary`` falls back to ``default_summary``, else to the message."""

    default_summary: ClassVar[str | None] = None

    def __init__(
        self,
        message: str,
        *,
        summary: str | None = None,
        status: int | None = None,
        endpoint: str | None = None,
        **where: Unpack[Where],
    ) -> None:
        super().__init__(message, **where)
        self.summary = summary or self.default_summary or message
        self.status = status
        self.endpoint = endpoint


class TransientBackendError(RequestFailure, BackendError):
    """A failure worth retrying: HTTP 429/5xx, a timeout, a refused or dropped connection.

    ``retry_after``: the server's ``Retry-After`` in seconds when it sent one. A backend makes one
    attempt; the runner retries (:class:`depthgate.run.retry.RetryPolicy`).

    Set by a backend over several endpoints (:class:`~depthgate.run.backends.pool.ReplicaPool`), beside
    ``endpoint``: ``failover``, another healthy endpoint that has not failed this request will take the
    retry at once (the runner retries it without a backoff, without counting a try and without feeding
    the circuit breaker: one endpoint down is not the arm down).
    """

    def __init__(
        self,
        message: str,
        *,
        retry_after: float | None = None,
        failover: bool = False,
        **facts: Unpack[RequestFacts],
    ) -> None:
        super().__init__(message, **facts)
        self.retry_after = retry_after
        self.failover = failover


class MalformedAnswerError(TransientBackendError):
    """A 2xx answer that is not the model's: no ``choices`` or no ``text``, zero generated tokens, a body
    that contradicts its own ``usage`` counts, or no JSON at all (issue #37, item 2). ``reason`` names it
    as a serving failure (``malformed_answer``, ``empty_completion``); ``excerpt`` is a short excerpt of
    the server's own words, safe for records (the API key redacted, the prompt and its ids removed:
    :func:`depthgate.run.backends.http_wire.server_excerpt`).

    Retried with the run's policy (a gateway's glitch passes) without feeding the circuit breaker (the
    server answers); still so after the last try, the job is recorded ``system_fail`` with ``reason``
    and the excerpt in ``error``, never scored as the model's answer and never lost data (INFRA)."""

    def __init__(
        self,
        message: str,
        *,
        reason: str = "malformed_answer",
        excerpt: str = "",
        **facts: Unpack[RequestFacts],
    ) -> None:
        super().__init__(message, **facts)
        self.reason = reason
        self.excerpt = excerpt


class EngineCrashError(RequestFailure, BackendError):
    """The engine's worker process died (by a signal: ``SIGILL``, ``SIGSEGV``, ``SIGKILL`` …, or an exit)
    while loading the model or answering a request (:mod:`depthgate.run.backends.llamacpp_worker`).

    Not retried in the run: the runner records the request in flight as ``infra_error`` with this
    ``summary``, stops sending on the arm, and the run ends INFRA (exit 30) with its reports; a rerun
    resumes on a fresh worker. ``signal_name``: e.g. ``"SIGILL"``, ``None`` for an exit; ``returncode``:
    the worker's, as :class:`subprocess.Popen` gives it."""

    default_summary = "engine_crash"

    def __init__(
        self,
        message: str,
        *,
        signal_name: str | None = None,
        returncode: int | None = None,
        **facts: Unpack[RequestFacts],
    ) -> None:
        super().__init__(message, **facts)
        self.signal_name = signal_name
        self.returncode = returncode


class OverLengthError(RequestFailure):
    """The backend refused the prompt as longer than its window: a system failure of the layout.

    Recorded as ``system_fail`` with reason ``overflow``, never retried, never a silent truncation.
    ``n_prompt_tokens`` and ``window``: the counts the backend reported, when it did.
    """

    exit_code = ExitCode.FAIL
    default_summary = "prompt longer than the backend's window"

    def __init__(
        self,
        message: str,
        *,
        n_prompt_tokens: int | None = None,
        window: int | None = None,
        **facts: Unpack[RequestFacts],
    ) -> None:
        super().__init__(message, **facts)
        self.n_prompt_tokens = n_prompt_tokens
        self.window = window


class BackendRequestError(RequestFailure, InputError):
    """The backend refused the request for a reason the caller must fix (4xx other than over-length,
    an unknown model, a parameter the backend does not support)."""


__all__ = [
    "BackendError",
    "BackendRequestError",
    "DepthgateError",
    "EngineCrashError",
    "ExitCode",
    "InfraError",
    "InputError",
    "MalformedAnswerError",
    "OverLengthError",
    "PlanChangedError",
    "RequestFacts",
    "RequestFailure",
    "SpecError",
    "TemplateError",
    "TokenizerLoadError",
    "TokenizerMismatchError",
    "TransientBackendError",
    "VerificationError",
    "Where",
]
