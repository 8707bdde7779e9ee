"""Reading a user's file, turning a library's failure into a named error, and writing a file whole.

Every step reads files the user names (matrices, suites, templates, models, record shards) and calls
libraries that raise their own exceptions; each failure must reach the user as a depthgate error that
names the file and the fix. This module is that mapping, written once: the callers keep their
own wording, so the messages the tests pin stay as they were. :func:`atomic_write` is the one way any
step writes a file that a reader or a crash must never see half-written (cache entries, records,
reports, run-folder JSON): it sits here, in the lowest layer, so every step may import it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import importlib
import json
import os
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, NoReturn

from depthgate.exceptions import DepthgateError, Where

if TYPE_CHECKING:
    from typing import Unpack  # Python 3.11; annotations are not evaluated at run time

    import polars as pl

__all__ = [
    "ReadFailures",
    "atomic_write",
    "cache_dir",
    "dist_version",
    "import_extra",
    "named_failure",
    "parse_json",
    "read_json",
    "read_parquet",
    "read_toml",
    "read_utf8",
    "refuse_unencodable",
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


#: The fix for a missing .gguf model file (the embedded backend and the GGUF tokenizer reader).
GGUF_FIX = "pass the path of an existing .gguf model file"


def require_file(path: Path, error: type[DepthgateError], message: str, **where: Unpack[Where]) -> None:
    """Raise ``error(message, **where)`` unless ``path`` is a file: the one check before a file is
    opened. The error names ``path`` unless ``where`` names another file (e.g. the run folder)."""
    if not path.is_file():
        what = _not_a_file(path)
        where.setdefault("file", str(path))
        # Something is there but cannot be read as a file: name it, never "no <file>" (issue #37).
        raise error(message if what is None else f"{path.name} is {what}, not a regular file", **where)


def _not_a_file(path: Path) -> str | None:
    """What stands at ``path`` when it is not a regular file, or None when nothing does."""
    if not os.path.lexists(path):
        return None
    try:
        mode = path.stat().st_mode
    except OSError as exc:  # a symlink loop (ELOOP) or a link to nothing
        target = "a symlink loop" if path.is_symlink() and exc.errno == errno.ELOOP else None
        return target or f"a link or entry that cannot be followed ({exc.strerror})"
    kinds = (
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISCHR, "a character device (such as /dev/zero)"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISFIFO, "a named pipe"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def read_json(path: Path, failures: ReadFailures) -> Any:
    """The file's JSON value; a file that cannot be read or parsed raises as :func:`read_utf8` does, and
    a string that is not encodable text (a lone surrogate such as ``"\\ud800"``) as
    :func:`refuse_unencodable` does."""
    return parse_json(read_utf8(path, failures), path, failures)


def read_json_object(path: Path, failures: ReadFailures, fix: str) -> dict[str, Any]:
    """:func:`read_json` of a file that must hold a JSON object; anything else raises ``failures.error``
    naming the file, ``failures.field`` and ``fix``."""
    data = read_json(path, failures)
    if not isinstance(data, dict):
        found = f"expected a JSON object, found {type(data).__name__}"
        raise failures.error(found, file=str(path), field=failures.field, fix=fix)
    return data


def parse_json(text: str, path: Path, failures: ReadFailures, *, line: int | None = None) -> Any:
    """``text`` (the content of ``path``, or its line ``line`` for JSONL) as a JSON value whose every
    string is encodable UTF-8; failures raise ``failures.error`` naming the file (``path:line``)."""
    where = path if line is None else Path(f"{path}:{line}")
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        failures.raise_for(where, failures.not_json, msg=exc.msg, lineno=exc.lineno, colno=exc.colno, exc=exc)
    except RecursionError:
        failures.raise_for(where, ("nested too deeply to read", "flatten the JSON"))
    refuse_unencodable(value, file=str(where), error=failures.error)
    return value


def _unencodable(value: Any, path: str) -> tuple[str, str] | None:
    """The first string in ``value`` (nested lists and objects, keys included) that is not encodable
    UTF-8, as (field path, the offending character); None when all are. Iterative: no recursion limit."""
    stack: list[tuple[Any, str]] = [(value, path)]
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError as exc:
                return where or "(root)", item[exc.start]
        elif isinstance(item, dict):
            for key, sub in reversed(list(item.items())):
                key_path = f"{where}.{key}" if where else str(key)
                stack.append((sub, key_path))
                stack.append((key, key_path))
        elif isinstance(item, list):
            stack.extend((sub, f"{where}[{i}]") for i, sub in reversed(list(enumerate(item))))
    return None


def refuse_unencodable(value: Any, *, file: str | None, error: type[DepthgateError]) -> None:
    """Raise ``error`` naming the file and the field when a string in ``value`` holds a lone surrogate
    (JSON allows ``"\\ud800"``; no tokenizer, server or report can encode it)."""
    found = _unencodable(value, "")
    if found is not None:
        field, char = found
        raise error(
            f"contains a lone surrogate {char.encode('unicode_escape').decode()} (half of a UTF-16 pair): "
            "not encodable text",
            file=file,
            field=field,
            fix="remove the escape or write the whole character (both halves of the pair, or the "
            "character itself)",
        )


def read_toml(path: Path, failures: ReadFailures) -> dict[str, Any]:
    """The file's TOML table; a file that cannot be read or parsed raises ``failures.error`` naming it."""
    from depthgate.spec._compat import tomllib

    text = read_utf8(path, failures)
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise failures.error(
            f"invalid TOML: {exc}",
            file=str(path),
            field=failures.field,
            fix="fix the TOML syntax at the reported line",
        ) from None
    except RecursionError:
        raise failures.error(
            "nested too deeply to read", file=str(path), field=failures.field, fix="flatten the TOML"
        ) from None


def read_parquet(
    path: Path,
    *,
    error: type[DepthgateError],
    what: str,
    fix: str,
    columns: Sequence[str] | None = None,
    field: str | None = None,
) -> pl.DataFrame:
    """The parquet file's rows (``columns`` only, when given); a missing file, a file that is not
    parquet, a cut file or a missing column raises ``error`` naming the file, never the library's
    own exception (polars' ``ComputeError``, an Arrow error, an OSError)."""
    import polars as pl

    if not path.is_file():
        raise error(
            f"no {what}" if not path.exists() else f"the {what} is not a file",
            file=str(path),
            field=field,
            fix=fix,
        )
    try:
        schema = pl.read_parquet_schema(path)
        if columns is not None:
            missing = [c for c in columns if c not in schema]
            if missing:
                raise error(
                    f"the {what} lacks the column(s) {', '.join(missing)}",
                    file=str(path),
                    field=field or missing[0],
                    fix=fix,
                )
        return pl.read_parquet(path, columns=list(columns) if columns is not None else None)
    except DepthgateError:
        raise
    except Exception as exc:  # polars/Arrow raise many types for a damaged file; each names no file
        detail = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise error(
            f"cannot read the {what}: not a readable parquet file ({detail})",
            file=str(path),
            field=field,
            fix=fix,
        ) from None


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


def atomic_write(
    target: Path, content: bytes | str | Callable[[Path], object], *, fsync: bool = False
) -> Path:
    """Write ``target`` whole or not at all: into a temporary file beside it (``.<name>.<random>.tmp``,
    the same folder, so the same file system), then one rename; missing parent folders are created.

    ``content``: the bytes, the text (written as UTF-8, newlines as given), or a function that writes
    the file at the path it is handed (``frame.write_parquet``; the path exists, empty). ``fsync``:
    flush the file to disk before the rename (record shards, reports: files a crash must not leave
    empty behind a completed rename). The file is mode 0644 (mkstemp creates 0600; depthgate's files are
    read by CI and people). On any failure, an interrupt included, the temporary file is removed and
    ``target`` keeps its previous content."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    tmp = Path(name)
    try:
        if callable(content):
            os.close(fd)
            content(tmp)
            if fsync:
                with open(tmp, "rb") as handle:
                    os.fsync(handle.fileno())
        else:
            with os.fdopen(fd, "wb") as handle:
                handle.write(content.encode("utf-8") if isinstance(content, str) else content)
                if fsync:
                    handle.flush()
                    os.fsync(handle.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    return target


def sha256_file(path: Path) -> str:
    """The file's sha256, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while block := fh.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()
