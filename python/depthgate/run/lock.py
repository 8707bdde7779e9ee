"""One writer per run folder: an exclusive, non-blocking ``flock`` held for the lifetime of a run."""

from __future__ import annotations

from pathlib import Path
from typing import IO

from depthgate.exceptions import InfraError

LOCK_FILE = ".depthgate-run.lock"


class DirLock:
    """An exclusive, non-blocking ``flock`` on ``out_dir``: one writer at a time (released by the OS
    when the process dies, SIGKILL included)."""

    def __init__(self, out_dir: Path) -> None:
        self.path = out_dir / LOCK_FILE
        self._handle: IO[bytes] | None = None

    def __enter__(self) -> DirLock:
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
