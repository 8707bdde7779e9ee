"""Reading a user's file, and turning a library's failure into a named error.

Every step reads files the user names (matrices, suites, templates, models, record shards) and calls
libraries that raise their own exceptions; each failure must reach the user as a depthgate error that
names the file and the fix. This module is that mapping, written once: the callers keep their
own wording, so the messages the tests pin stay as they were.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, NoReturn

from depthgate.exceptions import DepthgateError

__all__ = [
    "ReadFailures",
    "atomic_write_bytes",
    "cache_dir",
    "dist_version",
    "import_extra",
    "named_failure",
    "read_json",
    "read_utf8",
    "sha256_file",
]


@dataclass(frozen=True)
class ReadFailures:
    """What to tell the user, as (message, fix), for each way a file can fail to read or parse.

    The messages are format strings: ``not_utf8`` may use ``{reason}`` and ``{start}`` (the
    UnicodeDecodeError's reason and byte offset), ``unreadable`` ``{strerror}`` (the OSError's text,
    or the error itself), ``not_json`` ``{msg}``, ``{lineno}`` and ``{colno}``; each may use ``{exc}``.
    """

    error: type[DepthgateError]
    missing: tuple[str, str]
    unreadable: tuple[str, str]
    not_utf8: tuple[str, str] = ("not UTF-8 text ({reason})", "save the file as UTF-8")
    not_json: tuple[str, str] = (
        "invalid JSON: {msg} at line {lineno} column {colno}",
        "fix the JSON syntax at the reported line",
    )
    field: str | None = None

    def raise_for(self, path: Path, failure: tuple[str, str], **details: object) -> NoReturn:
        message, fix = failure
        raise self.error(message.format(**details), file=str(path), field=self.field, fix=fix) from None


def read_utf8(path: Path, failures: ReadFailures) -> str:
    """The file's text, decoded as UTF-8 in text mode (universal newlines); a failure raises
    ``failures.error`` naming the file, ``failures.field`` and the fix for that failure."""
    f = failures
    # Each handler raises the named error with the cause suppressed: the user needs the file and
    # the fix, not the OSError's traceback under it.
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        f.raise_for(path, f.missing)
    except UnicodeDecodeError as exc:
        f.raise_for(path, f.not_utf8, reason=exc.reason, start=exc.start, exc=exc)
    except OSError as exc:
        f.raise_for(path, f.unreadable, strerror=exc.strerror or exc, exc=exc)


def read_json(path: Path, failures: ReadFailures) -> Any:
    """The file's JSON value; a file that cannot be read or parsed raises as :func:`read_utf8` does."""
    text = read_utf8(path, failures)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        failures.raise_for(path, failures.not_json, msg=exc.msg, lineno=exc.lineno, colno=exc.colno, exc=exc)


@contextmanager
def named_failure(
    error: type[DepthgateError],
    what: str,
    *,
    file: str | Path | None,
    fix: str,
    field: str | None = None,
    catch: type[Exception] | tuple[type[Exception], ...] = Exception,
) -> Iterator[None]:
    """Re-raise a ``catch`` exception from the block as ``error("what (Type: detail)")`` naming file,
    field and fix. A depthgate error from the block already names its input and passes unchanged."""
    try:
        yield
    except DepthgateError:
        raise
    except catch as exc:
        raise error(
            f"{what} ({type(exc).__name__}: {exc})",
            file=None if file is None else str(file),
            field=field,
            fix=fix,
        ) from exc


def import_extra(
    *modules: str,
    error: type[DepthgateError],
    what: str,
    fix: str,
    field: str | None = None,
    file: str | None = None,
) -> ModuleType:
    """Import an optional dependency (``modules`` in order: ``"ray", "ray.data"``) and return the
    first; a missing one raises ``error`` as "``what`` (the ImportError)" with the extra to install
    as the fix. The harness runs without every extra; which one a command needs is said here, once."""
    try:
        loaded = [importlib.import_module(name) for name in modules]
    except ImportError as exc:
        raise error(f"{what} ({exc})", field=field, file=file, fix=fix) from None
    return loaded[0]


def dist_version(dist: str) -> str | None:
    """The installed version of distribution ``dist`` (``llama-cpp-python``), None when it is not
    installed: what a manifest records of the engine and libraries a run used."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cache_dir() -> Path:
    """The depthgate cache folder: ``$DEPTHGATE_CACHE`` or ``~/.cache/depthgate`` (created)."""
    env = os.environ.get("DEPTHGATE_CACHE")
    base = Path(env).expanduser() if env else Path.home() / ".cache" / "depthgate"
    base.mkdir(parents=True, exist_ok=True)
    return base


def atomic_write_bytes(target: Path, data: bytes) -> None:
    """Write ``target`` whole or not at all (a temporary file beside it, then a rename)."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; cache entries are shared, read-only data
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
