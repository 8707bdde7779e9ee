"""The console of a command: standard output that a closed reader cannot turn into a traceback (issue #21,
item 3), errors that name the file they are about, and the endpoint lines of a run (summarised, item 1).

Standard output first.

``depthgate gate RUN | head -1`` (or ``| true``) closes the pipe while the verdict is still being
printed. The reports are written before anything is printed, so the run's result stands; what must not
happen is a ``BrokenPipeError`` traceback, an exit code other than the command's, or the "Exception
ignored" line Python prints when it flushes a dead pipe at exit. :func:`pipe_safe_stdout` wraps
``sys.stdout`` for one command: the first write or flush that finds the pipe closed points file
descriptor 1 at ``/dev/null`` (the recipe of the Python documentation, "Note on SIGPIPE") and every
later write is dropped.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from depthgate.spec.limits import summarise_urls

__all__ = ["naming_the_file", "note_endpoints", "pipe_safe_stdout"]

# A serde message from the Rust core about a value of the wrong kind ("invalid value: integer `-5`,
# expected usize at line 1 column 2899"): library words for "a negative number where a count goes".
_SERDE = re.compile(
    r"invalid (?:value|type): (?P<what>[^,]+), expected (?P<want>[\w ]+?)(?: at line \d+ column \d+)?$"
)
_KINDS = {
    "usize": "a count or offset (an integer >= 0)",
    "u32": "a token id (an integer >= 0)",
    "u64": "an integer >= 0",
}


class _PipeSafe(io.TextIOBase):
    """A text stream that forwards to ``inner`` until the reader goes away, then drops the output."""

    def __init__(self, inner: TextIO) -> None:
        super().__init__()
        self._inner = inner
        self.broken = False

    def _gone(self) -> None:
        self.broken = True
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._inner.fileno())
            os.close(devnull)

    def write(self, text: str) -> int:
        if not self.broken:
            try:
                self._inner.write(text)
            except BrokenPipeError:
                self._gone()
        return len(text)

    def flush(self) -> None:
        if not self.broken:
            try:
                self._inner.flush()
            except BrokenPipeError:
                self._gone()

    def isatty(self) -> bool:
        # Asked at exit too (Ray's colorama resets the terminal in an atexit hook, after pytest closed the
        # captured stream): a closed stream is no terminal, not an error.
        try:
            return not self.broken and self._inner.isatty()
        except ValueError:
            return False

    def fileno(self) -> int:
        return self._inner.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._inner, "encoding", "utf-8")


@contextlib.contextmanager
def pipe_safe_stdout() -> Iterator[None]:
    """``sys.stdout`` made safe against a closed reader for the block (and flushed at its end)."""
    inner = sys.stdout
    safe = _PipeSafe(inner)
    sys.stdout = safe
    try:
        yield
    finally:
        safe.flush()
        sys.stdout = inner


def _plain(message: str) -> str:
    """``message`` without the Rust core's serde wording (see :data:`_SERDE`)."""
    match = _SERDE.search(message)
    if match is None:
        return message
    want = _KINDS.get(match.group("want").strip(), match.group("want").strip())
    what = match.group("what").replace("`", "")
    return f"a value of the wrong kind: {what} where {want} is expected"


#: Words of a fix meant for a developer (a module path, a library): the caller's fix replaces it.
_DEVELOPER = re.compile(r"depthgate\.[a-z_]+\.|pydantic|serde|polars|by hand", re.IGNORECASE)


@contextlib.contextmanager
def naming_the_file(path: str | os.PathLike[str], *, fix: str) -> Iterator[None]:
    """Bad-input errors raised in the block that name no file are about ``path`` (the input the block
    reads): re-raised naming it, in the user's words; ``fix`` replaces a fix that speaks to a developer."""
    from depthgate.exceptions import InputError

    try:
        yield
    except InputError as exc:
        if exc.file or (exc.field or "").startswith("--"):  # named already, or about an option
            raise
        field = None if exc.field in (None, "spec", "layouts") else exc.field
        keep = exc.fix and not _DEVELOPER.search(exc.fix)
        raise InputError(
            _plain(exc.message), file=os.fspath(path), field=field, fix=exc.fix if keep else fix
        ) from None


def note_endpoints(arm: str, backend: Any, concurrency: int) -> None:
    """One stderr line for an arm on several endpoints: which are up, and the run's cap."""
    endpoints = getattr(backend, "endpoints", None)
    if not endpoints:
        return
    healthy = list(getattr(backend, "healthy", endpoints))
    down = [e for e in endpoints if e not in healthy]
    print(
        f"depthgate: {arm}: {len(healthy)} of {len(endpoints)} endpoint(s) up, window {backend.window}"
        + (f" (down at start, drained: {summarise_urls(down)})" if down else "")
        + f"; --concurrency {concurrency} caps the whole run",
        file=sys.stderr,
    )
