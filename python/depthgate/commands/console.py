"""Standard output that a closed reader cannot turn into a traceback (issue #21, item 3).

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
import sys
from collections.abc import Iterator
from typing import TextIO

__all__ = ["pipe_safe_stdout"]


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
        return not self.broken and self._inner.isatty()

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
