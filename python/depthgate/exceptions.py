"""The one exception tree of depthgate, and the exit code each family maps to.

Every error a user can cause names the input (file), the field and the fix. Errors raised in the Rust
core are translated into these classes once, at the binding boundary (``rust/depthgate-py/src/errors.rs``).
"""

from __future__ import annotations

import enum


class ExitCode(enum.IntEnum):
    """Process exit codes. Documented in README.md; CI jobs branch on them."""

    PASS = 0
    FAIL = 10
    INCONCLUSIVE = 11
    SAFETY = 12
    FAIL_SYSTEM = 13
    BAD_INPUT = 20
    VERIFY_FAILED = 21
    INFRA = 30


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


class InfraError(DepthgateError, RuntimeError):
    """Infrastructure failure: unreachable endpoint, crashed backend, missing credentials."""

    exit_code = ExitCode.INFRA


class BackendError(InfraError):
    """A backend returned an error that is not the caller's input (5xx, timeouts, crashes)."""


__all__ = [
    "BackendError",
    "DepthgateError",
    "ExitCode",
    "InfraError",
    "InputError",
    "PlanChangedError",
    "SpecError",
    "TemplateError",
    "TokenizerLoadError",
    "VerificationError",
]
